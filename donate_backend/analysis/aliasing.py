"""Which donation candidates must not be donated, and why.

A candidate's buffer is handed to XLA to be overwritten, so nothing else may
still read it: not another input sharing its storage, not an output that
returns or views its old value, not a tensor saved for backward. Pure
functions over fake example inputs and the FX graph.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

SHARES_STORAGE = "shares storage with input #{other} (tied weights or views of one base)"
PASSED_TWICE = "the same tensor is passed again as input #{other}"
SAVED_FOR_BACKWARD = "its old value is saved for backward"
RETURNED = "it is returned or aliased by an output"
NO_MATCHING_OUTPUT = "no output has its shape and dtype, so no output can take its buffer"
HOST_SCALAR = "it is a host (CPU) tensor, uploaded afresh on every call"
NOT_WRITTEN = "donation was requested, but the graph does not write it and its old value is returned or saved"
DEVICE_SCALAR = (
    "it is a 0-dim device tensor: torch_xla gives equal scalars one shared buffer "
    "(its device-data cache), so another tensor may still read it"
)


def storage_key(t: torch.Tensor) -> Optional[StorageWeakRef]:
    """Hashable identity of the storage behind ``t`` (fake tensors too); None without one."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def storage_address(t: torch.Tensor) -> Optional[tuple]:
    """``(device, address)`` of the storage behind ``t``: one storage while it lives, told
    apart across calls without holding it. A meta storage has no address (every one
    is at 0), so it is told apart by its storage object's identity instead."""
    try:
        storage = t.untyped_storage()
        if t.device.type == "meta":
            return ("meta", StorageWeakRef(storage).cdata)
        return (str(t.device), storage.data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # no data pointer (an XLA tensor's storage)
        return None


def shared_storage_partner(example_inputs: Sequence) -> dict[int, str]:
    """Inputs whose storage (or identity) is shared with another input."""
    reasons: dict[int, str] = {}
    by_identity: dict[int, int] = {}
    by_storage: dict[object, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor):
            continue
        if id(t) in by_identity:
            first = by_identity[id(t)]
            reasons[i] = PASSED_TWICE.format(other=first)
            reasons.setdefault(first, PASSED_TWICE.format(other=i))
            continue
        by_identity[id(t)] = i
        key = storage_key(t)
        if key is not None:
            by_storage[key].append(i)
    for group in by_storage.values():
        for i in group:
            if len(group) > 1 and i not in reasons:
                other = next(j for j in group if j != i)
                reasons[i] = SHARES_STORAGE.format(other=other)
    return reasons




def output_values(graph: torch.fx.Graph) -> list:
    """The graph's outputs as a list (a graph may return one value or a tuple)."""
    value = graph.output_node().args[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _is_view_op(node: torch.fx.Node) -> bool:
    """Returns a view of its input (``Tensor(a)``); in-place ops (``Tensor(a!)``) return
    the written, i.e. new, value and are not views of the old one."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(
        r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns
    )


def inputs_reaching_outputs(graph: torch.fx.Graph) -> dict[int, list[int]]:
    """Map input index -> output positions that return a view of its old value.

    An output that is the placeholder itself is not counted: the graph is read
    after its ``copy_`` epilogue, so it is the input's new value, and the
    runtime returns the caller's tensor after the write-back.
    """
    index_of = {node: i for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    root_of: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and _is_view_op(node) and node.args:
            base = node.args[0]
            if isinstance(base, torch.fx.Node) and base in index_of:
                root_of[node] = index_of[base]
            elif isinstance(base, torch.fx.Node) and base in root_of:
                root_of[node] = root_of[base]
    result: dict[int, list[int]] = collections.defaultdict(list)
    for pos, value in enumerate(output_values(graph)):
        if isinstance(value, torch.fx.Node) and value in root_of:
            result[root_of[value]].append(pos)
    return dict(result)


def inputs_returned_as_is(graph: torch.fx.Graph) -> dict[int, list[int]]:
    """Map input index -> output positions that are the input's placeholder itself."""
    index_of = {node: i for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    result: dict[int, list[int]] = collections.defaultdict(list)
    for pos, value in enumerate(output_values(graph)):
        if value in index_of:
            result[index_of[value]].append(pos)
    return dict(result)


def outputs_without_slot(
    donors: Sequence[int], example_inputs: Sequence, output_metas: Sequence
) -> list[int]:
    """Donors for which no output of the same shape and dtype is left over."""
    free = collections.Counter(
        (tuple(m.shape), m.dtype) for m in output_metas if isinstance(m, torch.Tensor)
    )
    unmatched = []
    for i in donors:
        key = (tuple(example_inputs[i].shape), example_inputs[i].dtype)
        if free[key] > 0:
            free[key] -= 1
        else:
            unmatched.append(i)
    return unmatched


def classify_output_use(
    positions: Sequence[int], num_user_outputs: Optional[int]
) -> str:
    """Reason for an input that reaches the outputs at ``positions``."""
    if num_user_outputs is not None and all(p >= num_user_outputs for p in positions):
        return SAVED_FOR_BACKWARD
    return RETURNED


def _is_inplace_call(node: torch.fx.Node) -> bool:
    """A dynamo-level node that writes its first argument (``x.add_``, ``x += y``)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if name.startswith("i") and getattr(node.target, "__module__", "") in ("_operator", "operator"):
            return True
        if isinstance(node.target, torch._ops.OpOverload):
            args = node.target._schema.arguments
            return bool(args) and args[0].is_write
        return name.endswith("_") and not name.endswith("__")
    return False


def overlapping_inputs_written(gm: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """Pairs of distinct inputs that share storage, where the graph writes to one of them.

    Works on dynamo's graph (before aot_autograd): its nodes carry fake values
    in ``meta["example_value"]``, whose storages mirror the real inputs' sharing.
    """
    partners = collections.defaultdict(list)
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        t = node.meta.get("example_value")
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            if key is not None:
                partners[key].append(i)
    shared = {key: group for key, group in partners.items() if len(group) > 1}
    if not shared:
        return []
    written = set()
    for node in gm.graph.nodes:
        if not _is_inplace_call(node) or not node.args:
            continue
        target = node.args[0]
        value = target.meta.get("example_value") if isinstance(target, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and storage_key(value) in shared:
            written.add(storage_key(value))
    return [tuple(shared[key][:2]) for key in written]
