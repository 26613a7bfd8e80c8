"""Which graph inputs a functional FX graph overwrites, and what they are.

aot_autograd keeps input mutations in the graph as a ``copy_`` epilogue
(``keep_inference_input_mutations=True``): ``aten.copy_(primal, new_value)``.
An input written that way has a dead old value once the graph returns, so its
buffer is a donation candidate. Pure functions over the graph; no device work.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import torch
import torch.fx

ROLES = ("parameter", "gradient", "optimizer_state", "buffer", "other")

_COPY_TARGETS = (torch.ops.aten.copy_.default,)


def mutated_input_indices(graph: torch.fx.Graph) -> list[int]:
    """Indices of inputs that the graph overwrites with ``copy_`` (sorted)."""
    index_of = {node: i for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    mutated = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _COPY_TARGETS and node.args[0] in index_of:
            mutated.add(index_of[node.args[0]])
        elif _is_inplace_on_input(node, index_of):
            mutated.add(index_of[node.args[0]])
    return sorted(mutated)


def _is_donation_request(target) -> bool:
    """torch_xla's ``torch.ops.xla.dynamo_set_buffer_donor_`` (packet or overload)."""
    return "xla.dynamo_set_buffer_donor_" in str(target)


def donation_requests(gm: torch.fx.GraphModule) -> list[int]:
    """aot_autograd input indices the user asked to donate, in dynamo's graph:
    ``torch.ops.xla.dynamo_set_buffer_donor_(input, True)``.

    aot_autograd's flat inputs are the module's parameters and buffers (when
    dynamo kept them as attributes), then the placeholders.
    """
    offset = len(list(gm.named_parameters(remove_duplicate=False))) + len(
        list(gm.named_buffers(remove_duplicate=False))
    )
    index_of = {node: offset + i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    requested = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _is_donation_request(node.target) or not node.args:
            continue
        donate = node.args[1] if len(node.args) > 1 else next(iter(node.kwargs.values()), True)
        if node.args[0] in index_of and donate is True:
            requested.add(index_of[node.args[0]])
    return sorted(requested)


def strip_donation_requests(gm: torch.fx.GraphModule) -> int:
    """Replace each ``dynamo_set_buffer_donor_(x, flag)`` by ``x`` (in place).

    The request was read from dynamo's graph (``donation_requests``); left in
    the aot graph, the op's result would hide that outputs alias ``x``.
    """
    stripped = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and _is_donation_request(node.target) and node.args:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            stripped += 1
    if stripped:
        gm.recompile()
    return stripped


def _is_inplace_on_input(node: torch.fx.Node, index_of: dict) -> bool:
    """Any other ATen op that writes its first argument (``foo_`` or ``out=``)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args:
        return False
    if node.args[0] not in index_of:
        return False
    schema = target._schema
    return bool(schema.arguments) and schema.arguments[0].is_write


# An optimizer's ``state`` attribute (``L['self'].state[...]``, or dynamo's flattened
# ``self___state_...``) or a state entry's key; not a name that merely contains "state"
# (``L['hidden_states']``, the activations a graph break passes on in HF models).
_OPTIMIZER_STATE = re.compile(r"\.state\b|___state|momentum_buffer|exp_avg|'step'")


def input_role(source_name: Optional[str], is_parameter: bool) -> str:
    """Classify a dynamo input by its source name (e.g. ``L['self']...weight``)."""
    if is_parameter:
        return "parameter"
    if not source_name:
        return "other"
    name = source_name
    if name.endswith(".grad") or re.search(r"\.grad\b", name):
        return "gradient"
    if _OPTIMIZER_STATE.search(name):
        return "optimizer_state"
    if "_buffers" in name or re.search(r"running_(mean|var)|num_batches_tracked", name):
        return "buffer"
    if "_parameters" in name:
        return "parameter"
    return "other"


def _source_name(source) -> Optional[str]:
    """``Source.name`` is a method on torch 2.9 and a property on newer releases."""
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name


def graph_attributes(gm: torch.fx.GraphModule) -> list:
    """``(name, tensor, is_parameter)`` for the dynamo module's parameters, then its
    buffers: the inputs aot_autograd puts before the placeholders among its flat
    inputs. Dynamo leaves tensors as module attributes when it does not inline nn
    modules (``torch._dynamo.config.inline_inbuilt_nn_modules=False``) and for
    optimizer state it makes attributes; otherwise there are none."""
    return [(name, p, True) for name, p in gm.named_parameters(remove_duplicate=False)] + [
        (name, b, False) for name, b in gm.named_buffers(remove_duplicate=False)
    ]


def dynamo_input_roles(gm: torch.fx.GraphModule, example_inputs: Sequence) -> tuple[str, ...]:
    """One role per aot_autograd flat input, from the names dynamo recorded: the
    graph's attributes (``graph_attributes``), then the placeholders."""
    roles = [input_role(name, is_parameter) for name, _, is_parameter in graph_attributes(gm)]
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        source_name = _source_name(source)
        roles.append(input_role(source_name, isinstance(value, torch.nn.Parameter)))
    return tuple(roles)
