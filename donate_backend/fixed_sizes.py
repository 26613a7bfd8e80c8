"""A dynamo graph traced with symbolic sizes, compiled once per concrete size.

Dynamo traces a function again with symbolic sizes when it sees a second size (its
automatic dynamic shapes: the last, shorter batch of an epoch). A path whose compiler
takes fixed sizes only (``Path.fixed_sizes``: the JAX target) gets such a graph as a
``PerSizes``: at each call, the sizes of its tensors and the values of its integer
arguments pick a compiled step, made at the first call with those sizes by running
aot_autograd on the call's own tensors (it traces them as fake tensors of those sizes,
so every graph below is static). Each is a step of its own to the report and the
memory plan, as a graph that dynamo compiled for each size would be.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def symbolic(example_inputs: Sequence) -> bool:
    """Whether dynamo traced these inputs with a symbolic size or integer."""
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def sizes_key(args: Sequence) -> tuple:
    """What a fixed-size compile depends on beyond the graph: each tensor's sizes, strides
    and dtype, each integer's value."""
    key = []
    for value in args:
        if isinstance(value, torch.Tensor):
            key.append((tuple(value.shape), tuple(value.stride()), value.dtype, value.device))
        elif isinstance(value, (int, float, bool)):
            key.append(value)
        else:
            key.append(type(value))
    return tuple(key)


class PerSizes:
    """The callable dynamo runs for a graph with symbolic sizes (module docstring).
    ``compile_for(args)`` compiles the graph for the sizes of ``args`` and returns the
    callable to run them with."""

    def __init__(self, name: str, compile_for: Callable) -> None:
        self.name = name
        self._compile_for = torch.compiler.disable(compile_for)
        self._compiled: dict = {}

    def __call__(self, *args):
        key = sizes_key(args)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile_for(list(args))
        return compiled(*args)

    def sizes(self) -> list:
        """The sizes compiled so far (each a ``sizes_key``)."""
        return list(self._compiled)
