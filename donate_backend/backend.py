"""The ``donate_xla`` dynamo backend: aot_autograd, then route each graph by device.

Dynamo hands us an FX graph. aot_autograd turns it into functional forward,
backward or inference graphs (input mutations kept in the graph as ``copy_``),
and each of those is compiled by the path that owns its device: XLA graphs by
``donate_backend.xla``, CUDA/CPU graphs by ``donate_backend.native``.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Sequence

import torch
from torch._dynamo.backends.common import aot_autograd

from .analysis.mutation import dynamo_input_roles

_graph_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class GraphContext:
    """What a path compiler knows about the graph besides the graph itself."""

    graph_id: int
    kind: str  # "forward", "backward" or "inference"
    input_roles: tuple = ()  # one role per dynamo input (see analysis.mutation)
    # DDP (issue 5): a ``ddp.DDPGraphInfo`` when dynamo traced this graph inside a
    # DistributedDataParallel forward (which inputs are its parameters), else None.
    ddp: object = None

    @property
    def name(self) -> str:
        return f"graph {self.graph_id} {self.kind}"


def graph_device_type(example_inputs: Sequence) -> str:
    """``"xla"`` if any tensor input lives on an XLA device, else ``"native"``."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "xla":
            return "xla"
    return "native"


def _path_module(device_type: str):
    if device_type == "xla":
        from . import xla as path
    else:
        from . import native as path
    return path


def _kind_compiler(
    path_compile: Callable, graph_id: int, roles: tuple, kind: str, ddp=None
) -> Callable:
    def compile_one(gm: torch.fx.GraphModule, example_inputs):
        return path_compile(gm, list(example_inputs), GraphContext(graph_id, kind, roles, ddp))

    return compile_one


def donate_xla(gm: torch.fx.GraphModule, example_inputs, **_options):
    """Dynamo backend entry point (registered as ``"donate_xla"``)."""
    graph_id = next(_graph_ids)
    device_type = graph_device_type(example_inputs)
    path = _path_module(device_type)
    path.check_dynamo_graph(gm, example_inputs, graph_id)
    roles = dynamo_input_roles(gm, example_inputs)
    # DDP (issue 5): which inputs are the parameters of the DDP module being traced;
    # must run here, inside the DDP forward, before aot_autograd.
    ddp_info = None
    if device_type == "native":
        from . import ddp

        ddp_info = ddp.capture(gm, example_inputs)
    make = functools.partial(_kind_compiler, path.compile_graph, graph_id, roles, ddp=ddp_info)
    aot_options = dict(
        fw_compiler=make("forward"),
        bw_compiler=make("backward"),
        inference_compiler=make("inference"),
        keep_inference_input_mutations=True,
    )
    aot_options.update(path.aot_options())
    return aot_autograd(**aot_options)(gm, example_inputs)
