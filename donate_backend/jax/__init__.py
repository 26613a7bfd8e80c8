"""The JAX lowering target: XLA from current torch, without torch_xla (needs jax, torch >= 2.15).

Tensors on ``donate_backend.jax_device()`` hold JAX arrays (``device.py``; eager ops
through the same lowerings, ``eager.py``). A graph whose inputs are on that device is
compiled here (``paths.JaxPath``):

- ``aot_options``: torch's decompositions to the ATen ops the lowering table covers
  (``lowerings.decompositions``), and the min-cut partitioner under the activation
  budget (``budget.partition``, each candidate's step predicted from XLA's buffer
  assignment of its executables, ``memory.predict_step``);
- ``compile_graph``: the graph interpreted into a JAX function, its overwritten inputs
  donated, lowered from shapes alone and compiled (``compiler.py``, stages in
  ``stages.py``), run by ``runtime.JaxExecutable``.

See docs/jax.md.
"""
from __future__ import annotations

import functools

from .. import budget, torch_compat
from ..analysis.aliasing import overlapping_inputs_written
from ..errors import UnsupportedGraphError
from .device import jax_device


def aot_options() -> dict:
    from . import lowerings
    from .memory import predict_step

    options = {"decompositions": lowerings.decompositions()}
    min_cut = torch_compat.min_cut_partition()
    if min_cut is not None:
        options["partition_fn"] = functools.partial(budget.partition, min_cut, fit=True, predict_step=predict_step)
    return options


def check_dynamo_graph(gm, example_inputs, graph_id: int) -> None:
    """Refuse a graph that writes into one of two overlapping views of one input: each view is
    an input of its own to the executable, and a write through one would not reach the other."""
    for first, second in overlapping_inputs_written(gm):
        raise UnsupportedGraphError(
            f"graph {graph_id}: inputs #{first} and #{second} are views of one tensor on the JAX device "
            "and the graph writes to them in place. Pass the base tensor and slice it inside the compiled "
            "function, or .clone() one of the views before the call.",
            help_section="The JAX target",
        )


def prepare_dynamo_graph(gm) -> None:
    """Nothing to rewrite: aot_autograd traces every call dynamo records here."""


def capture(gm, example_inputs):
    return None


def compile_graph(gm, example_inputs, ctx):
    from .compiler import compile_graph as compile_one

    return compile_one(gm, example_inputs, ctx)


__all__ = ["aot_options", "capture", "check_dynamo_graph", "compile_graph", "jax_device", "prepare_dynamo_graph"]
