"""Keep the backward from reading an input after the forward overwrote it.

aot_autograd keeps a buffer's in-place update inside the forward as a
``copy_(primal, new_value)`` epilogue. Every other read of that primal in the
functional joint graph means its value *before* the update. The min-cut
partitioner does not know that: it happily saves the primal and recomputes a
reader of it in the backward (``count + 1`` from ``count``), and by then the
epilogue has written the new value into the primal's storage, so the backward
computes from the updated buffer (a wrong gradient, with aot_eager and Inductor
too on torch 2.9 through 2.15).

Two steps around any partitioner:

- ``pin_reads_of_overwritten_inputs(joint)`` marks every forward op that reads
  an overwritten primal (through views) ``MUST_SAVE``, so the partitioner saves
  its result instead of recomputing it from the primal;
- ``check_backward_reads(fw, bw, ...)`` then refuses a partition whose backward
  still reads such a primal, or a view of it, directly: then the backward needs
  the value from before the update itself (eager PyTorch raises its "modified
  by an inplace operation" error there).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from ..errors import UnsupportedGraphError

_COPY = torch.ops.aten.copy_.default


def overwritten_primals(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The placeholders the graph overwrites with a ``copy_`` epilogue, in order."""
    placeholders = set(graph.find_nodes(op="placeholder"))
    found: dict = {}
    for node in graph.find_nodes(op="call_function", target=_COPY):
        if node.args and node.args[0] in placeholders:
            found.setdefault(node.args[0], None)
    return list(found)


def _is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its first argument without writing it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if not schema.returns or not schema.arguments:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _depends_on_tangents(graph: torch.fx.Graph) -> set:
    """Nodes computed from a tangent: the backward part of a joint graph."""
    tainted = {n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    return tainted


def _readers(primal: torch.fx.Node, skip: set) -> list[torch.fx.Node]:
    """Ops that read ``primal``'s data, through any chain of views (the epilogue excluded)."""
    found, stack, seen = [], [primal], set()
    while stack:
        value = stack.pop()
        for user in value.users:
            if user in seen or user in skip:
                continue
            seen.add(user)
            if user.target is _COPY and user.args[0] is value:
                continue  # the epilogue itself
            if _is_view(user):
                stack.append(user)
            elif user.op == "call_function":
                found.append(user)
    return found


def pin_reads_of_overwritten_inputs(joint: torch.fx.GraphModule) -> list[str]:
    """Mark forward readers of overwritten primals as saved, never recomputed.

    Returns the names of the overwritten primals (for ``check_backward_reads``).
    """
    primals = overwritten_primals(joint.graph)
    if not primals:
        return []
    from torch.utils.checkpoint import CheckpointPolicy  # public since torch 2.4

    backward = _depends_on_tangents(joint.graph)
    for primal in primals:
        for reader in _readers(primal, backward):
            reader.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return [p.name for p in primals]


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    while _is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def check_backward_reads(
    fw_module: torch.fx.GraphModule,
    bw_module: torch.fx.GraphModule,
    overwritten: list[str],
    graph_name: str,
    input_names: Callable[[str], str] = str,
) -> None:
    """Refuse a partition whose backward reads an overwritten input's storage."""
    if not overwritten:
        return
    names = set(overwritten)
    stale = [p.name for p in bw_module.graph.find_nodes(op="placeholder") if p.name in names]
    saved = fw_module.graph.output_node().args[0]
    for value in saved if isinstance(saved, (list, tuple)) else ():
        if isinstance(value, torch.fx.Node) and _is_view(value) and _view_root(value).name in names:
            stale.append(_view_root(value).name)
    if not stale:
        return
    listed = ", ".join(sorted({input_names(name) for name in stale}))
    raise UnsupportedGraphError(
        f"donate_xla: {graph_name}: the backward needs the value that input(s) {listed} had "
        "before the forward overwrote them in place (for example a buffer updated with "
        "`+=` or `.copy_()` after an op whose gradient reads it). Eager PyTorch refuses this "
        "too, at backward time ('one of the variables needed for gradient computation has "
        "been modified by an inplace operation'). Update the tensor after its last use in "
        "the forward, or read a .clone() of it before updating it."
    )
