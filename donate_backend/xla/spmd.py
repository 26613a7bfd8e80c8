"""SPMD: what the XLA path needs to know about shardings beyond one graph.

A backward graph's inputs (saved activations, incoming gradients) are known
only when it first runs, and its outputs are the gradients of the forward's
inputs, in the forward's input order. A gradient gets the sharding of the
tensor it is the gradient of (a parameter sharded on dim 0 gets a gradient
sharded on dim 0, as FSDP wants), rather than whatever XLA's propagation
picks for the separate backward executable (often replicated: every device
would then hold every gradient, and Adam's state built from it).
"""
from __future__ import annotations

import threading
from typing import Optional

_lock = threading.Lock()
# dynamo graph id -> (number of forward inputs, {index: (shape, OpSharding)})
_forward_input_shardings: dict = {}


def remember_forward_inputs(graph_id: int, real_inputs: list, shardings: dict) -> None:
    """Called when a forward graph is lowered on its real (sharded) inputs."""
    described = {i: (tuple(real_inputs[i].shape), sharding) for i, sharding in shardings.items()}
    with _lock:
        _forward_input_shardings[graph_id] = (len(real_inputs), described)


def gradient_shardings(graph_id: int, num_outputs: int) -> Optional[dict]:
    """Backward output index -> (shape, sharding), when output k is the gradient of
    forward input k (aot_autograd's backward returns one per forward input)."""
    with _lock:
        known = _forward_input_shardings.get(graph_id)
    if known is None or known[0] != num_outputs:
        return None
    return dict(known[1])


def inherited_shardings(gm, specs: tuple, shapes: list) -> dict:
    """Written-back inputs that are not split over devices -> the input whose sharding
    their new value should take.

    An optimizer creates its state replicated (``zeros_like`` before the first
    step). Eager SPMD traces the whole step as one graph, and XLA's propagation
    gives the state its parameter's sharding. In the separate optimizer graph we
    pin it: a written-back input with no sharding takes the sharding of the
    same-shaped sharded inputs its new value is computed from, when they all
    agree. ``specs`` is the sharding spec per input ("" or "{replicated}" for
    none), ``shapes`` the shape per input.
    """
    import torch

    placeholders = gm.graph.find_nodes(op="placeholder")
    index_of = {node: i for i, node in enumerate(placeholders)}
    split = {i for i, spec in enumerate(specs) if spec and spec != "{replicated}"}
    inherited = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        target, new_value = node.args[0], node.args[1]
        i = index_of.get(target)
        if i is None or i in split or not isinstance(new_value, torch.fx.Node):
            continue
        sources = {
            index_of[a] for a in _ancestors(new_value) if a in index_of and index_of[a] in split
            and tuple(shapes[index_of[a]]) == tuple(shapes[i])
        }
        if sources and len({specs[j] for j in sources}) == 1:
            inherited[i] = min(sources)
    return inherited


def _ancestors(node) -> set:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        for arg in current.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return seen
