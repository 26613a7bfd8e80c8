"""Who holds which device buffer, and whether a call may donate it.

XLA tensors have no storage a caller can compare: two tensors can hold one
device buffer (a sync hands a copied tensor its source's buffer, two values
synced from one IR value come back as one buffer), and torch_xla's buffer tags
name only the last tensor synced to a buffer. Donating a buffer another tensor
still reads leaves that tensor pointing at a deleted buffer. This module keeps
the ledger the executables consult before they donate:

- ``installed``: tensors holding a buffer no other tensor can hold (an
  executable's results, its write-backs), while nothing has changed them;
- ``pending``: a stitched graph's write-backs, until their results have run;
- ``stitched_pending``: whether a stitched graph that reads buffers behind
  their tensors' backs may still be waiting to run;

and answers, per call, which donors can be donated as they are, which must be
copied first, and when nothing may be (``donatable_buffers``).
"""
from __future__ import annotations

import collections
import weakref
from typing import Optional, Sequence

import torch

from . import compat


def materialize_pending(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Give every argument that holds pending IR (eager code ran on it since its
    last sync) a buffer, waiting for it.

    All the device's pending IR runs, as at a step marker, not only the
    arguments': syncing part of it lets torch_xla hand an argument's old buffer
    to its new value (an in-place update) while other pending IR still reads
    the old one, and that read then fails ("buffer ... is deleted"). An eager
    SGD step with momentum and weight decay after a compiled forward and
    backward did that: a momentum buffer's pending IR reads the parameter it
    decays, the next forward syncs only the parameters.
    """
    if not tensors:
        return
    if any(compat.need_materialization(tensors)):
        compat.sync_live_tensors(device, wait=True)


_IDENTITY_VIEWS = ("detach_ViewMeta", "alias_ViewMeta", "lift_fresh_ViewMeta")


def identity_storages(tensors: Sequence[torch.Tensor]) -> bool:
    """False if one of the tensors is a functionalization view (``t()``,
    ``view()``...) of another tensor.

    Such a tensor's base storage still reads the old buffer after an in-place
    update, so donating it would leave the base pointing at a deleted buffer.
    Gradients that aot_autograd returns as views of a backward intermediate are
    like this; parameters (a ``detach`` of their base) are not.
    """
    get_sequence = compat.view_meta_sequence_function()
    if get_sequence is None:  # unknown torch: only plain, non-view tensors are donated
        return not any(t._is_view() for t in tensors)
    return all(type(meta).__name__ in _IDENTITY_VIEWS for t in tensors for meta in get_sequence(t))


def _tracks_versions(t: torch.Tensor) -> bool:
    """Whether ``t`` has a version counter. A tensor made under
    ``torch.inference_mode()`` has none (reading ``_version`` raises), and inside
    that mode it can be updated in place without a trace, so no record vouches for
    it: donating it costs a copy."""
    return not t.is_inference()


class _Installed:
    """The tensors holding a buffer no other tensor can hold: target -> (what it
    held then, its XLA tensor's id, its version then).

    A write-back (``compat.install_values``) or a result handed to the program leaves a
    tensor holding a new buffer with no IR node. Everything that can share the
    buffer with another tensor goes through an IR node: ``q.copy_(p)``, a view
    or an eager op on ``p`` first give ``p`` an IR node (``value_identity``
    changes), and an in-place update gives ``p`` another value (its version
    moves, and so does what it holds). A tensor whose record still matches
    holds its buffer alone. torch_xla's buffer tags cannot tell that: a buffer
    is tagged with the last tensor synced to it, not with all of them.

    Keyed by identity, weakly: an entry goes with its tensor.
    """

    def __init__(self):
        self._entries: dict = {}  # id(tensor) -> (weakref, value identity, tensor id, version, pin)

    def record(self, tensors: Sequence[torch.Tensor], pins: Sequence[torch.Tensor]) -> None:
        """``pins``: per tensor, another tensor on its buffer, kept with the record so
        that the buffer's device data object cannot be freed and its address reused
        for another tensor's (which would make a changed tensor look unchanged)."""
        for t, pin, held, tensor_id in zip(tensors, pins, compat.value_identities(tensors), compat.tensor_ids(tensors)):
            if ", " in held or not _tracks_versions(t):  # it has an IR node already, or no versions
                self.forget(t)
                continue
            key = id(t)
            entry = self._entries.get(key)
            ref = entry[0] if entry is not None and entry[0]() is t else weakref.ref(
                t, lambda _, key=key, entries=self._entries: entries.pop(key, None)
            )
            self._entries[key] = (ref, held, tensor_id, t._version, pin)

    def forget(self, t: torch.Tensor) -> None:
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t:
            del self._entries[id(t)]

    def holding_alone(self, tensors: Sequence[torch.Tensor], bumped: Sequence[int]) -> list:
        """Per tensor, whether its record still matches. ``bumped``: by how much
        aot_autograd moved each version since the record (its runtime wrapper
        increments the versions of inputs the graph mutates before calling it)."""
        entries = [self._entries.get(id(t)) for t in tensors]
        if any(e is None for e in entries):
            return [e is not None and self.matches(e, t, b) for e, t, b in zip(entries, tensors, bumped)]
        held = compat.value_identities(tensors)
        ids = compat.tensor_ids(tensors)
        return [
            e[0]() is t and e[3] + b == t._version and e[1] == h and e[2] == i
            for e, t, b, h, i in zip(entries, tensors, bumped, held, ids)
        ]

    def stand_ins(self, values: Sequence) -> list:
        """Per value, the pin of a tensor whose record still matches (it holds the
        same buffer, so the same value), else the value itself. A stitched graph
        reads the pins in place of the tensors: lazy IR that reads a tensor gives
        it an IR node, which would end its record (``StitchedExecutable``)."""
        positions = [k for k, v in enumerate(values) if isinstance(v, torch.Tensor) and id(v) in self._entries]
        if not positions:
            return values
        tensors = [values[k] for k in positions]
        out = list(values)
        for k, t, held, tensor_id in zip(positions, tensors, compat.value_identities(tensors), compat.tensor_ids(tensors)):
            entry = self._entries.get(id(t))
            if entry is not None and entry[0]() is t and entry[1] == held and entry[2] == tensor_id:
                out[k] = entry[4]
        return out if any(a is not b for a, b in zip(out, values)) else values

    @staticmethod
    def matches(entry: tuple, t: torch.Tensor, bumped: int) -> bool:
        return (
            entry[0]() is t
            and entry[3] + bumped == t._version
            and entry[1] == compat.value_identity(t)
            and entry[2] == compat.tensor_id(t)
        )


installed = _Installed()


class _Pending:
    """Stitched write-backs whose results have not run yet: target -> (the result
    tensor installed into it, that tensor's id, the target's version then).

    Once the results have buffers, ``confirm`` moves each target whose value is
    still that result into ``installed`` (a new tensor on the buffer installed
    into it, the result kept as the pin, as ``XlaExecutable`` does). Until then a
    target holds lazy IR, and two things can leave it holding another tensor's
    buffer without moving its version or its XLA tensor: ``t.data.copy_(u)``
    (the sync hands ``t`` the buffer of ``u``) and nothing else we know of; so a
    target is confirmed only if no ``copy_`` into an XLA tensor ran since the
    write-back (``compat.copies_between_tensors``). A ``copy_`` from the pending
    value itself (a backup of the new parameter) gets a buffer of its own.
    """

    def __init__(self):
        self._entries: list = []  # (weakref to target, result, result's tensor id, version)
        self._copies: Optional[int] = None  # the copy counter after the last write-back

    def add(self, targets: Sequence[torch.Tensor], results: Sequence[torch.Tensor]) -> None:
        copies = compat.copies_between_tensors()
        if self._entries and (copies is None or copies != self._copies):
            self._entries = []  # a copy_ since the earlier write-backs: they cannot be confirmed
        for target, result, tensor_id in zip(targets, results, compat.tensor_ids(targets)):
            if _tracks_versions(target):
                self._entries.append((weakref.ref(target), result, tensor_id, target._version))
        self._copies = copies

    def confirm(self) -> None:
        """Record the targets whose results have buffers now; forget them all if a
        ``copy_`` ran since the write-backs."""
        if not self._entries:
            return
        if self._copies is None or compat.copies_between_tensors() != self._copies:
            self._entries = []
            return
        results = [result for _, result, _, _ in self._entries]
        ran = [not pending for pending in compat.need_materialization(results)]
        if not all(ran):  # all or none: they belong to one lazy graph
            return
        entries, self._entries = self._entries, []
        targets = [ref() for ref, _, _, _ in entries]
        live = [
            (t, result) for t, (_, result, tensor_id, version) in zip(targets, entries)
            if t is not None and t._version == version and compat.tensor_id(t) == tensor_id
            and ", " not in compat.value_identity(t)
        ]
        if not live:
            return
        _, fresh = compat.device_data_nodes([result for _, result in live])
        if len(fresh) != len(live):  # two results on one buffer
            return
        done = compat.rewrap_values([t for t, _ in live], fresh)
        kept = [(t, result) for (t, result), ok in zip(live, done) if ok]
        installed.record([t for t, _ in kept], [result for _, result in kept])


pending = _Pending()


class _StitchedPending:
    """Whether a stitched graph that may not have run yet reads a buffer behind a
    tensor's back: through a pin (``_Installed.stand_ins``: the tensor shows no
    sign of the read, that is what the pins are for) or one flagged for donation
    (``StitchedExecutable._flag_donors``: any step-marker sync donates it, also
    one that runs only part of the pending graph).

    Until it has run, every executable call first starts every pending lazy
    graph (``materialized_device_args``, without waiting): an execution that
    donates is then ordered after the ones that read, and no pending IR (a
    partial sync of the call's inputs would leave some) reads a donated
    buffer. Only programs that mix stitched and unstitched graphs pay
    for it (dynamic shapes, or the switch changed between calls)."""

    def __init__(self):
        self.pending = False

    def settle(self, device: torch.device) -> None:
        if self.pending:
            compat.sync_live_tensors_async(device)
            self.pending = False


stitched_pending = _StitchedPending()


def _donors_passed_twice(args: Sequence, donors: Sequence[int]) -> bool:
    """A donor that is also passed at another position cannot be donated this call."""
    ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return False
    counts = collections.Counter(ids)
    return any(counts[id(args[i])] > 1 for i in donors)


def _donor_shares_a_tensor(device_args: Sequence, donors: Sequence[int]) -> bool:
    """A donor whose XLA tensor another argument shares (``p`` and ``p.detach()``)."""
    ids = compat.tensor_ids([a for a in device_args if isinstance(a, torch.Tensor) and a.is_xla])
    if len(set(ids)) == len(ids):
        return False
    counts = collections.Counter(ids)
    return any(counts[i] > 1 for i in compat.tensor_ids([device_args[i] for i in donors]))


def _buffers_of_their_own(device_args: Sequence, donors: Sequence[int]) -> bool:
    """No other argument holds one of these donors' buffers. Two tensors synced
    together from one IR value (``exp_avg`` and ``exp_avg_sq`` both
    ``zeros_like(p)``) can come back as one buffer. Only asked of donations the
    program requested: a donor ``_Installed`` vouches for holds its buffer alone,
    and any other is copied."""
    tensors = [a for a in device_args if isinstance(a, torch.Tensor) and a.is_xla]
    identities = compat.buffer_identities(tensors)
    if len(set(identities)) == len(identities):
        return True
    counts = collections.Counter(identities)
    position = {id(t): k for k, t in enumerate(tensors)}
    return all(counts[identities[position[id(device_args[i])]]] == 1 for i in donors)


def donatable_buffers(
    args: Sequence,
    device_args: Sequence,
    donors: Sequence[int],
    version_bumped: Optional[frozenset],
    requested: frozenset = frozenset(),
) -> Optional[tuple]:
    """Whether this call can donate, per call (between two calls the program can
    copy a donor, view it, read it or pass it twice).

    None if a donor is passed twice, is a view, or shares its XLA tensor with
    another argument: then nothing is donated. Else (held, shared): ``held``,
    the tensors behind the donors now (the caller keeps them while the buffers
    are donated), and ``shared``, the positions in ``donors`` of donors whose
    buffer another tensor may hold (``_Installed``): the call donates a copy of
    those. A host tensor uploaded for this call holds its buffer alone, and a
    donation the program ``requested`` (``dynamo_set_buffer_donor_``,
    ``_set_buffer_donation``) is its own promise that nothing else reads it.
    """
    donor_tensors = [device_args[i] for i in donors]
    if _donors_passed_twice(args, donors) or not identity_storages(donor_tensors):
        return None
    if _donor_shares_a_tensor(device_args, donors):
        return None
    trusted = [i for i in donors if i in requested]
    if trusted and not _buffers_of_their_own(device_args, trusted):
        return None
    held = compat.functional_values(donor_tensors)
    if held is None:
        return None
    if version_bumped is None:  # aot_autograd's increments unknown: no record can be read
        alone = [False] * len(donors)
    else:
        alone = installed.holding_alone(donor_tensors, [int(i in version_bumped) for i in donors])
    shared = [
        k for k, (i, ok) in enumerate(zip(donors, alone))
        if not ok and args[i] is device_args[i] and i not in requested
    ]
    return held, shared
