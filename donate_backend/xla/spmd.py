"""SPMD: what the XLA path needs to know about shardings beyond one graph.

A backward graph's inputs (saved activations, incoming gradients) are known
only when it first runs, and its outputs are the gradients of the forward's
inputs, in the forward's input order. A gradient gets the sharding of the
tensor it is the gradient of (a parameter sharded on dim 0 gets a gradient
sharded on dim 0, as FSDP wants), rather than whatever XLA's propagation
picks for the separate backward executable (often replicated: every device
would then hold every gradient, and Adam's state built from it).

Which tensor that is can change from call to call: dynamo runs one compiled
graph for every module instance it fits (layers whose forward became its own
frame after a graph break), and those instances may be sharded differently
(a column-parallel and a row-parallel ``Linear``). For a leaf (a parameter)
the autograd node running the backward names it (``gradient_leaves``); for
any other input the shardings of the forward variant compiled last stand in.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional, Sequence

import torch

from .. import autograd_compat
from . import compat


class ForwardInputs(NamedTuple):
    count: int  # the forward's inputs (the backward's outputs)
    edges: tuple  # per input, its index among the tensor inputs (its autograd edge), else None
    shapes: tuple  # per input, its shape (None for a non-tensor)
    shardings: dict  # index -> (shape, OpSharding) of the inputs split over devices


_lock = threading.Lock()
_forward_inputs: dict = {}  # dynamo graph id -> ForwardInputs of the variant lowered last


def remember_forward_inputs(graph_id: int, real_inputs: list, shardings: dict) -> None:
    """Called when a forward graph is lowered on its real (sharded) inputs."""
    edges, count = [], 0
    for value in real_inputs:
        edges.append(count if isinstance(value, torch.Tensor) else None)
        count += isinstance(value, torch.Tensor)
    shapes = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in real_inputs)
    with _lock:
        _forward_inputs[graph_id] = ForwardInputs(
            len(real_inputs), tuple(edges), shapes, {i: (shapes[i], s) for i, s in shardings.items()}
        )


def gradient_leaves(graph_id: int, num_outputs: int) -> Optional[tuple]:
    """Per backward output, the XLA leaf whose gradient it is in the backward running
    now (None for an output that is not a leaf's gradient); None when that cannot be
    told (no forward remembered, no autograd node, counts that do not match)."""
    with _lock:
        known = _forward_inputs.get(graph_id)
    if known is None or known.count != num_outputs:
        return None
    nodes = autograd_compat.running_node_inputs()
    if nodes is None or len(nodes) != sum(e is not None for e in known.edges):
        return None
    leaves = []
    for edge, shape in zip(known.edges, known.shapes):
        leaf = autograd_compat.accumulated_variable(nodes[edge]) if edge is not None else None
        fits = leaf is not None and leaf.device.type == "xla" and tuple(leaf.shape) == shape
        leaves.append(leaf if fits else None)
    return tuple(leaves)


def leaf_signature(leaves: Optional[Sequence]) -> tuple:
    """The sharding spec of each leaf ("" for none): the part of a backward's
    signature its arguments do not show."""
    if leaves is None:
        return ()
    from . import compat

    present = [leaf for leaf in leaves if leaf is not None]
    specs = iter(compat.sharding_specs(present) if present else ())
    return tuple(next(specs) if leaf is not None else None for leaf in leaves)


def gradient_shardings(graph_id: int, num_outputs: int, leaves: Optional[Sequence] = None) -> Optional[dict]:
    """Backward output index -> (shape, sharding), when output k is the gradient of
    forward input k (aot_autograd's backward returns one per forward input).

    Output k takes the sharding of ``leaves[k]`` where that is known (and none
    when the leaf is not split over devices, as a replicated forward input
    gets none), else of forward input k as last lowered."""
    with _lock:
        known = _forward_inputs.get(graph_id)
    if known is None or known.count != num_outputs:
        return None
    pinned = dict(known.shardings)
    if leaves is not None:
        from . import compat

        for k, (leaf, spec) in enumerate(zip(leaves, leaf_signature(leaves))):
            if leaf is None:
                continue
            pinned.pop(k, None)
            if spec and spec != "{replicated}":
                pinned[k] = (tuple(leaf.shape), compat.op_sharding(leaf))
    return pinned


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


def input_shardings(real_inputs: Sequence) -> dict:
    """Input index -> ``OpSharding`` of each XLA input that is split over devices.

    Replicated inputs are left out: the new value of a replicated optimizer
    state may take its gradient's sharding instead (what eager SPMD does).
    """
    signature = sharding_signature(real_inputs)
    return {
        i: compat.op_sharding(t)
        for i, (t, spec) in enumerate(zip(real_inputs, signature))
        if spec and spec != "{replicated}"
    }


def sharding_signature(real_inputs: Optional[Sequence]) -> tuple:
    """The sharding spec of every XLA input ("" for none); () without real inputs."""
    if real_inputs is None:
        return ()
    xla_inputs = [t for t in real_inputs if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    specs = iter(compat.sharding_specs(xla_inputs))
    return tuple(
        next(specs) if isinstance(t, torch.Tensor) and t.device.type == "xla" else None for t in real_inputs
    )
