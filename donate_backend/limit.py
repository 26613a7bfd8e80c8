"""A memory limit kept by the whole step, optimizer state included.

``budget.partition`` fits a forward and its backward under ``memory_limit``
while they compile. That is before the optimizer's first step makes its
state, so neither the state nor the optimizer's own graph is in that
prediction. Each function compiled under a limit carries a ``LimitLayer``
(``step.StepCompiled``): once the step has run ``STEPS`` times it plans the whole
step (``planner.memory_plan``, the state counted as resident). A step over the
limit first takes the path's lever that recomputes nothing if that fits
(``choice.fit``; on the XLA path, the stitched step). Else it is planned again: the same dynamo
graph, on fake copies of its inputs, goes through aot_autograd once more
under the limit less what the step holds beyond the planned forward and
backward (at least the state), so the least recomputation that fits with the
state counted is chosen. When nothing fits (the rest of the step, such as the
optimizer's graph, is over the limit by itself, or no activation budget, with its
saved activations offloaded or not, brings the forward and backward under what is left), the call raises
``MemoryLimitError`` before its step runs, with the bytes the step needs.

Where the step's forward is several graphs each planned under the limit (a loss
compiled on its own after a graph break), the graph whose forward-to-backward span
holds the step's peak is planned again; the others keep their choice. It plans
again once. It warns with the excess instead when it cannot compile the graph again
(symbolic inputs), when the step is still over after planning again, and when the
step is stitched (XLA: one computation, which it does not plan again).
"""
from __future__ import annotations

import time
import warnings
from typing import Optional

from . import config, graph_memory, report, torch_compat
from . import choice as step_choice
from .budget import MemoryLimitError
from .errors import DonateXlaError
from .planner import MemoryPlan, last_step, memory_plan

MIB = 2**20
STEPS = step_choice.STEPS  # the first step makes the optimizer state, the second runs with it
MAX_REPLANS = 1  # times a graph is planned again (with the state counted); then it warns


