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

from . import dynamo_compat, report
from .analysis.aliasing import storage_address
from .errors import DonateXlaError
from .native import compat as native_compat
from .native import memory as native_memory
from .native import workspace

MIB = 2**20

_ROLE_CATEGORY = {
    "parameter": native_memory.PARAMETERS,
    "buffer": native_memory.BUFFERS,
    "optimizer_state": native_memory.OPTIMIZER_STATE,
    "other": native_memory.INPUTS,
}
CATEGORIES = (
    native_memory.PARAMETERS,
    native_memory.BUFFERS,
    native_memory.OPTIMIZER_STATE,
    native_memory.INPUTS,
    native_memory.GRADIENTS,
    native_memory.ACTIVATIONS,
    native_memory.OUTPUTS,
    native_memory.TEMPORARIES,
    native_memory.WORKSPACE,
)


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
    return dataclasses.replace(record, memory=memory, tangent_bytes=tangents, tangents_passed_bytes=passed,
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


def _optimizer_state_bytes(optimizer, seen: set) -> int:
    import torch

    total = 0
    for state in getattr(optimizer, "state", {}).values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                key = storage_address(value)
                if key is not None and key not in seen:
                    seen.add(key)
                    total += native_memory.nbytes(value)
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
    native = [r for r in records if r.memory is not None]
    if not native:
        raise DonateXlaError(
            "donate_xla: memory_plan() found no compiled graph to plan"
            + (f" ({len(records)} graph(s) compiled, none with a prediction: DONATE_XLA_DEBUG=1 "
               "logs why)" if records else "")
            + ". Compile and run the step once (the graphs are compiled on their first call), "
            "then call memory_plan().",
            help_section="Memory plan",
        )
    paths = sorted({r.path for r in native})
    if len(paths) > 1:
        raise DonateXlaError(
            "donate_xla: memory_plan() found graphs of both paths (XLA and native devices): "
            "a step runs on one device. Pass records=[r for r in donate_backend.reports() "
            "if r.path == 'xla'] (or 'native'), or clear_reports() before compiling the step.",
            help_section="Memory plan",
        )
    path = paths[0]
    native = last_step(native, graph_id)
    # An input that is neither state nor a parameter, which another graph returned, is
    # that graph's output (logits read by a loss compiled separately), not resident.
    # (Optimizer state a first step's graph returned is resident all the same.)
    returned = set().union(*(r.returned for r in native))
    # what code run eagerly made in the step (``GraphRecord.eager_saved``), which a graph
    # that reads it does not hold between steps; a graph's output is that graph's
    eager_made = {key for r in native for key, _ in r.eager_saved} - returned
    ordered = _step_order(native)
    seen: set = set()
    resident: Dict[str, int] = {c: 0 for c in CATEGORIES}
    for r in {id(r): r for r in ordered}.values():
        for role, storage, nbytes in r.held_inputs:
            category = _ROLE_CATEGORY.get(role)
            made_in_step = storage in returned or storage in eager_made
            if category is None or storage in seen or (role == "other" and made_in_step):
                continue  # gradients come from the backward that makes them
            seen.add(storage)
            resident[category] += nbytes
    if optimizer is not None:
        resident[native_memory.OPTIMIZER_STATE] += _optimizer_state_bytes(optimizer, seen)
    resident_bytes = sum(resident.values())

    carried: Dict[str, int] = {c: 0 for c in CATEGORIES}
    level = resident_bytes
    peak, breakdown = resident_bytes, dict(resident)
    passed = 0  # input gradients a backward returned that an earlier graph's backward takes
    returned_dropped = 0  # what the last backward returned that is dropped before the next one runs
    planned = []
    outputs_of: Dict[int, int] = {}  # forward graph id -> bytes of its outputs carried so far
    if as_stitched and path == "xla" and not any(r.backward_segments for r in records):
        ordered = [dataclasses.replace(r, stitched=True) for r in ordered]
    consumers = _gradient_consumers(ordered)
    # What code run eagerly before a forward saved for the backward (native path): held
    # from that forward's first run in the step until its last backward has run (the
    # eager ops' backward runs right after it), each storage counted once.
    eager_of: Dict[int, int] = {}
    eager_seen: set = set()
    last_backward = {r.graph_id: position for position, r in enumerate(ordered) if r.kind == "backward"}
    for position, r in enumerate(ordered):
        m = r.memory
        if r.kind == "forward" and r.eager_saved and r.graph_id not in eager_of:
            fresh = {key: nbytes for key, nbytes in r.eager_saved
                     if key in eager_made and key not in seen and key not in eager_seen}
            eager_seen.update(fresh)
            eager_of[r.graph_id] = sum(fresh.values())
            carried[native_memory.ACTIVATIONS] += eager_of[r.graph_id]
            level += eager_of[r.graph_id]
        if m.kind == "backward" and r.outputs_held is not None:
            # Forward outputs the caller had dropped when this backward first ran
            # (``loss = f(x).sum()`` keeps no output; an HF model's output object keeps all).
            for graph_id, held in r.outputs_held.items():
                dropped = max(0, min(outputs_of.get(graph_id, 0), carried[native_memory.OUTPUTS]) - held)
                if dropped:
                    outputs_of[graph_id] -= dropped
                    carried[native_memory.OUTPUTS] -= dropped
                    level -= dropped
        if m.kind == "backward" and returned_dropped:
            # What the last backward returned that code run eagerly consumed and dropped
            # before this one ran (a mixture of experts' routing between graph breaks)
            carried[native_memory.GRADIENTS] -= returned_dropped
            passed = max(0, passed - returned_dropped)
            level -= returned_dropped
            returned_dropped = 0
        if m.kind == "backward":
            # Its tangents exist before it runs: taken from what a later backward passed
            # on, the rest made by the caller (the loss's ones, zeros for outputs that got
            # no gradient).
            if r.tangent_bytes is not None and r.tangents_passed_bytes is not None:
                # seen on its first call: which tangents an earlier backward returned
                fresh = max(0, r.tangent_bytes - r.tangents_passed_bytes)
            else:  # not run yet: the gradients of non-parameter inputs an earlier one returned
                taken = min(passed, m.tangent_bytes)
                passed -= taken
                fresh = m.tangent_bytes - taken
            carried[native_memory.GRADIENTS] += fresh
            level += fresh
        start = level
        own_peak, own_parts = m.peak_bytes, dict(m.peak_parts)
        if workspaces:
            for at, parts, call in m.workspace_points:
                extra = workspace.workspace_bytes(call)
                if extra and at + extra > own_peak:
                    own_peak = at + extra
                    own_parts = dict(parts, **{native_memory.WORKSPACE: extra})
        consumed = 0
        update = consumers.get(position)
        if update is not None:
            # A stitched step: the optimizer's update of each parameter runs as soon as
            # its gradient exists, inside the same XLA computation, so one gradient (and
            # one update's temporaries) is live at a time instead of all of them.
            consumed = max(0, dict(own_parts).get(native_memory.GRADIENTS, 0) - m.passed_grad_bytes)
            one = min(m.largest_output_bytes, consumed)
            own_peak += one + update - consumed
            own_parts = dict(own_parts)
            own_parts[native_memory.GRADIENTS] = own_parts.get(native_memory.GRADIENTS, 0) - consumed + one
            own_parts[native_memory.TEMPORARIES] = own_parts.get(native_memory.TEMPORARIES, 0) + update
        at_peak = {c: resident[c] + carried[c] + own_parts.get(c, 0) for c in CATEGORIES}
        graph_peak = start + own_peak
        if graph_peak > peak:
            peak, breakdown = graph_peak, at_peak
        for category, nbytes in m.end_parts:
            carried[category] = carried.get(category, 0) + nbytes
        if r.kind == "forward":
            outputs_of[r.graph_id] = outputs_of.get(r.graph_id, 0) + dict(m.end_parts).get(native_memory.OUTPUTS, 0)
        carried[native_memory.GRADIENTS] -= consumed
        level = start + m.end_bytes - consumed
        passed += m.passed_grad_bytes
        if m.kind == "backward":
            returned_dropped = r.outputs_dropped or 0
            if last_backward.get(r.graph_id) == position and eager_of.get(r.graph_id):
                carried[native_memory.ACTIVATIONS] -= eager_of[r.graph_id]
                level -= eager_of[r.graph_id]
        planned.append(PlannedGraph(r.name, start, graph_peak, level, tuple(at_peak.items()), r.graph_id, r.kind))
    # (a backward split into segments is planned through its segments' records)
    unplanned = [r.name for r in records
                 if r.path == path and r.memory is None and r.device != "cpu" and not r.backward_segments]
    notes = [f"{name}: no prediction (its replay failed; DONATE_XLA_DEBUG=1 logs why), not counted"
             for name in unplanned]
    if any(r.device == "meta" for r in native):
        notes.append(
            "planned on the meta device: sizes counted in CUDA's 512-byte blocks; no kernel ran, so "
            "kernel workspaces (convolutions, fused attention, cuBLAS) and memory an allocator caches "
            "are not counted, and ops take their meta form (scaled_dot_product_attention its math "
            "form, which saves the attention weights CUDA's fused kernels do not)"
        )
    if path == "xla":
        notes.append(
            "XLA: each executable's temporaries come from a model of XLA's fusion over the graph, "
            "not from XLA's buffer assignment; XLA's scheduler may hold more at once"
        )
        if consumers:
            notes.append(
                "stitched step: its graphs run as one XLA computation, in which the optimizer's graph "
                "updates each parameter as soon as its gradient exists; the plan counts one gradient "
                "and one update at a time, which holds when the step drops its gradients "
                "(optimizer.zero_grad()) before the torch_xla.sync() that runs it, and counts the "
                "rest as separate executables (XLA's schedule of the whole step may hold more)"
            )
        elif any(r.stitched for r in native):
            notes.append(
                "stitched graphs with no stitched optimizer graph after their backward: the plan "
                "counts them as separate executables"
            )
        if any(r.backward_segments for r in records):
            notes.append("backward segments: each segment counted as a backward of its own (approximate)")
    forwards = sum(r.kind == "forward" for r in ordered)
    if forwards > 1 and path != "xla" and not native_compat.reads_saved_tensors():
        notes.append(
            f"torch {native_compat.torch_version()} cannot read what eager autograd saved without "
            "unpacking it (which could rerun a checkpointed region): the activations that eager code "
            "between the graphs saves are not counted"
        )
    if forwards > 1:
        notes.append(
            f"the step's forward runs {forwards} compiled graphs (graph breaks): the code between them "
            + ("runs in torch_xla's lazy mode, outside any compiled graph: " if path == "xla" else
               "runs eagerly: ")
            + "what it passes to a graph and what its own autograd saves for the "
            f"backward are counted ({sum(eager_of.values()) / 1024:.1f} KiB, as activations held "
            "until that graph's backward, seen on each graph's first call"
            + (" and again once dynamo stopped compiling a function" if path == "xla" else "")
            + "; none that saved-tensor hooks packed), its other allocations are not"
            + (" (the lazy graphs torch_xla runs for it, and their temporaries)" if path == "xla" else "")
        )
    for function, limit in sorted(dynamo_compat.recompile_limit_hits().items()):
        notes.append(
            f"dynamo reached its {limit} for {function} and runs it eagerly from then on"
            + (" (lazy torch_xla code): what it saves for the backward and passes to the next graph "
               "is counted as the code between graph breaks is (above), what else it allocates "
               "is not " if path == "xla" else
               ": what it allocates and saves for the backward is in no compiled graph and not counted ")
            + "(a function called with a new size each time reaches the limit where dynamic shapes are "
            "off, as torch_xla turns them; raise torch._dynamo.config.recompile_limit, or give the "
            "function fixed sizes)"
        )
    return MemoryPlan(
        peak_bytes=peak,
        resident_bytes=resident_bytes,
        breakdown={c: b for c, b in breakdown.items()},
        graphs=tuple(planned),
        choices=_choices([r for r in records if r.path == path]),
        path=path,
        notes=tuple(notes),
    )
