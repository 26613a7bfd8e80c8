"""Every key donate_xla writes into a ``GraphModule.meta``, in one place.

A stage that runs inside aot_autograd can hand what it decided to a later stage only
on the graphs themselves: the partitioner returns a forward and a backward module, and
aot_autograd passes them on to the compilers with nothing else. Each key here is read
by the stage named beside it, on the same module, and by nothing else.
"""
from __future__ import annotations

# written by the partitioner under an activation budget (``budget``), read by the compilers
BUDGET_SHARE = "donate_xla_budget_share"  # backward: the budget it was partitioned at
BUDGET_CHOICE = "donate_xla_budget_choice"  # forward: what a memory limit chose, as text
PLAN_SECONDS = "donate_xla_plan_seconds"  # forward: seconds spent choosing it
PLANNED_PEAK = "donate_xla_planned_peak"  # forward: the step peak predicted for that choice (bytes)
# backward: the segments a memory limit chose for it (``xla.memory.predict_step``), read by
# the XLA compiler, which splits it so
BACKWARD_SEGMENTS = "donate_xla_backward_segments"
# backward: {placeholder name: output index} of the forward inputs whose gradients it
# returns (``xla.update_order.record_input_grads``), read when a stitched step is lowered
INPUT_GRADS = "donate_xla_input_grads"
# a part of a graph split around ops run on the CPU (``xla.fallback``): which of its inputs
# the whole graph keeps alive, read by the part's memory prediction
KEPT_INPUTS = "donate_xla_kept_inputs"
