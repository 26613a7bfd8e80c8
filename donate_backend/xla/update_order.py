"""In a stitched step, read each parameter in the backward before its update overwrites it.

A stitched step (``stitched.py``) runs forward, backward and optimizer as one
XLA computation, whose parameters are donated: the optimizer's new value of a
weight is written over the weight's own buffer. XLA may only do that once
every instruction that reads the old value has run, and it decides that from
data dependence alone (copy insertion runs before the schedule exists). A
linear layer's backward reads its weight for the input's gradient
(``grad_out @ W``), while the weight's own gradient (``grad_out^T @ x``),
which is all its update waits for, does not depend on that product. So no
dependence orders the read before the write, and XLA copies the weight at
the start of the step and reads the copy instead: a copy of every weight but
the first, made before the forward and held until each update (docs/xla.md,
"Measured reasons").

The fix is the same data dependence ``recompute.py`` uses, in the other
direction: the op that produces a parameter's gradient gets one input
through ``where(flag, x, 0)``, ``flag`` an always-true scalar computed from
every op of the backward that reads that parameter (through views) and is
not already an ancestor of the gradient. The gradient's bits are unchanged,
and now its update comes after the reads.

Which backward input is which parameter, and which output its gradient, is
known where the graph is partitioned: ``input_grads`` records, in the
backward module's meta, each backward input that is a forward input and
the position of its gradient among the backward's outputs (aot_autograd
returns one gradient per forward input, in order). ``gates`` is the pure
part: ``{producer: readers}`` for one backward graph.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.fx

from .. import graph_meta
from . import recompute
from .memory import is_view, view_base



def input_grads(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule) -> Dict[str, int]:
    """``{backward placeholder name: output index}`` for each input of the backward that
    is an input of the forward (a parameter saved as it is) or a view of one (``t(weight)``
    saved), with the position of that input's gradient among the backward's outputs.
    Empty where the backward's outputs are not one per forward input."""
    fw_inputs = list(fw_module.graph.find_nodes(op="placeholder"))
    outputs = bw_module.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(fw_inputs):
        return {}
    position = {node: k for k, node in enumerate(fw_inputs)}
    fw_nodes = {n.name: n for n in fw_module.graph.nodes}
    out = {}
    for node in bw_module.graph.find_nodes(op="placeholder"):
        source = fw_nodes.get(node.name)
        k = position.get(view_base(source)) if source is not None else None  # a view of an input reads it
        if k is not None and isinstance(outputs[k], torch.fx.Node):
            out[node.name] = k
    return out


def record_input_grads(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule) -> None:
    bw_module.meta[graph_meta.INPUT_GRADS] = input_grads(fw_module, bw_module)


def _readers(placeholder: torch.fx.Node) -> list:
    """The ops that read ``placeholder``'s data: its users, through views."""
    out, stack, seen = [], list(placeholder.users), set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if is_view(node):
            stack.extend(node.users)
        else:
            out.append(node)
    return out


def _producer(value) -> Optional[torch.fx.Node]:
    """The op that computes an output's data: back through views (and ``getitem``)."""
    node = view_base(value) if isinstance(value, torch.fx.Node) else None
    return node if node is not None and node.op == "call_function" else None


def _is_ancestor(reader: torch.fx.Node, node: torch.fx.Node, order: dict) -> bool:
    """Whether ``node`` depends on ``reader`` (searching back no further than ``reader``)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is reader:
            return True
        if current in seen or order[current] < order[reader]:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return False


def gates(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, Tuple[torch.fx.Node, ...]]:
    """``{producer: readers}``: the op computing each parameter's gradient and the ops that
    read that parameter before it, which it must wait for (see the module docstring).
    A gradient whose parameter is also read after its producer, in graph order, or by an
    op whose value no flag can be computed from, is left alone (it cannot wait for that read)."""
    grads_of = gm.meta.get(graph_meta.INPUT_GRADS) or {}
    if not grads_of:
        return {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outputs = gm.graph.output_node().args[0]
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    result: Dict[torch.fx.Node, Tuple[torch.fx.Node, ...]] = {}
    for name, k in grads_of.items():
        placeholder = placeholders.get(name)
        producer = _producer(outputs[k]) if placeholder is not None and k < len(outputs) else None
        if producer is None:
            continue
        readers = [r for r in _readers(placeholder) if r is not producer]
        if not readers or any(order[r] > order[producer] or not recompute.can_gate_with(r) for r in readers):
            continue
        waiting = tuple(r for r in readers if not _is_ancestor(r, producer, order))
        if waiting:
            result[producer] = tuple(dict.fromkeys(result.get(producer, ()) + waiting))
    return result
