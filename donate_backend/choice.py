"""Levers chosen per step, by default, once the step has run: the mechanism every path shares.

A path with levers to choose (``paths.Path.levers``: the XLA path's stitched step,
``xla/levers.py``) gets one ``StepChoice`` per dynamo graph whose settings are not
fixed; every graph compiled from that dynamo graph shares it, and its ``overrides``
are entered on each call of those graphs (``step.StepCompiled``).

- At the ``STEPS + 1``-th call of a forward, once the step has run with the
  optimizer state, ``decide`` asks the path's policy to choose by the step's memory
  plan (``levers.choose``), for every graph of the last step at once. It decides
  once per step's graphs; the reason is kept in ``StepChoice.note`` and shown in the
  plan's choices.
- Least memory must cost no step time. Where the step then runs a lever
  (``levers.in_use``: the stitched step, or a backward split into segments by
  default), it is timed against the plain executables (``levers.PLAIN``) where the
  choice is made (``StepTimes``): the forward's calls after the choice alternate
  between the two (``TRIAL``: each first runs untimed while its executables compile,
  then the two are timed in turn), each timed step from one forward call to the next
  with the device waited for at both ends. The lever stays where its fastest step is
  within ``TIME_TOLERANCE`` of the plain one's; else the step runs plain from then on.
  So the default waits for the device during those few calls only, once.
- A ``memory_limit`` chooses by memory alone (``limit``), and a step whose forward runs
  more than once (a graph break inside a layer loop) keeps the memory choice untimed:
  its forward's calls are no step boundaries.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from . import report

STEPS = 2  # the first step makes the optimizer state, the second runs with it
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

    def __init__(self, levers) -> None:
        self.levers = levers  # the path's policy (``paths.Path.levers``)
        self.overrides: tuple = ()
        self.note: Optional[str] = None
        self.decided = False
        self.trial: Optional["StepTimes"] = None

    def add_note(self, note: str) -> None:
        self.note = f"{self.note}; {note}" if self.note else note


@dataclasses.dataclass
class StepTimes:
    """A lever timed against the plain executables (module docstring). ``step_started``
    runs at each call of the forward that leads the step (``graph_id``'s) and sets every
    choice of the step to the trial's next setting."""

    graph_id: int
    choices: list  # the StepChoice of every graph of the step
    lever: tuple  # the lever's overrides (() where the default splits the backward itself)
    plain: tuple  # the plain executables' overrides
    what: str  # the lever, in words
    wait: Callable[[], None]  # waits until the device has run everything
    clock: Callable[[], float] = time.perf_counter
    position: int = 0
    seconds: dict = dataclasses.field(default_factory=lambda: {"lever": [], "plain": []})
    _timing: Optional[tuple] = None  # (setting, start) of the step being timed

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
            c.overrides = self.lever if setting == "lever" else self.plain
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
            c.overrides = self.lever if keep else self.plain
            c.add_note(note)
            c.trial = None
        report.log.info("donate_xla: graph %d: %s", self.graph_id, note)


def _last_step(records, graph_id: int):
    """(the records of the last step of ``graph_id``'s forward among ``records``, the
    distinct choices of its graphs), or None where no training step of ``graph_id`` ran,
    a graph of the step has fixed settings, or the step was decided already."""
    from .planner import last_step

    step = last_step([r for r in records if r.memory is not None], graph_id)
    own = [r for r in step if r.graph_id == graph_id and r.kind == "forward"]
    choices = {id(r.step_choice): r.step_choice for r in step}
    if not own or None in choices.values() or any(c.decided for c in choices.values()):
        return None
    return step, list(choices.values())


def _runs_once_per_step(graph_id: int) -> bool:
    """Whether ``graph_id``'s forward ran once in the last step (its calls are step
    boundaries)."""
    from .planner import last_step_calls

    return sum(1 for _, key, _ in last_step_calls() if key[0] == graph_id and key[1] == "forward") == 1


def _start_trial(graph_id: int, step, choices: list, levers, records) -> Optional[str]:
    """Time the lever the step runs against the plain executables (``StepTimes``), where
    it runs one."""
    what = levers.in_use(step, choices, records)
    if what is None:
        return None
    if not _runs_once_per_step(graph_id):
        note = f"{what} is not timed: the forward of graph {graph_id} runs more than once a step"
        for c in choices:
            c.add_note(note)
        return note
    trial = StepTimes(graph_id, choices, choices[0].overrides, levers.PLAIN, what, levers.wait_for_device)
    for c in choices:
        c.trial = trial
    return f"timing {what} against plain executables"


def decide(records, graph_id: int) -> Optional[str]:
    """At a forward's ``STEPS + 1``-th call, with no memory limit: let the path's policy
    choose for the last step's graphs (among ``records``, the path's) by their plan, then
    time the lever it runs (module docstring). Returns the note of what was chosen, or None."""
    from . import config

    if config.current().memory_limit is not None:  # the limit chooses (``limit``)
        return None
    found = _last_step(records, graph_id)
    if found is None:
        return None
    step, choices = found
    levers = choices[0].levers
    note = levers.choose(graph_id, step, choices, STEPS, records)
    for c in choices:
        c.decided = True
    _start_trial(graph_id, step, choices, levers, records)
    return note


def fit(records, graph_id: int, limit: int) -> Optional[str]:
    """Under ``memory_limit``, a step over it: the path's lever that fits without
    recomputing anything (XLA: the stitched step), if one does, among ``records`` (the
    path's). Returns the note, or None."""
    found = _last_step(records, graph_id)
    if found is None:
        return None
    step, choices = found
    return choices[0].levers.fit(graph_id, step, choices, limit, STEPS, records)
