"""Run time of the bucket rewrite: write one parameter's gradient into its slot, if this call may.

The rewritten backward graph (``grad_slots.py``) first calls ``begin(graph)``,
then ``write_grad(writer, call, g)`` for each parameter gradient and
``mm_into_slot(writer, call, a, b)`` for weight gradients made by a matrix
multiply.

**Which parameter.** A compiled graph is not tied to the parameters it was
traced with: dynamo reuses it for every module instance it fits (each expert
of a mixture of experts, each layer whose forward is its own frame), passing
other parameters as inputs. So ``begin`` asks the autograd engine which node
runs this backward and where that node sends each input's gradient; the
gradient of forward input *i* belongs to the leaf behind the ``AccumulateGrad``
node at that input's edge, whichever DDP parameter that is this time. No
``AccumulateGrad`` there (the input is not a leaf, or needs no gradient), or
no answer from the engine: the plain path.

**Whether to write.** A gradient goes into DDP's bucket only when all of
these hold (``GradWriter.slot_for_this_call``):

- the switch is on and grad mode is off (under ``create_graph`` the gradient
  must stay differentiable);
- the module is in bucket mode now (``binding.state``: our hook is on its
  reducer) and the slot is known and has the gradient's layout;
- the parameter has no tensor hook (it may replace the gradient; logged once
  per parameter);
- the autograd engine will run this parameter's ``AccumulateGrad`` in the
  backward running now, i.e. this backward computes the gradient *for
  ``.grad``*. Under ``backward(inputs=...)`` without this parameter, or
  ``torch.autograd.grad``, it will not, and ``.grad`` must stay untouched.

Otherwise the writer returns ``g`` unchanged (the plain path): the engine then
does what it does in eager, accumulate into ``.grad`` or drop the gradient.
When it does write, it copies (or, when ``.grad`` already holds the slot, as
under ``no_sync`` or ``zero_grad(set_to_none=False)``, adds) into the slot,
makes ``.grad`` the slot view and returns None, so ``AccumulateGrad`` does
nothing; DDP's reducer hook still fires and finds ``.grad`` in its bucket.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import config
from ..errors import DonateXlaError
from . import compat, eligibility


log = logging.getLogger("donate_xla")


_fallbacks_logged = WeakIdKeyDictionary()  # parameter -> reasons already logged


def _log_param_fallback(param: torch.Tensor, index: int, reason: str) -> None:
    logged = _fallbacks_logged.setdefault(param, set())
    if reason not in logged:
        logged.add(reason)
        log.warning("donate_xla: DDP parameter #%d keeps DDP's normal path: %s", index, reason)


class GraphWrites:
    """What ``begin`` needs to know about one rewritten backward graph."""

    def __init__(self, name: str, tensor_inputs: int):
        self.name = name
        self.tensor_inputs = tensor_inputs  # tensor inputs of the forward: edges of its node
        self._warned = False

    def __repr__(self) -> str:
        return f"GraphWrites({self.name!r}, tensor_inputs={self.tensor_inputs})"

    def mismatch(self, edges: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "donate_xla: %s: the autograd node running this backward has %d inputs, "
                "not the %d tensor inputs of its forward; its gradients take DDP's normal path",
                self.name,
                edges,
                self.tensor_inputs,
            )


class BackwardCall:
    """One run of a rewritten backward: where each input's gradient goes this time."""

    __slots__ = ("graph_name", "inputs", "out_slots")

    def __init__(self, inputs: Optional[tuple], graph_name: str = "a DDP backward"):
        self.graph_name = graph_name
        self.inputs = inputs  # the next node of each tensor input, or None: write nothing
        self.out_slots: dict = {}  # writer -> (parameter index, slot) written by mm out=


def begin(graph: GraphWrites) -> BackwardCall:
    """Graph-level entry, first node of a rewritten backward."""
    inputs = compat.running_node_inputs()
    if inputs is not None and len(inputs) != graph.tensor_inputs:
        graph.mismatch(len(inputs))
        inputs = None
    return BackwardCall(inputs, graph.name)


