"""Running a lowered graph on real device buffers (one signature; see ``dispatch.py``
for one executable per signature, ``stitched.py`` for graphs inside a lazy whole step).

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
from typing import Callable, Optional

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
        self._exclusive: dict = {}  # id(variant) -> (variant, exclusive_results(variant))
        self._version_bumped = version_bumped  # compat.aot_version_bumped_inputs(); None: unknown
        # inference graphs (optimizer steps) return new state a later call donates; a
        # forward's outputs (activations, the loss) are not worth the record
        self._record_outputs = record_outputs
        self._requested = requested  # donations the program asked for in the graph
        self._host_values = host_values  # analysis.host_part.HostPart: values computed on the host
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
            cached = self._exclusive[id(lowered)] = (lowered, exclusive_results(lowered, self._record_outputs))
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


def exclusive_results(lowered: LoweredGraph, outputs_too: bool) -> list:
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
