"""Guards around the private autograd API that tells a compiled backward whose
gradients it is computing (torch 2.9 and newer).

dynamo reuses one compiled graph for every module instance it fits (each
expert of a mixture of experts, each layer whose forward became its own frame
after a graph break), with other parameters each time. The backward graph is
the same for all of them; only the autograd node running it knows which
tensors this call's gradients belong to. Both the DDP bucket writer and the
SPMD gradient layouts ask it.

- ``running_node_inputs()``: the nodes the autograd node the engine runs now
  sends its gradients to, one per tensor input of its forward
  (``torch._C._current_autograd_node``, ``next_functions``). None when no node
  runs or the API is missing: callers then act as if they did not know.
- ``accumulated_variable(node)``: the leaf an ``AccumulateGrad`` node
  accumulates into (its ``variable``), None for any other node.

Each has a test that removes or refuses the API (tests/test_ddp_compat.py).
"""
from __future__ import annotations

from typing import Optional

import torch


def running_node_inputs() -> Optional[tuple]:
    """The next node of each tensor input of the autograd node running now, or None."""
    current = getattr(torch._C, "_current_autograd_node", None)
    if current is None:
        return None
    try:
        node = current()
        if node is None:
            return None
        return tuple(next_node for next_node, _ in node.next_functions)
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return None


def accumulated_variable(node) -> Optional[torch.Tensor]:
    """The leaf tensor ``node`` accumulates gradients into, if it is an ``AccumulateGrad``."""
    if node is None or type(node).__name__ != "AccumulateGrad":
        return None
    try:
        variable = node.variable
    except (RuntimeError, AttributeError):
        return None
    return variable if isinstance(variable, torch.Tensor) else None
