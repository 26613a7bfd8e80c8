"""The XLA path's levers chosen per step (``paths.XlaPath.levers``): the stitched step.

A stitched step (``Settings.stitch``) runs the forward, the backward and the
optimizer's graph as one XLA computation, in which each parameter's update runs
as soon as its gradient exists. Where the gradients are most of what a step
holds (a wide MLP), that is the least memory of any plan; where the saved
activations are (a transformer), XLA's schedule of the whole step holds more
than separate executables in segments. So with ``stitch`` unset the choice is
made per step, from its plan (``choice.decide`` calls ``choose``): the last step is
planned twice (``planner.memory_plan``: as it runs, and ``as_stitched``), and every
graph of it is stitched when that is predicted to save at least
``MIN_SAVING_BYTES`` and ``MIN_SAVING_SHARE`` of the step's growth. Under
``memory_limit``, a step over the limit is stitched when the stitched plan fits
(``fit``, from the step's limit), before any activation budget is tried: it
recomputes nothing.

The stitched plan assumes XLA's schedule of the whole step holds what the
separate executables hold, less the gradients its updates consume at once. That
holds on matmul models (MLPs), not on convolutions, where a stitched ResNet-18 held
2 to 3 times the separate step's growth (docs/donation.md). A step with a
convolution (``_convolves``) is not stitched by default or to fit a limit;
``stitch=True`` still stitches it.

A stitched step frees the gradients only if the program drops them before the
``torch_xla.sync()`` that runs the step (``optimizer.zero_grad()`` before it):
kept past it, they are outputs of the computation. ``xla.memory.note_call``
watches that at each sync (``GraphRecord.gradients_at_sync``), and a step is
only stitched where every backward's gradients were gone at the syncs so far.

A lever the default takes (stitched, or a backward the compiler split into
segments by itself) is then timed against ``PLAIN`` (``choice.StepTimes``).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .. import report

MIN_SAVING_BYTES = 16 * 2**20  # below this a stitched step is not worth its second compile
MIN_SAVING_SHARE = 0.25  # of the step's growth (peak above its resident bytes)
MIB = 2**20
STITCHED = (("stitch", True),)
# What a lever is timed against: every graph one executable of its own
PLAIN = (("stitch", False), ("backward_segments", 0))


def chosen_by_default(settings) -> bool:
    """Whether a dynamo graph's levers are chosen once its step has run."""
    return settings.stitch is None


def wait_for_device() -> None:
    from . import compat

    compat.wait_device_ops()


def _stitch_candidate(graph_id: int, step: Sequence, records: Sequence):
    """(the step's plan as it runs, its plan stitched), or None where stitching is not a
    candidate: stitched already, no stitched estimate (a backward in segments, no
    optimizer graph after it), the gradients kept past a sync (or no sync seen yet),
    or a convolution in the step."""
    from ..errors import DonateXlaError
    from ..planner import memory_plan

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
    return separate, stitched


def _convolves(record: report.GraphRecord) -> bool:
    """Whether a graph runs a convolution (forward or backward)."""
    traced = getattr(record.lowered, "traced", None)
    if traced is None:
        return False
    return any(getattr(node.target, "__name__", "").startswith("convolution")
               for node in traced.gm.graph.nodes if node.op == "call_function")


def _stitch(choices: list, note: str, graph_id: int) -> str:
    for c in choices:
        c.overrides = STITCHED
        c.note = note
        c.decided = True
    report.log.info("donate_xla: graph %d: %s", graph_id, note)
    return note


def choose(graph_id: int, step: Sequence, choices: list, steps: int, records: Sequence) -> Optional[str]:
    """With no memory limit, once the step has run ``steps`` times: stitch the step's
    graphs if its plan says so (module docstring; ``records``: the path's). Returns the
    note, or None."""
    candidate = _stitch_candidate(graph_id, step, records)
    if candidate is None:
        return None
    separate, stitched = candidate
    saving = separate.peak_bytes - stitched.peak_bytes
    if saving < max(MIN_SAVING_BYTES, MIN_SAVING_SHARE * separate.growth_bytes):
        return None
    return _stitch(choices, (
        f"chosen automatically after {steps} steps: stitched step (forward, backward and optimizer as one "
        f"XLA computation), planned at {stitched.peak_bytes / MIB:.1f} MiB against "
        f"{separate.peak_bytes / MIB:.1f} MiB as separate executables; recomputes nothing "
        "(DONATE_XLA_STITCH=0 keeps them separate)"
    ), graph_id)


def in_use(step: Sequence, choices: list, records: Sequence) -> Optional[str]:
    """The lever the step runs by default, in words (the stitched step, or a backward the
    compiler split into segments by itself), or None."""
    if any(c.overrides == STITCHED for c in choices):
        return "the stitched step"
    graphs = {r.graph_id for r in step}
    # the split's record carries no memory of its own, so it is not among ``step``
    if any(r.graph_id in graphs and r.backward_segments
           and (r.segments_choice or "").startswith("chosen automatically") for r in records):
        return "the backward in segments"
    return None


def fit(graph_id: int, step: Sequence, choices: list, limit: int, steps: int, records: Sequence) -> Optional[str]:
    """Under ``memory_limit``, a step over it: stitch its graphs if the step stitched is
    planned within the limit (it recomputes nothing, so it comes before any activation
    budget). Returns the note, or None."""
    candidate = _stitch_candidate(graph_id, step, records)
    if candidate is None:
        return None
    separate, stitched = candidate
    if stitched.peak_bytes > limit:
        return None
    return _stitch(choices, (
        f"chosen to fit memory_limit {limit / MIB:.1f} MiB after {steps} steps: stitched step (forward, "
        f"backward and optimizer as one XLA computation), planned at {stitched.peak_bytes / MIB:.1f} MiB "
        f"against {separate.peak_bytes / MIB:.1f} MiB as separate executables; recomputes nothing"
    ), graph_id)


def refusal_hint(graph_id: int, settings, records: Sequence) -> str:
    """What a refused limit's message adds on this path: the stitched step, where it is
    not set already, with its plan."""
    if settings.stitch:
        return ""
    from ..errors import DonateXlaError
    from ..planner import memory_plan

    estimate = ""
    try:
        plan = memory_plan(records, workspaces=False, as_stitched=True, graph_id=graph_id)
        if any("stitched step" in note for note in plan.notes):
            estimate = f"; this step stitched is planned at {plan.peak_bytes / MIB:.1f} MiB ({plan.peak_bytes} bytes)"
    except DonateXlaError:
        pass
    return (" On the XLA path a stitched step (options={'stitch': True}) runs the graphs as one XLA "
            "computation, which frees each gradient as the optimizer consumes it" + estimate
            + " (docs/donation.md, 'Below the floor').")
