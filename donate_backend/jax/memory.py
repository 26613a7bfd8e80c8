"""The JAX target's memory estimator: each executable's memory from XLA's own buffer assignment.

``Compiled.memory_analysis()`` gives what XLA assigned to one executable: its
arguments, outputs, the outputs that reuse a donated argument's buffer (aliases) and
its temporaries. ``graph_memory`` turns that into the ``GraphMemory`` the planner
composes (``planner.memory_plan``), relative to the level at the call:

- while it runs, its temporaries and the outputs that reuse no donated buffer are
  live above its arguments (``stages.MemoryAnalysis.peak_bytes``);
- once it returns, its outputs stay: a forward's outputs the caller's and the
  activations it saves for the backward, a backward's gradients; a new value written
  into an input replaces the old one (in its buffer where it was donated); a backward
  lets go of its saved activations and tangents.

Nothing here models XLA: the figures are XLA's, so the same code holds on CPU, GPU
and TPU. ``predict_step`` compiles a candidate partition's forward and backward from
their shapes to plan an activation budget under a memory limit.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import graph_memory
from ..graph_memory import ACTIVATIONS, GRADIENTS, INPUTS, TEMPORARIES, GraphMemory


def tensor_bytes(value: torch.Tensor) -> int:
    """Bytes an array of ``value`` takes on the device, for the step's plan."""
    return graph_memory.dense_bytes(value)


def workspace_bytes(call) -> int:
    """XLA executables' scratch is in their temporaries: nothing apart."""
    return 0


def _value_bytes(node) -> int:
    return sum(graph_memory.dense_bytes(v) for v in graph_memory.node_tensors(node)) if node is not None else 0


def graph_memory_of(program, analysis, name: str, kind: str, forward_returns: Optional[int] = None) -> GraphMemory:
    """A ``GraphMemory`` from XLA's buffer assignment of ``program``'s executable (module docstring)."""
    output = program.gm.graph.output_node()
    values = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    parts: Dict[str, int] = {}
    seen = set()
    for index, value in enumerate(values):
        if not isinstance(value, torch.fx.Node) or value in seen:
            continue
        seen.add(value)
        if value.op == "placeholder":  # an input returned as it is: its buffer, not a new one
            continue
        category = graph_memory.output_category(kind, index, forward_returns)
        parts[category] = parts.get(category, 0) + _value_bytes(value)
    outputs = sum(parts.values())
    peak_parts = dict(parts)
    temporaries = max(0, analysis.peak_bytes - outputs)
    if temporaries:
        peak_parts[TEMPORARIES] = temporaries
    end_parts = dict(parts)
    placeholders = program.placeholders
    tangent_bytes = released = 0
    if kind == "backward":
        for node in placeholders:
            size = _value_bytes(node)
            if node.name.startswith("tangents"):
                tangent_bytes += size
                end_parts[GRADIENTS] = end_parts.get(GRADIENTS, 0) - size
            elif not node.name.startswith("primals"):
                end_parts[ACTIVATIONS] = end_parts.get(ACTIVATIONS, 0) - size
                released += size
    return GraphMemory(
        name=name,
        kind=kind,
        peak_bytes=outputs + temporaries,
        end_bytes=sum(end_parts.values()),
        peak_parts=tuple(sorted((c, b) for c, b in peak_parts.items() if b)),
        end_parts=tuple(sorted((c, b) for c, b in end_parts.items() if b)),
        peak_node="(XLA's buffer assignment)",
        released_input_bytes=released,
        tangent_bytes=tangent_bytes,
        passed_grad_bytes=0,
        tangent_indices=tuple(i for i, n in enumerate(placeholders) if n.name.startswith("tangents")),
        largest_output_bytes=max((_value_bytes(v) for v in values if isinstance(v, torch.fx.Node)), default=0),
    )


def predict_step(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule,
                 forward_returns: Optional[int] = None):
    """A candidate partition's step peak (bytes) and its parts (``budget``, under a memory
    limit): its forward and backward compiled from their shapes, each executable's memory
    XLA's; the forward's inputs resident, its outputs held through the backward."""
    from .compiler import compile_abstractly

    resident = sum(_value_bytes(n) for n in fw_module.graph.find_nodes(op="placeholder"))
    forward = compile_abstractly(fw_module, "forward", forward_returns)
    backward = compile_abstractly(bw_module, "backward", None)
    parts: Dict[str, int] = {INPUTS: resident}
    in_backward = forward.end_bytes + backward.tangent_bytes + backward.peak_bytes
    if forward.peak_bytes >= in_backward:
        for category, size in forward.peak_parts:
            parts[category] = parts.get(category, 0) + size
        return resident + forward.peak_bytes, parts
    for category, size in forward.end_parts + backward.peak_parts + ((GRADIENTS, backward.tangent_bytes),):
        parts[category] = parts.get(category, 0) + size
    return resident + in_backward, parts


def plan_notes(facts) -> list:
    """What a memory plan of a JAX step cannot see (``planner.PlanFacts``), as sentences."""
    notes = [
        "JAX: each executable's memory is XLA's own buffer assignment (Compiled.memory_analysis); "
        "what JAX's runtime holds beside it (its caches, a host allocator's slack) is not counted"
    ]
    if facts.forwards > 1:
        notes.append(
            f"the step's forward runs {facts.forwards} compiled graphs (graph breaks): the code between "
            "them runs op by op on the JAX device: what it passes to a graph and what its autograd saves "
            f"for the backward are counted ({facts.eager_bytes / 1024:.1f} KiB), its other allocations are not"
        )
    return notes
