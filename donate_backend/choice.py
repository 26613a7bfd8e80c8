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
"""
from __future__ import annotations

from typing import Optional

from . import report

STEPS = 2  # the first step makes the optimizer state, the second runs with it
MIN_SAVING_BYTES = 16 * 2**20  # below this a stitched step is not worth its second compile
MIN_SAVING_SHARE = 0.25  # of the step's growth (peak above its resident bytes)
MIB = 2**20


class StepChoice:
    """The settings chosen for the graphs of one dynamo graph after it was compiled
    (``overrides``: ``config`` pairs entered on each call), and why (``note``)."""

    def __init__(self) -> None:
        self.overrides: tuple = ()
        self.note: Optional[str] = None
        self.decided = False


def _candidate(graph_id: int):
    """(the choices of the last step's graphs, its plan as it runs, its plan stitched),
    or None where stitching is not a candidate: no training step of ``graph_id``, a
    graph of the step with fixed settings, decided already, stitched already, no
    stitched estimate (a backward in segments, no optimizer graph after it), the
    gradients kept past a sync (or no sync seen yet), or a convolution in the step."""
    from .errors import DonateXlaError
    from .planner import last_step, memory_plan

    records = [r for r in report.reports() if r.path == "xla"]
    step = last_step([r for r in records if r.memory is not None], graph_id)
    own = [r for r in step if r.graph_id == graph_id and r.kind == "forward"]
    choices = {id(r.step_choice): r.step_choice for r in step}
    if not own or None in choices.values() or any(c.decided for c in choices.values()):
        return None
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
    return list(choices.values()), separate, stitched


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
    candidate = _candidate(graph_id)
    if candidate is None:
        return None
    choices, separate, stitched = candidate
    for c in choices:
        c.decided = True
    saving = separate.peak_bytes - stitched.peak_bytes
    if saving < max(MIN_SAVING_BYTES, MIN_SAVING_SHARE * separate.growth_bytes):
        return None
    return _stitch(choices, (
        f"chosen automatically after {STEPS} steps: stitched step (forward, backward and optimizer as one "
        f"XLA computation), planned at {stitched.peak_bytes / MIB:.1f} MiB against "
        f"{separate.peak_bytes / MIB:.1f} MiB as separate executables; recomputes nothing "
        "(DONATE_XLA_STITCH=0 keeps them separate)"
    ), graph_id)


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
