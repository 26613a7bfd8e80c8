"""Guards around the private torch APIs the native path uses (torch 2.9 and 2.11+).

Each function here touches one private API and says what happens when it is
missing or has changed, so the rest of the path never calls a private API
directly. Every guard has a test that removes the API by monkeypatching
(tests/test_native_compat.py).

- ``keep_graph()``: whether the running backward keeps its graph
  (``retain_graph``/``create_graph``). ``None`` when torch cannot tell; the
  caller must then assume the graph is kept and not reuse saved buffers.
- ``bw_donated_indices()``: aot_autograd's list of backward inputs that are
  saved tensors sharing no storage with a forward input, a user output or a
  backward output (``fw_metadata.bw_donated_idxs``). ``None`` when unknown.
- ``lift_aot_donation_check()``: aot_autograd refuses a ``retain_graph``
  backward once a backward with donated buffers was compiled (its check
  assumes the compiled code always overwrites them). Our backward decides
  per call (``free_saved``), so after reading the list we empty it in the
  metadata, which turns that check off for this graph only.
- ``as_boxed(fn)``: a function marked with ``_boxed_call``. In torch 2.13,
  ``GraphModule._boxed_call`` is read-only, so we never set it on a module;
  we always mark a plain function we own.
- ``storage_key(tensor)``: a hashable identity of a (fake) tensor's storage.
- ``inductor_compile(...)`` / ``inductor_aot_options()``: the Inductor entry
  points the ``inductor`` executor uses.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch


def keep_graph() -> Optional[bool]:
    """True/False while a backward runs; None if this torch has no way to ask."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None:
        return None
    try:
        return bool(query())
    except RuntimeError:
        # Not inside a backward (no current graph task): we cannot tell.
        return None


def bw_donated_indices() -> Optional[List[int]]:
    """aot_autograd's donated backward inputs for the graph being compiled, or None."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return None
    try_get = getattr(TracingContext, "try_get", None)
    if try_get is None:
        return None
    context = try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    indices = getattr(metadata, "bw_donated_idxs", None) if metadata is not None else None
    if indices is None:
        return None
    return [int(i) for i in indices]


def lift_aot_donation_check() -> bool:
    """Empty ``fw_metadata.bw_donated_idxs`` of the graph being compiled; True if done."""
    context = current_tracing_context()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    if metadata is None or getattr(metadata, "bw_donated_idxs", None) is None:
        return False
    metadata.bw_donated_idxs = []
    return True


def current_tracing_context():
    """The active TracingContext (to re-enter when recompiling lazily), or None."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return None
    try_get = getattr(TracingContext, "try_get", None)
    return try_get() if try_get is not None else None


def tracing(context):
    """Context manager that re-enters ``context`` (a no-op for None)."""
    import contextlib

    if context is None:
        return contextlib.nullcontext()
    from torch._guards import tracing as enter_tracing

    return enter_tracing(context)


def as_boxed(fn: Callable) -> Callable:
    """Mark a plain Python function as taking the argument list itself."""
    if isinstance(fn, torch.nn.Module):
        raise TypeError(
            "donate_xla: as_boxed needs a plain function; GraphModule._boxed_call is "
            "read-only in newer torch, wrap the module in a function first"
        )
    fn._boxed_call = True
    return fn


def storage_key(tensor: torch.Tensor):
    """Hashable identity of the storage behind ``tensor`` (works for fake tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def inductor_compile(gm, example_inputs, *, is_backward: bool, is_inference: bool):
    """Compile an aot_autograd graph with Inductor; returns a boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(
        gm, example_inputs, is_backward=is_backward, is_inference=is_inference
    )


def inductor_aot_options() -> dict:
    """aot_autograd options Inductor expects: its decompositions and partitioner."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    return {
        "decompositions": select_decomp_table(),
        "partition_fn": min_cut_rematerialization_partition,
    }
