"""Running a lowered graph on real device buffers.

``XlaExecutable`` is the callable aot_autograd receives. Per call it
1. uploads host scalar inputs and makes inputs with pending lazy IR concrete,
2. checks that each donor can be donated now: it is not passed twice, not a
   view, and holds its buffer alone (``ownership.installed``); a donor that may share
   its buffer is copied first and the copy donated,
3. runs the cached HLO with inputs in parameter order (recompiling if the
   entry was evicted from torch_xla's cache),
4. writes in-place mutations back into the caller's tensors (views and version
   counters behave as after an in-place op; ``_write_back``), and
5. returns the outputs.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, Optional, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from ..errors import DonateXlaError
from . import compat, ownership
from .lower import LoweredGraph, LoweringRequest, lower
from .plan import check_results

log = logging.getLogger("donate_xla")

_CACHE_MISS_MARKERS = ("failed to get computation by hash", "lru cache")

_SEED_MUL = 7012063
_SEED_ADD = 1012031


def _fresh_seed_tensor(device: torch.device) -> torch.Tensor:
    """The device's current base seed as a tensor; advances the device RNG."""
    seed = compat.base_seed_tensor(device)
    next_seed = (_SEED_ADD + compat.rng_seed() * _SEED_MUL) % (2**64 - 1)
    xm.set_rng_state(next_seed, str(device))
    return seed


def _may_be_cache_miss(exc: RuntimeError) -> bool:
    """Whether a failed run may be an evicted cache entry (then: compile again, retry).

    While torch_xla's cache has never been full nothing was evicted, so no
    error is a miss; past that, the error's text decides.
    """
    if not compat.cache_may_have_evicted():
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _CACHE_MISS_MARKERS)


