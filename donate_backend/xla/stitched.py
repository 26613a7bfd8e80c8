"""Stitched steps (``DONATE_XLA_STITCH=1``): graphs that run inside torch_xla's lazy
whole-step computation instead of as executables of their own (``StitchedExecutable``).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch_xla

from . import compat, ownership
from .lower import LoweredGraph
from .runtime import XlaExecutable, exclusive_results


# Operand orders one stitched graph is called with at most; past this, calls keep the
# computation's own order (each order is another lazy graph for XLA to compile).
_MAX_OPERAND_ORDERS = 4


def donor_pairing_order(ids: Sequence[int]) -> tuple:
    """The order to pass a stitched graph's operands in, given their torch_xla
    tensor ids: newest first.

    At the sync torch_xla returns the step's updated tensors in the order of
    their ids and offers their old buffers as donors; XLA pairs each donor with
    the next result of the same byte size, in parameter order. torch_xla numbers
    the parameters as it first reaches their data walking the lazy graph, and it
    walks a node's operands last to first. Operands newest first therefore
    number the oldest data (parameters, then optimizer state) first, in id
    order, and each donor is paired with its own new value. Any pairing gives
    the same values, but XLA copies each buffer whose value moves to another
    one (on the benchmark MLP 24 copies of 26 MB per step).
    """
    return tuple(sorted(range(len(ids)), key=ids.__getitem__, reverse=True))


def _install_lazy(args: list, lowered: LoweredGraph, results: list, exclusive: frozenset) -> list:
    """Write a stitched graph's lazy results back by handing each input its result's
    XLA tensor (``compat.install_values``), not by ``copy_``; returns the
    (target, result index) pairs installed. A result that is not ``exclusive``
    (another write-back or an output takes it too) is cloned first, so that no two
    tensors share one XLA tensor.

    After a ``copy_`` the input's new value would descend from its old one, and
    torch_xla's sync donates every buffer tagged with the old value's tensor id,
    whether or not another tensor still holds it (a backup copied from the
    parameter, an upload ``p.data.copy_``-ed into it). A result's tensor is new,
    so no buffer carries its id: nothing is donated through the tags. Which
    buffers a stitched step donates is ``StitchedExecutable``'s choice.
    """
    installed = []
    if not lowered.writebacks:
        return installed
    with torch.no_grad():
        for input_index, result_index in lowered.writebacks:
            target, new_value = args[input_index], results[result_index]
            ownership.installed.forget(target)
            if not target.is_xla:
                target.copy_(new_value.cpu())
                continue
            if result_index not in exclusive:
                new_value = new_value.clone()
            if compat.install_values([target], [new_value])[0]:
                installed.append((target, result_index))
            else:
                target.copy_(new_value)
    return installed


class StitchedExecutable:
    """``DONATE_XLA_STITCH=1``: a graph that does not run on its own.

    Each call adds a lazy-IR node that calls the graph's XLA computation
    (``user_computation``) and returns lazy tensors; write-backs are lazy
    too. Graphs called back to back (forward, backward, optimizer) so form one
    lazy graph, which XLA compiles once (its computation cache) and runs as a
    single executable: activations and gradients are temporaries inside it,
    freed as they are consumed, as in torch_xla's whole-step lazy mode, while
    nothing is traced op by op again.

    The lazy graph runs when something reads a result, at ``torch_xla.sync()``,
    or when this graph is called again while its previous call has not run:
    that starts every pending graph as one execution (without waiting), so the
    lazy graph stays one training step long.

    Donation: write-backs install the result tensors (``_install_lazy``), so
    torch_xla's buffer tags donate nothing (a tag names only the last tensor
    synced to a buffer). A result that alone updates its input is remembered
    (``ownership.pending``) and, once it has run, recorded like an executable's
    (``ownership.installed``). At the next call that updates the input, a donor whose
    record still matches has its buffer flagged for donation
    (``compat.set_buffer_donation``), and the sync that runs the step donates
    it. Any other donor (the first step, a parameter read or replaced since)
    is not donated that step. Graphs read recorded tensors through their pins
    (``ownership.installed.stand_ins``): reading them would end their records.
    """

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        lowered: LoweredGraph,
        host_values=None,
        donors: Sequence[int] = (),
        version_bumped: Optional[frozenset] = None,
        on_call: Optional[Callable[[list, list], None]] = None,
    ):
        self.graph_name = graph_name
        self.lowered = lowered
        self.last_call = lowered
        self._on_call = on_call  # after each call, notes for the memory plan (xla.memory.note_call)
        self._host_values = host_values
        self._opname = f"donate_xla::{graph_name.replace(' ', '_')}"
        self.device = torch_xla.device()
        self._last_result: Optional[torch.Tensor] = None  # one result of the previous call
        self.calls_started = 0  # calls that started the pending lazy graph
        self._reordered: dict = {}  # operand order -> computation taking them so (donor_pairing_order)
        # Inputs whose buffers may be donated (parameters, state), if the graph writes
        # them back: a stitched graph is lowered without forced write-backs, so an
        # input whose traced value comes out unchanged (``a.copy_(b); b.copy_(a)``
        # leaves ``b`` as it was) has no new value, and a donated buffer would leave
        # it holding nothing ("Check failed: handle->HasValue()" at its next read).
        written = {i for i, _ in lowered.writebacks}
        self._donors = tuple(i for i in donors if i in written)
        self._version_bumped = version_bumped  # compat.aot_version_bumped_inputs(); None: unknown
        self._exclusive = frozenset(exclusive_results(lowered, outputs_too=False))
        self.calls_donating = 0  # calls that flagged buffers for donation
        self.calls_without_donation = 0  # calls with donors that flagged none

    def __call__(self, args: list):
        args = list(args)
        outputs = self.run(args, None)
        if self._on_call is not None:
            self._on_call(args, outputs)
        return outputs

    def run(self, args: list, device_args: Optional[list]):
        lowered = self.lowered
        if device_args is None:
            device_args = [
                a.to(self.device) if isinstance(a, torch.Tensor) and not a.is_xla else a for a in args
            ]
        self._start_previous_step()
        ownership.pending.confirm()
        if self._donors:
            self._flag_donors(args, device_args)
        results = []
        if lowered.graph_hash is not None:
            values = XlaExecutable._param_values(self, lowered, device_args)
            read = ownership.installed.stand_ins(values)
            if read is not values:
                ownership.stitched_pending.pending = True
            computation, values = self._in_pairing_order(read)
            results = compat.user_computation(self._opname, values, computation)
            self._last_result = results[-1]
        on_host = self._host_values(args) if self._host_values is not None else ()
        installed = _install_lazy(args, lowered, results, self._exclusive)
        alone = [(t, results[k]) for t, k in installed if k in self._exclusive]
        if alone:
            ownership.pending.add([t for t, _ in alone], [r for _, r in alone])
        if self._host_values is not None:
            with torch.no_grad():
                for input_index, k in self._host_values.writebacks:
                    args[input_index].copy_(on_host[k])
        return [
            on_host[slot.index] if slot.kind == "host" else XlaExecutable._output(slot, args, results)
            for slot in lowered.outputs
        ]

    def _flag_donors(self, args: list, device_args: list) -> None:
        """Flag the buffers of the donors whose record matches (``donatable_buffers``)
        for donation at the sync that runs this call."""
        checked = ownership.donatable_buffers(args, device_args, self._donors, self._version_bumped)
        flagged = 0
        if checked is not None:
            shared = set(checked[1])
            flagged = sum(
                compat.set_buffer_donation(device_args[i], True)
                for k, i in enumerate(self._donors) if k not in shared
            )
        if flagged:
            self.calls_donating += 1
            ownership.stitched_pending.pending = True
        else:
            self.calls_without_donation += 1

    def _in_pairing_order(self, values: list) -> tuple:
        """(computation, operands) with the operands in ``donor_pairing_order``."""
        order = donor_pairing_order(compat.tensor_ids(values))
        if order == tuple(range(len(values))):
            return self.lowered.computation, values
        computation = self._reordered.get(order)
        if computation is None:
            if len(self._reordered) >= _MAX_OPERAND_ORDERS:
                return self.lowered.computation, values
            computation = self._reordered[order] = compat.reordered_computation(
                self.lowered.computation, values, order, self._opname
            )
        return computation, [values[k] for k in order]

    def _start_previous_step(self) -> None:
        previous, self._last_result = self._last_result, None
        if previous is not None and compat.need_materialization([previous])[0]:
            compat.sync_live_tensors_async(self.device)
            ownership.stitched_pending.pending = False
            self.calls_started += 1
