"""Keep a backward graph's recomputation where the graph puts it.

aot_autograd's min-cut partitioner recomputes cheap activations (and, under
``DONATE_XLA_ACTIVATION_BUDGET``, most of them) in the backward instead of
saving them, and orders the backward graph as the autograd engine would run
it: each layer's recomputation just before that layer's gradients. XLA does
not keep that order. The recomputation reads only saved values, so its
scheduler is free to run all of it at the start of the executable, and it
does: every layer's recomputed activations are then live together at the
backward's peak, which is what the recomputation was meant to avoid (docs/xla.md,
"Measured reasons").

The fix is data dependence. Each recomputation *root* (a node that depends
on no incoming gradient and on no other gated node) gets one of its inputs
(its smallest floating-point one) through ``where(flag, x, 0)``, where
``flag`` is a ``True`` computed from the last gradient-dependent value the
graph computed before it: the same bits as ``x``, but XLA cannot run the root
before that value exists, and everything computed from the root follows it.
XLA's optimization barrier would be the obvious tool, but the CPU compiler
removes barriers before it schedules, and the order with them. The flag is
``finite * 0 == 0`` with ``finite`` the gate's maximum (0 if that is not
finite), which no gradient makes false and XLA does not fold (``y * 0`` is not
0 for every floating-point ``y``). An addition of ``-0.0`` would do too, but
XLA:CPU flushes denormals to zero in arithmetic, so a copying op downstream
would see a changed value; a select does no arithmetic.

``gates(graph)`` is the pure part: which node waits for which.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx

_TANGENT_PREFIX = "tangents_"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor_value(node: torch.fx.Node) -> Optional[torch.Tensor]:
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) and value.device.type != "cpu" else None


def can_gate_with(node: torch.fx.Node) -> bool:
    """A value a flag can be computed from: a floating-point device tensor known to be
    non-empty (a symbolic size is not known to be)."""
    value = _tensor_value(node)
    if value is None or value.dtype not in _FLOATS:
        return False
    numel = value.numel()
    return isinstance(numel, int) and numel > 0


def _gateable(node: torch.fx.Node) -> bool:
    """A functional op (not a view, not in place) with a floating-point device tensor input."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
        return False
    return any(can_gate_with(i) for i in node.all_input_nodes)


def gates(graph: torch.fx.Graph) -> dict:
    """``{root: gate}``: each recomputation root of a backward graph and the
    gradient-dependent node it must wait for (the last one computed before
    it, in graph order, that a flag can be computed from).

    A graph with no incoming gradients (``tangents_*`` placeholders) is not a
    backward: nothing is gated. A recomputed node that reads a gated node (or
    one that does) is ordered through it; views and in-place ops are not gated
    themselves but pass the question on to their users; nodes before the
    first computed gradient-dependent value are left alone.
    """
    flows: set = set()  # nodes whose value depends on an incoming gradient
    ordered: set = set()  # recomputed nodes that cannot run before some gate
    result: dict = {}
    last_flow: Optional[torch.fx.Node] = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith(_TANGENT_PREFIX):
                flows.add(node)  # an input: available from the start, so no gate itself
            continue
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if any(i in flows for i in inputs):
            flows.add(node)
            last_flow = node if can_gate_with(node) else last_flow
        elif any(i in ordered for i in inputs):
            ordered.add(node)
        elif last_flow is not None and _gateable(node):
            result[node] = last_flow
            ordered.add(node)
    return result


def always_true(gate: torch.Tensor) -> torch.Tensor:
    """A 0-d ``True`` that XLA can compute only once all of ``gate`` is computed.

    From the maximum of the whole tensor, not one element: on a mesh one element
    lives on one device, and XLA gathered the gate to read it (more memory at a sharded
    step's peak); a reduction stays local up to one scalar all-reduce. A maximum that is not finite (an overflowed gradient) counts as
    0, so ``largest * 0 == 0`` holds whatever the gate holds."""
    largest = gate.max()
    finite = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))
    return finite * 0 == 0


def gated_inputs(leaves: list, flag: torch.Tensor) -> list:
    """``leaves`` (a node's flattened arguments) with its smallest floating-point
    XLA tensor ``x`` replaced by ``where(flag, x, 0)``: ``x`` bit for bit (a
    select moves data and does no arithmetic, so denormals and signed zeros pass
    unchanged; a NaN stays NaN), now dependent on the gate."""
    candidates = [
        k for k, v in enumerate(leaves)
        if isinstance(v, torch.Tensor) and v.device.type == "xla" and v.dtype in _FLOATS and v.numel() > 0
    ]
    if not candidates:
        return leaves
    k = min(candidates, key=lambda k: leaves[k].numel())
    out = list(leaves)
    out[k] = torch.where(flag, leaves[k], torch.zeros((), dtype=leaves[k].dtype, device=leaves[k].device))
    return out
