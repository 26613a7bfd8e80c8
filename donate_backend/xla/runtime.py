"""Running a lowered graph on real device buffers.

``XlaExecutable`` is the callable aot_autograd receives. Per call it
1. uploads host scalar inputs and makes inputs with pending lazy IR concrete,
2. before donating, gives every live lazy clone of a donor its own buffer, and
   checks that each donor owns its buffer (a ``copy_`` from another tensor
   shares one buffer between two tensors; torch_xla tags the buffer with the
   tensor that owns it). A donor that does not own its buffer makes this call
   run the non-donating variant,
3. runs the cached HLO with inputs in parameter order (recompiling if the
   entry was evicted from torch_xla's cache),
4. writes in-place mutations back into the caller's tensors (``copy_`` of the
   new buffer, so views and version counters behave as after an in-place op), and
5. returns the outputs.
"""
from __future__ import annotations

import collections
import logging
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm

from ..errors import DonateXlaError
from . import compat
from .lower import LoweredGraph
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


def _materialize_pending(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        return
    flags = compat.need_materialization(tensors)
    pending = [t for t, need in zip(tensors, flags) if need]
    if pending:
        compat.sync(pending, wait=True)


def _sync_live_aliases(device: torch.device) -> None:
    """Give lazy clones that still read a donor's buffer buffers of their own."""
    compat.sync_live_tensors(device)


_IDENTITY_VIEWS = ("detach_ViewMeta", "alias_ViewMeta", "lift_fresh_ViewMeta")


def has_identity_storage(t: torch.Tensor) -> bool:
    """False for a functionalization view (``t()``, ``view()``...) of another tensor.

    Such a tensor's base storage still reads the old buffer after an in-place
    update, so donating it would leave the base pointing at a deleted buffer.
    Gradients that aot_autograd returns as views of a backward intermediate are
    like this; parameters (a ``detach`` of their base) are not.
    """
    get_sequence = getattr(torch._C._functionalization, "get_view_meta_sequence", None)
    if get_sequence is None:  # unknown torch: only plain, non-view tensors are donated
        return not t._is_view()
    return all(type(meta).__name__ in _IDENTITY_VIEWS for meta in get_sequence(t))


class _WrittenBuffers:
    """Which buffer our write-back gave each tensor: target -> the tensor id torch_xla
    tagged the buffer with (the result's).

    The target is not synced after the write-back (a sync is a barrier: it would
    wait for the device), so its buffer keeps the result's tag until something
    syncs it; the ownership check accepts that tag too. Only the id is kept: a
    reference to the result would keep its buffer alive, and dropping it later,
    while an execution uses the buffer, waits for that execution. Keyed by
    identity, weakly: an entry goes with its target.
    """

    def __init__(self):
        self._entries: dict = {}  # id(target) -> (weakref to target, tag)

    def set(self, target: torch.Tensor, tag: int) -> None:
        key = id(target)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is target:
            self._entries[key] = (entry[0], tag)
            return
        ref = weakref.ref(target, lambda _, key=key, entries=self._entries: entries.pop(key, None))
        self._entries[key] = (ref, tag)

    def get(self, target: torch.Tensor):
        entry = self._entries.get(id(target))
        return entry[1] if entry is not None and entry[0]() is target else None


_written = _WrittenBuffers()


def donors_owning_their_buffers(tensors: Sequence[torch.Tensor], expected: Sequence[tuple]) -> bool:
    """True if each tensor's device data is tagged with one of its ``expected`` tags:
    its own id, or the tag of the buffer our write-back gave it (``expected_tags``).

    torch_xla tags a buffer with the tensor it was synced for: a tensor that
    copied another's buffer reads a buffer tagged with the other's id, and once
    that copy is synced (``_sync_live_aliases``) the buffer is tagged with the
    copy's id, so the original fails this.
    """
    # passing the tensors back keeps torch_xla from wrapping their buffers in new tensors
    tags, _ = compat.device_data_nodes(tensors, tensors)
    return _tagged_as_expected(tags, tensors, expected)


def owned_donor_buffers(tensors: Sequence[torch.Tensor], expected: Sequence[tuple]) -> Optional[list]:
    """``donors_owning_their_buffers``, returning new tensors on the donors' buffers
    (None if a donor fails it): the same torch_xla call gives both, and the caller
    holds them while the buffers are donated (``XlaExecutable._choose_variant``).
    Wrapping a buffer does not re-tag it."""
    tags, wrappers = compat.device_data_nodes(tensors)
    return wrappers if _tagged_as_expected(tags, tensors, expected) else None


def _tagged_as_expected(tags: Sequence[int], tensors: Sequence, expected: Sequence[tuple]) -> bool:
    # each donor reads exactly one buffer (torch_xla lists a buffer once), so the
    # tags come in the tensors' order
    return len(tags) == len(tensors) and all(map(tuple.__contains__, expected, tags))


def expected_tags(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """Per tensor, the tags its buffer may carry: its own id and, after our
    write-back, the tag of the result buffer it now reads."""
    return [(own, _written.get(t)) for own, t in zip(compat.tensor_ids(tensors), tensors)]


def donor_buffers_distinct(device_args: Sequence, donors: Sequence[int]) -> bool:
    """Each donor holds a buffer of its own that no other argument holds.

    Two tensors synced together from one IR value (``exp_avg`` and ``exp_avg_sq``
    both ``zeros_like(p)``) can come back as one buffer.
    """
    tensors = [a for a in device_args if isinstance(a, torch.Tensor) and a.is_xla]
    identities = compat.buffer_identities(tensors)
    if len(set(identities)) == len(identities):  # the usual case: no two share a buffer
        return True
    counts = collections.Counter(identities)
    position = {id(t): k for k, t in enumerate(tensors)}
    return all(counts[identities[position[id(device_args[i])]]] == 1 for i in donors)


def _may_be_cache_miss(exc: RuntimeError) -> bool:
    """Whether a failed run may be an evicted cache entry (then: compile again, retry).

    While torch_xla's cache has never been full nothing was evicted, so no
    error is a miss; past that, the error's text decides.
    """
    if not compat.cache_may_have_evicted():
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _CACHE_MISS_MARKERS)


def _donors_passed_twice(args: Sequence, donors: Sequence[int]) -> bool:
    """A donor that is also passed at another position cannot be donated this call."""
    ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return False
    counts = collections.Counter(ids)
    return any(counts[id(args[i])] > 1 for i in donors)


def donatable_buffers(
    args: Sequence, device_args: Sequence, donors: Sequence[int], trust_tags: bool, device
) -> Optional[list]:
    """None if some donor cannot be donated now: it is passed twice, is a view, its
    buffer is held by another argument, or it does not own its buffer before or
    after live lazy clones get buffers of their own (``donors_owning_their_buffers``).
    Else new tensors on the donors' buffers, for the caller to hold while they are
    donated.

    Run per call: between two calls the program can copy a donor, view it or
    clone it lazily. Each part is one pass over the arguments and at most one
    torch_xla call; none waits for the device.
    """
    donor_tensors = [device_args[i] for i in donors]
    if _donors_passed_twice(args, donors) or not all(has_identity_storage(t) for t in donor_tensors):
        return None
    if not donor_buffers_distinct(device_args, donors):
        return None
    if not trust_tags:
        _sync_live_aliases(device)
        return compat.device_data_nodes(donor_tensors)[1]
    # before the sync: a donor that copied another tensor's buffer; after it: a
    # donor whose buffer a live tensor copied
    expected = expected_tags(donor_tensors)
    if not donors_owning_their_buffers(donor_tensors, expected):
        return None
    _sync_live_aliases(device)
    return owned_donor_buffers(donor_tensors, expected)


class XlaExecutable:
    """A compiled graph; call it with the flat list of graph inputs (boxed)."""

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        lowered: LoweredGraph,
        relower: Callable[[bool, list], LoweredGraph],
        tags_untrusted: bool = False,
        host_values=None,
        requestable: tuple = (),
        sharded: bool = False,
    ):
        self.graph_name = graph_name
        self.lowered = lowered
        self._relower = relower
        self._without_donation: Optional[LoweredGraph] = None
        self.device = torch_xla.device()
        self.calls_without_donation = 0  # calls where a donor shared its buffer
        self.last_call: Optional[LoweredGraph] = None  # the variant the last call ran
        self._checked: set = set()  # hashes whose results were checked against the plan
        self._held: list = []  # tensors on the buffers the last call donated (_choose_variant)
        # Lowering on the real buffers (SPMD) re-tags them with torch_xla's temporary
        # wrappers, so the first call cannot read ownership from the tags; its
        # write-back tags them again.
        self._tags_untrusted = tags_untrusted
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
        return self.run(args, self._device_args(args))

    def run(self, args: list, device_args: list):
        """One call, given the arguments already on the device (``materialized_device_args``)."""
        lowered, held = self._choose_variant(args, device_args)
        self.last_call = lowered
        results = []
        if lowered.graph_hash is not None:
            lowered, results = self._run(lowered, device_args)
        on_host = self._host_values(args) if self._host_values is not None else ()
        self._write_back(args, lowered, results)
        if self._host_values is not None:
            with torch.no_grad():
                for input_index, k in self._host_values.writebacks:
                    args[input_index].copy_(on_host[k])
        self._held = held  # lets go of the previous call's (its execution is done by now)
        return [
            on_host[slot.index] if slot.kind == "host" else self._output(slot, args, results)
            for slot in lowered.outputs
        ]

    def _plain_variant(self, device_args: list) -> LoweredGraph:
        if self._without_donation is None:
            self._without_donation = self._relower(False, device_args)
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
            self._with_flagged[flagged] = self._relower(True, device_args, flagged)
        return self._with_flagged[flagged]

    def _choose_variant(self, args: list, device_args: list) -> tuple:
        """(the donating graph, tensors on the buffers it donates) if every donor is
        safe to donate now, else (the plain graph, []).

        The caller keeps those tensors until its next call: the write-back replaces
        each donor's buffer, and if that dropped the last handle of a buffer an
        in-flight execution was given as a donor, torch_xla would wait for the
        execution (the whole step). Handles of donated buffers hold no memory (XLA
        reuses it).
        """
        flagged = self._flagged_inputs(device_args)
        lowered = self._variant_with_flagged(flagged, device_args) if flagged else self.lowered
        if not lowered.donors:
            return lowered, []
        trust_tags, self._tags_untrusted = not self._tags_untrusted, False
        self._settle_if_sharded()
        held = donatable_buffers(args, device_args, lowered.donors, trust_tags, self.device)
        if held is not None:
            return lowered, held
        self.calls_without_donation += 1
        if self.calls_without_donation == 1:
            log.info(
                "donate_xla: %s ran without donation: a donor shares its buffer with another "
                "tensor (a copy_, a view, or passed twice)",
                self.graph_name,
            )
        return self._plain_variant(device_args), []

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
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                ) from exc
            # Evicted from torch_xla's LRU cache: compile again (no data moves) and retry.
            self._settle_if_sharded()  # SPMD lowers on the real buffers, reading their handles
            was_main = lowered is self.lowered
            lowered = self._relower(bool(lowered.donors), device_args)
            self.last_call = lowered
            if was_main:
                self.lowered = lowered
            else:
                self._without_donation = lowered
            results = compat.run_cached_graph(lowered.graph_hash, self._param_values(lowered, device_args))
        if lowered.graph_hash not in self._checked:
            check_results(results, lowered.results, self.graph_name)
            self._checked.add(lowered.graph_hash)
        return lowered, results

    @staticmethod
    def _write_back(args: list, lowered: LoweredGraph, results: list) -> None:
        """In-place semantics for the caller: ``arg.copy_(new)``, then own the buffer.

        ``copy_`` (not a handle swap) keeps functionalization's view tracking
        right, so views of a parameter see its new value, and it bumps the version
        counter as an in-place op would. The copy is of a device-data node, so it
        executes nothing. The targets are not synced (a sync waits for the device);
        ``_written`` remembers whose buffer each now reads, for the ownership check.
        """
        if not lowered.writebacks:
            return
        on_device = []
        with torch.no_grad():
            for input_index, result_index in lowered.writebacks:
                target = args[input_index]
                new_value = results[result_index]
                if target.is_xla:
                    target.copy_(new_value)
                    on_device.append((target, new_value))
                else:
                    target.copy_(new_value.cpu())
        tags = compat.tensor_ids([new_value for _, new_value in on_device])
        for (target, _), tag in zip(on_device, tags):
            _written.set(target, tag)

    @staticmethod
    def _output(slot, args: list, results: list):
        if slot.kind == "input":
            return args[slot.index]
        if slot.kind == "value":
            return slot.value
        value = results[slot.index]
        return value.cpu() if slot.to_host else value


