"""Resident-set sampling for the memory benchmarks, with no torch import (the JAX
worker, ``bench/jax_gpt.py``, runs in an environment without torch).

On XLA:CPU device buffers are host memory, so the process's RSS is its device
memory; with ``MALLOC_MMAP_THRESHOLD_=65536`` it follows the live bytes
(docs/benchmarks.md).
"""
from __future__ import annotations

import os
import sys
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


# --- results files -------------------------------------------------------------------------
# Every benchmark writes what it measured, every sample included, to bench/results/<name>.json
# (or <name>-<variant>.json, e.g. the torch release where one script runs under two), with the
# machine and versions it ran on; bench/render.py builds docs/benchmarks.md and README.md's
# headline table from these files only.

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results_path(name: str, variant: str | None = None) -> str:
    return os.path.join(RESULTS_DIR, f"{name}-{variant}.json" if variant else f"{name}.json")


def torch_variant() -> str:
    """The file-name variant of a script that runs under two torch releases: ``torch2.9.0``."""
    return "torch" + _version("torch").split("+")[0]


def _version(module: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(modules=("torch", "torch_xla")) -> dict:
    """Machine, versions, date and command line of this run (no nvidia-smi, nothing imported)."""
    import datetime
    import platform
    import shlex

    versions = {"python": platform.python_version()}
    for module in modules:
        version = _version(module)
        if version is not None:
            versions[module] = version
    commit = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--", "donate_backend")
    return dict(
        machine=dict(cpu=_cpu_model(), cores=os.cpu_count(), arch=platform.machine(),
                     system=f"{platform.system()} {platform.release()}"),
        versions=versions,
        donate_backend_commit=commit,
        donate_backend_modified=bool(changed) if changed is not None else None,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]]),
    )


def write_results(name: str, results, *, repeats: int, steps, path: str | None = None,
                  variant: str | None = None, modules=("torch", "torch_xla"), more_versions=None,
                  **extra) -> str:
    """Write one benchmark's results with its environment; returns the path written.

    ``results`` holds every sample; ``repeats`` is fresh processes (or runs) per figure,
    ``steps`` the measured steps in each (None where a figure is not per step)."""
    import json

    path = path or results_path(name, variant)
    env = environment(modules)
    env["versions"].update(more_versions or {})
    data = dict(benchmark=name, variant=variant, **env, repeats=repeats, steps=steps, **extra, results=results)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"results: {os.path.relpath(path)}")
    return path