class LimitLayer:
    """A compiled function under ``memory_limit`` (see the module docstring): a layer of
    its ``step.StepCompiled``, which counts the calls and compiles it again."""

    def __init__(self, owner, example_inputs, limit: int):
        self.owner = owner  # step.StepCompiled
        self.request = owner.request  # graphs.GraphRequest
        self.limit = limit
        # None: cannot be compiled again (a graph with symbolic sizes would come back static)
        self._fakes = None if _symbolic(self.request.gm) else torch_compat.fake_copies(example_inputs)
        self.replans = 0  # times this graph was planned again (with the state counted)

    @property
    def replanned(self) -> bool:
        return self.replans > 0

    def before_call(self, owner) -> None:
        if owner.calls == STEPS + 1:
            self.check(owner.records())

    def _records(self, records=None) -> list:
        """This graph's records among ``records`` (default: the path's now)."""
        records = self.owner.records() if records is None else records
        return [r for r in records if r.graph_id == self.request.graph_id]

    def check(self, same_path: list) -> Optional[str]:
        """Plan the whole step (``same_path``: the records of this function's path); over
        the limit, plan this graph again (or warn). Returns what was done, as text (None:
        within the limit, or no plan)."""
        own = self._records(same_path)
        forward = next((r for r in own if r.kind == "forward" and r.planned_peak is not None), None)
        if forward is None:  # no training step was planned (inference, an optimizer's graph)
            return None
        # the step from the first forward planned under the limit: every graph's check
        # sees the same step (a loss compiled on its own runs after the model's forward)
        ran = [r for r in same_path if r.graph_id in _limited_forwards(same_path) and r.kind == "forward"
               and r.last_call is not None]
        first = min(ran, key=lambda r: r.last_call).graph_id if ran else self.request.graph_id
        try:
            plan = memory_plan(same_path, workspaces=False, graph_id=first)
        except DonateXlaError:
            return None
        if plan.peak_bytes <= self.limit:
            return None
        step = last_step([r for r in same_path if r.memory is not None], first)
        if any(r.stitched for r in step):
            # one XLA computation, whose schedule the plan only approximates, and which
            # no activation budget is planned for: warned, not refused
            return self._warn(plan, stitched=True)
        fitted = step_choice.fit(same_path, self.request.graph_id, self.limit)  # a lever that recomputes nothing
        if fitted is not None:
            return fitted
        owner = _peak_owner(plan, same_path)
        if owner is not None and owner != self.request.graph_id:
            return None  # the step peaks in another graph planned under the limit: its own check plans it
        if self._fakes is None or self.replans >= MAX_REPLANS:
            return self._warn(plan)
        return self._plan_again(plan, forward, same_path)

    def _warn(self, plan: MemoryPlan, stitched: bool = False) -> str:
        state = plan.breakdown.get(graph_memory.OPTIMIZER_STATE, 0)
        message = (
            f"donate_xla: graph {self.request.graph_id}: the whole step is predicted at "
            f"{plan.peak_bytes / MIB:.1f} MiB, {(plan.peak_bytes - self.limit) / MIB:.1f} MiB over "
            f"memory_limit {self.limit / MIB:.1f} MiB"
            + (f" (optimizer state {state / MIB:.1f} MiB)" if state else "")
            + ("; the step is stitched (one XLA computation, whose schedule the plan approximates), "
               "and a stitched step is not planned again under the limit" if stitched else
               ", after planning it again with that counted" if self.replanned else
               "; the limit was planned for the forward and backward when they compiled")
            + ". For the step to fit, lower memory_limit by the excess; donate_backend.memory_plan() "
            "shows the step."
        )
        warnings.warn(message, stacklevel=3)
        return message

    def _plan_again(self, plan: MemoryPlan, forward: report.GraphRecord, same_path: list) -> str:
        graph_id = self.request.graph_id
        old = self._records(same_path)
        names = {r.name for r in old}
        state = plan.breakdown.get(graph_memory.OPTIMIZER_STATE, 0)
        # The step's peak is the higher of the part from this graph's forward to the end of
        # its backward (which recomputation lowers) and the rest (the optimizer's graph,
        # which it does not).
        at = [i for i, g in enumerate(plan.graphs) if g.name in names]
        own_peak = max(g.peak_bytes for g in plan.graphs[at[0]:at[-1] + 1])
        rest = plan.graphs[:at[0]] + plan.graphs[at[-1] + 1:]
        rest_peak = max(rest, key=lambda g: g.peak_bytes, default=None)
        # What the step holds beyond the forward and backward as planned: at least the
        # state (the plan the limit chose never saw it), more where the whole step's plan
        # of this part is above the prediction the choice was made with.
        beyond = max(own_peak - forward.planned_peak, state)
        lower = self.limit - beyond
        started = time.perf_counter()
        try:
            if rest_peak is not None and rest_peak.peak_bytes > self.limit:
                raise MemoryLimitError("", least_bytes=None)
            if lower <= 0:
                raise MemoryLimitError("", least_bytes=0)
            mode, fakes = self._fakes
            with torch_compat.fresh_tracing(mode):
                compiled = self.owner.recompile(self.request.with_limit(lower), fakes)
        except MemoryLimitError as error:
            kept = {id(r) for r in old}
            report.discard([r for r in self._records() if id(r) not in kept])
            if error.least_bytes is None:  # the rest of the step alone is over the limit
                need = rest_peak.peak_bytes
                why = (f"{rest_peak.name} (outside this graph's forward and backward) peaks at "
                       f"{need / MIB:.1f} MiB with the state counted, which neither recomputing nor offloading "
                       "this graph's activations lowers")
            else:
                need = beyond + error.least_bytes
                why = (f"{beyond / MIB:.1f} MiB beyond the forward and backward, which need at least "
                       f"{error.least_bytes / MIB:.1f} MiB at any activation budget")
            with config.overriding(self.request.overrides):
                settings = config.current()
            levers = self.request.path.levers()
            hint = levers.refusal_hint(graph_id, settings, same_path) if levers is not None else ""
            raise MemoryLimitError(
                f"donate_xla: graph {graph_id}: once the optimizer's first step made its state "
                f"({state / MIB:.1f} MiB), the step needs at least {need / MIB:.1f} MiB ({need} bytes): "
                f"{why}; memory_limit is {self.limit / MIB:.1f} MiB ({self.limit} bytes). The first "
                f"{STEPS} steps ran before the state existed; this one has not run. Raise the limit, "
                "or lower what the step holds (a smaller batch, an optimizer with less state)." + hint,
                least_bytes=need,
            ) from None
        report.discard(old)
        self.owner.compiled = compiled
        self.replans += 1
        self.owner.calls = 1  # this call is the new graphs' first step
        note = (
            f"planned again after {STEPS} steps with the whole step counted (optimizer state "
            f"{state / MIB:.1f} MiB; {beyond / MIB:.1f} MiB beyond the forward and backward): "
            f"memory_limit {self.limit / MIB:.1f} MiB less that, in {time.perf_counter() - started:.2f}s"
        )
        for r in self._records():
            if r.kind == "forward" and r.budget_choice:
                r.choices.budget_choice = f"{r.budget_choice}; {note}"
        return note


def _limited_forwards(records) -> dict:
    """Graph id -> its forward's planned peak, for the forwards planned under a limit."""
    return {r.graph_id: r.planned_peak for r in records if r.kind == "forward" and r.planned_peak is not None}


def _peak_owner(plan: MemoryPlan, records) -> Optional[int]:
    """The dynamo graph planned under the limit whose forward-to-backward span holds the
    step's peak (its activation budget can lower it); of several (a loss compiled on its
    own runs inside the model's span), the one planned at the most bytes, whose saved
    activations are most of what the span holds. None where the peak lies in no such
    span (an optimizer's graph, which no budget lowers)."""
    limited = _limited_forwards(records)
    peak = max(plan.graphs, key=lambda g: g.peak_bytes, default=None)
    if peak is None:
        return None
    at = plan.graphs.index(peak)
    spans = []
    for graph_id, planned in limited.items():
        places = [i for i, g in enumerate(plan.graphs) if g.graph_id == graph_id]
        if places and places[0] <= at <= places[-1]:
            spans.append((planned, graph_id))
    return max(spans)[1] if spans else None


def _symbolic(gm) -> bool:
    """Whether dynamo traced ``gm`` with symbolic sizes (dynamic shapes)."""
    import torch

    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(not isinstance(d, int) for d in value.shape):
            return True
    return False
