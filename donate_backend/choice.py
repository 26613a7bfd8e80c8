"""Levers chosen per step, by default: the stitched step on the XLA path.

A stitched step (``Settings.stitch``) runs the forward, the backward and the
optimizer's graph as one XLA computation, in which each parameter's update runs
as soon as its gradient exists. Where the gradients are most of what a step
holds (a wide MLP), that is the least memory of any plan; where the saved
activations are (a transformer), XLA's schedule of the whole step holds more
than separate executables in segments. So with ``stitch`` unset the choice is
made per step, from its plan:

- every graph compiled from one dynamo graph shares a ``StepChoice``; its
  ``overrides`` are entered on each call of those graphs;
- at the ``STEPS + 1``-th call of a forward, once the step has run with the
  optimizer state, ``decide`` plans the last step twice (``planner.memory_plan``:
  as it runs, and ``as_stitched``) and stitches every graph of it when that is
  predicted to save at least ``MIN_SAVING_BYTES`` and ``MIN_SAVING_SHARE`` of
  the step's growth. It decides once per step's graphs; the reason is kept in
  ``StepChoice.note`` and shown in the plan's choices.
- under ``memory_limit``, a step over the limit at that call is stitched when the
  stitched plan fits (``stitch_to_fit``, from ``limit.LimitedGraph``), before any
  activation budget is tried: it recomputes nothing.

The stitched plan assumes XLA's schedule of the whole step holds what the
separate executables hold, less the gradients its updates consume at once. That
was measured to hold on matmul models (MLPs), not on convolutions: a ResNet-18
stitched held 2 to 3 times the separate step's growth where the plan said less.
A step with a convolution (``_convolves``) is not stitched by default or to fit a
limit; ``stitch=True`` still stitches it.

A stitched step frees the gradients only if the program drops them before the
``torch_xla.sync()`` that runs the step (``optimizer.zero_grad()`` before it):
kept past it, they are outputs of the computation. ``xla.memory.note_call``
watches that at each sync (``GraphRecord.gradients_at_sync``), and a step is
only stitched where every backward's gradients were gone at the syncs so far.

Least memory must cost no step time. A step that runs a lever after the choice (the
stitched step, or a backward split into segments by default) is timed against the
plain executables (``PLAIN``: one executable per graph) where the choice is made
(``StepTimes``): the forward's calls after the choice alternate between the two
(``TRIAL``: each first runs untimed while its executables compile, then the two are
timed in turn), each timed step from one forward call to the next with the device
waited for at both ends. The lever stays where its fastest step is within
``TIME_TOLERANCE`` of the plain one's; else the step runs plain from then on. So the
default waits for the device during those few calls only, once. A ``memory_limit``
chooses by memory alone (``limit.LimitedGraph``), and a step whose forward runs more
than once (a graph break inside a layer loop) keeps the memory choice untimed: its
forward's calls are no step boundaries.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from . import report

STEPS = 2  # the first step makes the optimizer state, the second runs with it
MIN_SAVING_BYTES = 16 * 2**20  # below this a stitched step is not worth its second compile
MIN_SAVING_SHARE = 0.25  # of the step's growth (peak above its resident bytes)
MIB = 2**20


# The step a lever is timed against: every graph one executable of its own
PLAIN = (("stitch", False), ("backward_segments", 0))
# A lever is kept while its step is at most this much slower than the plain one's
TIME_TOLERANCE = 0.03
# The trial, one step per forward call after the choice: (settings, timed). Each setting
# first runs twice untimed: its executables compile (a stitched step's donating variant
# at its second call); then each is timed twice, in turn.
TRIAL = (("lever", False), ("lever", False), ("lever", True), ("plain", False), ("plain", False),
         ("plain", True), ("lever", True), ("plain", True))


class StepChoice:
    """The settings chosen for the graphs of one dynamo graph after it was compiled
    (``overrides``: ``config`` pairs entered on each call), and why (``note``);
    ``trial``: the ``StepTimes`` of a lever being timed, shared by the step's graphs."""

    def __init__(self) -> None:
        self.overrides: tuple = ()
        self.note: Optional[str] = None
        self.decided = False
        self.trial: Optional["StepTimes"] = None


def _wait_for_device() -> None:
    from .xla import compat

    compat.wait_device_ops()


@dataclasses.dataclass
class StepTimes:
    """A lever timed against the plain executables (module docstring). ``step_started``
    runs at each call of the forward that leads the step (``graph_id``'s) and sets every
    choice of the step to the trial's next setting."""

    graph_id: int
    choices: list  # the StepChoice of every graph of the step
    lever: tuple  # the lever's overrides (() where the default splits the backward itself)
    what: str  # the lever, in words
    position: int = 0
    seconds: dict = dataclasses.field(default_factory=lambda: {"lever": [], "plain": []})
    _timing: Optional[tuple] = None  # (setting, start) of the step being timed
    wait: Callable[[], None] = _wait_for_device  # waits until the device has run everything
    clock: Callable[[], float] = time.perf_counter

    def step_started(self) -> None:
        start = None
        if self._timing is not None:  # the step before ends here
            self.wait()
            start = self.clock()
            setting, began = self._timing
            self.seconds[setting].append(start - began)
            self._timing = None
        if self.position == len(TRIAL):
            self._finish()
            return
        setting, timed = TRIAL[self.position]
        self.position += 1
        for c in self.choices:
            c.overrides = self.lever if setting == "lever" else PLAIN
        if timed:
            if start is None:
                self.wait()
                start = self.clock()
            self._timing = (setting, start)

    def _finish(self) -> None:
        lever, plain = min(self.seconds["lever"]), min(self.seconds["plain"])
        keep = lever <= (1 + TIME_TOLERANCE) * plain
        timed = (f"timed after the choice: {self.what} {lever:.3f} s a step against {plain:.3f} s as plain "
                 "executables (the fastest of two steps each)")
        note = (f"{timed}: kept" if keep else
                f"{timed}: {lever / plain - 1:.0%} slower, so the step runs plain (one executable per graph); "
                "set the lever or a memory_limit to take it anyway")
        for c in self.choices:
            c.overrides = self.lever if keep else PLAIN
            c.note = f"{c.note}; {note}" if c.note else note
            c.trial = None
        report.log.info("donate_xla: graph %d: %s", self.graph_id, note)


def _segmented_by_default(step) -> bool:
    """Whether a backward of the step's graphs was split into segments by default (the
    split's record carries no memory of its own, so it is not among ``step``)."""
    graphs = {r.graph_id for r in step}
    return any(r.graph_id in graphs and r.backward_segments
               and (r.segments_choice or "").startswith("chosen automatically") for r in report.reports())


def _runs_once_per_step(graph_id: int) -> bool:
    """Whether ``graph_id``'s forward ran once in the last step (its calls are step
    boundaries)."""
    from .planner import _last_step_calls

    records = [r for r in report.reports() if r.first_call is not None]
    if not records:
        return False
    ran = sorted(records, key=lambda r: r.last_call)
    calls = _last_step_calls(report.calls(), ran)
    return sum(1 for _, key, _ in calls if key[0] == graph_id and key[1] == "forward") == 1


def _start_trial(graph_id: int, step, choices: list) -> Optional[str]:
    """Time the lever the step runs against the plain executables (``StepTimes``), where
    it runs one: stitched, or a backward split into segments by default."""
    stitched = any(c.overrides == (("stitch", True),) for c in choices)
    if not stitched and not _segmented_by_default(step):
        return None
    what = "the stitched step" if stitched else "the backward in segments"
    if not _runs_once_per_step(graph_id):
        note = f"{what} is not timed: the forward of graph {graph_id} runs more than once a step"
        for c in choices:
            c.note = f"{c.note}; {note}" if c.note else note
        return note
    trial = StepTimes(graph_id, choices, choices[0].overrides, what)
    for c in choices:
        c.trial = trial
    return f"timing {what} against plain executables"


def _last_step(graph_id: int):
    """(the XLA records of the last step of ``graph_id``'s forward, the distinct choices
    of its graphs), or None where no training step of ``graph_id`` ran, a graph of the
    step has fixed settings, or the step was decided already."""
    from .planner import last_step

    records = [r for r in report.reports() if r.path == "xla"]
    step = last_step([r for r in records if r.memory is not None], graph_id)
    own = [r for r in step if r.graph_id == graph_id and r.kind == "forward"]
    choices = {id(r.step_choice): r.step_choice for r in step}
    if not own or None in choices.values() or any(c.decided for c in choices.values()):
        return None
    return step, list(choices.values())


