"""Dynamo-graph rewrites for XLA tensors, before aot_autograd traces the graph.

aot_autograd traces dynamo's graph on functional fake tensors. A few torch
functions decompose (CompositeImplicitAutograd) into an in-place view op that
the functional wrapper re-runs on the fake XLA tensor, which reaches torch_xla's
kernel and fails with "Expected XLA tensor. Got: XLAFloatType" (openxla too;
eager torch_xla never takes that route). Each such call is replaced here by one
that computes the same values.

- ``F.adaptive_avg_pool2d(x, 1)`` / ``adaptive_avg_pool3d(x, 1)``: ATen computes
  ``x.mean(spatial dims, keepdim=True)`` and, for a channels-last input,
  restrides it with ``as_strided_``. ConvNeXt and Swin (torchvision) pool a
  permuted, channels-last-strided tensor: their training failed to compile. XLA
  tensors have no strides, so the mean alone is the same value.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import torch_compat


def _is_ones(output_size, dims: int) -> bool:
    if isinstance(output_size, int):
        return output_size == 1
    return isinstance(output_size, (list, tuple)) and len(output_size) == dims and all(s == 1 for s in output_size)


def global_avg_pool2d(input, output_size):
    """``F.adaptive_avg_pool2d`` with ATen's mean for an output of 1 x 1, without its restride."""
    if _is_ones(output_size, 2):
        return input.mean((-2, -1), keepdim=True)
    return F.adaptive_avg_pool2d(input, output_size)


def global_avg_pool3d(input, output_size):
    """``F.adaptive_avg_pool3d`` with ATen's mean for an output of 1 x 1 x 1, without its restride."""
    if _is_ones(output_size, 3):
        return input.mean((-3, -2, -1), keepdim=True)
    return F.adaptive_avg_pool3d(input, output_size)


_REPLACEMENTS = {
    F.adaptive_avg_pool2d: global_avg_pool2d,
    torch_compat.nn_function("adaptive_avg_pool2d"): global_avg_pool2d,
    F.adaptive_avg_pool3d: global_avg_pool3d,
    torch_compat.nn_function("adaptive_avg_pool3d"): global_avg_pool3d,
}
_REPLACEMENTS.pop(None, None)  # a torch without them


def rewrite_for_xla(gm: torch.fx.GraphModule) -> int:
    """Replace, in place, the calls aot_autograd cannot trace for XLA tensors; returns how many."""
    replaced = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        replacement = _REPLACEMENTS.get(node.target)
        if replacement is not None and len(node.args) + len(node.kwargs) == 2:
            args = list(node.args) + [node.kwargs[k] for k in ("input", "output_size") if k in node.kwargs]
            node.target, node.args, node.kwargs = replacement, tuple(args), {}
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced
