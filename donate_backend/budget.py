"""The activation budget, for both paths: min-cut partitioning that saves only a share
of the activations for the backward and recomputes the rest.

``partition(min_cut, ...)`` is the ``partition_fn`` both paths give aot_autograd.
At ``Settings.activation_budget`` 1.0 it is plain min-cut; below, aot_autograd's
memory-budget partitioner (``torch._functorch.config.activation_memory_budget``)
picks what to recompute, and random ops are never among it
(``keep_random_values_saved``).

Under a ``memory_limit`` (``partition(..., fit=True)``) it tries the budget in
force, then smaller shares (``SHARES``), predicting each candidate's step peak
from its forward and backward with the path's own estimate (``native.memory``
replays them, ``xla.memory`` models XLA's fusion), and keeps the first that fits: the least recomputation
that fits. Where the path gives an ``offload`` lever for the graph (the native
path on CUDA, ``native.offload.lever``), each budget is tried as it is, then
with the saved activations offloaded to host memory, before the next smaller
budget: offloading recomputes nothing. When none fits it raises
``MemoryLimitError`` before anything runs, with the least bytes any candidate needs.
"""
from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Optional

import torch
import torch.fx

from . import config, graph_meta, torch_compat
from .errors import DonateXlaError, UnsupportedGraphError

log = logging.getLogger("donate_xla")


SHARES = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)  # activation budgets tried under a memory limit
PLAN_PHASE = "memory limit plan"  # the phase of a forward's compile_seconds spent choosing


def plan_phase(fw_module: torch.fx.GraphModule) -> tuple:
    """``((PLAN_PHASE, seconds),)`` for a forward a memory limit was planned for, else ()."""
    seconds = fw_module.meta.get(graph_meta.PLAN_SECONDS)
    return ((PLAN_PHASE, seconds),) if seconds is not None else ()


class MemoryLimitError(DonateXlaError):
    """No activation budget fits a graph's step under ``memory_limit``."""

    help_section = "Memory plan"

    def __init__(self, *args, least_bytes: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.least_bytes = least_bytes  # the least any candidate plan was predicted to need


def partition(min_cut, *args, fit: bool = False, predict_step=None, offload=None, **kwargs):
    """Min-cut under the activation budget in force (``DONATE_XLA_ACTIVATION_BUDGET``),
    or, with ``fit`` and a ``memory_limit``, under the first budget that fits it.
    ``predict_step(fw_module, bw_module, num_forward_outputs) -> (peak, parts)``
    predicts a candidate's step (the path's own estimate: ``native.memory``,
    ``xla.memory``); needed with ``fit``. ``offload``: None, or the path's offload lever
    (``native.offload.lever``): ``offload(joint)`` None or a wrapper of a partition
    function that offloads the saved activations, tried under a limit, and
    ``offload.moved_bytes(fw_module)`` what it moves.

    Below 1.0, aot_autograd's memory-budget partitioning saves only that share
    of the activations (by its own estimate) and recomputes the rest in the
    backward: less memory held from forward to backward, more compute.
    """
    settings = config.current()
    if fit and settings.memory_limit is not None:
        return _fit(min_cut, settings, predict_step, *args, offload=offload, **kwargs)
    return _partition_at(settings.activation_budget, min_cut, *args, **kwargs)


OFFLOADED = "+offload"  # a candidate's label: its saved activations offloaded to host memory


def _fit(min_cut, settings, predict_step, joint, *args, offload=None, **kwargs):
    limit = settings.memory_limit
    started = time.perf_counter()
    offloading = offload(joint) if offload is not None else None
    tried = []  # (label, peak, parts)
    shares = [s for s in SHARES if s <= settings.activation_budget] or [settings.activation_budget]
    candidates = [(share, off) for share in shares for off in ((False, True) if offloading else (False,))]
    for share, off in candidates:
        candidate = torch.fx.GraphModule(joint, copy.deepcopy(joint.graph))  # meta values shared
        partition_fn = functools.partial(_partition_at, share, min_cut)
        if off:
            partition_fn = offloading(partition_fn)
        fw_module, bw_module = partition_fn(candidate, *args, **kwargs)
        bw_module.meta[graph_meta.BUDGET_SHARE] = share
        peak, parts = predict_step(fw_module, bw_module, kwargs.get("num_fwd_outputs"))
        label = f"{share:g}{OFFLOADED if off else ''}"
        tried.append((label, peak, parts))
        if peak <= limit:
            moved = ""
            if off:
                moved = (f" with {_mib(offload.moved_bytes(fw_module))} of saved activations offloaded to host "
                         "memory (copied out after the forward and back for the backward, each step)")
            fw_module.meta[graph_meta.BUDGET_CHOICE] = (
                f"activation budget {share:g}{moved} chosen under memory_limit {_mib(limit)} "
                f"(predicted step peak {_mib(peak)}; tried {', '.join(f'{s}: {_mib(p)}' for s, p, _ in tried)})"
            )
            fw_module.meta[graph_meta.PLAN_SECONDS] = time.perf_counter() - started
            fw_module.meta[graph_meta.PLANNED_PEAK] = peak
            return fw_module, bw_module
    label, least, parts = min(tried, key=lambda t: t[1])
    largest = ", ".join(f"{c} {_mib(b)}" for c, b in sorted(parts.items(), key=lambda kv: -kv[1])[:3] if b > 0)
    offloaded = " (+offload: saved activations offloaded to host memory)" if offloading else ""
    raise MemoryLimitError(
        f"donate_xla: this graph's training step needs at least {_mib(least)} ({least} bytes, the "
        f"least of the activation budgets tried{offloaded}: "
        f"{', '.join(f'{s}: {_mib(p)}' for s, p, _ in tried)}; at {label}), but memory_limit is "
        f"{_mib(limit)} ({limit} bytes); largest at the peak: {largest}. Nothing has run. Raise the "
        "limit, or lower what the step holds (a smaller batch, fewer parameters on this device).",
        least_bytes=least,
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _partition_at(share: float, min_cut, *args, **kwargs):
    if share >= 1.0:
        return min_cut(*args, **kwargs)
    keep_random_values_saved(args[0] if args else kwargs["joint_module"])
    with torch_compat.activation_memory_budget(share):
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
