"""One executable per signature of the arguments: dynamic shapes and SPMD.

A symbolic graph (dynamic shapes) or one whose HLO parameters must carry their
inputs' shardings (SPMD) is lowered only when a call brings a new signature;
``PerSignatureExecutable`` keeps one ``runtime.XlaExecutable`` per signature.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch_xla

from . import compat
from .runtime import XlaExecutable, materialized_device_args
from .spmd import sharding_signature


def shape_signature(args: Sequence) -> tuple:
    """The concrete shapes and dtypes of the tensor arguments, and the values of the
    integer ones (dynamic sizes)."""
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a if isinstance(a, int) else None
        for a in args
    )


class PerSignatureExecutable:
    """One ``XlaExecutable`` per signature of the arguments, lowered at the first
    call that brings it:

    - dynamic shapes: the graph is symbolic; each concrete combination of input
      shapes (and dynamic sizes) gets a static executable;
    - SPMD: HLO parameters must carry their inputs' shardings, which only the
      real tensors know; ``context`` (called at each call) adds what else the
      executable depends on that the arguments do not show (a backward's
      gradient layouts: the shardings of the parameters this call is for).
    """

    _boxed_call = True

    def __init__(
        self,
        graph_name: str,
        make: Callable[[list, list], XlaExecutable],
        by_shape: bool,
        by_sharding: bool,
        context: Optional[Callable[[], tuple]] = None,
    ):
        self.graph_name = graph_name
        self._make = make  # (args, device args) -> XlaExecutable
        self._by_shape = by_shape
        self._by_sharding = by_sharding
        self._context = context
        self.device = torch_xla.device()
        self.by_signature: dict = {}

    def __call__(self, args: list):
        args = list(args)
        device_args = materialized_device_args(args, self.device)
        signature = (
            shape_signature(args) if self._by_shape else (),
            sharding_signature(device_args) if self._by_sharding else (),
            self._context() if self._context is not None else (),
        )
        executable = self.by_signature.get(signature)
        if executable is None:
            # SPMD keeps a new tensor's data on the host until it is used: upload it
            # now, as the run would, so that lowering itself moves nothing
            compat.sync([a for a in device_args if isinstance(a, torch.Tensor)], wait=False)
            if self._by_sharding:  # lowering reads the real buffers' handles: they must exist
                compat.wait_device_ops()
            executable = self.by_signature[signature] = self._make(args, device_args)
        return executable.run(args, device_args)
