"""Run time of the bucket rewrite: write one parameter's gradient into its slot, if this call may.

The rewritten backward graph (``rewrite.py``) calls ``write_grad(writer, g)``
for each parameter gradient and ``mm_into_slot(writer, a, b)`` for weight
gradients made by a matrix multiply. Whether a gradient goes into DDP's bucket
is decided on every call, by ``GradWriter.slot_for_this_call``. It does only
when all of these hold:

- the switch is on and grad mode is off (under ``create_graph`` the gradient
  must stay differentiable);
- the module is in bucket mode now (``binding.state``: our hook is on its
  reducer) and the slot is known and has the gradient's layout;
- the parameter has no tensor hook (it may replace the gradient);
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

from typing import Optional

import torch

from .. import config
from . import compat


class GradWriter:
    """Writes one parameter's gradient into its bucket slot, when this call may."""

    def __init__(self, binding, param_index: int):
        self.binding = binding  # integration.ModuleBinding
        self.param_index = param_index
        self._written_by_out = False  # set by mm_into_slot, consumed by write
        self._accumulator = None  # the parameter's AccumulateGrad node, once looked up

    def __repr__(self) -> str:
        return f"GradWriter(param={self.param_index})"

    def slot_for_this_call(self, shape, dtype, device) -> Optional[torch.Tensor]:
        """The slot to write this gradient into, or None for the plain path."""
        if not config.current().bucket_view or torch.is_grad_enabled():
            return None
        state = self.binding.state
        if state is None:
            return None
        param = state.params[self.param_index]
        if compat.tensor_hooks(param):
            return None
        slot = state.slot(self.param_index)
        if slot is None or slot.shape != shape or slot.dtype != dtype or slot.device != device:
            return None
        if self._accumulator is None:
            self._accumulator = compat.accumulate_grad_node(param)
        if compat.engine_will_execute(self._accumulator) is not True:
            return None
        return slot

    def fresh_slot(self, shape, dtype, device) -> Optional[torch.Tensor]:
        """The slot, when the gradient may be computed straight into it (out=)."""
        slot = self.slot_for_this_call(shape, dtype, device)
        if slot is None or self.binding.state.params[self.param_index].grad is not None:
            return None  # accumulation: compute a temporary, then ``write``
        return slot if slot.is_contiguous() else None

    def wrote_by_out(self, slot) -> None:
        self.binding.state.params[self.param_index].grad = slot
        self._written_by_out = True

    def write(self, grad):
        state = self.binding.state
        if self._written_by_out:
            self._written_by_out = False
            slot = None if state is None else state.slot(self.param_index)
            if slot is not None and grad is not None and _is_view_of(grad, slot):
                state.counts.slot_writes += 1
                state.counts.out_writes += 1
                return None
            # Only a backward aborted between ``mm_into_slot`` and here leaves the
            # flag set with another gradient: ``param.grad`` then holds what that
            # run wrote, and this gradient is accumulated onto it as eager would.
        if grad is None or grad.layout != torch.strided:
            return grad
        slot = self.slot_for_this_call(grad.shape, grad.dtype, grad.device)
        if slot is None:
            return grad
        param = state.params[self.param_index]
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


def write_grad(writer: GradWriter, grad):
    """Graph-level entry: the call_function target the pass inserts."""
    return writer.write(grad)


def mm_into_slot(writer: GradWriter, a, b):
    """``aten.mm(a, b)``, computed straight into the slot (``out=``) when this call may."""
    slot = writer.fresh_slot((a.shape[0], b.shape[1]), a.dtype, a.device)
    if slot is None:
        return torch.ops.aten.mm.default(a, b)
    torch.ops.aten.mm.out(a, b, out=slot)
    writer.wrote_by_out(slot)
    return slot
