"""Worker functions for the multi-process DDP tests (importable for ``mp.spawn``).

Each worker joins a 2-rank gloo group on 127.0.0.1, runs one scenario with
eager DDP and with ``torch.compile(ddp, backend="donate_xla")`` from the same
initial weights and data, and puts a dict of results in a queue for the
parent (rank 0 only, plus any failure on either rank).
"""
from __future__ import annotations

import logging
import os
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = 512  # 1 MiB weights: bucket_cap_mb=1 gives several buckets and graph splits


class MLP(torch.nn.Module):
    """Four Linear layers; ``use_last=False`` leaves the last layer unused."""

    def __init__(self, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, use_last: bool = True, graph_break: bool = False):
        if graph_break:  # two dynamo graphs: layers 0-1, then layers 2-3
            x = torch.relu(self.layers[1](torch.relu(self.layers[0](x))))
            torch._dynamo.graph_break()
            return torch.relu(self.layers[3](torch.relu(self.layers[2](x))))
        layers = self.layers if use_last else self.layers[:-1]
        for layer in layers:
            x = torch.relu(layer(x))
        return x


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _init(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


def _batches(rank: int, steps: int, batch: int = 4, width: int = WIDTH):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(batch, width, generator=gen) for _ in range(steps)]


def _make_ddp(compiled: bool, scenario: str, **ddp_kwargs):
    torch.manual_seed(0)
    model = MLP()
    ddp = DDP(model, bucket_cap_mb=25 if scenario == "graph_break" else 1, **ddp_kwargs)
    if scenario == "param_hook":
        model.layers[0].weight.register_hook(lambda grad: grad * 2)
    if scenario == "comm_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    runner = torch.compile(ddp, backend="donate_xla") if compiled else ddp
    return model, ddp, runner


def _snapshot(model):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
    }


def _grads_in_buckets(ddp) -> bool:
    """Every param.grad lies inside the storage of one of our learned bucket slots."""
    from donate_backend import ddp as ddp_path

    state = ddp_path.state_for(ddp)
    if state is None:
        return False
    ranges = []
    for index in range(len(state.params)):
        slot = state.slot(index)
        if slot is not None:
            storage = slot.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    if not ranges:
        return False
    for p in state.params:
        if p.grad is None:
            continue
        start = p.grad.data_ptr()
        end = start + p.grad.numel() * p.grad.element_size()
        if not any(lo <= start and end <= hi for lo, hi in ranges):
            return False
    return True


def _bucket_sizes(ddp) -> str:
    """DDP's own record of its (rebuilt, when it rebuilt) bucket sizes."""
    data = ddp._get_ddp_logging_data()
    return data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")


def _train(compiled: bool, rank: int, scenario: str, steps: int = 3, **ddp_kwargs):
    """Run ``steps`` SGD steps of one scenario; return snapshots after each step."""
    model, ddp, runner = _make_ddp(compiled, scenario, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _batches(rank, steps * 2)
    snapshots, in_buckets, slot_writes, out_writes, reduced = [], [], [], [], []
    for step in range(steps):
        if scenario == "no_sync":
            with ddp.no_sync():
                runner(data[2 * step]).sum().backward()
            runner(data[2 * step + 1]).sum().backward()
        elif scenario == "unused":
            runner(data[step], use_last=(step != 1)).sum().backward()
        elif scenario == "graph_break":
            runner(data[step], graph_break=True).sum().backward()
        else:
            runner(data[step]).sum().backward()
        snapshots.append(_snapshot(model))
        if compiled:
            from donate_backend import ddp as ddp_path

            state = ddp_path.state_for(ddp)
            in_buckets.append(state is not None and _grads_in_buckets(ddp))
            slot_writes.append(0 if state is None else state.slot_writes)
            out_writes.append(0 if state is None else state.out_writes)
            reduced.append(0 if state is None else state.buckets_reduced)
        opt.step()
        opt.zero_grad(set_to_none=(scenario != "zero_grad_keep"))
    snapshots.append(_snapshot(model))
    return snapshots, {
        "in_buckets": in_buckets,
        "slot_writes": slot_writes,
        "out_writes": out_writes,
        "buckets_reduced": reduced,
        "bucket_sizes": _bucket_sizes(ddp),
    }


def _compare(eager, compiled) -> list:
    """Mismatch descriptions (empty when everything is bitwise equal)."""
    problems = []
    for step, (a, b) in enumerate(zip(eager, compiled)):
        for kind in ("params", "grads"):
            for i, (x, y) in enumerate(zip(a[kind], b[kind])):
                if (x is None) != (y is None):
                    problems.append(f"step {step} {kind}[{i}]: None mismatch ({x is None}, {y is None})")
                elif x is not None and not torch.equal(x, y):
                    diff = (x - y).abs().max().item()
                    problems.append(f"step {step} {kind}[{i}]: max diff {diff}")
    return problems


def scenario_worker(rank, world_size, port, scenario, queue, ddp_kwargs, settings):
    """Compare eager DDP with compiled DDP for one scenario."""
    try:
        _init(rank, world_size, port)
        capture = LogCapture()
        logging.getLogger("donate_xla").addHandler(capture)
        from donate_backend import report

        report.clear_reports()
        torch._dynamo.reset()
        eager, _ = _train(False, rank, scenario, **ddp_kwargs)
        torch._dynamo.reset()
        from donate_backend import config

        with config.patch(**settings):
            compiled, observed = _train(True, rank, scenario, **ddp_kwargs)
        records = [r for r in report.reports() if r.kind == "backward"]
        result = {
            "rank": rank,
            "problems": _compare(eager, compiled),
            **observed,
            "bucket_grads": [r.bucket_grads for r in records],
            "bucket_bytes": [r.bucket_bytes for r in records],
            "logs": capture.lines,
        }
        queue.put(result)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # report the failure to the parent instead of hanging it
        queue.put({"rank": rank, "error": traceback.format_exc()})
