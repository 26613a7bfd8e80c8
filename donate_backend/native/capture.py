"""What the native path learns from the dynamo graph, before aot_autograd runs.

``backend.donate_xla`` calls ``capture`` once per dynamo graph; the result
reaches every compiler of that graph as ``GraphContext.captured``:

- ``ddp``: for a graph traced inside a ``DistributedDataParallel`` forward,
  which inputs are its parameters (``ddp.DDPGraphInfo``), else None;
- ``aot_compiler``: the executor whose aot_autograd options (decompositions,
  partitioner) produced the graphs. A graph built later for the other
  executor (a switch flipped after capture) needs what those options would
  have done (``executor``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .. import config, ddp


@dataclasses.dataclass(frozen=True)
class NativeCapture:
    ddp: Optional[ddp.DDPGraphInfo]
    aot_compiler: str  # "aten" or "inductor": config.native_compiler at capture


def capture(gm, example_inputs) -> NativeCapture:
    return NativeCapture(ddp.capture(gm, example_inputs), config.current().native_compiler)
