"""XLA path: abstract lowering with automatic buffer donation (needs torch_xla)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

from .. import config
from ..analysis.aliasing import overlapping_inputs_written
from ..analysis.mutation import donation_requests
from ..errors import UnsupportedGraphError
from . import compat
from .compiler import compile_graph
from .rewrite import rewrite_for_xla
from .sharding import MeshDescription, describe_mesh, mark_sharding

log = logging.getLogger("donate_xla")


def aot_options() -> dict:
    """Use the min-cut partitioner, which saves a parameter rather than a view of it.

    The default partitioner saves ``t(weight)`` for backward. An XLA graph
    output is always a buffer of its own, so every saved transpose was a full
    copy of its weight, held from forward to backward (175 MiB on a
    52M-parameter MLP). Min-cut recomputes such views in backward instead.
    """
    try:  # private torch API, present in 2.9 through 2.13
        from torch._functorch.partitioners import min_cut_rematerialization_partition
    except ImportError:
        log.warning(
            "donate_xla: torch has no min-cut partitioner here; the XLA forward will save "
            "transposed weights for backward (more memory, same results)"
        )
        return {}
    return {"partition_fn": functools.partial(_partition, min_cut_rematerialization_partition)}


def _partition(min_cut, *args, **kwargs):
    """Min-cut under the activation budget in force (``DONATE_XLA_ACTIVATION_BUDGET``).

    Below 1.0, aot_autograd's memory-budget partitioning saves only that share
    of the activations (by its own estimate) and recomputes the rest in the
    backward: less memory held from forward to backward, more compute.
    """
    budget = config.current().activation_budget
    if budget >= 1.0:
        return min_cut(*args, **kwargs)
    import torch._functorch.config as functorch_config

    keep_random_values_saved(args[0] if args else kwargs["joint_module"])
    with functorch_config.patch(activation_memory_budget=budget):
        fw_module, bw_module = min_cut(*args, **kwargs)
    if not _saves_a_tuple(fw_module):
        return fw_module, bw_module
    # torch's budget partitioner, left with nothing to recompute but the random ops
    # it must save, returns them whole: a dropout's (output, mask) pair as one saved
    # value, which aot_autograd cannot handle. Then nothing would be recomputed
    # anyway: partition this graph as at the full budget.
    log.info("donate_xla: a graph whose only recomputable ops are random ones: its full activations are saved")
    return min_cut(*args, **kwargs)


def _saves_a_tuple(fw_module) -> bool:
    outputs = fw_module.graph.output_node().args[0]
    return any(isinstance(getattr(n, "meta", {}).get("val"), (tuple, list)) for n in outputs)


def keep_random_values_saved(joint) -> int:
    """Mark every random op of the joint graph (dropout, ``rand``, ``bernoulli``...)
    as saved for the backward, never recomputed; returns how many.

    Under a memory budget the partitioner's knapsack may recompute any op its
    plain min-cut bans, random ones included, and on XLA a recomputed dropout
    draws a new mask from a new seed: the backward differentiated through
    other positions than the forward dropped (a silently wrong gradient,
    measured at budgets 0.5 and 0.01). The partitioner never recomputes a node
    marked ``CheckpointPolicy.MUST_SAVE``.
    """
    try:  # public since torch 2.4; the tag since 2.1
        from torch.utils.checkpoint import CheckpointPolicy

        random_tag = torch.Tag.nondeterministic_seeded
    except (ImportError, AttributeError) as exc:
        raise UnsupportedGraphError(
            "donate_xla: this torch cannot mark random ops as saved for the backward, so "
            "DONATE_XLA_ACTIVATION_BUDGET below 1.0 could recompute a dropout with another mask. "
            "Unset DONATE_XLA_ACTIVATION_BUDGET, or use torch 2.9."
        ) from exc
    marked = 0
    for node in joint.graph.nodes:
        target = node.target
        if node.op == "call_function" and random_tag in getattr(target, "tags", ()):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def check_dynamo_graph(gm, example_inputs, graph_id: int) -> None:
    """Refuse graphs that torch/torch_xla would compute wrongly, before tracing them.

    Writing to one of two overlapping views of a tensor needs aot_autograd's
    synthetic bases, which give wrong values for XLA tensors on torch 2.9 /
    torch_xla 2.9 (``aot_eager`` included), so it is an error rather than a
    silently wrong result.

    Without torch_xla's functionalization (XLA_DISABLE_FUNCTIONALIZATION=1) a
    view taken before a call does not follow its base's new value, a lazy clone
    taken before a donating call lost its value, and reads failed with "Check
    failed: handle->HasValue()" (openxla computes wrong values there): refused.
    """
    switch = compat.functionalization_disabled()
    if switch is not None:
        raise UnsupportedGraphError(
            f"graph {graph_id}: donate_xla needs torch_xla's functionalization, which {switch} "
            "turns off: views, clones and copies of the graph's inputs would read wrong or deleted "
            "buffers. Unset XLA_DISABLE_FUNCTIONALIZATION (it is a torch_xla debugging switch)."
        )
    for first, second in overlapping_inputs_written(gm):
        raise UnsupportedGraphError(
            f"graph {graph_id}: inputs #{first} and #{second} are views of one XLA tensor and "
            "the graph writes to them in place. aot_autograd cannot handle that correctly for "
            "XLA tensors (torch 2.9 / torch_xla 2.9). Pass the base tensor and slice it inside "
            "the compiled function, or .clone() one of the views before the call."
        )


def prepare_dynamo_graph(gm) -> None:
    """Rewrite, in place, the calls aot_autograd cannot trace for XLA tensors (``xla/rewrite.py``)."""
    count = rewrite_for_xla(gm)
    if count:
        log.debug("donate_xla: %d call(s) rewritten before aot_autograd (xla/rewrite.py)", count)


@dataclasses.dataclass(frozen=True)
class XlaCapture:
    """What the XLA compilers learn from dynamo's graph."""

    requested_donors: tuple = ()  # inputs the user asked to donate (dynamo_set_buffer_donor_)


def capture(gm, example_inputs) -> Optional[XlaCapture]:
    """Dynamo-level facts for the compilers: explicit donation requests."""
    requested = donation_requests(gm)
    return XlaCapture(tuple(requested)) if requested else None


__all__ = [
    "MeshDescription", "aot_options", "capture", "check_dynamo_graph", "compile_graph", "describe_mesh", "mark_sharding",
    "prepare_dynamo_graph",
]
