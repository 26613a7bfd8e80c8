"""The callable aot_autograd gets for one native graph, one build per switch setting.

``compile_graph`` returns a ``CompiledGraph``. It keeps the graph exactly as
aot_autograd gave it and never changes it: every build starts from that graph
and works on its own copy (``prepare_graph``: the DDP rewrite, then the
executor, ``executor.build``). Nothing is deep-copied: aot_autograd's graphs
can hold tensor constants that are fake or meta tensors, and copying those
under the fake mode fails (issue 11).

A ``CompiledGraph`` is boxed (it takes the argument list itself). Builds live
in a ``builds.BuildsPerSetting``: the build for the switches in force is made
on first use (at compile time for the settings then in force, lazily for
others) and reused whenever those settings come back, so code built under one
setting never runs under another.
"""
from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from .. import builds, config, ddp, report
from . import compat, executor


def _device_of(example_inputs) -> str:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph that shares its attributes.

    Passes rewrite the copy; the tensors ``gm`` holds (constants, possibly fake)
    are shared, not copied.
    """
    # ``Graph.__deepcopy__`` copies nodes and their ``meta`` dicts shallowly:
    # the values in ``meta`` (fake tensors) are shared, not copied.
    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta.update(gm.meta)
    return copied


class CompiledGraph:
    """Boxed callable for one graph; runs the build for the current switches."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, ctx) -> None:
        # An instance attribute: dynamo's ``disable`` wrapper copies the
        # instance ``__dict__`` onto the function it returns, not class attributes.
        self._boxed_call = True
        self.ctx = ctx
        self._graph = gm  # as aot_autograd gave it; builds never change it
        self._example_inputs = list(example_inputs)
        self._tracing_context = compat.current_tracing_context()
        self._donated_indices = compat.bw_donated_indices() if ctx.kind == "backward" else None
        self.record = report.GraphRecord(
            graph_id=ctx.graph_id,
            kind=ctx.kind,
            device=_device_of(example_inputs),
            path="native",
            num_inputs=len(example_inputs),
        )
        self._builds = builds.BuildsPerSetting(self._build)
        self._current: Optional[executor.Built] = None
        self._current_build()  # for the settings in force: built now, inside aot_autograd
        if ctx.kind == "backward":
            # Both executors decide on every call whether saved buffers may be
            # overwritten (never under retain_graph/create_graph), so
            # aot_autograd's blanket refusal of retain_graph after donation does
            # not apply to our graphs.
            compat.lift_aot_donation_check()
        report.add(self.record)

    @property
    def built(self) -> executor.Built:
        """The build that runs under the current switches (building it if needed)."""
        return self._current_build()

    def _current_build(self) -> executor.Built:
        built = self._builds.current()
        if built is not self._current:
            self._current = built
            self.record.saved_freed_early = built.saved_freed_early
            self.record.buffers_reused = built.buffers_reused
            self.record.bucket_grads = built.bucket_grads
            self.record.bucket_bytes = built.bucket_bytes
        return built

    @property
    def source(self) -> Optional[str]:
        """Generated Python of the current build (aten executor), for inspection."""
        return self.built.source

    def __call__(self, args: list):
        return self.built.run(args)

    def _build(self, settings: config.Settings) -> executor.Built:
        started = time.perf_counter()
        # A lazy rebuild runs outside aot_autograd: re-enter its tracing context.
        outside = compat.current_tracing_context() is None
        with compat.tracing(self._tracing_context if outside else None):
            captured = self.ctx.captured
            prepared = ddp.prepare(
                graph_copy(self._graph), getattr(captured, "ddp", None), self.ctx, settings
            )
            built = executor.build(
                prepared.gm, self._example_inputs, self.ctx, settings, self._donated_indices
            )
        built.bucket_grads = prepared.bucket_grads
        built.bucket_bytes = prepared.bucket_bytes
        self.record.compile_seconds += time.perf_counter() - started
        return built


def compile_graph(gm: torch.fx.GraphModule, example_inputs, ctx) -> CompiledGraph:
    """Compile one aot_autograd graph for the native path (see module docstring)."""
    return CompiledGraph(gm, example_inputs, ctx)