class XlaExecutable:
    """A compiled graph; call it with the flat list of graph inputs (boxed)."""

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        lowered: LoweredGraph,
        host_values=None,
        version_bumped: Optional[frozenset] = None,
        record_outputs: bool = False,
        requested: frozenset = frozenset(),
        requestable: tuple = (),
        sharded: bool = False,
        on_call: Optional[Callable[[list, list], None]] = None,
    ):
        self.graph_name = graph_name
        self._on_call = on_call  # after each call, notes for the memory plan (xla.memory.note_call)
        self.lowered = lowered  # its request (lowered.request) makes the variants
        self._without_donation: Optional[LoweredGraph] = None
        self.device = torch_xla.device()
        self.calls_without_donation = 0  # calls where a donor shared its buffer
        self.last_call: Optional[LoweredGraph] = None  # the variant the last call ran
        self._checked: set = set()  # hashes whose results were checked against the plan
        self._held: list = []  # tensors on the buffers the last call donated (_choose_variant)
        self.calls_copying_donors = 0  # calls that donated copies of donors others may share
        self._exclusive: dict = {}  # id(variant) -> (variant, _exclusive_results(variant))
        self._version_bumped = version_bumped  # compat.aot_version_bumped_inputs(); None: unknown
        # inference graphs (optimizer steps) return new state a later call donates; a
        # forward's outputs (activations, the loss) are not worth the record
        self._record_outputs = record_outputs
        self._requested = requested  # donations the program asked for in the graph
        self._host_values = host_values  # host.HostPart: values computed on the host
        self._requestable = requestable  # inputs donated when their buffer is flagged
        self._flag_count: Optional[int] = None  # torch_xla's XlaSetBufferDonation at the last look
        self._with_flagged: dict = {}  # frozenset of flagged inputs -> LoweredGraph
        self._last_flagged: frozenset = frozenset()
        # SPMD: a result of an execution still running is a sharded placeholder without
        # shards, and torch_xla 2.9 reads its first shard for a buffer handle or tag
        # (undefined behaviour: a segfault now and then). Its checks wait for executions.
        self._wait_before_checks = sharded

    def __call__(self, args: list):
        args = list(args)
        outputs = self.run(args, self._device_args(args))
        if self._on_call is not None:
            self._on_call(args, outputs)
        return outputs

    def run(self, args: list, device_args: list):
        """One call, given the arguments already on the device (``materialized_device_args``)."""
        device_args = list(device_args)
        lowered, held = self._choose_variant(args, device_args)
        self.last_call = lowered
        results = []
        if lowered.graph_hash is not None:
            lowered, results = self._run(lowered, device_args)
        on_host = self._host_values(args) if self._host_values is not None else ()
        cached = self._exclusive.get(id(lowered))
        if cached is None or cached[0] is not lowered:  # a variant lowered again is a new object
            cached = self._exclusive[id(lowered)] = (lowered, _exclusive_results(lowered, self._record_outputs))
        exclusive = cached[1]
        installed = self._installed_results(results, exclusive)
        self._write_back(args, lowered, results, installed)
        if self._host_values is not None:
            with torch.no_grad():
                for input_index, k in self._host_values.writebacks:
                    args[input_index].copy_(on_host[k])
        self._held = held  # lets go of the previous call's (its execution is done by now)
        outputs, fresh, pins = [], [], []
        for slot in lowered.outputs:
            if slot.kind == "result" and slot.index in installed and not slot.to_host:
                value = installed[slot.index]
                fresh.append(value)
                pins.append(results[slot.index])
            else:
                value = on_host[slot.index] if slot.kind == "host" else self._output(slot, args, results)
            outputs.append(value)
        if fresh:
            ownership.installed.record(fresh, pins)
        return outputs

    def _lower(self, request: LoweringRequest, device_args: list) -> LoweredGraph:
        """A variant of this graph (no data moves; under SPMD on the call's inputs)."""
        return lower(request, device_args if request.sharded else None)

    def _plain_variant(self, device_args: list) -> LoweredGraph:
        if self._without_donation is None:
            self._without_donation = self._lower(self.lowered.request.without_donation(), device_args)
        return self._without_donation

    def _device_args(self, args: list) -> list:
        return materialized_device_args(args, self.device)

    def _flagged_inputs(self, device_args: list) -> frozenset:
        """Inputs whose buffers the user flagged for donation (``_set_buffer_donation``).

        Looked at when torch_xla's count of flag changes moved since the last
        look, or the last look found flags: a program that flags nothing pays one
        counter read per call.
        """
        if not self._requestable:
            return frozenset()
        count = compat.buffer_donation_count()
        if count == self._flag_count and not self._last_flagged:
            return frozenset()
        self._flag_count = count
        self._last_flagged = frozenset(
            i for i in self._requestable
            if device_args[i].is_xla and compat.get_buffer_donation(device_args[i])
        )
        return self._last_flagged

    def _variant_with_flagged(self, flagged: frozenset, device_args: list) -> LoweredGraph:
        if flagged not in self._with_flagged:
            self._with_flagged[flagged] = self._lower(self.lowered.request.with_requested(flagged), device_args)
        return self._with_flagged[flagged]

    def _choose_variant(self, args: list, device_args: list) -> tuple:
        """(the graph to run, tensors on the buffers it donates).

        The donating graph if no donor is passed twice, is a view or shares its
        XLA tensor with another argument; a donor whose buffer another tensor may
        hold (``ownership.installed``) is replaced in ``device_args`` by a fresh copy, which
        is donated instead. Else the plain graph.

        The caller keeps the returned tensors until its next call: the write-back
        replaces each donor's buffer, and if that dropped the last handle of a
        buffer an in-flight execution was given as a donor, torch_xla would wait
        for the execution (the whole step). Handles of donated buffers hold no
        memory (XLA reuses it).
        """
        flagged = self._flagged_inputs(device_args)
        lowered = self._variant_with_flagged(flagged, device_args) if flagged else self.lowered
        if not lowered.donors:
            return lowered, []
        self._settle_if_sharded()
        checked = ownership.donatable_buffers(
            args, device_args, lowered.donors, self._version_bumped, self._requested | flagged
        )
        if checked is not None:
            held, shared = checked
            if not shared:
                return lowered, held
            self._note_copies(shared, lowered.donors)
            copies = [device_args[lowered.donors[k]].clone() for k in shared]
            compat.sync(copies, wait=False)
            for k, copy in zip(shared, copies):
                device_args[lowered.donors[k]] = copy
                held[k] = copy
            return lowered, held
        self.calls_without_donation += 1
        if self.calls_without_donation == 1:
            log.info(
                "donate_xla: %s ran without donation: a donor is a view, is passed twice, or "
                "shares its buffer with another tensor",
                self.graph_name,
            )
        return self._plain_variant(device_args), []

    def _note_copies(self, shared: list, donors: tuple) -> None:
        self.calls_copying_donors += 1
        if self.calls_copying_donors == 1:
            log.info(
                "donate_xla: %s donated copies of inputs %s: other tensors may hold their "
                "buffers (read outside a compiled graph, or not yet written by donate_xla)",
                self.graph_name, [donors[k] for k in shared],
            )

    def _installed_results(self, results: list, exclusive: list) -> dict:
        """Result index -> a new tensor on that result's buffer, to install (``_write_back``).

        The result tensor itself stays with the record as its pin
        (``ownership.installed.record``). Making the new tensors reads the results' buffer
        handles; on a mesh a result still being computed has none yet (see
        ``_settle_if_sharded``), so there the call waits for its execution first.
        """
        if not exclusive or not results:
            return {}
        self._settle_if_sharded()
        _, fresh = compat.device_data_nodes([results[k] for k in exclusive])
        if len(fresh) != len(exclusive):  # two results on one buffer: install nothing
            return {}
        return dict(zip(exclusive, fresh))

    def _settle_if_sharded(self) -> None:
        if self._wait_before_checks:
            compat.wait_device_ops()

    def _param_values(self, lowered: LoweredGraph, device_args: list) -> list:
        values = []
        for p in lowered.params:
            if p.kind == "input":
                values.append(device_args[p.input_index])
            elif p.kind == "seed":
                values.append(_fresh_seed_tensor(self.device))
            else:
                values.append(p.constant)
        return values

    def _run(self, lowered: LoweredGraph, device_args: list) -> tuple:
        """Run ``lowered``; returns (the variant that ran, its results)."""
        try:
            results = compat.run_cached_graph(lowered.graph_hash, self._param_values(lowered, device_args))
        except RuntimeError as exc:
            if not _may_be_cache_miss(exc):
                raise DonateXlaError(
                    f"donate_xla: {self.graph_name}: running the compiled graph failed: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                    help_section="While running",
                ) from exc
            # Evicted from torch_xla's LRU cache: compile again (no data moves) and retry.
            self._settle_if_sharded()  # SPMD lowers on the real buffers, reading their handles
            evicted, lowered = lowered, self._lower(lowered.request, device_args)
            self.last_call = lowered
            if evicted is self.lowered:
                self.lowered = lowered
            elif evicted is self._without_donation:
                self._without_donation = lowered
            else:
                for flagged, variant in self._with_flagged.items():
                    if variant is evicted:
                        self._with_flagged[flagged] = lowered
            results = compat.run_cached_graph(lowered.graph_hash, self._param_values(lowered, device_args))
        if lowered.graph_hash not in self._checked:
            check_results(results, lowered.results, self.graph_name)
            self._checked.add(lowered.graph_hash)
        return lowered, results

    @staticmethod
    def _write_back(args: list, lowered: LoweredGraph, results: list, installed=None) -> None:
        """In-place semantics for the caller: views of a written input see its new
        value and its version counter moves, as after an in-place op.

        ``installed`` (``_installed_results``): result index -> a tensor to install
        into the input that alone receives that result (``compat.install_values``:
        the input then holds the new buffer with no IR node, and ``ownership.installed``
        records that it holds it alone). Every other result is ``copy_``-ed (IR
        that reads the result's buffer; executes nothing), and its input is not
        recorded. ``installed`` None: copy every result (stitched graphs, whose
        results are lazy). Nothing waits for the device.
        """
        if not lowered.writebacks:
            return
        installs = []  # (target, tensor to install, the result as the record's pin)
        with torch.no_grad():
            for input_index, result_index in lowered.writebacks:
                target = args[input_index]
                new_value = results[result_index]
                if not target.is_xla:
                    target.copy_(new_value.cpu())
                elif installed is not None and result_index in installed:
                    installs.append((target, installed[result_index], new_value))
                else:
                    target.copy_(new_value)
                    ownership.installed.forget(target)
            if not installs:
                return
            targets = [t for t, _, _ in installs]
            done = compat.install_values(targets, [fresh for _, fresh, _ in installs])
            for (target, _, new_value), ok in zip(installs, done):
                if not ok:
                    target.copy_(new_value)
                    ownership.installed.forget(target)
        ownership.installed.record(
            [t for t, ok in zip(targets, done) if ok], [pin for (_, _, pin), ok in zip(installs, done) if ok]
        )

    @staticmethod
    def _output(slot, args: list, results: list):
        if slot.kind == "input":
            return args[slot.index]
        if slot.kind == "value":
            return slot.value
        value = results[slot.index]
        return value.cpu() if slot.to_host else value


