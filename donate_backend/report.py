"""One record per compiled graph: what was compiled, donated, excluded and freed.

``reports()`` returns the records in compile order; ``format_table`` and
``format_record`` print them. The XLA and native paths fill in the fields that
apply to them and leave the rest at their defaults.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import Any, Dict, Optional

from . import dynamo_compat

log = logging.getLogger("donate_xla")


@dataclasses.dataclass(frozen=True)
class InputDonation:
    """A graph input whose buffer is handed to XLA for the outputs to reuse."""

    index: int
    role: str  # parameter, gradient, optimizer_state, buffer, other
    shape: tuple
    dtype: str
    nbytes: int
    sharding: str = ""  # SPMD: torch_xla's sharding spec of the donor ("" when not sharded)
    requested: bool = False  # asked for (dynamo_set_buffer_donor_); not overwritten: invalid afterwards


@dataclasses.dataclass(frozen=True)
class InputExclusion:
    """A graph input that is overwritten but not donated, and why."""

    index: int
    role: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Build:
    """What a graph compiled to: written by its path's compiler, once per build (a graph
    built again for other settings, or with its memory predicted again, gets a new one)."""

    graph_id: int  # dynamo graph number, shared by its forward and backward
    kind: str  # forward, backward, inference
    device: str
    path: str  # the ``paths.Path`` name: xla, native, jax
    num_inputs: int
    compile_seconds: float = 0.0
    # where compile_seconds went: (phase, seconds), e.g. XLA: donors, trace, plan, xla compile,
    # memory prediction; native: build, memory prediction
    phases: tuple = ()
    transfers_count: int = 0  # host-to-device transfers while compiling
    transfers_bytes: int = 0
    constants_uploaded: int = 0  # lifted tensor constants uploaded once
    donated: tuple = ()  # InputDonation
    excluded: tuple = ()  # InputExclusion
    donation_enabled: bool = True
    # native path
    saved_freed_early: Optional[int] = None
    buffers_reused: Optional[int] = None
    bucket_grads: Optional[int] = None
    bucket_bytes: Optional[int] = None
    host_input_bytes: int = 0  # XLA path: host (CPU) tensors uploaded with the inputs, per call
    input_shapes: Optional[tuple] = None  # XLA path, dynamic shapes: the signature compiled
    fallback_ops: tuple = ()  # XLA path: ops that run on the CPU between the graph's XLA segments
    stitched: bool = False  # XLA path: runs inside a lazy whole-step graph (DONATE_XLA_STITCH)
    # XLA path: roles of the inputs the graph writes new values into (an optimizer's
    # step: parameter, optimizer_state), donated or not
    overwritten_roles: tuple = ()
    saved_bytes: Optional[int] = None  # forward graphs: bytes of activations saved for backward
    recompute_gated: int = 0  # XLA backward graphs: recomputation roots kept in order (xla/recompute.py)
    # stitched XLA backward graphs: gradients computed after their parameter's reads (xla/update_order.py)
    updates_ordered: int = 0
    # XLA backward graphs run in segments (xla/segments.py): how many, and the bytes of
    # inputs (saved tensors, incoming gradients) released before the last segment runs
    backward_segments: int = 0
    released_bytes: int = 0
    # the graph's own allocations, as its path predicts them (``graph_memory.GraphMemory``),
    # and the path's estimator that made them (``native.memory``, ``xla.memory``): what the
    # step's plan asks of the path (``plan_notes``, ``tensor_bytes``, ``workspace_bytes``)
    memory: Any = dataclasses.field(default=None, repr=False, compare=False)
    estimator: Any = dataclasses.field(default=None, repr=False, compare=False)
    # native graph with symbolic sizes: a weak reference to the compiled graph's method that
    # replays its allocations at the sizes a call gave (``memory`` is at the traced sizes)
    memory_at_sizes: Any = dataclasses.field(default=None, repr=False, compare=False)
    # XLA path: the lowered graph (``xla.lower.LoweredGraph``); ``lowered.traced`` is
    # the traced stage. Each prints itself with ``as_text()``.
    lowered: Any = dataclasses.field(default=None, repr=False, compare=False)
    # the switch settings the build was made for (``config.cache_key()``): a graph built
    # again for other settings (a lever timed against plain executables) has a record per
    # build, and a step runs one of them
    build_key: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Runs:
    """What the graph's calls showed: written by its path's run-time observer (the
    compiled callable), read by the memory plan."""

    # the inputs a caller holds across steps, as ``(role, identity, nbytes)``
    held_inputs: tuple = dataclasses.field(default=(), repr=False)
    # the identities (as in ``held_inputs``) of the tensors its first call returned
    returned: frozenset = dataclasses.field(default=frozenset(), repr=False)
    first_call: Optional[int] = None  # when it first ran among all graphs (the plan's order)
    last_call: Optional[int] = None  # when it last ran: graphs of a first step only (state made) drop out of the plan
    tangent_bytes: Optional[int] = None  # backward: bytes of the tangents its first call got
    # the storages a graph's first call returned (weak references), and for a backward the
    # bytes of each forward's outputs still alive when it first ran (graph id -> bytes)
    output_storages: Optional[tuple] = dataclasses.field(default=None, repr=False)
    outputs_held: Optional[dict] = None
    tangents_passed_bytes: Optional[int] = None  # backward: of its tangents, an earlier backward's outputs
    # XLA forward: weak references to the parameters its first call read
    parameter_refs: tuple = dataclasses.field(default=(), repr=False)
    # XLA backward: bytes of its forward's parameters' gradients (``.grad``) after the
    # torch_xla.sync() that followed it (kept past it, a stitched step holds them all);
    # None until a sync ran after it
    gradients_at_sync: Optional[int] = None
    # native backward: bytes of what a call returned that were dropped by the time the next
    # backward ran (input gradients that code run eagerly between graph breaks consumed: a
    # mixture of experts' routing); None until a backward ran right after it
    # (``native.memory.DroppedOutputs``)
    outputs_dropped: Optional[int] = None
    # forward: ``(identity, bytes)`` of what eager code run before it saved for its
    # backward, as its first call found them (``native.memory.eager_saved``)
    eager_saved: tuple = dataclasses.field(default=(), repr=False)
    # XLA forward: how many functions dynamo had stopped compiling when ``eager_saved`` was
    # found (found again at the next call once that number grows: ``xla.memory.note_call``)
    eager_saved_after_limits: int = dataclasses.field(default=0, repr=False)


@dataclasses.dataclass
class Choices:
    """What was decided for the graph: by the activation budget under a limit, the
    automatic backward segments, and the step's levers."""

    segments_choice: Optional[str] = None  # why its backward was split (automatic or by the switch)
    budget_choice: Optional[str] = None  # forward: the activation budget a memory_limit chose
    planned_peak: Optional[int] = None  # forward: the step peak predicted for that choice (bytes)
    # the settings chosen for its dynamo graph once its step ran (``choice.StepChoice``)
    step_choice: Any = dataclasses.field(default=None, repr=False)


