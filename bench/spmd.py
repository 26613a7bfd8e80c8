"""Sharded training on 4 CPU devices (SPMD): donate_xla vs openxla vs eager SPMD.

A GPT (6 layers, width 512, 27.4M parameters) with FSDP-style sharding:
every parameter sharded on dim 0 over a 4-device mesh, the batch on the same
axis, AdamW. Each backend runs `--repeats` times, interleaved, each in a fresh
process with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 and MALLOC_MMAP_THRESHOLD_=65536
(every buffer of 64 KiB or more its own mapping, so RSS follows live bytes:
the "live" method of bench/donation.py). After two warm-up steps the process
samples its RSS every 5 ms over `--steps` steps.

Reported (medians over the repeats, with ranges):
  - live growth: peak - trough of RSS over the steps, what a step needs on top
    of its persistent state (parameter and optimizer-state shards);
  - aliased: buffers XLA compiled as input/output aliases (InputOutputAliasCount
    of the executables compiled), against the state tensors (parameters and
    Adam moments);
  - compile: seconds of the first call (it compiles every graph);
  - step: median seconds per step after the warm-up.
eager is plain torch_xla SPMD: no torch.compile, torch_xla.sync() after each
step (one lazy graph per step).

Two layouts (`--layout`, both by default):
  - fsdp: the parameters and the batch sharded, nothing else;
  - fsdp-act: also the activations sharded on the batch (the residual stream and
    the logits, with donate_backend.xla.mark_sharding, for every backend, as FSDP
    recipes do) and XLA's memory-minimising CPU scheduler for every backend
    (XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false); donate_xla
    also runs with DONATE_XLA_ACTIVATION_BUDGET=0.1 ("donate_xla budget 0.1").
Writes every run (RSS traces included) to bench/results/spmd.json; bench/render.py draws
docs/spmd_rss.png and docs/spmd_act_rss.png from it (first repeat). Run: `make bench`.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

ENV = {"CPU_NUM_DEVICES": "4", "MALLOC_MMAP_THRESHOLD_": "65536"}
MEMORY_SCHEDULER = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=false"}
# layout -> {row name: (backend, extra environment)}
LAYOUTS = {
    "fsdp": {
        "donate_xla": ("donate_xla", {}),
        "openxla": ("openxla", {}),
        "eager": ("eager", {}),
    },
    "fsdp-act": {
        "donate_xla": ("donate_xla", MEMORY_SCHEDULER),
        "donate_xla budget 0.1": ("donate_xla", {**MEMORY_SCHEDULER, "DONATE_XLA_ACTIVATION_BUDGET": "0.1"}),
        "openxla": ("openxla", MEMORY_SCHEDULER),
        "eager": ("eager", MEMORY_SCHEDULER),
    },
}


def worker(backend: str, layout: str, steps: int) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    import donate_backend  # noqa: F401
    from xla_common import RssSampler, SmallGPT, median

    device = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
    constrain = None
    if layout == "fsdp-act":
        from donate_backend.xla import describe_mesh, mark_sharding

        described = describe_mesh(mesh)  # outside the compiled step: no graph break

        def constrain(t):
            return mark_sharding(t, described, ("data",) + (None,) * (t.dim() - 1))

    torch.manual_seed(0)
    model = SmallGPT(constrain=constrain).to(device)
    for p in model.parameters():
        if p.shape[0] % n == 0:
            xs.mark_sharding(p, mesh, ("data",) + (None,) * (p.dim() - 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8192, (8, 128)).to(device)
    y = torch.randint(0, 8192, (8, 128)).to(device)
    xs.mark_sharding(x, mesh, ("data", None))
    xs.mark_sharding(y, mesh, ("data", None))

    def step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = step if backend == "eager" else torch.compile(step, backend=backend)

    def run_step():
        loss = run(x, y)
        torch_xla.sync()
        xm.wait_device_ops()
        return loss

    start = time.perf_counter()
    run_step()
    first_call_s = time.perf_counter() - start
    run_step()  # the second step compiles what the first created (optimizer state)
    times = []
    with RssSampler() as sampler:
        for _ in range(steps):
            start = time.perf_counter()
            run_step()
            times.append(time.perf_counter() - start)
    alias = met.metric_data("InputOutputAliasCount")
    state = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return dict(
        backend=backend,
        transient=sampler.peak - sampler.trough,
        aliased=int(alias[1]) if alias else 0,
        state_buffers=len(state),
        first_call_s=first_call_s,
        step_s=median(times),
        step_times=times,
        loss=float(run(x, y).item()),
        rss=[(t, r - sampler.trough) for t, r in sampler.samples[::4]],
    )


def report(layout: str, runs: dict, steps: int, repeats: int) -> list:
    from xla_common import summarize

    mib = lambda b: b / 2**20  # noqa: E731
    ref = {key: summarize(runs["openxla"], key)[0] for key in ("transient", "first_call_s", "step_s")}
    print(f"\n== GPT 6x512 AdamW on 4 CPU devices, layout {layout}: {steps} steps x {repeats} repeats")
    print(f"{'row':24}{'live growth MiB':>24}{'x openxla':>11}{'aliased/state':>15}"
          f"{'compile s':>11}{'x openxla':>11}{'step s':>9}{'x openxla':>11}")
    summary = []
    for row, row_runs in runs.items():
        growth, lo, hi = summarize(row_runs, "transient")
        compile_s = summarize(row_runs, "first_call_s")[0]
        step = summarize(row_runs, "step_s")[0]
        aliased = summarize(row_runs, "aliased")[0]
        state = row_runs[0]["state_buffers"]
        print(f"{row:24}{mib(growth):>10.1f} [{mib(lo):>5.0f}-{mib(hi):<5.0f}]"
              f"{growth / ref['transient']:>11.2f}{aliased:>8.0f}/{state:<6d}"
              f"{compile_s:>11.2f}{compile_s / ref['first_call_s']:>11.2f}"
              f"{step:>9.3f}{step / ref['step_s']:>11.2f}")
        summary.append(dict(layout=layout, row=row, growth=growth, growth_min=lo, growth_max=hi,
                            x_openxla=growth / ref["transient"], aliased=aliased, state_buffers=state,
                            compile_s=compile_s, step_s=step, x_openxla_step=step / ref["step_s"],
                            losses=[r["loss"] for r in row_runs]))
    return summary


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: both")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "LAYOUT"), help="internal: one run")
    parser.add_argument("--json", help="write the results here instead of bench/results/")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return

    from xla_common import run_worker, write_results

    summary, results = [], []
    for layout in args.layout or list(LAYOUTS):
        rows = LAYOUTS[layout]
        runs = {row: [] for row in rows}
        for _ in range(args.repeats):
            for row, (backend, env) in rows.items():
                runs[row].append(run_worker(
                    __file__, "--worker", backend, layout, "--steps", str(args.steps), env={**ENV, **env}
                ))
        summary += report(layout, runs, args.steps, args.repeats)
        results.append(dict(layout=layout, runs=runs, env={row: {**ENV, **env} for row, (_, env) in rows.items()}))
    write_results("spmd", results, repeats=args.repeats, steps=args.steps, path=args.json)


if __name__ == "__main__":
    main()
