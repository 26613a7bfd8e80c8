"""Reuse of dead buffers: a pointwise op writes its result into an input that dies there.

When a buffer's last reader is a pointwise op whose result has the same shape,
strides and dtype, the op can write into that buffer (its ``out=`` overload)
instead of allocating a fresh one. The peak at that op drops by one buffer.
This is the reuse Inductor gets from donated saved buffers (DESIGN §3).

A buffer qualifies only when nothing else can read it afterwards:

- its storage belongs to the backward alone: either made inside this graph,
  or a saved tensor aot_autograd lists as donated (no storage shared with a
  forward input, a user output or a backward output: ``bw_donated_idxs``);
  never a tangent or any other input;
- the storage holds exactly that tensor (no bigger base), and no other value
  in the graph that shares the storage is read after the op, nor read by the
  op through another view;
- no opaque call (a Python function, method or module, e.g. one inserted by
  the DDP rewrite) reads any value of that storage, and no op mutates it;
- saved-tensor reuse runs only when the backward does not keep its graph
  (checked at run time, see ``free_saved``).

``plan_reuse`` is pure and returns ``Reuse`` entries; ``apply_reuse``
rewrites a graph (a copy) accordingly.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx

from ..analysis import liveness
from ..analysis.aliasing import storage_key


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Node ``node`` writes its result into ``buffer`` (whose last reader it is)."""

    node: torch.fx.Node
    buffer: torch.fx.Node
    out_overload: torch._ops.OpOverload
    out_argument: str


def _tensor_val(node: torch.fx.Node) -> Optional[torch.Tensor]:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return val if isinstance(val, torch.Tensor) else None


def out_variant(op: torch._ops.OpOverload) -> Optional[Tuple[torch._ops.OpOverload, str]]:
    """The overload of ``op`` that takes the same arguments plus one ``out`` tensor."""
    functional = [(a.name, str(a.type)) for a in op._schema.arguments]
    if len(op._schema.returns) != 1:
        return None
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        outs = [a for a in candidate._schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in candidate._schema.arguments if not a.is_out]
        if len(outs) == 1 and rest == functional and len(candidate._schema.returns) == 1:
            return candidate, outs[0].name
    return None


def _is_reusing_candidate_op(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    tags = set(getattr(target, "tags", ()))
    if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
        return False
    return not target._schema.is_mutable


def _mutated_or_escaping_values(graph: torch.fx.Graph) -> Set[torch.fx.Node]:
    """Values an opaque call reads, or that an op writes to."""
    flagged: Set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output" or node.op == "placeholder":
            continue
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            flagged.update(node.all_input_nodes)
            continue
        if target._schema.is_mutable:
            flagged.update(node.all_input_nodes)
    return flagged


def _storage_groups(graph: torch.fx.Graph) -> Dict[torch.fx.Node, object]:
    keys: Dict[torch.fx.Node, object] = {}
    for node in graph.nodes:
        val = _tensor_val(node)
        key = storage_key(val) if val is not None else None
        if key is not None:
            keys[node] = key
    return keys


def _owns_exact_storage(val: torch.Tensor) -> bool:
    try:
        nbytes = val.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return (
        val.is_contiguous()
        and val.numel() > 0
        and val.storage_offset() == 0
        and nbytes == val.numel() * val.element_size()
    )


def plan_reuse(graph: torch.fx.Graph, donated_inputs: Set[torch.fx.Node]) -> List[Reuse]:
    """Which pointwise ops may write into a buffer that dies at them (pure)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = liveness.last_uses(graph)
    key_of = _storage_groups(graph)
    members: Dict[object, List[torch.fx.Node]] = {}
    for node, key in key_of.items():
        members.setdefault(key, []).append(node)
    flagged = _mutated_or_escaping_values(graph)

    def group_is_reusable(key) -> bool:
        group = members[key]
        placeholders = [m for m in group if m.op == "placeholder"]
        if placeholders and (len(placeholders) > 1 or placeholders[0] not in donated_inputs):
            return False
        for member in group:
            if member in flagged or last.get(member, member).op == "output":
                return False
        return True

    reusable = {key: group_is_reusable(key) for key in members}
    plans: List[Reuse] = []
    for node in graph.nodes:
        if not _is_reusing_candidate_op(node):
            continue
        result = _tensor_val(node)
        if result is None:
            continue
        variant = out_variant(node.target)
        if variant is None:
            continue
        direct = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        for buffer in direct:
            key = key_of.get(buffer)
            val = _tensor_val(buffer)
            if key is None or val is None or not reusable[key] or last.get(buffer) is not node:
                continue
            if any(order[last.get(m, m)] > order[node] for m in members[key]):
                continue  # another view of the storage is read later
            if any(key_of.get(a) == key and a is not buffer for a in node.all_input_nodes):
                continue  # the op reads the storage through another view too
            if (
                val.shape != result.shape
                or val.dtype != result.dtype
                or val.device != result.device
                or val.stride() != result.stride()
                or not _owns_exact_storage(val)
            ):
                continue
            plans.append(Reuse(node, buffer, variant[0], variant[1]))
            # The result (and every view of it) now lives in the buffer's
            # storage: merge the two groups, so a later op may reuse the
            # storage again once all of them are dead.
            own_key = key_of.get(node)
            if own_key is not None and own_key != key:
                for member in members.pop(own_key):
                    key_of[member] = key
                    members[key].append(member)
                reusable[key] = reusable[key] and reusable.pop(own_key)
            elif own_key is None:
                key_of[node] = key
                members[key].append(node)
            break
    return plans


def apply_reuse(plans: List[Reuse]) -> int:
    """Rewrite each planned node to its ``out=`` overload writing into the buffer."""
    for plan in plans:
        node = plan.node
        node.target = plan.out_overload
        node.kwargs = {**node.kwargs, plan.out_argument: plan.buffer}
    return len(plans)
