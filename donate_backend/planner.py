"""The memory plan of a training step: what is live, graph by graph, and the peak.

``memory_plan()`` composes the graphs compiled so far into one step and
returns a ``MemoryPlan``. Each graph brings its own prediction (native path:
``native.memory.GraphMemory``, its allocations replayed on fake tensors); the
plan adds what lives across graphs:

- **resident**: the tensors the step's graphs read that the caller holds
  between steps (parameters, buffers, optimizer state, the batch), each
  storage counted once however many graphs read it, plus the state of an
  ``optimizer`` passed in (an optimizer that runs eagerly is not a graph);
- **carried**: what a graph leaves behind for later ones: a forward's saved
  activations (released by its backward) and outputs (held by the caller to
  the end of the step), a backward's gradients.

Graphs run in the order of the last step, each as often as it ran in it
(``report``'s call log: a graph break inside a layer runs one compiled graph
per layer); graphs that have not run yet go in the usual order (forwards,
then backwards in reverse, then the rest). The plan is a prediction:
``bench/backward_memory.py`` and the tests compare it with measured peaks
(docs/memory_plan.md gives the errors).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from . import graph_memory, report
from .analysis.aliasing import storage_address
from .errors import DonateXlaError
from .graph_memory import CATEGORIES

MIB = 2**20

@dataclasses.dataclass(frozen=True)
class PlannedGraph:
    """One graph of the step: the live bytes when it starts, at its peak and when it returns."""

    name: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    peak_parts: Tuple[Tuple[str, int], ...]  # (category, bytes) live at this graph's peak
    graph_id: Optional[int] = None  # the dynamo graph it was compiled from
    kind: str = ""  # forward, backward or inference


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """A step's predicted memory (bytes). ``as_text()`` and ``plot(path)`` show it."""

    peak_bytes: int  # most bytes live at any point of the step
    resident_bytes: int  # live at the start of a step
    breakdown: Dict[str, int]  # category -> bytes live at the peak
    graphs: Tuple[PlannedGraph, ...]  # in step order
    choices: Tuple[str, ...]  # the levers each graph uses, and what they cost
    path: str = "native"
    limit_bytes: Optional[int] = None
    notes: Tuple[str, ...] = ()  # what the plan could not see

    @property
    def growth_bytes(self) -> int:
        """Peak above the start of the step (what a step adds to the resident tensors)."""
        return self.peak_bytes - self.resident_bytes

    def as_text(self) -> str:
        lines = [
            f"memory plan ({self.path} path): peak {self.peak_bytes / MIB:.1f} MiB, "
            f"resident {self.resident_bytes / MIB:.1f} MiB, growth {self.growth_bytes / MIB:.1f} MiB"
            + (f", limit {self.limit_bytes / MIB:.1f} MiB" if self.limit_bytes else ""),
            "  at the peak: " + ", ".join(
                f"{c} {b / MIB:.1f}" for c, b in self.breakdown.items() if b
            ),
            "  graph                       start      peak       end   (MiB)",
        ]
        for g in self.graphs:
            lines.append(
                f"  {g.name:<24} {g.start_bytes / MIB:9.1f} {g.peak_bytes / MIB:9.1f} {g.end_bytes / MIB:9.1f}"
            )
        lines += [f"  {c}" for c in self.choices]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Draw the live bytes at each graph's start, peak and end, stacked by category."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise DonateXlaError(
                "donate_xla: MemoryPlan.plot needs matplotlib, which is not installed: "
                "pip install 'donate_backend[plot]' (or pip install matplotlib); "
                "MemoryPlan.as_text() needs nothing.",
                help_section="Memory plan",
            ) from error
        figure, axes = plt.subplots(figsize=(max(4.0, 1.4 * len(self.graphs) + 2), 4))
        names = [g.name for g in self.graphs]
        bottoms = [0.0] * len(self.graphs)
        for category in CATEGORIES:
            heights = [dict(g.peak_parts).get(category, 0) / MIB for g in self.graphs]
            if any(heights):
                axes.bar(names, heights, bottom=bottoms, label=category)
                bottoms = [b + h for b, h in zip(bottoms, heights)]
        if self.limit_bytes:
            axes.axhline(self.limit_bytes / MIB, color="black", linestyle="--", label="limit")
        axes.set_ylabel("MiB live at the graph's peak")
        axes.set_title(f"peak {self.peak_bytes / MIB:.1f} MiB, resident {self.resident_bytes / MIB:.1f} MiB")
        axes.tick_params(axis="x", labelrotation=30)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return path