def _exclusive_results(lowered: LoweredGraph, outputs_too: bool) -> list:
    """The HLO results exactly one write-back (or, ``outputs_too``, one device
    output) takes and nothing else does: those are installed and recorded."""
    uses = collections.Counter(k for _, k in lowered.writebacks)
    outputs = [slot.index for slot in lowered.outputs if slot.kind == "result"]
    uses.update(outputs)
    candidates = {k for _, k in lowered.writebacks}
    if outputs_too:
        candidates.update(outputs)
    return sorted(k for k in candidates if uses[k] == 1)


def materialized_device_args(args: list, device: torch.device) -> list:
    """``args`` with host tensors moved to ``device`` and pending IR made concrete."""
    ownership.stitched_pending.settle(device)
    device_args = list(args)
    tensors, uploaded = [], []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if not a.is_xla:
                a = device_args[i] = a.to(device)
                uploaded.append(a)
            tensors.append(a)
    if uploaded:  # give them buffers now: a later trace must not turn them into IR constants
        compat.sync(uploaded, wait=False)
    ownership.materialize_pending(tensors, device)
    return device_args


def shape_signature(args: Sequence) -> tuple:
    """The concrete shapes and dtypes of the tensor arguments, and the values of the
    integer ones (dynamic sizes)."""
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a if isinstance(a, int) else None
        for a in args
    )


