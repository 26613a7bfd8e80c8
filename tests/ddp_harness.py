"""Parent side of the multi-process DDP tests: N gloo ranks run jobs; collect every rank.

``run_jobs(jobs, world_size)`` returns ``{job name: [result of rank 0, rank 1, ...]}``
(see tests/ddp_workers.py for jobs and results). Any rank that fails, dies or
times out fails the test, with its traceback.
"""
from __future__ import annotations

import atexit
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


class _Group:
    """N spawned ranks in one gloo group, each waiting for lists of jobs
    (``ddp_workers.serve``). Starting ranks costs each an interpreter, torch and the
    backend (seconds on a 2-core machine), so one group serves every test that runs
    jobs on that many ranks, until a job fails."""

    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.inboxes = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        self.ranks = mp.spawn(
            ddp_workers.serve,
            args=(world_size, _free_port(), self.inboxes, self.results),
            nprocs=world_size,
            join=False,
        )

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.ranks.processes)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for process in self.ranks.processes:
            process.join(timeout=20)
            if process.is_alive():
                process.terminate()


_group = None


def _ranks(world_size: int) -> _Group:
    global _group
    if _group is not None and (_group.world_size != world_size or not _group.alive()):
        _close_group()
    if _group is None:
        _group = _Group(world_size)
    return _group


def _close_group() -> None:
    global _group
    if _group is not None:
        group, _group = _group, None
        group.close()


atexit.register(_close_group)  # before multiprocessing's own exit handler joins the ranks


def run_jobs(jobs: list, world_size: int = 2) -> dict:
    group = _ranks(world_size)
    for inbox in group.inboxes:
        inbox.put(jobs)
    names = [j["name"] for j in jobs]
    expected = len(jobs) * world_size
    collected = []
    deadline = time.monotonic() + TIMEOUT_S * len(jobs)
    failure = None
    while failure is None and len(collected) < expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            failure = f"DDP jobs {names} timed out"
            break
        try:
            result = group.results.get(timeout=min(remaining, 5))
        except queue_module.Empty:
            if not group.alive():
                failure = f"a rank died in DDP jobs {names}"
            continue
        if "error" in result:
            failure = f"rank {result['rank']} failed:\n{result['error']}"
        else:
            collected.append(result)
    if failure is not None:  # the ranks may be out of step: the next test gets a new group
        _close_group()
        pytest.fail(failure)
    by_job = {job["name"]: [None] * world_size for job in jobs}
    for result in collected:
        by_job[result["job"]][result["rank"]] = result
    return by_job


def run_job(job: dict, world_size: int = 2) -> list:
    """One job; the list of every rank's result."""
    return run_jobs([job], world_size)[job["name"]]


def train(steps: int, **step) -> list:
    return [dict(kind="train", **step) for _ in range(steps)]
