"""Saved activations kept in host memory between the forward and the backward (``offload_saved``).

torch's min-cut partitioner can offload activations itself
(``torch._functorch._activation_offloading``): after the partition, each saved
activation the forward computed (not a view, not an output the caller gets, not
a graph input, contiguous) is copied to host memory after its last forward use,
and the backward copies it back before its first use. On CUDA the copies run on
a stream of their own, the forward waits for each as late as it can and the
backward starts each reload early enough to overlap it with compute; on the CPU
they are plain copies (host and device memory are the same: nothing is saved,
the values are the same).

torch offloads the nodes marked ``should_offload``. ``partition_offloading``
marks every node of the joint graph and lets torch's own checks choose among
them, then runs the partitioner with offloading on. The executors run the copy
ops like any other (the ATen executor's freeing and buffer reuse see a reload as
a new tensor, freed at its last use).

torch 2.9 has no activation offloading: ``offload_saved`` is refused there
(``check_available``).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..errors import DonateXlaError
from . import compat


def check_available(graph_id: int) -> None:
    """Refuse ``offload_saved`` on a torch without activation offloading."""
    if compat.activation_offloading(on_cuda=False) is None:
        raise DonateXlaError(
            f"donate_xla: graph {graph_id}: offload_saved needs torch's activation offloading "
            f"(torch._functorch._activation_offloading), which torch {compat.torch_version()} does "
            "not have (torch 2.15 does). Leave offload_saved off (DONATE_XLA_OFFLOAD_SAVED=0), or "
            "lower the memory of the step with activation_budget or memory_limit instead.",
            help_section="Settings and `torch.compile` arguments",
        )


def _on_cuda(joint: torch.fx.GraphModule) -> bool:
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return True
    return False


def partition_offloading(partition_fn: Callable) -> Callable:
    """``partition_fn`` with torch's activation offloading on (see the module docstring)."""

    @functools.wraps(partition_fn)
    def partition(joint, *args, **kwargs):
        for node in joint.graph.nodes:
            if node.op == "call_function":
                node.meta["should_offload"] = True
        with compat.activation_offloading(on_cuda=_on_cuda(joint)):
            return partition_fn(joint, *args, **kwargs)

    return partition
