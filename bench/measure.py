"""Resident-set sampling for the memory benchmarks, with no torch import (the JAX
worker, ``bench/jax_gpt.py``, runs in an environment without torch).

On XLA:CPU device buffers are host memory, so the process's RSS is its device
memory; with ``MALLOC_MMAP_THRESHOLD_=65536`` it follows the live bytes
(docs/benchmarks.md).
"""
from __future__ import annotations

import os
import statistics
import threading
import time


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples this process's resident set size every ``interval`` seconds."""

    def __init__(self, interval=0.005):
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        start = time.perf_counter()
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - start, current_rss()))
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return max(r for _, r in self.samples)

    @property
    def trough(self) -> int:
        return min(r for _, r in self.samples)


def median(values) -> float:
    return statistics.median(values)
