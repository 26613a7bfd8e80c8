"""Kernel workspaces: bytes an op allocates for itself while it runs, beyond its result.

A replay on fake tensors (``memory``) sees the tensors a graph makes, not the
scratch memory inside a kernel. Most kernels use none; convolutions do (oneDNN
on the CPU reorders its operands into blocked copies: a ViT patch embedding's
forward takes 13 times its output; cuDNN picks algorithms with workspaces), and
so can fused attention. ``memory.replay`` notes where in a graph such an op
runs (``WorkspacePoint``); ``workspace_bytes`` measures it by running the op
once on zero-filled tensors of the same shapes, on the device the graph runs
on, and is cached per signature. The memory plan calls it, never the compiler:
compiling stays free of device work.

Measure: CUDA, ``max_memory_allocated`` above the level before the call, less
the result's blocks; CPU, the profiler's allocation events (``compat``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from .. import graph_memory
from . import compat

_OPS_WITH_WORKSPACE = (
    "aten.convolution.",
    "aten.convolution_backward.",
    "aten._convolution.",
    "aten.cudnn_convolution",
    "aten.mkldnn_convolution",
    "aten._scaled_dot_product_",
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclasses.dataclass(frozen=True)
class OpCall:
    """An op and its arguments, tensors replaced by their specs (hashable)."""

    op: object  # torch._ops.OpOverload
    args: tuple
    kwargs: tuple  # sorted (name, value) pairs

    @property
    def device(self) -> Optional[str]:
        for a in self.args:
            if isinstance(a, TensorSpec):
                return a.device
        return None


def has_workspace(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and str(target).startswith(_OPS_WITH_WORKSPACE)


def _hint(size) -> int:
    value = graph_memory.size_hint(size)  # never int(): that would guard on a symbolic size
    if value is None:
        raise ValueError("data-dependent size")
    return value


def _spec(value):
    if isinstance(value, torch.Tensor):
        return TensorSpec(
            tuple(_hint(s) for s in value.shape), tuple(_hint(s) for s in value.stride()),
            value.dtype, str(value.device),
        )
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    if isinstance(value, torch.SymInt):
        return _hint(value)
    return value


def op_call(node) -> Optional[OpCall]:
    """The ``OpCall`` of an FX node, from its arguments' fake values; None if it has none."""
    import torch.fx

    def value_of(arg):
        if isinstance(arg, torch.fx.Node):
            return arg.meta.get("val")
        if isinstance(arg, (list, tuple)):
            return type(arg)(value_of(a) for a in arg)
        return arg

    try:
        args = _spec(tuple(value_of(a) for a in node.args))
        kwargs = tuple(sorted((k, _spec(value_of(v))) for k, v in node.kwargs.items()))
    except ValueError:
        return None
    call = OpCall(node.target, args, kwargs)
    return call if call.device is not None else None


def _materialise(value):
    if isinstance(value, TensorSpec):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device=value.device).zero_()
    if isinstance(value, tuple):
        return [_materialise(v) for v in value]
    return value


def _result_bytes(out) -> int:
    total, seen = 0, set()
    for value in torch.utils._pytree.tree_leaves(out):
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                size = storage.nbytes()
                total += (size + 511) // 512 * 512 if value.device.type == "cuda" and size else size
    return total


@functools.lru_cache(maxsize=4096)
def workspace_bytes(call: OpCall) -> Optional[int]:
    """Bytes ``call`` allocates beyond its result while it runs; None if it cannot be measured
    here (no such device, or the op fails on zeros)."""
    device = torch.device(call.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    if device.type not in ("cpu", "cuda"):
        return None
    try:
        args = [_materialise(a) for a in call.args]
        kwargs = {k: _materialise(v) for k, v in call.kwargs}
        holder = {}

        def run():
            holder["out"] = call.op(*args, **kwargs)

        with torch.no_grad():
            run()  # the first call may set up libraries (cuDNN handles, oneDNN primitives)
            holder.clear()
            peak = compat.allocation_peak_bytes(run, device)
        if peak is None:
            return None
        return max(0, peak - _result_bytes(holder.get("out")))
    except Exception:  # noqa: BLE001  (an op that does not run on zeros has no estimate)
        return None
