"""Memory of one DDP training step: eager, eager with bucket views, Inductor, donate_xla.

Run: ``python bench/ddp_memory.py`` (``make bench``). Two gloo ranks on
127.0.0.1, CPU only (no NCCL: this benchmark has no GPU to run on).

What is measured, per variant and model, on rank 0, for a steady-state step
(after 3 warm-up steps: compile, DDP's bucket rebuild, our slot learning):

- ``buckets``: bytes of DDP's flat gradient buckets (the reducer allocates
  them at construction; one per bucket, as large as its parameters).
- ``step peak``: the peak, above the level at the start of the step, of the
  running sum of the CPU allocator's ``[memory]`` events recorded by
  ``torch.profiler(profile_memory=True)`` over forward + backward +
  ``optimizer.step()`` (every c10 CPU allocation and free, Inductor's buffers
  included; gloo's internal buffers are not c10 allocations and are not seen).
  ``param.grad`` is set to None before each step (``zero_grad()``), so
  separately allocated gradients are part of the step peak.
- ``total = buckets + step peak``: the steady-state peak beyond parameters and
  inputs, which are the same in every variant.
- cross-check: ``dispatch peak``, the same step's peak of live storages made by
  ATen ops, from a ``TorchDispatchMode`` that tracks output storages with
  ``StorageWeakRef`` (it cannot see Inductor's CPU buffers, so it is shown as
  ``-`` for Inductor).

Ratios are against eager DDP with ``gradient_as_bucket_view=True``.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from memtrack import StorageTracker, profiler_peak_bytes  # noqa: E402  (the tests' trackers)

MiB = 2**20
WORLD_SIZE = 2
WARMUP_STEPS = 3
MEASURED_STEPS = 2

VARIANTS = ("eager DDP", "eager DDP bucket view", "compile(DDP) inductor", "donate_xla")


class Stack(torch.nn.Module):
    """``depth`` x (Linear ``width`` + GELU); a user class so dynamo traces it."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


MODELS = {
    # name: (width, depth, batch)
    "params dominate (8 x Linear 1024, batch 16)": (1024, 8, 16),
    "activations dominate (4 x Linear 256, batch 4096)": (256, 4, 4096),
}


def _make(variant: str, width: int, depth: int):
    torch.manual_seed(0)
    model = Stack(width, depth)
    bucket_view = variant != "eager DDP"
    if variant == "donate_xla":
        bucket_view = False  # the backend turns bucket views on by itself
    ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=bucket_view)
    if variant == "compile(DDP) inductor":
        runner = torch.compile(ddp, backend="inductor")
    elif variant == "donate_xla":
        runner = torch.compile(ddp, backend="donate_xla")
    else:
        runner = ddp
    return model, ddp, runner


def measure(variant: str, width: int, depth: int, batch: int, rank: int) -> dict:
    torch._dynamo.reset()
    model, ddp, runner = _make(variant, width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(batch, width, generator=gen) for _ in range(WARMUP_STEPS + MEASURED_STEPS)]

    def step(x):
        runner(x).sum().backward()
        opt.step()

    for x in data[:WARMUP_STEPS]:
        step(x)
        opt.zero_grad(set_to_none=True)
    peaks, dispatch_peaks = [], []
    for x in data[WARMUP_STEPS:]:
        peaks.append(profiler_peak_bytes(lambda: step(x)))
        opt.zero_grad(set_to_none=True)
        if variant != "compile(DDP) inductor":
            # Twice: an active dispatch mode makes dynamo recompile, and the
            # compile's own allocations must not count.
            for _ in range(2):
                with StorageTracker() as tracker:
                    step(x)
                opt.zero_grad(set_to_none=True)
            dispatch_peaks.append(tracker.peak_bytes)
    bucket_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    aliased = None
    if variant == "donate_xla":
        from donate_backend import ddp as ddp_path

        binding = ddp_path.binding_of(ddp)
        aliased = 0 if binding is None else binding.counts.slot_writes
    return {
        "buckets": bucket_bytes,
        "step_peak": max(peaks),
        "step_peaks": peaks,
        "dispatch_peak": max(dispatch_peaks) if dispatch_peaks else None,
        "slot_writes": aliased,
    }


def worker(rank: int, port: int, out_queue, only: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    for model_name, (width, depth, batch) in MODELS.items():
        for variant in VARIANTS:
            if only and only not in variant:
                continue
            started = time.perf_counter()
            result = measure(variant, width, depth, batch, rank)
            dist.barrier()
            if rank == 0:
                result.update(model=model_name, variant=variant, seconds=time.perf_counter() - started)
                out_queue.put(result)
    dist.destroy_process_group()
    if rank == 0:
        out_queue.put(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def format_table(rows: list) -> str:
    lines = []
    for model_name in MODELS:
        model_rows = [r for r in rows if r["model"] == model_name]
        if not model_rows:
            continue
        base = next((r for r in model_rows if r["variant"] == "eager DDP bucket view"), None)
        lines.append(f"\n{model_name}")
        lines.append(
            f"{'variant':<24}{'buckets MiB':>12}{'step peak':>11}{'total MiB':>11}"
            f"{'vs bucket view':>16}{'dispatch peak':>15}"
        )
        for r in model_rows:
            total = r["buckets"] + r["step_peak"]
            ratio = "-" if base is None else f"{total / (base['buckets'] + base['step_peak']):.3f}"
            lines.append(
                f"{r['variant']:<24}{_fmt(r['buckets']):>12}{_fmt(r['step_peak']):>11}"
                f"{_fmt(total):>11}{ratio:>16}{_fmt(r['dispatch_peak']):>15}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only variants whose name contains this")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the results here instead of bench/results/")
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(worker, args=(_free_port(), results, args.only), nprocs=WORLD_SIZE, join=False)
    rows, deadline = [], time.monotonic() + args.timeout
    try:
        while True:
            row = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if row is None:
                break
            rows.append(row)
            print(f"  measured {row['model']}: {row['variant']} ({row['seconds']:.0f}s)", flush=True)
        context.join(timeout=60)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    print("DDP gradient buckets: 2 gloo ranks, CPU, rank 0, steady-state step (MiB)")
    print(format_table(rows))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from measure import torch_variant, write_results

    write_results("ddp_memory", rows, repeats=1, steps=MEASURED_STEPS, path=args.json, variant=torch_variant(),
                  world_size=WORLD_SIZE, warmup_steps=WARMUP_STEPS, models=MODELS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
