"""Which graph inputs are parameters of the DDP module (pure functions).

Dynamo lifts every parameter a graph uses into a placeholder (unless it does not
inline nn modules: the parameters are then attributes of the graph module, which
aot_autograd passes before the placeholders). When DDPOptimizer
splits the graph at bucket boundaries, the example inputs it hands the backend
are fake tensors, but each parameter placeholder still carries the dynamo
``GraphArg`` whose ``example`` is the real ``nn.Parameter``. We identify the
parameter from that, or from the example input itself when it is real.

aot_autograd's backward graph returns one gradient per forward input, in the
forward's input order, so the index of a placeholder is also the index of its
gradient among the backward outputs. At run time the autograd node of the
compiled function has one edge per *tensor* input (SymInt inputs have none),
so a placeholder's edge is its index among the tensor placeholders.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def placeholder_tensors(gm: torch.fx.GraphModule, example_inputs: Sequence) -> list:
    """The real tensor behind each placeholder: GraphArg example, else the example input."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    tensors = []
    for position, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if example is None and position < len(example_inputs):
            example = example_inputs[position]
        tensors.append(example)
    return tensors


def input_param_indices(tensors: Sequence, params: Sequence[torch.Tensor]) -> tuple:
    """For each graph input, the index of the parameter it is in ``params``, else None."""
    by_id = {id(p): i for i, p in enumerate(params)}
    return tuple(by_id.get(id(t)) if isinstance(t, torch.Tensor) else None for t in tensors)


def tensor_edges(example_inputs: Sequence) -> tuple:
    """For each graph input, its index among the tensor inputs (its autograd edge), else None."""
    edges, count = [], 0
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            edges.append(count)
            count += 1
        else:
            edges.append(None)
    return tuple(edges)


def gradient_outputs(output_args: Sequence, param_indices: Sequence[Optional[int]]) -> Optional[list]:
    """Pairs ``(output position, parameter index)`` for the backward outputs that are
    parameter gradients, or None when the output count does not match the inputs
    (aot_autograd deduplicated or merged inputs; we then leave the graph alone)."""
    if len(output_args) != len(param_indices):
        return None
    return [
        (pos, idx)
        for pos, (arg, idx) in enumerate(zip(output_args, param_indices))
        if idx is not None and isinstance(arg, torch.fx.Node)
    ]