def materialized_device_args(args: list, device: torch.device) -> list:
    """``args`` with host tensors moved to ``device`` and pending IR made concrete."""
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
    _materialize_pending(tensors)
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
      real tensors know.
    """

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        make: Callable[[list, list], XlaExecutable],
        by_shape: bool,
        by_sharding: bool,
    ):
        self.graph_name = graph_name
        self._make = make  # (args, device args) -> XlaExecutable
        self._by_shape = by_shape
        self._by_sharding = by_sharding
        self.device = torch_xla.device()
        self.by_signature: dict = {}

    def __call__(self, args: list):
        from .lower import sharding_signature

        args = list(args)
        device_args = materialized_device_args(args, self.device)
        signature = (
            shape_signature(args) if self._by_shape else (),
            sharding_signature(device_args) if self._by_sharding else (),
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


class StitchedExecutable:
    """``DONATE_XLA_STITCH=1``: a graph that does not run on its own.

    Each call adds a lazy-IR node that calls the graph's XLA computation
    (``user_computation``) and returns lazy tensors; write-backs are lazy
    too. Graphs called back to back (forward, backward, optimizer) so form one
    lazy graph, which XLA compiles once (its computation cache) and runs as a
    single executable: activations and gradients are temporaries inside it,
    freed as they are consumed, as in torch_xla's whole-step lazy mode, while
    nothing is traced op by op again. torch_xla's sync aliases the buffers of
    updated tensors (parameters, optimizer state), so they are still donated.

    The lazy graph runs when something reads a result, at ``torch_xla.sync()``,
    or when this graph is called again while its previous call has not run:
    that starts every pending graph as one execution (without waiting), so the
    lazy graph stays one training step long.
    """

    _boxed_call = True

    def __init__(self, graph_name: str, lowered: LoweredGraph, host_values=None):
        self.graph_name = graph_name
        self.lowered = lowered
        self.last_call = lowered
        self._host_values = host_values
        self._opname = f"donate_xla::{graph_name.replace(' ', '_')}"
        self.device = torch_xla.device()
        self._last_result: Optional[torch.Tensor] = None  # one result of the previous call
        self.calls_started = 0  # calls that started the pending lazy graph
        self._reordered: dict = {}  # operand order -> computation taking them so (donor_pairing_order)

    def __call__(self, args: list):
        return self.run(list(args), None)

    def run(self, args: list, device_args: Optional[list]):
        lowered = self.lowered
        if device_args is None:
            device_args = [
                a.to(self.device) if isinstance(a, torch.Tensor) and not a.is_xla else a for a in args
            ]
        self._start_previous_step()
        results = []
        if lowered.graph_hash is not None:
            values = XlaExecutable._param_values(self, lowered, device_args)
            computation, values = self._in_pairing_order(values)
            results = compat.user_computation(self._opname, values, computation)
            self._last_result = results[-1]
        on_host = self._host_values(args) if self._host_values is not None else ()
        XlaExecutable._write_back(args, lowered, results)
        if self._host_values is not None:
            with torch.no_grad():
                for input_index, k in self._host_values.writebacks:
                    args[input_index].copy_(on_host[k])
        return [
            on_host[slot.index] if slot.kind == "host" else XlaExecutable._output(slot, args, results)
            for slot in lowered.outputs
        ]

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
            self.calls_started += 1
