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

    def __repr__(self) -> str:
        return f"GradWriter(param={self.param_index})"

    def write(self, grad):
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


def _anchor(graph: torch.fx.Graph, producer: torch.fx.Node) -> torch.fx.Node:
    """Insert right after the producer (after the last placeholder for inputs)."""
    if producer.op != "placeholder":
        return producer
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def rewrite_backward(gm: torch.fx.GraphModule, targets, state: DDPBucketState) -> list:
    """Route each ``(output position, parameter index)`` gradient through a writer.

    Returns the parameter indices that were routed. Mutates ``gm`` in place.
    """
    graph = gm.graph
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = list(output_node.args[0])
    routed = []
    for position, param_index in targets:
        grad_node = outputs[position]
        attr = f"_donate_ddp_writer_{position}"
        setattr(gm, attr, GradWriter(state, param_index))
        with graph.inserting_after(_anchor(graph, grad_node)), warnings.catch_warnings():
            # FX warns that a get_attr target is not a module/parameter/buffer;
            # a plain Python attribute is what we want here.
            warnings.simplefilter("ignore", UserWarning)
            writer_node = graph.get_attr(attr)
        with graph.inserting_after(writer_node):
            outputs[position] = graph.call_function(write_grad, (writer_node, grad_node))
        routed.append(param_index)
    output_node.args = (tuple(outputs),) + tuple(output_node.args[1:])
    graph.lint()
    gm.recompile()
    return routed
