"""Parent side of the multi-process DDP tests: spawn N gloo ranks, run jobs, collect every rank.

``run_jobs(jobs, world_size)`` returns ``{job name: [result of rank 0, rank 1, ...]}``
(see tests/ddp_workers.py for jobs and results). Any rank that fails, dies or
times out fails the test, with its traceback.
"""
from __future__ import annotations

import queue as queue_module
import socket
import time

import pytest
import torch.multiprocessing as mp

import ddp_workers

TIMEOUT_S = 150  # per job


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_jobs(jobs: list, world_size: int = 2) -> dict:
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(
        ddp_workers.jobs_worker,
        args=(world_size, _free_port(), jobs, results),
        nprocs=world_size,
        join=False,
    )
    expected = len(jobs) * world_size
    collected = []
    deadline = time.monotonic() + TIMEOUT_S * len(jobs)
    try:
        while len(collected) < expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"DDP jobs {[j['name'] for j in jobs]} timed out")
            try:
                result = results.get(timeout=min(remaining, 5))
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in context.processes):
                    pytest.fail(f"a rank died in DDP jobs {[j['name'] for j in jobs]}")
                continue
            if "error" in result:
                pytest.fail(f"rank {result['rank']} failed:\n{result['error']}")
            collected.append(result)
        context.join(timeout=max(1, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    by_job = {job["name"]: [None] * world_size for job in jobs}
    for result in collected:
        by_job[result["job"]][result["rank"]] = result
    return by_job


def run_job(job: dict, world_size: int = 2) -> list:
    """One job; the list of every rank's result."""
    return run_jobs([job], world_size)[job["name"]]


def train(steps: int, **step) -> list:
    return [dict(kind="train", **step) for _ in range(steps)]