_PARTS = {f.name: part for part in ("build", "runs", "choices")
          for f in dataclasses.fields({"build": Build, "runs": Runs, "choices": Choices}[part])}


class GraphRecord:
    """One record per compiled graph (per build): ``build`` (what it compiled to),
    ``runs`` (what its calls showed) and ``choices`` (what was decided for it). Every
    field reads as an attribute of the record (``record.donated``); it is written
    through its part, each part by one owner (see each class)."""

    __slots__ = ("build", "runs", "choices")

    def __init__(self, graph_id: int, kind: str, device: str, path: str, num_inputs: int, **fields) -> None:
        parts: Dict[str, dict] = {"build": {}, "runs": {}, "choices": {}}
        for name, value in fields.items():
            if name not in _PARTS:
                raise TypeError(f"GraphRecord has no field {name!r}")
            parts[_PARTS[name]][name] = tuple(value) if name in ("donated", "excluded") else value
        object.__setattr__(self, "build", Build(graph_id, kind, device, path, num_inputs, **parts["build"]))
        object.__setattr__(self, "runs", Runs(**parts["runs"]))
        object.__setattr__(self, "choices", Choices(**parts["choices"]))

    def __getattr__(self, name: str):
        part = _PARTS.get(name)
        if part is None:
            raise AttributeError(f"GraphRecord has no field {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def __setattr__(self, name: str, value) -> None:
        if name == "build":
            object.__setattr__(self, name, value)
            return
        raise AttributeError(
            f"GraphRecord.{name} is written through its part: record.{_PARTS.get(name, 'build')}"
            f".{name} (runs, choices), or record.rebuilt({name}=...) for what the graph compiled to"
        )

    def rebuilt(self, **changes) -> None:
        """What the graph compiled to, changed (its path's compiler, after a build)."""
        object.__setattr__(self, "build", dataclasses.replace(self.build, **changes))

    def replaced(self, **changes) -> "GraphRecord":
        """A copy with ``changes`` (the memory plan's view of one call of the graph)."""
        copy = object.__new__(GraphRecord)
        parts = {"build": self.build, "runs": dataclasses.replace(self.runs),
                 "choices": dataclasses.replace(self.choices)}
        for name, value in changes.items():
            parts[_PARTS[name]] = dataclasses.replace(parts[_PARTS[name]], **{name: value})
        for part, value in parts.items():
            object.__setattr__(copy, part, value)
        return copy

    @property
    def name(self) -> str:
        return f"graph {self.graph_id} {self.kind}"

    @property
    def donated_bytes(self) -> int:
        return sum(d.nbytes for d in self.donated)

    def __repr__(self) -> str:
        return f"GraphRecord({self.build!r})"


_lock = threading.Lock()
_records: list[GraphRecord] = []
_calls = itertools.count()
# Every call, in order: (call number, call_key(record), sizes). A graph can run more than
# once in a step (a graph break inside a layer: the same compiled graph for every layer), and
# the memory plan replays the step call by call. Keys, not records: the log keeps nothing
# alive. ``sizes``: the values of a graph's symbolic sizes in that call (a graph compiled with
# dynamic shapes, such as a mixture of experts' expert for the tokens routed to it), else None.
_call_log: collections.deque = collections.deque(maxlen=1 << 13)


def call_key(record: GraphRecord) -> tuple:
    """What names a graph's record in the call log (copies of a record share it)."""
    return (record.graph_id, record.kind, record.first_call)


def mark_first_call(record: GraphRecord, sizes: Optional[tuple] = None) -> None:
    """Note when ``record``'s graph first ran, among all graphs (the memory plan's order)."""
    if record.first_call is None:
        record.runs.first_call = record.runs.last_call = next(_calls)
        _call_log.append((record.last_call, call_key(record), sizes))


def mark_call(record: GraphRecord, sizes: Optional[tuple] = None) -> None:
    """Note that ``record``'s graph runs now (the plan's step is the graphs of the last one),
    and ``sizes``, the values of its symbolic sizes in this call."""
    record.runs.last_call = next(_calls)
    _call_log.append((record.last_call, call_key(record), sizes))


def calls() -> list:
    """The call log, oldest first: (call number, ``call_key``, sizes) of the last 8192 calls."""
    return list(_call_log)


def add(record: GraphRecord) -> GraphRecord:
    with _lock:
        _records.append(record)
    from . import config

    if config.current().debug:
        log.warning("donate_xla compiled %s\n%s", record.name, format_record(record))
    return record


def reports() -> list[GraphRecord]:
    """All graph records so far, oldest first."""
    with _lock:
        return list(_records)


def discard(records) -> None:
    """Remove ``records`` (the graphs of a function compiled again, which no longer run)."""
    gone = {id(r) for r in records}
    with _lock:
        _records[:] = [r for r in _records if id(r) not in gone]


def clear_reports() -> None:
    with _lock:
        _records.clear()
        _call_log.clear()
    dynamo_compat.clear_recompile_limit_hits()


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def format_record(r: GraphRecord) -> str:
    lines = [
        f"{r.name} [{r.path}, {r.device}] inputs={r.num_inputs} "
        f"compile={r.compile_seconds:.3f}s transfers={r.transfers_count} ({r.transfers_bytes} B)"
    ]
    if r.constants_uploaded:
        lines.append(f"  constants uploaded once: {r.constants_uploaded}")
    if r.fallback_ops:
        lines.append(f"  split into XLA segments around ops run on the CPU: {', '.join(r.fallback_ops)}")
    if r.saved_bytes is not None:
        lines.append(f"  saved for backward: {r.saved_bytes} B")
    if r.recompute_gated:
        lines.append(
            f"  recomputation kept in order: {r.recompute_gated} roots wait for the gradient before them"
        )
    if r.updates_ordered:
        lines.append(
            f"  read before updated: {r.updates_ordered} parameters' gradients wait for the backward's reads "
            "of them (no copy of the parameter in the stitched step)"
        )
    if r.backward_segments:
        lines.append(
            f"  run in {r.backward_segments} segments (records follow): {r.released_bytes} B of saved "
            "tensors and incoming gradients released before the last one runs"
        )
    if r.segments_choice:
        lines.append(f"  segments {r.segments_choice}")
    if r.budget_choice:
        planned = dict(r.phases).get("memory limit plan")
        lines.append(f"  {r.budget_choice}" + (f"; planned in {planned:.3f}s" if planned is not None else ""))
    if r.stitched:
        lines.append(
            "  stitched: runs inside the lazy whole-step graph; the sync donates the parameters' and "
            "state's buffers the exclusivity record vouches for"
        )
    if r.host_input_bytes:
        lines.append(f"  host tensors uploaded per call: {r.host_input_bytes} B")
    if r.input_shapes is not None:
        lines.append(f"  compiled for input shapes {list(r.input_shapes)}")
    if r.path == "xla":
        state = "on" if r.donation_enabled else "off (DONATE_XLA_DONATION=0)"
        lines.append(f"  donation {state}: {len(r.donated)} inputs, {_mib(r.donated_bytes)}")
        for d in r.donated:
            sharding = f" {d.sharding}" if d.sharding else ""
            sharding += " (requested; invalid after the call)" if d.requested else ""
            lines.append(
                f"    donated  #{d.index:<3} {d.role:<15} {d.dtype}{list(d.shape)} {d.nbytes} B{sharding}"
            )
        for e in r.excluded:
            lines.append(f"    excluded #{e.index:<3} {e.role:<15} {e.reason}")
    if r.saved_freed_early is not None:
        lines.append(
            f"  saved tensors freed early: {r.saved_freed_early}, buffers reused: {r.buffers_reused}"
        )
    if r.bucket_grads is not None:
        lines.append(f"  gradients in DDP buckets: {r.bucket_grads} ({_mib(r.bucket_bytes or 0)})")
    return "\n".join(lines)


def format_table(records: Optional[list[GraphRecord]] = None) -> str:
    """A fixed-width table, one row per graph."""
    records = reports() if records is None else records
    header = (
        f"{'graph':<22}{'path':<8}{'device':<8}{'inputs':>7}{'xfers':>7}{'xfer B':>9}"
        f"{'donated':>9}{'donated MiB':>13}{'freed':>7}{'compile s':>11}"
    )
    rows = [header, "-" * len(header)]
    for r in records:
        freed = "-" if r.saved_freed_early is None else str(r.saved_freed_early)
        rows.append(
            f"{r.name:<22}{r.path:<8}{r.device:<8}{r.num_inputs:>7}{r.transfers_count:>7}"
            f"{r.transfers_bytes:>9}{len(r.donated):>9}{r.donated_bytes / 2**20:>13.2f}"
            f"{freed:>7}{r.compile_seconds:>11.3f}"
        )
    return "\n".join(rows)
