"""Executors: turn a (rewritten) aot_autograd graph into a boxed callable.

Two executors, picked by ``Settings.native_compiler``
(``DONATE_XLA_NATIVE_COMPILER``):

- ``aten`` (default): generated Python that calls ATen kernels one by one
  (``codegen``). With ``free_saved`` on it frees at last use and, in a
  backward, reuses dying buffers (``free_saved``/``reuse``). With it off, the
  plain FX ``GraphModule`` runs with its arguments unpacked, which keeps every
  input alive until it returns (the reference behaviour).
- ``inductor``: the graph goes to Inductor's ``compile_fx_inner``. Inductor's
  generated code is boxed and frees at last use itself, and reuses donated
  saved buffers in the backward. Like the ATen executor, the backward decides
  on every call: under ``retain_graph``/``create_graph`` it runs a variant
  compiled with no donated buffers (``InductorProgram``). With ``free_saved``
  off only that variant exists, and the call keeps a copy of the argument list
  until it returns. Inductor's FX-graph cache ignores donation in its key
  (DESIGN §3), so it is switched off while we compile; our own cache
  (``compiled.py``) is keyed on every switch.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import torch

from .. import config
from . import compat, free_saved


@dataclasses.dataclass
class Built:
    """A boxed callable for one graph, and what it frees and reuses."""

    run: Callable  # boxed: takes the argument list
    saved_freed_early: Optional[int]
    buffers_reused: Optional[int]
    source: Optional[str] = None  # generated Python (aten executor)
    bucket_grads: Optional[int] = None  # gradients written into DDP buckets (ddp.prepare)
    bucket_bytes: Optional[int] = None
    memory: object = None  # its allocations replayed on fake tensors (``graph_memory.GraphMemory``)
    # a graph with symbolic sizes: the replay again (``compiled.CompiledGraph.memory_at_sizes``)
    predict: Optional[Callable] = None
    memory_at_sizes: dict = dataclasses.field(default_factory=dict)


def build(gm, example_inputs, ctx, settings: config.Settings, donated_indices) -> Built:
    is_backward = ctx.kind == "backward"
    if settings.native_compiler == "inductor":
        return _build_inductor(gm, example_inputs, ctx, settings, donated_indices)
    if not settings.free_saved:
        return _build_plain(gm, is_backward)
    program = free_saved.build_freeing(
        gm,
        f"{ctx.kind}_graph_{ctx.graph_id}",
        reuse_buffers=is_backward,
        donated_indices=donated_indices,
    )

    def run_freeing(args):
        return program(args)

    return Built(
        run=compat.as_boxed(run_freeing),
        saved_freed_early=program.saved_freed_early if is_backward else None,
        buffers_reused=program.buffers_reused if is_backward else None,
        source=program.reusing_source or program.freeing_source,
    )


def _build_plain(gm, is_backward: bool) -> Built:
    def run_plain(args):
        return gm(*args)  # ``args`` stays alive until the graph returns

    return Built(
        run=compat.as_boxed(run_plain),
        saved_freed_early=0 if is_backward else None,
        buffers_reused=0 if is_backward else None,
    )


class InductorProgram:
    """Inductor code for one graph, in a donating and a non-donating variant.

    The donating variant (compiled with aot_autograd's donated saved tensors,
    which Inductor overwrites with backward intermediates) runs only while the
    backward does not keep its graph and grad mode is off, as with the ATen
    executor; otherwise the non-donating variant runs. Each is compiled on
    first need; for a graph with nothing donated they are one and the same.
    """

    def __init__(self, compile_with, donated_indices, free_at_last_use: bool):
        self._compile_with = compile_with  # donated indices -> boxed Inductor callable
        self._donated = list(donated_indices or [])
        self._free_at_last_use = free_at_last_use
        self._variants = {}

    def variant(self, donating: bool):
        key = bool(donating and self._donated)
        if key not in self._variants:
            self._variants[key] = self._compile_with(self._donated if key else [])
        return self._variants[key]

    def __call__(self, args: list):
        compiled = self.variant(free_saved.may_reuse_saved_buffers())
        if self._free_at_last_use:
            return compiled(args)
        kept = list(args)  # hold every input to the end, like a plain backward
        result = compiled(args)
        del kept
        return result


def _build_inductor(gm, example_inputs, ctx, settings: config.Settings, donated_indices) -> Built:
    is_backward = ctx.kind == "backward"
    tracing_context = compat.current_tracing_context()
    traced_for_inductor = getattr(ctx.captured, "aot_compiler", None) == "inductor"
    if not traced_for_inductor:
        # Captured for the ATen executor before the switch was flipped.
        gm = compat.inductor_decompose(gm, example_inputs)
    if ctx.kind == "inference" or not traced_for_inductor:
        # Graphs that did not come through Inductor's partitioner get the
        # joint-graph passes compile_fx would have run.
        compat.inductor_graph_passes(gm)
    compat.mark_outputs_user_visible(gm)

    def compile_with(donated):
        # Inductor's post-grad passes rewrite the graph they compile: each
        # variant gets its own copy. A variant compiled lazily (inside a
        # backward) re-enters the tracing context.
        own = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        outside = compat.current_tracing_context() is None
        with compat.tracing(tracing_context if outside else None), compat.donated_indices(
            donated
        ), compat.inductor_config_patch(fx_graph_cache=False):
            return compat.inductor_compile(
                own, example_inputs, is_backward=is_backward, is_inference=ctx.kind == "inference"
            )

    donating = is_backward and settings.free_saved
    program = InductorProgram(
        compile_with, donated_indices if donating else [], free_at_last_use=settings.free_saved
    )
    program.variant(donating)  # compile now the variant a plain backward runs

    saved = free_saved.freed_early_count(gm.graph) if is_backward and settings.free_saved else 0
    return Built(
        run=compat.as_boxed(lambda args: program(args)),
        saved_freed_early=saved if is_backward else None,
        buffers_reused=None,  # Inductor plans its own reuse; we do not count it
    )
