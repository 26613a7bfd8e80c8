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
  saved buffers in the backward. With ``free_saved`` off we turn both off:
  the donated list is emptied while Inductor compiles, and the call keeps a
  copy of the argument list until it returns. Inductor's FX-graph cache
  ignores donation in its key (DESIGN §3), so it is switched off while we
  compile; our own cache (``compiled.py``) is keyed on every switch.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional


from .. import config
from . import compat, free_saved


@dataclasses.dataclass
class Built:
    """A boxed callable for one graph, and what it frees and reuses."""

    run: Callable  # boxed: takes the argument list
    saved_freed_early: Optional[int]
    buffers_reused: Optional[int]
    source: Optional[str] = None  # generated Python (aten executor)


def build(gm, example_inputs, ctx, settings: config.Settings, donated_indices) -> Built:
    is_backward = ctx.kind == "backward"
    if settings.native_compiler == "inductor":
        return _build_inductor(gm, example_inputs, ctx, settings)
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


@contextlib.contextmanager
def _donated_list_emptied():
    context = compat.current_tracing_context()
    metadata = getattr(context, "fw_metadata", None)
    if metadata is None or getattr(metadata, "bw_donated_idxs", None) is None:
        yield
        return
    saved = metadata.bw_donated_idxs
    metadata.bw_donated_idxs = []
    try:
        yield
    finally:
        metadata.bw_donated_idxs = saved


def _build_inductor(gm, example_inputs, ctx, settings: config.Settings) -> Built:
    import torch._inductor.config as inductor_config

    is_backward = ctx.kind == "backward"
    donation = contextlib.nullcontext() if settings.free_saved else _donated_list_emptied()
    with inductor_config.patch(fx_graph_cache=False), donation:
        compiled = compat.inductor_compile(
            gm, example_inputs, is_backward=is_backward, is_inference=ctx.kind == "inference"
        )
    if settings.free_saved:
        def run_inductor(args):
            return compiled(args)
    else:
        def run_inductor(args):
            kept = list(args)  # hold every input to the end, like a plain backward
            result = compiled(args)
            del kept
            return result

    saved = free_saved.freed_early_count(gm.graph) if is_backward and settings.free_saved else 0
    return Built(
        run=compat.as_boxed(run_inductor),
        saved_freed_early=saved if is_backward else None,
        buffers_reused=None,  # Inductor plans its own reuse; we do not count it
    )
