"""The activation budget, for both paths: min-cut partitioning that saves only a share
of the activations for the backward and recomputes the rest.

``partition(min_cut, ...)`` is the ``partition_fn`` both paths give aot_autograd.
At ``Settings.activation_budget`` 1.0 it is plain min-cut; below, aot_autograd's
memory-budget partitioner (``torch._functorch.config.activation_memory_budget``)
picks what to recompute, and random ops are never among it
(``keep_random_values_saved``).
"""
from __future__ import annotations

import logging

import torch

from . import config
from .errors import UnsupportedGraphError

log = logging.getLogger("donate_xla")


def partition(min_cut, *args, **kwargs):
    """Min-cut under the activation budget in force (``DONATE_XLA_ACTIVATION_BUDGET``).

    Below 1.0, aot_autograd's memory-budget partitioning saves only that share
    of the activations (by its own estimate) and recomputes the rest in the
    backward: less memory held from forward to backward, more compute.
    """
    share = config.current().activation_budget
    if share >= 1.0:
        return min_cut(*args, **kwargs)
    import torch._functorch.config as functorch_config

    keep_random_values_saved(args[0] if args else kwargs["joint_module"])
    with functorch_config.patch(activation_memory_budget=share):
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
