"""The host part of a graph: values computed on the CPU from host inputs only.

An optimizer keeps its step counters on the CPU (``torch.tensor(0.)``) and the
compiled step increments them. Computed on a device (XLA, JAX), each new count
has to come back with ``.cpu()``: a wait for the device on every call. But a value
that depends only on host inputs (``step + 1``) can be computed on the host, by
the same ATen ops, in microseconds: ``host_part`` finds those values among the
graph's write-backs and outputs and builds a small FX graph for them. The
device's executable still reads the host inputs it needs (uploaded with the
call); it just no longer returns these values.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.fx

_COPY = torch.ops.aten.copy_.default


def _is_host_value(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cpu"


def _is_pure(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class HostPart:
    """A boxed-free callable ``fn(*host inputs) -> tuple`` and where its values go."""

    gm: torch.fx.GraphModule
    inputs: tuple  # graph input indices fed to ``gm``, in order
    writebacks: tuple  # (graph input index, position in gm's result)
    outputs: tuple  # (graph output position, position in gm's result)

    def __call__(self, args: Sequence) -> tuple:
        with torch.no_grad():
            return tuple(self.gm(*[args[i] for i in self.inputs]))


def host_part(gm: torch.fx.GraphModule, host_inputs: Sequence[int]) -> Optional[HostPart]:
    """The write-backs and outputs of ``gm`` computable on the host, or None."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    host_input_set = set(host_inputs)
    host = {placeholders[i] for i in host_input_set if i < len(placeholders)}
    for node in gm.graph.nodes:
        if (
            node.op == "call_function"
            and node.target is not _COPY
            and _is_pure(node)
            and _is_host_value(node)
            and all(arg in host for arg in node.all_input_nodes)
        ):
            host.add(node)
    index_of = {node: i for i, node in enumerate(placeholders)}
    writebacks = [
        (index_of[n.args[0]], n.args[1])
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is _COPY and n.args[0] in index_of
        and index_of[n.args[0]] in host_input_set and n.args[1] in host and n.args[1] not in index_of
    ]
    output = gm.graph.output_node().args[0]
    output_values = list(output) if isinstance(output, (tuple, list)) else [output]
    outputs = [
        (pos, v) for pos, v in enumerate(output_values)
        if isinstance(v, torch.fx.Node) and v in host and v not in index_of
    ]
    if not writebacks and not outputs:
        return None
    return _build(gm, placeholders, host, host_input_set, writebacks, outputs)


def _build(gm, placeholders, host, host_input_set, writebacks, outputs) -> HostPart:
    graph = torch.fx.Graph()
    env: dict = {}
    inputs = []
    for i, node in enumerate(placeholders):
        if i in host_input_set:
            env[node] = graph.placeholder(node.name)
            inputs.append(i)
    for node in gm.graph.nodes:
        if node in host and node.op == "call_function":
            env[node] = graph.node_copy(node, lambda n: env[n])
    values = [v for _, v in writebacks] + [v for _, v in outputs]
    graph.output(tuple(env[v] for v in values))
    part = torch.fx.GraphModule(torch.nn.Module(), graph)
    return HostPart(
        gm=part,
        inputs=tuple(inputs),
        writebacks=tuple((i, k) for k, (i, _) in enumerate(writebacks)),
        outputs=tuple((pos, len(writebacks) + k) for k, (pos, _) in enumerate(outputs)),
    )