def _candidate(graph_id: int):
    """(the choices of the last step's graphs, its plan as it runs, its plan stitched),
    or None where stitching is not a candidate: no training step of ``graph_id``, a
    graph of the step with fixed settings, decided already, stitched already, no
    stitched estimate (a backward in segments, no optimizer graph after it), the
    gradients kept past a sync (or no sync seen yet), or a convolution in the step."""
    from .errors import DonateXlaError
    from .planner import memory_plan

    found = _last_step(graph_id)
    if found is None:
        return None
    step, choices = found
    records = [r for r in report.reports() if r.path == "xla"]
    backwards = [r for r in step if r.kind == "backward"]
    if not backwards or any(r.stitched for r in step):
        return None
    seen = [r.gradients_at_sync for r in backwards]
    if any(g for g in seen) or None in seen:
        return None  # gradients kept past the sync: stitched, they would all be outputs
    if any(_convolves(r) for r in step):
        return None  # the stitched plan does not hold there (module docstring)
    try:
        separate = memory_plan(records, workspaces=False, graph_id=graph_id)
        stitched = memory_plan(records, workspaces=False, as_stitched=True, graph_id=graph_id)
    except DonateXlaError:
        return None
    if not any("stitched step" in note for note in stitched.notes):
        return None
    return choices, separate, stitched


def _convolves(record: report.GraphRecord) -> bool:
    """Whether a graph runs a convolution (forward or backward)."""
    traced = getattr(record.lowered, "traced", None)
    if traced is None:
        return False
    return any(getattr(node.target, "__name__", "").startswith("convolution")
               for node in traced.gm.graph.nodes if node.op == "call_function")


def _stitch(choices: list, note: str, graph_id: int) -> str:
    for c in choices:
        c.overrides = (("stitch", True),)
        c.note = note
        c.decided = True
    report.log.info("donate_xla: graph %d: %s", graph_id, note)
    return note


def decide(graph_id: int) -> Optional[str]:
    """At a forward's ``STEPS + 1``-th call, with no memory limit: stitch the last
    step's graphs if its plan says so (module docstring). Returns the note of what
    was chosen, or None."""
    from . import config

    if config.current().memory_limit is not None:  # the limit chooses (``limit.LimitedGraph``)
        return None
    found = _last_step(graph_id)
    if found is None:
        return None
    step, choices = found
    note = None
    candidate = _candidate(graph_id)
    if candidate is not None:
        _, separate, stitched = candidate
        saving = separate.peak_bytes - stitched.peak_bytes
        if saving >= max(MIN_SAVING_BYTES, MIN_SAVING_SHARE * separate.growth_bytes):
            note = _stitch(choices, (
                f"chosen automatically after {STEPS} steps: stitched step (forward, backward and optimizer as "
                f"one XLA computation), planned at {stitched.peak_bytes / MIB:.1f} MiB against "
                f"{separate.peak_bytes / MIB:.1f} MiB as separate executables; recomputes nothing "
                "(DONATE_XLA_STITCH=0 keeps them separate)"
            ), graph_id)
    for c in choices:
        c.decided = True
    _start_trial(graph_id, step, choices)
    return note


def stitch_to_fit(graph_id: int, limit: int) -> Optional[str]:
    """Under ``memory_limit``, a step over it: stitch its graphs if the step stitched is
    planned within the limit (it recomputes nothing, so it comes before any activation
    budget). Returns the note, or None."""
    candidate = _candidate(graph_id)
    if candidate is None:
        return None
    choices, separate, stitched = candidate
    if stitched.peak_bytes > limit:
        return None
    return _stitch(choices, (
        f"chosen to fit memory_limit {limit / MIB:.1f} MiB after {STEPS} steps: stitched step (forward, "
        f"backward and optimizer as one XLA computation), planned at {stitched.peak_bytes / MIB:.1f} MiB "
        f"against {separate.peak_bytes / MIB:.1f} MiB as separate executables; recomputes nothing"
    ), graph_id)