class GradWriter:
    """Writes the gradient of one forward input into its parameter's slot, when this call may."""

    def __init__(self, binding, edge: int):
        self.binding = binding  # integration.ModuleBinding
        self.edge = edge  # the input's index among the forward's tensor inputs

    def __repr__(self) -> str:
        return f"GradWriter(edge={self.edge})"

    def slot_for_this_call(self, call: BackwardCall, shape, dtype, device) -> Optional[tuple]:
        """``(parameter index, slot)`` to write this gradient into, or None for the plain path."""
        if call.inputs is None or not config.current().bucket_view or torch.is_grad_enabled():
            return None
        state = self.binding.state
        if state is None:
            return None
        accumulator = call.inputs[self.edge]
        index = state.index_of(compat.accumulated_variable(accumulator))
        if index is None:
            return None
        reason = eligibility.param_fallback_reason(state.params[index])
        if reason is not None:
            _log_param_fallback(state.params[index], index, reason)
            return None
        slot = state.slot(index)
        if slot is None or slot.shape != shape or slot.dtype != dtype or slot.device != device:
            return None
        if compat.engine_will_execute(accumulator) is not True:
            return None
        return index, slot

    def fresh_slot(self, call: BackwardCall, shape, dtype, device) -> Optional[tuple]:
        """``(parameter index, slot)`` when the gradient may be computed straight into it (out=)."""
        target = self.slot_for_this_call(call, shape, dtype, device)
        if target is None:
            return None
        index, slot = target
        if self.binding.state.params[index].grad is not None or not slot.is_contiguous():
            return None  # accumulation: compute a temporary, then ``write``
        return target

    def wrote_by_out(self, call: BackwardCall, index: int, slot) -> None:
        self.binding.state.params[index].grad = slot
        call.out_slots[self] = (index, slot)

    def write(self, call: BackwardCall, grad):
        state = self.binding.state
        written = call.out_slots.pop(self, None)
        if written is not None:
            # ``mm_into_slot`` computed this gradient into the slot and made it
            # ``.grad``; the rewrite only routes a product that reaches the output
            # through transposes back to the same layout, so it is the slot.
            if grad is None or not _is_view_of(grad, written[1]):
                raise DonateXlaError(
                    f"donate_xla internal error in {call.graph_name}: the gradient of DDP "
                    f"parameter #{written[0]} was computed into its bucket slot, but the graph "
                    f"returns another tensor for it; set DONATE_XLA_BUCKET_VIEW=0 to train "
                    f"without bucket writes, and please report this",
                    help_section="While running",
                )
            state.counts.slot_writes += 1
            state.counts.out_writes += 1
            return None
        if grad is None or grad.layout != torch.strided:
            return grad
        target = self.slot_for_this_call(call, grad.shape, grad.dtype, grad.device)
        if target is None:
            return grad
        index, slot = target
        param = state.params[index]
        current = param.grad
        if current is None:
            slot.copy_(grad)
        elif _is_view_of(current, slot):
            slot.add_(grad)  # what AccumulateGrad does: ``grad += new_grad``
        elif (
            current.layout == torch.strided
            and current.shape == slot.shape
            and current.dtype == slot.dtype
            and current.device == slot.device
        ):
            slot.copy_(current)
            slot.add_(grad)
        else:
            return grad
        if current is not slot:
            param.grad = slot
        state.counts.slot_writes += 1
        return None


def _is_view_of(tensor: torch.Tensor, slot: torch.Tensor) -> bool:
    return (
        tensor.data_ptr() == slot.data_ptr()
        and tensor.shape == slot.shape
        and tensor.stride() == slot.stride()
    )


def write_grad(writer: GradWriter, call: BackwardCall, grad):
    """Graph-level entry: the call_function target the pass puts on each parameter output."""
    return writer.write(call, grad)


def mm_into_slot(writer: GradWriter, call: BackwardCall, a, b):
    """``aten.mm(a, b)``, computed straight into the slot (``out=``) when this call may."""
    target = writer.fresh_slot(call, (a.shape[0], b.shape[1]), a.dtype, a.device)
    if target is None:
        return torch.ops.aten.mm.default(a, b)
    index, slot = target
    torch.ops.aten.mm.out(a, b, out=slot)
    writer.wrote_by_out(call, index, slot)
    return slot
