"""Liveness of the values of an FX graph: where each value is read for the last time.

Pure functions over ``torch.fx.Graph``; nothing here changes a graph. Every
node that reads a value counts as a use, whatever it is: an ATen op, a call
into an arbitrary Python function (the DDP rewrite inserts such calls), or the
output node. Nodes are never reordered, so "last use" is simply the last
reader in graph order.

- ``last_uses(graph)``: value -> the node that reads it last.
- ``values_dying_at(graph)``: node -> the values that can be dropped right
  after it runs (a value read by the output node is never dropped; a value
  nothing reads is dropped right after the node that makes it).
- ``unused_inputs(graph)``: placeholders that nothing reads.
"""
from __future__ import annotations

from typing import Dict, List

import torch.fx


def _readers_in_order(graph: torch.fx.Graph):
    for node in graph.nodes:
        for value in node.all_input_nodes:
            yield value, node


def last_uses(graph: torch.fx.Graph) -> Dict[torch.fx.Node, torch.fx.Node]:
    """Map every value that something reads to the last node (in graph order) that reads it."""
    last: Dict[torch.fx.Node, torch.fx.Node] = {}
    for value, reader in _readers_in_order(graph):
        last[value] = reader  # later readers overwrite earlier ones
    return last


def unused_inputs(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    """Placeholders that no node reads (not even the output)."""
    return [n for n in graph.find_nodes(op="placeholder") if not n.users]


def values_dying_at(graph: torch.fx.Graph) -> Dict[torch.fx.Node, List[torch.fx.Node]]:
    """Map each node to the values whose last reader it is, in a stable order.

    Values read by the output node are returned to the caller, so they are
    never listed. A non-placeholder value that nothing reads (e.g. the ``None``
    result of a side-effecting call) dies at the node that makes it.
    Placeholders that nothing reads are not listed: see ``unused_inputs``.
    """
    dying: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
    for value, reader in last_uses(graph).items():
        if reader.op == "output":
            continue
        dying.setdefault(reader, []).append(value)
    for node in graph.nodes:
        if node.op not in ("placeholder", "output") and not node.users:
            dying.setdefault(node, []).append(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    return {reader: sorted(values, key=order.__getitem__) for reader, values in dying.items()}