class PerSignatureExecutable:
    """One ``XlaExecutable`` per signature of the arguments, lowered at the first
    call that brings it:

    - dynamic shapes: the graph is symbolic; each concrete combination of input
      shapes (and dynamic sizes) gets a static executable;
    - SPMD: HLO parameters must carry their inputs' shardings, which only the
      real tensors know; ``context`` (called at each call) adds what else the
      executable depends on that the arguments do not show (a backward's
      gradient layouts: the shardings of the parameters this call is for).
    """

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        make: Callable[[list, list], XlaExecutable],
        by_shape: bool,
        by_sharding: bool,
        context: Optional[Callable[[], tuple]] = None,
    ):
        self.graph_name = graph_name
        self._make = make  # (args, device args) -> XlaExecutable
        self._by_shape = by_shape
        self._by_sharding = by_sharding
        self._context = context
        self.device = torch_xla.device()
        self.by_signature: dict = {}

    def __call__(self, args: list):
        from .spmd import sharding_signature

        args = list(args)
        device_args = materialized_device_args(args, self.device)
        signature = (
            shape_signature(args) if self._by_shape else (),
            sharding_signature(device_args) if self._by_sharding else (),
            self._context() if self._context is not None else (),
        )
        executable = self.by_signature.get(signature)
        if executable is None:
            # SPMD keeps a new tensor's data on the host until it is used: upload it
            # now, as the run would, so that lowering itself moves nothing
            compat.sync([a for a in device_args if isinstance(a, torch.Tensor)], wait=False)
            if self._by_sharding:  # lowering reads the real buffers' handles: they must exist
                compat.wait_device_ops()
            executable = self.by_signature[signature] = self._make(args, device_args)
        return executable.run(args, device_args)


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
        self._exclusive = frozenset(_exclusive_results(lowered, outputs_too=False))
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
