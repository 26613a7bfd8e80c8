"""Native (CUDA/CPU) path: aot_autograd graphs run with a freeing, buffer-reusing backward.

Imports and runs without torch_xla. ``backend.py`` calls ``compile_graph``
for every forward, backward and inference graph whose inputs are not XLA
tensors, and adds ``aot_options()`` to its aot_autograd call.

Stages (one module each):

- ``donate_backend.ddp.prepare``: the DDP bucket rewrite (runs first);
- ``donate_backend.analysis.liveness``: last use of every value;
- ``free_saved``: boxed code that frees each saved tensor and tangent at its
  last use;
- ``reuse``: pointwise ops write into buffers that die at them;
- ``executor``: ATen (generated Python) or Inductor;
- ``compiled``: the callable aot_autograd gets; rebuilds when a switch changes;
- ``compat``: guards around private torch APIs.

See docs/native.md.
"""
from __future__ import annotations

from .. import config
from .compiled import compile_graph


def aot_options() -> dict:
    """Extra aot_autograd options: Inductor's decompositions and partitioner when it runs."""
    if config.current().native_compiler == "inductor":
        from . import compat

        return compat.inductor_aot_options()
    return {}


def check_dynamo_graph(gm, example_inputs, graph_id: int) -> None:
    """Nothing to refuse up front: aot_autograd handles aliased inputs correctly here."""


__all__ = ["compile_graph", "aot_options", "check_dynamo_graph"]