def _step_order(records: Sequence[report.GraphRecord]) -> List[report.GraphRecord]:
    """The step's graphs call by call: each as often as it ran in the last step (a graph
    break inside a layer runs one compiled graph once per layer), in the order they ran
    (a graph compiled again under a memory limit first ran after the optimizer's graph,
    but runs before it); then the graphs that have not run yet, in the usual order.

    A graph that ran only before the last step is left out: dynamo compiled it for the
    first step and then replaced it (a graph recompiled with dynamic sizes once a second
    size came), or it ran once (an optimizer's first step, which makes its state)."""
    ran = sorted((r for r in records if r.first_call is not None), key=lambda r: r.last_call)
    waiting = [r for r in records if r.first_call is None]
    rank = {"forward": 0, "backward": 1, "inference": 2}
    waiting.sort(key=lambda r: (rank.get(r.kind, 3), -r.graph_id if r.kind == "backward" else r.graph_id))
    if ran:
        by_key = {report.call_key(r): r for r in ran}
        calls = [(number, by_key[key], sizes)
                 for number, key, sizes in _last_step_calls(report.calls(), ran) if key in by_key]
        if calls:
            since = calls[0][0]
            # every graph that ran since the step began is in the log: else keep one call each
            if {id(r) for _, r, _ in calls} == {id(r) for r in ran if r.last_call >= since}:
                ran = [_at_sizes(r, sizes) for _, r, sizes in calls]
    return ran + waiting


def _at_sizes(record: report.GraphRecord, sizes: Optional[tuple]) -> report.GraphRecord:
    """``record`` for one call of its graph: a graph with symbolic sizes (dynamic shapes)
    replayed at the sizes of that call (a copy of the record), else the record itself."""
    method = record.memory_at_sizes() if record.memory_at_sizes is not None and sizes is not None else None
    memory = method(sizes) if method is not None else None
    if memory is None or memory is record.memory:
        return record
    # the tangents its first call got (and what it returned that was dropped) were at
    # that call's sizes: scaled to these
    tangents, passed, dropped = record.tangent_bytes, record.tangents_passed_bytes, record.outputs_dropped
    if record.memory is not None and record.memory.tangent_bytes:
        scale = memory.tangent_bytes / record.memory.tangent_bytes
        tangents, passed, dropped = (None if v is None else round(v * scale) for v in (tangents, passed, dropped))
    return record.replaced(memory=memory, tangent_bytes=tangents, tangents_passed_bytes=passed,
                               outputs_dropped=dropped)


def _last_step_calls(log: list, ran: Sequence[report.GraphRecord]) -> list:
    """The last step's calls in ``report.calls()`` (``(call number, key, sizes)``).

    Those since the step's last graph ran in the step before (a graph the step runs more
    than once may also run before the step's first forward), if the first forward among
    them runs once there. Else (the last graph did not run in the step before: dynamo
    compiled it again; an evaluation run every few steps; a forward that runs more than
    once) the last forward pass and what ran after it, with the graphs run just before
    it that are not the ones run after the backward (the step before's optimizer)."""
    last = report.call_key(ran[-1])
    at = [i for i, (_, key, _) in enumerate(log) if key == last]
    if at:
        block = at[-1]  # the last graph's final calls, run one after another
        while block > 0 and log[block - 1][1] == last:
            block -= 1
        before = [i for i in at if i < block]
        if before:
            window = log[before[-1] + 1: at[-1] + 1]
            forwards = [key for _, key, _ in window if key[1] == "forward"]
            if forwards and forwards.count(forwards[0]) == 1:
                return window
    kinds = [key[1] for _, key, _ in log]
    if "forward" not in kinds:
        return [entry for entry in log if entry[0] >= ran[0].last_call]
    start = len(kinds) - 1 - kinds[::-1].index("forward")
    while start > 0 and kinds[start - 1] != "backward":
        start -= 1
    after = len(kinds) - kinds[::-1].index("backward") if "backward" in kinds[start:] else len(kinds)
    tail = {key for _, key, _ in log[after:]}
    while kinds[start] != "forward" and log[start][1] in tail:
        start += 1
    return log[start:]


