"""FX pass: write each parameter gradient into its DDP bucket slot.

The backward graph's output for a parameter becomes ``write_grad(writer, g)``,
called right after ``g`` is produced (the output node is its last use, so the
temporary dies as soon as it is copied). At run time the writer copies ``g``
into the slot (or adds it, when ``param.grad`` already holds a gradient, as
under ``no_sync``), makes ``param.grad`` the slot view, and returns None so
that AccumulateGrad does nothing. DDP's reducer hook still fires, sees that
``param.grad`` already lies in its bucket, and leaves the data alone.

When the writer cannot write safely (no slot learned yet, the switch is off,
shape/dtype/layout mismatch, ``create_graph``) it returns ``g`` unchanged and
DDP's normal path handles the gradient, so a gradient is never wrong.
"""
from __future__ import annotations

import warnings

import torch

from .. import config
from .state import DDPBucketState


class GradWriter:
    """Writes one parameter's gradient into its bucket slot."""

    def __init__(self, state: DDPBucketState, param_index: int):
        self.state = state
        self.param_index = param_index
        self.writes = 0
        self._written_by_out = False  # set by mm_into_slot, consumed by write

    def __repr__(self) -> str:
        return f"GradWriter(param={self.param_index})"

    def fresh_slot(self, shape, dtype, device):
        """The slot, when the next gradient may be computed straight into it (out=)."""
        if not config.current().bucket_view or torch.is_grad_enabled():
            return None
        param = self.state.params[self.param_index]
        if param.grad is not None or getattr(param, "_backward_hooks", None):
            return None  # accumulation or a hook: compute a temporary, then ``write``
        slot = self.state.slot(self.param_index)
        if slot is None or slot.shape != shape or slot.dtype != dtype or slot.device != device:
            return None
        return slot

    def wrote_by_out(self, slot) -> None:
        param = self.state.params[self.param_index]
        param.grad = slot
        self._written_by_out = True

    def write(self, grad):
        if self._written_by_out:
            self._written_by_out = False
            slot = self.state.slot(self.param_index)
            if slot is not None and grad is not None and _is_view_of(grad, slot):
                self.writes += 1
                self.state.slot_writes += 1
                self.state.out_writes += 1
                return None
            # Only a backward aborted between ``mm_into_slot`` and here leaves the
            # flag set with another gradient: ``param.grad`` then holds what that
            # run wrote, and this gradient is accumulated onto it as eager would.
        if grad is None or not config.current().bucket_view or torch.is_grad_enabled():
            return grad
        param = self.state.params[self.param_index]
        if getattr(param, "_backward_hooks", None):
            return grad  # a tensor hook must see (and may replace) the gradient
        slot = self.state.slot(self.param_index)
        if slot is None or not _same_layout(grad, slot):
            return grad
        current = param.grad
        if current is None:
            slot.copy_(grad)
        elif _is_view_of(current, slot):
            slot.add_(grad)  # what AccumulateGrad does: ``grad += new_grad``
        elif _same_layout(current, slot):
            slot.copy_(current)
            slot.add_(grad)
        else:
            return grad
        if current is None or current is not slot:
            param.grad = slot
        self.writes += 1
        self.state.slot_writes += 1
        return None


def _same_layout(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and tensor.shape == slot.shape
        and tensor.dtype == slot.dtype
        and tensor.device == slot.device
    )


def _is_view_of(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        tensor.data_ptr() == slot.data_ptr()
        and tensor.shape == slot.shape
        and tensor.stride() == slot.stride()
    )


def write_grad(writer: GradWriter, grad):
    """Graph-level entry: the call_function target the pass inserts."""
    return writer.write(grad)


def mm_into_slot(writer: GradWriter, a, b):
    """``aten.mm(a, b)``, computed straight into the slot (``out=``) when it may be."""
    slot = writer.fresh_slot((a.shape[0], b.shape[1]), a.dtype, a.device)
    if slot is None or not slot.is_contiguous():
        return torch.ops.aten.mm.default(a, b)
    torch.ops.aten.mm.out(a, b, out=slot)
    writer.wrote_by_out(slot)
    return slot


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
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return placeholders[-1] if placeholders else next(iter(graph.nodes))


def _anchor(graph: torch.fx.Graph, producer: torch.fx.Node) -> torch.fx.Node:
    """Insert right after the producer (after the writers, for graph inputs)."""
    if producer.op != "placeholder":
        return producer
    last = _last_placeholder(graph)
    while last.next.op == "get_attr":
        last = last.next
    return last


def rewrite_backward(gm: torch.fx.GraphModule, targets, state: DDPBucketState) -> list:
    """Route each ``(output position, parameter index)`` gradient through a writer.

    Returns the parameter indices that were routed. Mutates ``gm`` in place.
    """
    graph = gm.graph
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = list(output_node.args[0])
    routed, out_variants = [], 0
    for position, param_index in targets:
        grad_node = outputs[position]
        attr = f"_donate_ddp_writer_{position}"
        setattr(gm, attr, GradWriter(state, param_index))
        # The writer is fetched at the top of the graph, so that it is defined
        # before the gradient's producer as well (see ``_compute_into_slot``).
        with graph.inserting_after(_last_placeholder(graph)), warnings.catch_warnings():
            # FX warns that a get_attr target is not a module/parameter/buffer;
            # a plain Python attribute is what we want here.
            warnings.simplefilter("ignore", UserWarning)
            writer_node = graph.get_attr(attr)
        with graph.inserting_after(_anchor(graph, grad_node)):
            outputs[position] = graph.call_function(write_grad, (writer_node, grad_node))
        producer = _mm_producer(grad_node, {output_node, outputs[position]})
        if producer is not None:
            _compute_into_slot(graph, producer, writer_node)
            out_variants += 1
        routed.append(param_index)
    output_node.args = (tuple(outputs),) + tuple(output_node.args[1:])
    graph.lint()
    gm.recompile()
    gm.meta["donate_ddp_out_variants"] = out_variants
    return routed


def _compute_into_slot(graph: torch.fx.Graph, mm_node: torch.fx.Node, writer_node) -> None:
    """Replace ``mm(a, b)`` by ``mm_into_slot(writer, a, b)`` (writer defined first)."""
    a, b = mm_node.args
    with graph.inserting_after(mm_node):
        replacement = graph.call_function(mm_into_slot, (writer_node, a, b))
    replacement.meta = dict(mm_node.meta)
    mm_node.replace_all_uses_with(replacement)
    graph.erase_node(mm_node)

