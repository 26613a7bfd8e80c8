"""What a lowering target is: the ``Path`` protocol ``backend.py`` dispatches every graph through.

A path owns the graphs whose tensors live on its devices, from dynamo's graph to the
callable aot_autograd runs. Its stages, in the order the backend calls them:

1. ``claims(gm, example_inputs)``: route: is this graph on one of my devices?
2. ``check_available`` / ``check_dynamo_graph``: refuse early, before anything is traced
   (a missing dependency, a graph the path would compute wrongly);
3. ``prepare_dynamo_graph`` and ``capture``: rewrite dynamo's graph in place where
   aot_autograd cannot trace it for this device, and learn what only dynamo's graph tells
   (handed to the compilers as ``GraphContext.captured``);
4. ``aot_options``: what the path asks of aot_autograd (its partitioner, decompositions);
5. ``compile_graph(gm, example_inputs, ctx)``: lower and compile one functional aot
   graph; the callable it returns runs the graph and notes, per call, what the memory
   plan needs (``report.GraphRecord``, its ``memory`` the path's own estimate of the
   graph's allocations, ``graph_memory.GraphMemory``);
6. the step's levers, once it has run (``choice``): ``levers`` names the path's policy
   (None: no lever is chosen per step).

The paths: ``NativePath`` (CUDA and CPU tensors, ``donate_backend.native``),
``XlaPath`` (torch_xla, ``donate_backend.xla``) and ``JaxPath`` (tensors on
``donate_backend.jax_device()``, ``donate_backend.jax``). Each adapter here imports its
package only when a graph needs it, so that ``import donate_backend`` needs torch alone.
"""
from __future__ import annotations

import abc
import functools
from typing import Sequence

import torch

from .errors import DonateXlaError


def _tensors(example_inputs: Sequence):
    # compiled autograd passes its tensors in a list
    return [v for v in torch.utils._pytree.tree_leaves(list(example_inputs)) if isinstance(v, torch.Tensor)]


class Path(abc.ABC):
    """One lowering target (module docstring). ``name`` is the records' ``path``."""

    name: str = ""
    # Whether the path compiles fixed sizes only: a graph dynamo traced with symbolic sizes is
    # then compiled once per concrete size (``fixed_sizes.PerSizes``)
    fixed_sizes: bool = False

    @abc.abstractmethod
    def claims(self, gm, example_inputs: Sequence) -> bool:
        """Whether dynamo's graph ``gm``, with these inputs, runs on this path."""

    def check_available(self, graph_id: int, example_inputs: Sequence) -> None:
        """Raise ``DonateXlaError`` where what the path needs is not installed."""

    @abc.abstractmethod
    def package(self):
        """The module that implements the path's stages (imported on first use)."""

    def check_dynamo_graph(self, gm, example_inputs, graph_id: int) -> None:
        self.package().check_dynamo_graph(gm, example_inputs, graph_id)

    def prepare_dynamo_graph(self, gm) -> None:
        self.package().prepare_dynamo_graph(gm)

    def capture(self, gm, example_inputs):
        return self.package().capture(gm, example_inputs)

    def aot_options(self) -> dict:
        return self.package().aot_options()

    def compile_graph(self, gm, example_inputs, ctx):
        return self.package().compile_graph(gm, example_inputs, ctx)

    def levers(self):
        """The path's per-step lever policy (an object with ``chosen_by_default``,
        ``choose``, ``plain``, ``wait_for_device``, ``fit``, ``refusal_hint`` and
        ``plan_notes``), or None where nothing is chosen once a step has run."""
        return None



class NativePath(Path):
    """CUDA and CPU tensors: the freeing, buffer-reusing backward (``donate_backend.native``)."""

    name = "native"

    def claims(self, gm, example_inputs) -> bool:
        return True  # whatever no other path claims

    def package(self):
        from . import native

        return native



class XlaPath(Path):
    """torch_xla tensors: abstract lowering with donation (``donate_backend.xla``)."""

    name = "xla"

    def claims(self, gm, example_inputs) -> bool:
        return any(t.device.type == "xla" for t in _tensors(example_inputs))

    def check_available(self, graph_id: int, example_inputs) -> None:
        try:
            import torch_xla  # noqa: F401  (the XLA path needs it; the native path does not)
        except ImportError as error:
            index, tensor = next((i, t) for i, t in enumerate(_tensors(example_inputs)) if t.device.type == "xla")
            raise DonateXlaError(
                f"donate_xla: graph {graph_id} has an input on an XLA device (input {index}, "
                f"shape {tuple(tensor.shape)}, device {tensor.device}), but torch_xla is not installed. "
                "The XLA path needs the xla extra: pip install 'donate_backend[xla]' "
                "(torch==2.9.0 and torch_xla==2.9.0). CUDA and CPU tensors need no torch_xla; on current "
                "torch, XLA runs through JAX: donate_backend.jax_device() (docs/jax.md).",
                help_section="Refused before anything runs",
            ) from error

    def package(self):
        from . import xla

        return xla

    def levers(self):
        from .xla import levers

        return levers



class JaxPath(Path):
    """Tensors on ``donate_backend.jax_device()``: graphs lowered to JAX (``donate_backend.jax``)."""

    name = "jax"
    fixed_sizes = True

    def claims(self, gm, example_inputs) -> bool:
        """Its inputs on the JAX device, or, for a graph that reads no tensor of it, the
        tensors it makes (``torch.arange(..., device=x.device)`` after a graph break)."""
        if any(t.device.type == "jax" for t in _tensors(example_inputs)):
            return True
        made = (node.meta.get("example_value") for node in gm.graph.nodes if node.op == "call_function")
        return any(t.device.type == "jax" for t in _tensors(made))

    def check_available(self, graph_id: int, example_inputs) -> None:
        from .jax import device

        device.start()  # refuses, with what to do, where torch or JAX cannot serve it

    def package(self):
        from . import jax

        return jax


@functools.lru_cache(maxsize=None)
def paths() -> tuple:
    """Every path, in the order they are asked to claim a graph (the native path last)."""
    return (JaxPath(), XlaPath(), NativePath())


def path_for(gm, example_inputs: Sequence, graph_id: int) -> Path:
    """The path that claims dynamo's graph ``gm`` with ``example_inputs``, checked to be available."""
    path = next(p for p in paths() if p.claims(gm, example_inputs))
    path.check_available(graph_id, example_inputs)
    return path


def named(name: str) -> Path:
    """The path whose records say ``path == name``."""
    return next(p for p in paths() if p.name == name)