def last_step_calls() -> list:
    """The calls of the last step among all graphs (``report.calls()`` entries)."""
    ran = sorted((r for r in report.reports() if r.first_call is not None), key=lambda r: r.last_call)
    return _last_step_calls(report.calls(), ran) if ran else []


def last_step(records: List[report.GraphRecord], graph_id: Optional[int] = None) -> List[report.GraphRecord]:
    """The graphs of the last step: a graph that last ran before the step's first
    forward belongs to an earlier step only (an optimizer's first step, which makes
    its state, compiles a graph of its own that later steps never run again).
    With ``graph_id``: the last step of that forward, from its last call on (another
    model's graphs that stopped running before it are not part of it)."""
    # A graph built again for other settings (a step stitched once it had run) first ran
    # after its old build last ran: the old one is no longer part of the step.
    newest: Dict[tuple, int] = {}
    for r in records:
        if r.first_call is not None:
            key = (r.graph_id, r.kind)
            newest[key] = max(newest.get(key, r.first_call), r.first_call)
    records = [r for r in records if r.last_call is None or r.last_call >= newest.get((r.graph_id, r.kind), 0)]
    # Builds of one graph for settings taken in turn (a lever timed against plain
    # executables, ``choice.StepTimes``): the step runs the build that ran last.
    latest: Dict[tuple, tuple] = {}
    for r in sorted((r for r in records if r.last_call is not None), key=lambda r: r.last_call):
        latest[(r.graph_id, r.kind)] = r.build_key
    records = [r for r in records
               if r.build_key is None or latest.get((r.graph_id, r.kind), r.build_key) == r.build_key]
    forwards = [r.last_call for r in records if r.kind == "forward" and r.last_call is not None
                and graph_id in (None, r.graph_id)]
    if not forwards:
        return records
    start = min(forwards)
    return [r for r in records if r.last_call is None or r.last_call >= start]


def _gradient_consumers(ordered: Sequence[report.GraphRecord]) -> Dict[int, int]:
    """Position of each stitched backward whose gradients a stitched optimizer graph
    consumes in the same XLA computation -> one update's temporaries: that graph's own
    peak, plus the largest new value it writes, which XLA's schedule of the whole step
    may put in a buffer of its own while the old value is still read (an executable
    of its own updates in place: XLA's buffer assignment of a stitched MLP step held
    one parameter's bytes more than the separate graphs). The optimizer graph is the
    first graph after the backward that overwrites parameters (an optimizer's step; an
    evaluation graph run in between updates none), if it is stitched too."""
    out = {}
    for position, r in enumerate(ordered):
        if r.kind != "backward" or not r.stitched:
            continue
        after = next((g for g in ordered[position + 1:] if g.kind not in ("forward", "backward")
                      and _updates_parameters(g)), None)
        if after is not None and after.stitched:
            out[position] = max(0, after.memory.peak_bytes) + after.memory.largest_written_bytes
    return out


def _updates_parameters(record: report.GraphRecord) -> bool:
    """Whether a graph writes new values into parameters (donated or not)."""
    return "parameter" in record.overwritten_roles


def _optimizer_state_bytes(optimizer, seen: set, path) -> int:
    import torch

    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                key = storage_address(value)
                if key is not None and key not in seen:
                    seen.add(key)
                    total += path.tensor_bytes(value)
    return total


def _choices(records: Iterable[report.GraphRecord]) -> Tuple[str, ...]:
    out = []
    notes = set()
    for r in records:
        note = getattr(r.step_choice, "note", None)
        if note and note not in notes and (r.stitched or r.kind == "forward"):
            notes.add(note)
            out.append(f"{r.name}: {note}")
        if r.segments_choice:
            out.append(f"{r.name}: {r.segments_choice}")
        if r.budget_choice:
            out.append(f"{r.name}: {r.budget_choice}")
        if r.kind == "backward" and r.saved_freed_early is not None:
            out.append(
                f"{r.name}: saved tensors freed at last use ({r.saved_freed_early}), "
                f"buffers reused ({r.buffers_reused if r.buffers_reused is not None else 'by Inductor'}); "
                "recomputes nothing beyond the partitioner's choice"
            )
        if r.bucket_grads:
            out.append(f"{r.name}: {r.bucket_grads} gradients written into DDP buckets")
    # a graph built again for other settings (stitched once its step ran) repeats its choices
    return tuple(dict.fromkeys(out))


