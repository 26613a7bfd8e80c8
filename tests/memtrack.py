"""Memory tracking for the native-path tests and benchmark (DESIGN §4).

Two independent measures, to cross-check one another:

- ``StorageTracker``: a ``TorchDispatchMode`` that records the storage of
  every tensor an ATen op returns (``StorageWeakRef``) and, around every op,
  drops the storages that died. Results that share an input's storage
  (views, in-place and ``out=`` ops) are not new. ``live_bytes`` is the sum of live tracked
  storages; ``peak_bytes`` its maximum, taken right after each op (when the
  op's output and all its inputs are alive). It sets
  ``ignore_compile_internals()`` so dynamo still compiles while it is active
  and the compiled code's ops are tracked at run time. It cannot see buffers
  that are allocated outside the dispatcher (Inductor's CPU kernels).
  ``probe(fn)`` runs ``fn(tracker, op_name)`` after every op, for tests that
  check a storage is already dead at some point of the backward.
- ``profiler_peak_bytes(fn)``: runs ``fn`` under
  ``torch.profiler.profile(profile_memory=True)`` and returns the peak of the
  running sum of the allocator's ``[memory]`` events (every CPU allocation
  and free in c10, Inductor's included), above the level at the start.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_ref(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages made by ATen ops while the mode is active."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self._live: Dict[StorageWeakRef, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.ops: List[str] = []
        self.made: List[tuple] = []  # (op name, StorageWeakRef) of each new storage
        self._probes: List[Callable] = []

    def probe(self, fn: Callable[["StorageTracker", str], None]) -> None:
        """Call ``fn(tracker, op_name)`` after every tracked op."""
        self._probes.append(fn)

    def made_by(self, op_name: str) -> List[StorageWeakRef]:
        """Storages that ops named ``op_name`` (e.g. ``"aten.gelu.default"``) made."""
        return [ref for name, ref in self.made if name == op_name]

    def reset_peak(self) -> None:
        self._sweep()
        self.peak_bytes = self.live_bytes

    def _sweep(self) -> None:
        dead = [ref for ref in self._live if ref.expired()]
        for ref in dead:
            self.live_bytes -= self._live.pop(ref)

    # Eager code between compiled graphs runs with dynamo's frame hook set (Whisper's
    # encoder): dynamo must not compile the tracker's own bookkeeping there.
    @torch._dynamo.disable
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()  # before the op: a freed storage's address may come back
        inputs = {
            storage_ref(v)
            for v in tree_leaves((args, kwargs))
            if isinstance(v, torch.Tensor) and v.layout == torch.strided
        }
        out = func(*args, **(kwargs or {}))
        self._sweep()
        name = str(func)
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                ref = storage_ref(value)
                # A view or in-place result of an input is not a new storage,
                # even when the input was made before tracking started.
                if ref not in self._live and ref not in inputs:
                    nbytes = value.untyped_storage().nbytes()
                    self._live[ref] = nbytes
                    self.live_bytes += nbytes
                    self.made.append((name, ref))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.ops.append(name)
        for probe in self._probes:
            probe(self, name)
        return out


def _memory_events(prof) -> List[tuple]:
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise RuntimeError("this torch profiler has no kineto results; cannot read memory events")
    events = []
    for event in results.events():
        if event.name() == "[memory]":
            events.append((event.start_ns(), event.nbytes()))
    events.sort()
    return events


def profiler_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of allocated bytes above the starting level while ``fn()`` runs (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    level = peak = 0
    for _, nbytes in _memory_events(prof):
        level += nbytes
        peak = max(peak, level)
    return peak


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of allocated bytes above the starting level while ``fn()`` runs (the CUDA allocator)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
