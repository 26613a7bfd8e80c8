"""Native (CUDA/CPU) path. Imports and runs without torch_xla.

Placeholder until the native-path issue lands: runs the FX graph as it is.
"""
from __future__ import annotations

from functorch.compile import make_boxed_func

from .. import report


def aot_options() -> dict:
    return {}


def compile_graph(gm, example_inputs, ctx):
    report.add(
        report.GraphRecord(
            graph_id=ctx.graph_id,
            kind=ctx.kind,
            device=_device_of(example_inputs),
            path="native",
            num_inputs=len(example_inputs),
        )
    )
    return make_boxed_func(gm.forward)


def _device_of(example_inputs) -> str:
    import torch

    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"