def memory_plan(
    records: Optional[Sequence[report.GraphRecord]] = None, *, optimizer=None, workspaces: bool = True,
    as_stitched: bool = False, graph_id: Optional[int] = None,
) -> MemoryPlan:
    """The predicted memory of one step of the graphs compiled so far (see the module docstring).

    ``records``: the graphs of the step (default: every graph in ``reports()``,
    so call ``clear_reports()`` before compiling the program to plan).
    ``optimizer``: an optimizer run eagerly, whose state the plan counts as
    resident (its state exists once it has stepped).
    ``workspaces``: measure the kernel workspaces of the ops that may have one
    (``native.workspace``: each distinct op signature runs once on zeros on its
    device); False counts none.
    ``as_stitched``: XLA path, a step compiled without stitching, planned as if
    its graphs were stitched (``DONATE_XLA_STITCH``): what that lever would need.
    Only where the backward is one graph (not in segments); else the plan as it is.
    ``graph_id``: plan the last step of that dynamo graph's forward (the graphs run
    since it last ran); default: of the forward that last ran first.
    """
    records = list(report.reports() if records is None else records)
    path, step = _step_of(records, graph_id)
    ordered = _step_order(step)
    if as_stitched and not any(r.backward_segments for r in records):
        ordered = [r.replaced(stitched=True) for r in ordered]
    resident, seen = _resident(step, ordered)
    if optimizer is not None:
        resident[graph_memory.OPTIMIZER_STATE] += _optimizer_state_bytes(optimizer, seen, path)
    composed = _StepLedger(resident, path, workspaces).run(ordered, seen, _made_in_step(step)[1])
    return MemoryPlan(
        peak_bytes=composed.peak,
        resident_bytes=sum(resident.values()),
        breakdown=dict(composed.breakdown),
        graphs=tuple(composed.planned),
        choices=_choices([r for r in records if r.path == path.name]),
        path=path.name,
        notes=tuple(_notes(path, records, step, ordered, composed)),
    )


def _step_of(records: Sequence[report.GraphRecord], graph_id: Optional[int]):
    """(the path, the records of its last step): refused where nothing was predicted, or
    the records are of two paths."""
    predicted = [r for r in records if r.memory is not None]
    if not predicted:
        raise DonateXlaError(
            "donate_xla: memory_plan() found no compiled graph to plan"
            + (f" ({len(records)} graph(s) compiled, none with a prediction: DONATE_XLA_DEBUG=1 "
               "logs why)" if records else "")
            + ". Compile and run the step once (the graphs are compiled on their first call), "
            "then call memory_plan().",
            help_section="Memory plan",
        )
    names = sorted({r.path for r in predicted})
    if len(names) > 1:
        raise DonateXlaError(
            f"donate_xla: memory_plan() found graphs of several paths ({', '.join(names)}): a step "
            "runs on one device. Pass records=[r for r in donate_backend.reports() if r.path == "
            f"{names[-1]!r}] (or {' or '.join(repr(n) for n in names[:-1])}), or clear_reports() before "
            "compiling the step.",
            help_section="Memory plan",
        )
    step = last_step(predicted, graph_id)
    estimator = next((r.estimator for r in step if r.estimator is not None), None)
    return _Path(names[0], estimator), step


@dataclasses.dataclass(frozen=True)
class _Path:
    """The plan's view of the step's path: its name and its memory estimator (the module
    that predicted the graphs: ``plan_notes``, ``tensor_bytes``, ``workspace_bytes``)."""

    name: str
    estimator: object

    def plan_notes(self, facts) -> list:
        return self.estimator.plan_notes(facts) if self.estimator is not None else []

    def tensor_bytes(self, value) -> int:
        if self.estimator is not None:
            return self.estimator.tensor_bytes(value)
        return graph_memory.dense_bytes(value)

    def workspace_bytes(self, call) -> int:
        return self.estimator.workspace_bytes(call) if self.estimator is not None else 0


def _made_in_step(step) -> tuple:
    """(what the step's graphs returned, what code run eagerly made in the step that a graph
    reads): neither is held between steps. An input that is neither state nor a parameter
    and that another graph returned is that graph's output (logits read by a loss compiled
    separately); optimizer state a first step's graph returned is resident all the same."""
    returned = set().union(*(r.returned for r in step))
    eager_made = {key for r in step for key, _ in r.eager_saved} - returned
    return returned, eager_made


