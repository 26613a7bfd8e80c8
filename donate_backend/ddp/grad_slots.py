"""FX pass: route each parameter gradient of a backward graph through a slot writer.

The backward graph first looks up where this call's gradients go
(``call = begin(graph)``: the parameters behind the autograd node running it).
Its output for a parameter becomes ``write_grad(writer, call, g)``, called
right after ``g`` is produced (the output node was its last use, so the
temporary dies as soon as it is copied), and a gradient made by ``aten.mm``
(through an even number of transposes) is computed by
``mm_into_slot(writer, call, a, b)`` instead, which can write straight into
the slot.
What the writer does at run time, and when it leaves the gradient alone, is
in ``writer.py``. This module only changes graphs; it is pure apart from
setting the writer attributes on the ``GraphModule`` it rewrites.
"""
from __future__ import annotations

import warnings

import torch

from .writer import GradWriter, GraphWrites, begin, mm_into_slot, write_grad


_TRANSPOSES = (torch.ops.aten.t.default,)


def _mm_producer(grad_node: torch.fx.Node, allowed_users: set):
    """The ``aten.mm`` whose result the gradient is, through an even number of
    ``aten.t``, else None. Every node of the chain must have no other user (the
    gradient itself only ``allowed_users``), so nothing else ever reads or
    reuses the slot's memory inside the graph."""
    node, flips = grad_node, 0
    while True:
        users = set(node.users)
        if (node is grad_node and not users <= allowed_users) or (
            node is not grad_node and len(users) != 1
        ):
            return None
        if node.op == "call_function" and node.target in _TRANSPOSES:
            node, flips = node.args[0], flips + 1
            continue
        break
    if flips % 2 or node.op != "call_function" or node.target != torch.ops.aten.mm.default:
        return None
    return node


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    placeholders = graph.find_nodes(op="placeholder")
    return placeholders[-1] if placeholders else next(iter(graph.nodes))


def _get_attr(graph: torch.fx.Graph, attr: str) -> torch.fx.Node:
    with warnings.catch_warnings():
        # FX warns that a get_attr target is not a module/parameter/buffer;
        # a plain Python attribute is what we want here.
        warnings.simplefilter("ignore", UserWarning)
        return graph.get_attr(attr)


def rewrite_backward(gm: torch.fx.GraphModule, targets, binding, name: str, tensor_inputs: int) -> list:
    """Route each ``(output position, tensor-input edge, parameter index)`` gradient
    through a writer.

    ``tensor_inputs`` is how many tensor inputs the forward has (the edges of the
    autograd node that will run this backward). Returns the parameter indices
    the graph was traced with for the routed gradients. Mutates ``gm`` in place
    (the caller passes its own copy).
    """
    graph = gm.graph
    output_node = graph.output_node()
    outputs = list(output_node.args[0])
    gm._donate_ddp_graph = GraphWrites(name, tensor_inputs)
    # A header right after the placeholders, so that it is defined before every
    # gradient's producer (see ``_compute_into_slot``): the per-call lookup of
    # where each gradient goes, then one writer per routed gradient.
    with graph.inserting_after(_last_placeholder(graph)):
        graph_node = _get_attr(graph, "_donate_ddp_graph")
    with graph.inserting_after(graph_node):
        call_node = graph.call_function(begin, (graph_node,))
    header_end = call_node
    routed = []
    for position, edge, param_index in targets:
        grad_node = outputs[position]
        attr = f"_donate_ddp_writer_{position}"
        setattr(gm, attr, GradWriter(binding, edge))
        with graph.inserting_after(header_end):
            writer_node = header_end = _get_attr(graph, attr)
        anchor = header_end if grad_node.op == "placeholder" else grad_node
        with graph.inserting_after(anchor):
            outputs[position] = graph.call_function(write_grad, (writer_node, call_node, grad_node))
        if anchor is header_end:
            header_end = outputs[position]
        producer = _mm_producer(grad_node, {output_node, outputs[position]})
        if producer is not None:
            _compute_into_slot(graph, producer, writer_node, call_node)
        routed.append(param_index)
    output_node.args = (tuple(outputs),) + tuple(output_node.args[1:])
    graph.lint()
    gm.recompile()
    return routed


def _compute_into_slot(graph: torch.fx.Graph, mm_node: torch.fx.Node, writer_node, call_node) -> None:
    """Replace ``mm(a, b)`` by ``mm_into_slot(writer, call, a, b)`` (both defined first)."""
    a, b = mm_node.args
    with graph.inserting_after(mm_node):
        replacement = graph.call_function(mm_into_slot, (writer_node, call_node, a, b))
    replacement.meta = dict(mm_node.meta)
    mm_node.replace_all_uses_with(replacement)
    graph.erase_node(mm_node)

