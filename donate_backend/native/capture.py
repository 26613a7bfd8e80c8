"""What the native path learns from the dynamo graph, before aot_autograd runs.

``backend.donate_xla`` calls ``capture`` once per dynamo graph; the result
reaches every compiler of that graph as ``GraphContext.captured``:

- ``ddp``: for a graph traced inside a ``DistributedDataParallel`` forward,
  which inputs are its parameters (``ddp.DDPGraphInfo``), else None;
- ``aot_compiler``: the executor whose aot_autograd options (decompositions,
  partitioner) produced the graphs. A graph built later for the other
  executor (a switch flipped after capture) needs what those options would
  have done (``executor``);
- ``input_storages``: for each aot_autograd flat input (the dynamo module's
  attributes, then its placeholders), the identity and size of the storage
  behind it, from the real tensors dynamo passes. The memory plan counts a
  parameter read by two graphs once.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .. import config, ddp
from ..analysis.aliasing import storage_address
from ..analysis.mutation import graph_attributes
from . import memory


@dataclasses.dataclass(frozen=True)
class InputStorage:
    storage: Tuple[str, int]  # ``storage_address``: one storage, while it lives
    nbytes: int


@dataclasses.dataclass(frozen=True)
class NativeCapture:
    ddp: Optional[ddp.DDPGraphInfo]
    aot_compiler: str  # "aten" or "inductor": config.native_compiler at capture
    input_storages: Tuple[Optional[InputStorage], ...] = ()  # None: not a tensor


def _storage_of(value) -> Optional[InputStorage]:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return None
    address = storage_address(value)
    return None if address is None else InputStorage(address, memory.nbytes(value))


def input_storages(args, captured: Optional[NativeCapture]) -> frozenset:
    """The storage identities of a call's inputs: ``args`` and the module attributes
    ``captured`` saw."""
    known = getattr(captured, "input_storages", ())
    return frozenset(s.storage for s in (*known, *map(_storage_of, args)) if s is not None)


def returned_storages(inputs: frozenset, outputs) -> frozenset:
    """The storage identities (as in ``input_storages``) of the tensors a graph returned
    that are not its ``inputs``' storages: a later graph reading one reads a value of
    the step, not a tensor held between steps."""
    return frozenset(
        s.storage for s in map(_storage_of, outputs) if s is not None and s.storage not in inputs
    )


def capture(gm, example_inputs) -> NativeCapture:
    flat = [tensor for _, tensor, _ in graph_attributes(gm)] + list(example_inputs)
    return NativeCapture(
        ddp.capture(gm, example_inputs),
        config.current().native_compiler,
        tuple(_storage_of(v) for v in flat),
    )