def _resident(step, ordered) -> tuple:
    """(bytes by category of the tensors the step's graphs read that the caller holds
    between steps, each storage once; the storages counted)."""
    returned, eager_made = _made_in_step(step)
    seen: set = set()
    resident: Dict[str, int] = {c: 0 for c in CATEGORIES}
    for r in {id(r): r for r in ordered}.values():
        for role, storage, nbytes in r.held_inputs:
            category = graph_memory.ROLE_CATEGORY.get(role)
            made_in_step = storage in returned or storage in eager_made
            if category is None or storage in seen or (role == "other" and made_in_step):
                continue  # gradients come from the backward that makes them
            seen.add(storage)
            resident[category] += nbytes
    return resident, seen


class _StepLedger:
    """The step's graphs run in order over the resident bytes: what each carries to the
    next (a forward's saved activations and outputs, a backward's gradients, what eager
    code saved), and the peak (module docstring)."""

    def __init__(self, resident: Dict[str, int], path, workspaces: bool) -> None:
        self.resident = resident
        self.path = path
        self.workspaces = workspaces
        self.carried: Dict[str, int] = {c: 0 for c in CATEGORIES}
        self.level = sum(resident.values())
        self.peak, self.breakdown = self.level, dict(resident)
        self.passed = 0  # input gradients a backward returned that an earlier graph's backward takes
        self.returned_dropped = 0  # what the last backward returned that is dropped before the next one runs
        self.planned: List[PlannedGraph] = []
        self.outputs_of: Dict[int, int] = {}  # forward graph id -> bytes of its outputs carried so far
        # What code run eagerly before a forward saved for the backward: held from that
        # forward's first run in the step until its last backward has run (the eager ops'
        # backward runs right after it), each storage counted once.
        self.eager_of: Dict[int, int] = {}
        self.eager_seen: set = set()
        self.consumers: Dict[int, int] = {}

    def run(self, ordered, seen: set, eager_made: set) -> "_StepLedger":
        self.consumers = _gradient_consumers(ordered)
        last_backward = {r.graph_id: position for position, r in enumerate(ordered) if r.kind == "backward"}
        for position, r in enumerate(ordered):
            if r.kind == "forward":
                self._eager_saved_before(r, seen, eager_made)
            if r.memory.kind == "backward":
                self._before_backward(r)
            start = self.level
            graph_peak, at_peak = self._graph_peak(r, position, start)
            if graph_peak > self.peak:
                self.peak, self.breakdown = graph_peak, at_peak
            self._after(r, position, start, last_backward)
            self.planned.append(PlannedGraph(r.name, start, graph_peak, self.level, tuple(at_peak.items()),
                                             r.graph_id, r.kind))
        return self

    def _eager_saved_before(self, r, seen: set, eager_made: set) -> None:
        if not r.eager_saved or r.graph_id in self.eager_of:
            return
        fresh = {key: nbytes for key, nbytes in r.eager_saved
                 if key in eager_made and key not in seen and key not in self.eager_seen}
        self.eager_seen.update(fresh)
        self.eager_of[r.graph_id] = sum(fresh.values())
        self.carried[graph_memory.ACTIVATIONS] += self.eager_of[r.graph_id]
        self.level += self.eager_of[r.graph_id]

    def _before_backward(self, r) -> None:
        m = r.memory
        if r.outputs_held is not None:
            # Forward outputs the caller had dropped when this backward first ran
            # (``loss = f(x).sum()`` keeps no output; an HF model's output object keeps all).
            for graph_id, held in r.outputs_held.items():
                dropped = max(0, min(self.outputs_of.get(graph_id, 0), self.carried[graph_memory.OUTPUTS]) - held)
                if dropped:
                    self.outputs_of[graph_id] -= dropped
                    self.carried[graph_memory.OUTPUTS] -= dropped
                    self.level -= dropped
        if self.returned_dropped:
            # What the last backward returned that code run eagerly consumed and dropped
            # before this one ran (a mixture of experts' routing between graph breaks)
            self.carried[graph_memory.GRADIENTS] -= self.returned_dropped
            self.passed = max(0, self.passed - self.returned_dropped)
            self.level -= self.returned_dropped
            self.returned_dropped = 0
        # Its tangents exist before it runs: taken from what a later backward passed on,
        # the rest made by the caller (the loss's ones, zeros for outputs that got no gradient).
        if r.tangent_bytes is not None and r.tangents_passed_bytes is not None:
            # seen on its first call: which tangents an earlier backward returned
            fresh = max(0, r.tangent_bytes - r.tangents_passed_bytes)
        else:  # not run yet: the gradients of non-parameter inputs an earlier one returned
            taken = min(self.passed, m.tangent_bytes)
            self.passed -= taken
            fresh = m.tangent_bytes - taken
        self.carried[graph_memory.GRADIENTS] += fresh
        self.level += fresh

    def _graph_peak(self, r, position: int, start: int) -> tuple:
        """(the step's level at this graph's peak, bytes by category then)."""
        m = r.memory
        own_peak, own_parts = m.peak_bytes, dict(m.peak_parts)
        if self.workspaces:
            for at, parts, call in m.workspace_points:
                extra = self.path.workspace_bytes(call)
                if extra and at + extra > own_peak:
                    own_peak = at + extra
                    own_parts = dict(parts, **{graph_memory.WORKSPACE: extra})
        update = self.consumers.get(position)
        if update is not None:
            # A stitched step: the optimizer's update of each parameter runs as soon as
            # its gradient exists, inside the same XLA computation, so one gradient (and
            # one update's temporaries) is live at a time instead of all of them.
            consumed = self._consumed(r, own_parts)
            one = min(m.largest_output_bytes, consumed)
            own_peak += one + update - consumed
            own_parts[graph_memory.GRADIENTS] = own_parts.get(graph_memory.GRADIENTS, 0) - consumed + one
            own_parts[graph_memory.TEMPORARIES] = own_parts.get(graph_memory.TEMPORARIES, 0) + update
        at_peak = {c: self.resident[c] + self.carried[c] + own_parts.get(c, 0) for c in CATEGORIES}
        return start + own_peak, at_peak

    def _consumed(self, r, own_parts) -> int:
        """The gradients a stitched backward's optimizer consumes as they are made."""
        return max(0, dict(own_parts).get(graph_memory.GRADIENTS, 0) - r.memory.passed_grad_bytes)

    def _after(self, r, position: int, start: int, last_backward: dict) -> None:
        m = r.memory
        consumed = self._consumed(r, dict(m.peak_parts)) if position in self.consumers else 0
        for category, nbytes in m.end_parts:
            self.carried[category] = self.carried.get(category, 0) + nbytes
        if r.kind == "forward":
            self.outputs_of[r.graph_id] = self.outputs_of.get(r.graph_id, 0) + dict(m.end_parts).get(
                graph_memory.OUTPUTS, 0)
        self.carried[graph_memory.GRADIENTS] -= consumed
        self.level = start + m.end_bytes - consumed
        self.passed += m.passed_grad_bytes
        if m.kind == "backward":
            self.returned_dropped = r.outputs_dropped or 0
            if last_backward.get(r.graph_id) == position and self.eager_of.get(r.graph_id):
                self.carried[graph_memory.ACTIVATIONS] -= self.eager_of[r.graph_id]
                self.level -= self.eager_of[r.graph_id]


def _notes(path, records, step, ordered, composed: "_StepLedger") -> list:
    """What the plan could not see: graphs with no prediction, and the path's own notes."""
    # (a backward split into segments is planned through its segments' records)
    unplanned = [r.name for r in records
                 if r.path == path.name and r.memory is None and r.device != "cpu" and not r.backward_segments]
    notes = [f"{name}: no prediction (its replay failed; DONATE_XLA_DEBUG=1 logs why), not counted"
             for name in unplanned]
    facts = PlanFacts(
        records=tuple(records), step=tuple(step), forwards=sum(r.kind == "forward" for r in ordered),
        eager_bytes=sum(composed.eager_of.values()), stitched_step=bool(composed.consumers),
    )
    return notes + list(path.plan_notes(facts))


@dataclasses.dataclass(frozen=True)
class PlanFacts:
    """What a path's ``plan_notes`` knows of the step it is planned for."""

    records: tuple  # every record given to the plan
    step: tuple  # the records of the step planned
    forwards: int  # forward graphs the step runs (more than one: graph breaks)
    eager_bytes: int  # what code run eagerly between them saved for the backward, as counted
    stitched_step: bool  # the plan counts a stitched step (one gradient and one update at a time)
