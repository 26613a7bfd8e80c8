"""The callable aot_autograd gets for one native graph, one build per switch setting.

``compile_graph`` returns a ``CompiledGraph``. It keeps the graph exactly as
aot_autograd gave it and never changes it: every build starts from that graph
and works on its own copy (``prepare_graph``: the DDP rewrite, then the
executor, ``executor.build``). Nothing is deep-copied: aot_autograd's graphs
can hold tensor constants that are fake or meta tensors, and copying those
under the fake mode fails (HF models did).

A ``CompiledGraph`` is boxed (it takes the argument list itself). Builds live
in a ``builds.BuildsPerSetting``: the build for the switches in force is made
on first use (at compile time for the settings then in force, lazily for
others) and reused whenever those settings come back, so code built under one
setting never runs under another.
"""
from __future__ import annotations

import copy
import time
import weakref
from typing import Optional

import torch

from .. import budget, builds, config, ddp, graph_memory, graph_meta, report
from . import compat, executor, memory
from .capture import input_storages, returned_storages


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


def _held_inputs(ctx) -> tuple:
    """``(role, storage, nbytes)`` of each tensor input of a forward or inference graph."""
    storages = getattr(ctx.captured, "input_storages", ())
    return tuple(
        (role, s.storage, s.nbytes)
        for role, s in zip(ctx.input_roles, storages)
        if s is not None
    )


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
        self._forward_returns = compat.forward_returns_count() if ctx.kind == "forward" else None
        self._tangents_held: frozenset = frozenset()  # seen at a backward's second call (``memory.held_until_return``)
        self._calls = 0
        self.record = report.GraphRecord(
            graph_id=ctx.graph_id,
            kind=ctx.kind,
            device=_device_of(example_inputs),
            path="native",
            num_inputs=len(example_inputs),
            held_inputs=_held_inputs(ctx) if ctx.kind != "backward" else (),
            estimator=memory,
            budget_choice=gm.meta.get(graph_meta.BUDGET_CHOICE),
            planned_peak=gm.meta.get(graph_meta.PLANNED_PEAK),
            phases=budget.plan_phase(gm),
        )
        self.record.rebuilt(compile_seconds=sum(s for _, s in self.record.phases))
        # a graph with symbolic sizes: where each call's arguments give them (the memory
        # plan replays a call at its own sizes: ``memory_at_sizes``)
        self._size_sources = memory.size_sources(gm.graph)
        if self._size_sources:
            self.record.rebuilt(memory_at_sizes=weakref.WeakMethod(self.memory_at_sizes))
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
            self.record.rebuilt(
                saved_freed_early=built.saved_freed_early, buffers_reused=built.buffers_reused,
                bucket_grads=built.bucket_grads, bucket_bytes=built.bucket_bytes, memory=built.memory,
            )
        return built

    @property
    def source(self) -> Optional[str]:
        """Generated Python of the current build (aten executor), for inspection."""
        return self.built.source

    def __call__(self, args: list):
        sizes = memory.sizes_of(args, self._size_sources) if self._size_sources else None
        memory.dropped_outputs.next_call(self.ctx.kind)
        self._calls += 1
        if self.record.first_call is None:
            result = self._first_call(args, sizes)
        elif self._calls == 2 and self.ctx.kind == "backward":
            report.mark_call(self.record, sizes)
            result = self._second_backward_call(args)
        else:
            report.mark_call(self.record, sizes)
            result = self.built.run(args)
        if self.ctx.kind == "backward":
            memory.dropped_outputs.returned(self.record, result)
        return result

    def memory_at_sizes(self, sizes: tuple):
        """The current build's allocations replayed with the graph's symbolic sizes at
        ``sizes`` (the ints a call gave them, ``memory.sizes_of``); None where the replay
        fails. Kept per build and sizes."""
        built = self.built
        if sizes not in built.memory_at_sizes:
            binding = {symbol: value for (_, _, symbol), value in zip(self._size_sources, sizes)}
            with graph_memory.sizes_bound(binding):
                built.memory_at_sizes[sizes] = built.predict() if built.predict is not None else None
        return built.memory_at_sizes[sizes]

    def _first_call(self, args: list, sizes: Optional[tuple] = None):
        """Run the graph for the first time, noting what the memory plan cannot know from
        the graph alone: when it first ran among all graphs; the storages it returns (a
        forward's to the caller, a backward's gradients); for a forward, what code run
        eagerly before it saved for the backward; for a backward, the bytes of the
        tangents it was given, how many of them an earlier backward returned (graph
        breaks: a later graph's input gradients), and how many bytes of each forward's
        outputs the caller still holds."""
        report.mark_first_call(self.record, sizes)
        predicted = self.record.memory
        if self.ctx.kind == "backward" and predicted is not None:
            self.record.runs.tangent_bytes = memory.tangent_bytes_of(args, predicted.tangent_indices)
            earlier = [r for r in report.reports() if r.kind == "backward" and r.output_storages]
            self.record.runs.tangents_passed_bytes = memory.passed_tangent_bytes(
                args, predicted.tangent_indices, [r.output_storages for r in earlier]
            )
            self.record.runs.outputs_held = graph_memory.outputs_held(report.reports())
        if self.ctx.kind == "forward":
            self.record.runs.eager_saved = memory.eager_saved(args)
        # the run empties ``args`` (boxed calling convention, so that a backward can free
        # what it was given): note the inputs' storages first, holding no tensor
        inputs = input_storages(args, self.ctx.captured) if self.ctx.kind != "backward" else None
        result = self.built.run(args)
        if inputs is not None:
            self.record.runs.returned = returned_storages(inputs, result)
        if self.ctx.kind == "forward" and self._forward_returns is not None:
            self.record.runs.output_storages = memory.storage_refs(result[: self._forward_returns])
        # a backward's output storages: noted by ``memory.dropped_outputs.returned``
        return result

    def _second_backward_call(self, args: list):
        """Run a backward for the second time, noting which of its tangents something else
        held until it returned (``memory.held_until_return``): the replay frees each at
        its last use unless told so. Not at the first call, where aot_autograd compiles the
        backward with the call's arguments at hand."""
        predicted = self.record.memory
        tangents = memory.tangent_refs(args, predicted.tangent_indices) if predicted is not None else ()
        result = self.built.run(args)
        held = memory.held_until_return(tangents)
        if held != self._tangents_held:  # replayed again with those tangents live to the end
            self._tangents_held = held
            self.built.memory = self.built.predict()
            self.record.rebuilt(memory=self.built.memory)
            self.built.memory_at_sizes.clear()
        return result

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
        predicted_at = time.perf_counter()
        built.memory = self._predict_memory(prepared.gm, settings, self._tangents_held)
        built.predict = lambda: self._predict_memory(prepared.gm, settings, self._tangents_held)
        finished = time.perf_counter()
        self.record.rebuilt(
            compile_seconds=self.record.compile_seconds + finished - started,
            phases=_added(self.record.phases, (("build", predicted_at - started),
                                               ("memory prediction", finished - predicted_at))),
        )
        return built

    def _predict_memory(self, gm, settings: config.Settings, tangents_held=()):
        """The graph's allocations replayed on fake tensors (``memory``), or None
        where the replay fails: a prediction never stops a graph from compiling."""
        try:
            return memory.for_build(
                gm, self.ctx.name, self.ctx.kind,
                free_saved_on=settings.free_saved,
                reuses=settings.native_compiler == "aten",
                donated_indices=self._donated_indices,
                forward_returns=self._forward_returns,
                input_roles=self.ctx.input_roles,
                tangents_held=tangents_held,
            )
        except Exception as error:  # noqa: BLE001  (reported, never raised)
            report.log.debug("donate_xla: no memory prediction for %s: %s", self.ctx.name, error)
            return None


def _added(phases: tuple, more: tuple) -> tuple:
    """``phases`` with ``more``'s seconds added by name (a second build adds to the first)."""
    total = dict(phases)
    for name, seconds in more:
        total[name] = total.get(name, 0.0) + seconds
    return tuple(total.items())


def compile_graph(gm: torch.fx.GraphModule, example_inputs, ctx) -> CompiledGraph:
    """Compile one aot_autograd graph for the native path (see module docstring)."""
    return CompiledGraph(gm, example_inputs, ctx)
