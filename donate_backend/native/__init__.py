"""Native (CUDA/CPU) path: aot_autograd graphs run with a freeing, buffer-reusing backward.

Imports and runs without torch_xla. ``backend.py`` calls ``capture`` on the
dynamo graph, ``compile_graph`` for every forward, backward and inference
graph whose inputs are not XLA tensors, and adds ``aot_options()`` to its
aot_autograd call.

Stages (one module each):

- ``capture``: facts from the dynamo graph (its DDP parameters, the aot options used);
- ``donate_backend.ddp.prepare``: the DDP bucket rewrite (runs first on each aot graph);
- ``donate_backend.analysis.liveness``: last use of every value;
- ``free_saved``: boxed code that frees each saved tensor and tangent at its
  last use;
- ``reuse``: pointwise ops write into buffers that die at them;
- ``offload``: torch's activation offloading in the partitioner (``offload_saved``);
- ``executor``: ATen (generated Python) or Inductor;
- ``compiled``: the callable aot_autograd gets; rebuilds when a switch changes;
- ``compat``: guards around private torch APIs.

See docs/native.md.
"""
from __future__ import annotations

import functools

from .. import budget, config
from .capture import capture
from .compiled import compile_graph


def aot_options() -> dict:
    """Extra aot_autograd options: the partitioner (and Inductor's decompositions when it runs).

    The ATen executor uses the min-cut partitioner, as ``aot_eager`` does: it
    recomputes cheap ops in the backward instead of saving their results, which
    saved 15 to 30% of the forward+backward peak on the HF models. Either
    executor's partitioner runs under the activation budget in force, or
    under a ``memory_limit`` the first budget whose step fits it
    (``budget.partition``), on CUDA each budget with and without the saved
    activations offloaded (``offload.lever``).
    """
    from . import compat

    if config.current().native_compiler == "inductor":
        options = compat.inductor_aot_options()
    else:
        options = compat.aten_aot_options()
    if "partition_fn" in options:
        from . import offload

        from .memory import predict_step

        options["partition_fn"] = functools.partial(
            budget.partition, options["partition_fn"], fit=True, predict_step=predict_step, offload=offload.lever
        )
        if config.current().offload_saved:  # torch's own activation offloading (``offload``)
            options["partition_fn"] = offload.partition_offloading(options["partition_fn"])
    return options


def check_dynamo_graph(gm, example_inputs, graph_id: int) -> None:
    """Nothing to refuse up front (aot_autograd handles aliased inputs correctly here) but
    ``offload_saved`` on a torch that cannot offload activations."""
    if config.current().offload_saved:
        from .offload import check_available

        check_available(graph_id)


def prepare_dynamo_graph(gm) -> None:
    """Nothing to rewrite: aot_autograd traces every call dynamo records here."""


__all__ = ["capture", "compile_graph", "aot_options", "check_dynamo_graph", "prepare_dynamo_graph"]
