"""DDP gradient buckets under torch.compile (issue 5).

Multi-process tests: 2 gloo ranks on 127.0.0.1, spawned with
torch.multiprocessing, each bounded by a timeout. Every scenario trains eager
DDP and ``torch.compile(ddp, backend="donate_xla")`` from the same weights and
data for 3 SGD steps and requires gradients and parameters after every step to
be bitwise equal. NCCL is not tested here (no GPU in this environment).
"""
from __future__ import annotations

import queue as queue_module
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from donate_backend.ddp import plan

import ddp_workers

WORLD_SIZE = 2
TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(scenario: str, ddp_kwargs=None, settings=None) -> dict:
    """Spawn the ranks, wait at most TIMEOUT_S, return rank 0's result."""
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(
        ddp_workers.scenario_worker,
        args=(WORLD_SIZE, _free_port(), scenario, results, ddp_kwargs or {}, settings or {}),
        nprocs=WORLD_SIZE,
        join=False,
    )
    collected = {}
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(collected) < WORLD_SIZE:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"DDP scenario {scenario!r} timed out after {TIMEOUT_S}s")
            try:
                result = results.get(timeout=min(remaining, 5))
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in context.processes):
                    pytest.fail(f"a rank died in scenario {scenario!r}")
                continue
            collected[result["rank"]] = result
        context.join(timeout=max(1, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    for result in collected.values():
        assert "error" not in result, result["error"]
    return collected[0]


def assert_equal_and_aliased(result: dict, steady_writes: int, steady_out=0) -> None:
    assert result["problems"] == [], result["problems"]
    # After the first step every param.grad lies inside its bucket's storage.
    assert all(result["in_buckets"]), result["in_buckets"]
    # Step 1 learns the slots, step 2 follows DDP's bucket rebuild; by step 3
    # the compiled backward wrote every gradient straight into its slot.
    writes = result["slot_writes"]
    assert writes[-1] - writes[-2] == steady_writes, writes
    # Of those, weight gradients (mm) were computed straight into the slot (out=).
    outs = result["out_writes"]
    assert outs[-1] - outs[-2] == steady_out, outs


@pytest.mark.parametrize("gradient_as_bucket_view", [True, False])
def test_three_sgd_steps_bitwise_equal_eager_ddp(gradient_as_bucket_view):
    result = run_scenario("plain", {"gradient_as_bucket_view": gradient_as_bucket_view})
    assert_equal_and_aliased(result, steady_writes=8, steady_out=4)
    # DDPOptimizer split the graph at bucket boundaries (1 MiB cap): one graph per layer.
    assert result["bucket_grads"] == [2, 2, 2, 2]
    assert result["bucket_bytes"] == [(512 * 512 + 512) * 4] * 4
    assert result["logs"] == []


def test_no_sync_accumulates_into_slots():
    result = run_scenario("no_sync")
    # The first backward of a step writes fresh (out=), the second adds.
    assert_equal_and_aliased(result, steady_writes=16, steady_out=4)


def test_unused_parameters():
    result = run_scenario("unused", {"find_unused_parameters": True})
    assert result["problems"] == [], result["problems"]
    assert all(result["in_buckets"])
    assert result["slot_writes"][1] == 6  # step 2: last layer unused, 6 gradients written


def test_zero_grad_without_set_to_none():
    result = run_scenario("zero_grad_keep")
    # param.grad is kept (zeroed), so gradients are added into the slot: no out=.
    assert_equal_and_aliased(result, steady_writes=8, steady_out=0)


def test_bucket_written_by_several_graphs_is_reduced_once():
    result = run_scenario("graph_break")
    assert_equal_and_aliased(result, steady_writes=8, steady_out=4)
    assert result["bucket_sizes"] == str((512 * 512 + 512) * 4 * 4)  # one bucket...
    assert len(result["bucket_grads"]) == 4  # ...written by four backward graphs
    reduced = result["buckets_reduced"]
    assert reduced[-1] - reduced[-2] == 1, reduced  # and all-reduced once per step


def test_gradient_hook_keeps_that_parameter_on_ddp_path():
    result = run_scenario("param_hook")  # layers[0].weight doubles its gradient
    assert result["problems"] == [], result["problems"]
    assert all(result["in_buckets"])
    writes = result["slot_writes"]
    assert writes[-1] - writes[-2] == 7, writes
    assert result["logs"] == [
        "donate_xla: DDP parameter #0 keeps DDP's normal path: a gradient hook is "
        "registered on the parameter (it may replace the gradient)"
    ]


def test_comm_hook_falls_back_and_logs_reason():
    result = run_scenario("comm_hook")
    assert result["problems"] == [], result["problems"]
    assert result["slot_writes"] == [0, 0, 0]
    assert result["logs"] == [
        "donate_xla: DDP gradient buckets off for MLP: a communication hook is registered "
        "(allreduce_hook); gradients take DDP's normal path"
    ]


def test_switch_off_keeps_ddp_path():
    result = run_scenario("plain", settings={"bucket_view": False})
    assert result["problems"] == [], result["problems"]
    assert result["slot_writes"] == [0, 0, 0]
    assert all(n in (None, 0) for n in result["bucket_grads"])


# ---- pure parts, no processes ------------------------------------------------


def test_input_param_indices_by_identity():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    x = torch.zeros(2)
    assert plan.input_param_indices([x, b, a, 3], [a, b]) == (None, 1, 0, None)


def test_gradient_outputs_pairs_and_mismatch():
    graph = torch.fx.Graph()
    g0, g1 = graph.placeholder("g0"), graph.placeholder("g1")
    assert plan.gradient_outputs([None, g0, g1], (None, 0, 1)) == [(1, 0), (2, 1)]
    assert plan.gradient_outputs([g0, None], (0, 1)) == [(0, 0)]
    assert plan.gradient_outputs([g0], (0, 1)) is None
