"""The callable aot_autograd gets for one native graph, keyed on every switch.

``compile_graph`` runs the DDP rewrite, then the executor
(``executor.build``), adds a ``GraphRecord`` and returns a ``CompiledGraph``.

A ``CompiledGraph`` is boxed (it takes the argument list itself). Each call
compares the current switches with the ones its code was built under; when
they differ it builds again, lazily, from the graph it kept (before any
rewrite), so code built under one setting never runs under another. Builds
are cached per ``config.cache_key()``, so flipping a switch back reuses the
earlier build.
"""
from __future__ import annotations

import copy
import time
from typing import Dict, Optional

import torch

from .. import config, ddp, report
from . import compat, executor


def _device_of(example_inputs) -> str:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


class CompiledGraph:
    """Boxed callable for one graph; rebuilds when ``config.cache_key()`` changes."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, ctx) -> None:
        # An instance attribute: dynamo's ``disable`` wrapper copies the
        # instance ``__dict__`` onto the function it returns, not class attributes.
        self._boxed_call = True
        self.ctx = ctx
        self._pristine = copy.deepcopy(gm)  # rebuilds start from the graph as aot_autograd gave it
        self._example_inputs = list(example_inputs)
        self._tracing_context = compat.current_tracing_context()
        self._donated_indices = compat.bw_donated_indices() if ctx.kind == "backward" else None
        self._builds: Dict[tuple, executor.Built] = {}
        self._settings: Optional[config.Settings] = None
        self._current: Optional[executor.Built] = None
        self.record = report.GraphRecord(
            graph_id=ctx.graph_id,
            kind=ctx.kind,
            device=_device_of(example_inputs),
            path="native",
            num_inputs=len(example_inputs),
        )
        self._switch_to(config.current(), gm)
        if ctx.kind == "backward" and config.current().native_compiler == "aten":
            # Our ATen backward checks retain_graph on every call, so aot_autograd's
            # blanket refusal of retain_graph after donation does not apply.
            compat.lift_aot_donation_check()
        report.add(self.record)

    @property
    def built(self) -> executor.Built:
        """The build that runs under the current switches (building it if needed)."""
        settings = config.current()
        if settings is not self._settings:
            self._switch_to(settings, None)
        return self._current

    @property
    def source(self) -> Optional[str]:
        """Generated Python of the current build (aten executor), for inspection."""
        return self.built.source

    def __call__(self, args: list):
        settings = config.current()
        if settings is not self._settings:
            self._switch_to(settings, None)
        return self._current.run(args)

    def _switch_to(self, settings: config.Settings, gm: Optional[torch.fx.GraphModule]) -> None:
        key = config.cache_key()
        if key not in self._builds:
            self._builds[key] = self._build(settings, gm)
        self._settings = settings
        self._current = self._builds[key]
        self.record.saved_freed_early = self._current.saved_freed_early
        self.record.buffers_reused = self._current.buffers_reused

    def _build(self, settings: config.Settings, gm) -> executor.Built:
        started = time.perf_counter()
        if gm is None:
            gm = copy.deepcopy(self._pristine)
        # A lazy rebuild runs outside aot_autograd: re-enter its tracing context.
        outside = compat.current_tracing_context() is None
        with compat.tracing(self._tracing_context if outside else None):
            gm, record_fields = ddp.prepare(gm, self._example_inputs, self.ctx)
            built = executor.build(
                gm, self._example_inputs, self.ctx, settings, self._donated_indices
            )
        for field, value in (record_fields or {}).items():
            setattr(self.record, field, value)
        self.record.compile_seconds += time.perf_counter() - started
        return built


def compile_graph(gm: torch.fx.GraphModule, example_inputs, ctx) -> CompiledGraph:
    """Compile one aot_autograd graph for the native path (see module docstring)."""
    return CompiledGraph(gm, example_inputs, ctx)
