"""Per-DDP-module state: the reducer's bucket slots, learned from the comm hook.

We do not allocate buckets of our own: DDP's reducer already holds one flat
buffer per bucket (in DDP's bucket order and size cap), and a second set would
double the gradient memory. Our comm hook sees each bucket's real buffer and
its per-parameter views; we remember those views ("slots") and the compiled
backward writes the next step's gradients straight into them.

After DDP rebuilds its buckets (once, before the second step's forward), the
remembered slots point into the old buffers; ``slot`` drops them and the hook
learns the new ones at the end of that step.

``WriteCounts`` are kept per module across states (a module gets a new state
each time our hook is installed on a new reducer).
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Optional

import torch

from . import compat


@dataclasses.dataclass
class WriteCounts:
    """What the compiled backwards and our hook did for one DDP module (for tests and reports)."""

    slot_writes: int = 0  # gradients the compiled backward wrote into slots
    out_writes: int = 0  # of those, computed straight into the slot (mm out=)
    buckets_reduced: int = 0  # buckets our hook has all-reduced


class DDPBucketState:
    """What the backend knows about one DDP module's buckets (while our hook is on its reducer)."""

    def __init__(self, ddp_module, params, counts: WriteCounts):
        self._ddp = weakref.ref(ddp_module)
        self.process_group = ddp_module.process_group
        self.world_size = self.process_group.size()
        self.params = list(params)
        self._index_by_id = {id(p): i for i, p in enumerate(self.params)}
        self._slots: dict[int, torch.Tensor] = {}
        self._learned_with_rebuilt: Optional[bool] = None
        self._lock = threading.Lock()
        self.counts = counts

    def _rebuilt_flag(self) -> Optional[bool]:
        ddp = self._ddp()
        return None if ddp is None else compat.has_rebuilt_buckets(ddp)

    def learn(self, bucket) -> None:
        """Remember the slots of one ready bucket (called from the comm hook)."""
        buffer = bucket.buffer()
        storage_ptr = buffer.untyped_storage().data_ptr()
        with self._lock:
            self._learned_with_rebuilt = self._rebuilt_flag()
            for param, view in zip(bucket.parameters(), bucket.gradients()):
                index = self._index_by_id.get(id(param))
                if index is None:
                    continue
                usable = (
                    view.untyped_storage().data_ptr() == storage_ptr
                    and view.shape == param.shape
                    and view.dtype == param.dtype
                    and view.stride() == param.stride()
                )
                if usable:
                    self._slots[index] = view
                else:
                    self._slots.pop(index, None)

    def index_of(self, tensor) -> Optional[int]:
        """The index of ``tensor`` among this module's parameters, or None."""
        index = self._index_by_id.get(id(tensor))
        return index if index is not None and self.params[index] is tensor else None

    def slot(self, index: int) -> Optional[torch.Tensor]:
        """The current slot of parameter ``index``, or None (not learned, or stale)."""
        with self._lock:
            flag = self._rebuilt_flag()
            if self._slots and (flag is None or self._learned_with_rebuilt != flag):
                # DDP rebuilt its buckets since we learned (or we cannot tell):
                # our views are stale.
                self._slots.clear()
            return self._slots.get(index)

    def slot_count(self) -> int:
        with self._lock:
            return len(self._slots)
