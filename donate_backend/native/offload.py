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

With ``offload_saved`` unset, a ``memory_limit`` may choose it (``lever``): on
CUDA, where host memory is not the device's, ``budget.partition`` tries each
activation budget as it is, then with the saved activations offloaded, before a
smaller budget. Offloading recomputes nothing and its copies overlap compute on
their own stream, so at one budget it comes before more recomputation; it costs
host memory and PCIe bandwidth, which the plan's choice names in bytes. The
CPU has no lever (nothing to save). The meta device, on which a step is planned
for a GPU, has it as CUDA does, so that the plan made there chooses what the
GPU would; a meta tensor cannot be copied to the host, so on meta each copy
(``prims.device_put``) runs as ``meta_host_copy``, a meta tensor of the same
shape, while the graph's values keep the host device the plan counts.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .. import config
from ..errors import DonateXlaError
from . import compat

# the ops by which torch's offloading copies a saved activation to the host
_OFFLOAD_OPS = ("device_put", "offload")


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


def _on(joint: torch.fx.GraphModule, device_type: str) -> bool:
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.device.type == device_type:
            return True
    return False


def _on_cuda(joint: torch.fx.GraphModule) -> bool:
    return _on(joint, "cuda")


def meta_host_copy(value: torch.Tensor, device, non_blocking: bool = False) -> torch.Tensor:
    """What a copy to or from the host runs as on the meta device: a meta tensor like
    ``value`` (no data to copy; the plan counts the graph's own values)."""
    return torch.empty_like(value, device="meta")


def _runnable_on_meta(*modules: torch.fx.GraphModule) -> None:
    for gm in modules:
        copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.prims.device_put.default]
        for node in copies:
            node.target = meta_host_copy
        if copies:
            gm.recompile()


def partition_offloading(partition_fn: Callable) -> Callable:
    """``partition_fn`` with torch's activation offloading on (see the module docstring)."""

    @functools.wraps(partition_fn)
    def partition(joint, *args, **kwargs):
        for node in joint.graph.nodes:
            if node.op == "call_function":
                node.meta["should_offload"] = True
        with compat.activation_offloading(on_cuda=_on_cuda(joint)):
            fw_module, bw_module = partition_fn(joint, *args, **kwargs)
        if _on(joint, "meta"):
            _runnable_on_meta(fw_module, bw_module)
        return fw_module, bw_module

    return partition


class _Lever:
    """The offload lever a memory limit tries (``budget.partition(offload=lever)``):
    ``lever(joint)`` is ``partition_offloading`` where a memory limit may offload the saved
    activations of ``joint`` (``offload_saved`` unset, the graph on CUDA or on the meta
    device, planning for one, and a torch that offloads), else None (module docstring);
    ``lever.moved_bytes(fw_module)`` what a forward so partitioned copies to host memory."""

    def __call__(self, joint: torch.fx.GraphModule) -> Optional[Callable]:
        if config.current().offload_saved is not None or not (_on_cuda(joint) or _on(joint, "meta")):
            return None
        if compat.activation_offloading(on_cuda=True) is None:
            return None
        return partition_offloading

    @staticmethod
    def moved_bytes(fw_module: torch.fx.GraphModule) -> int:
        return offloaded_bytes(fw_module)


lever = _Lever()


def offloaded_bytes(fw_module: torch.fx.GraphModule) -> int:
    """Bytes of saved activations a partitioned forward copies to host memory."""
    from .memory import nbytes

    total = 0
    for node in fw_module.graph.nodes:
        if node.op == "call_function" and (
            getattr(node.target, "_opname", None) in _OFFLOAD_OPS or node.target is meta_host_copy
        ):
            value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                total += nbytes(value)
    return total
