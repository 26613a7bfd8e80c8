"""donate_xla vs openxla: bytes sent to the device while compiling, compile time, step time.

Each (model, backend) pair runs `--repeats` times (default 3), interleaved, each in
a fresh process, after one discarded run of each (cold file caches), the order of
the two backends swapped every other repeat; figures are medians over the repeats. "Compiling" is every call up
to the steady state (the first three calls), less three steady steps:
    compile_s = time(first 3 calls) - 3 * median(steady step)
The ratio of the first three calls' wall clock (time to the steady state, nothing
subtracted) is printed per repeat too: a backend whose steady step is faster has
more subtracted, so the two figures can disagree (docs/benchmarks.md).
Bytes (torch_xla's OutboundData) are printed raw: for the first three calls and
per steady call. Inputs are on the device before the first call; what a steady
call sends is per-call data (Adam's host `step` counters, RNG seeds). For
donate_xla the bytes sent inside its lowering are also measured exactly (the
graph records), which is the "while compiling" figure. Also printed: where the compile
time goes (``donate_backend.compile_phases()``: dynamo, aot_autograd, and each phase of
the graph compilers; for openxla only dynamo's and aot_autograd's timers apply).
*Time to the first step* is the first call's wall clock (it compiles the forward, the
backward and the optimizer's first step, and runs them). On the GPT, where JAX has a twin
(``bench/jax_gpt.py``: the same weights, batch and AdamW step as one whole-step ``jax.jit``
with ``donate_argnums``), a JAX row runs in the JAX environment when there is one
(``bench/jax_common.py``) and gives its first call's wall clock; the ratios to JAX are per
repeat.
Run: `make bench` or `python bench/compile.py [--steps N]`.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

WARM_CALLS = 3


def jax_row(model_name: str, steps: int) -> dict:
    from jax_common import jax_worker

    result = jax_worker(model_name, steps)
    return dict(model=model_name, backend="jax", first_step_s=result["first_step_s"], step_s=result["step_s"],
                loss=result["first_loss"], jax=result["jax"])


def worker(model_name: str, backend: str, steps: int) -> dict:
    if backend == "jax":
        return jax_row(model_name, steps)
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    import donate_backend
    from xla_common import build, median

    def outbound() -> float:
        data = met.metric_data("OutboundData")
        return float(data[1]) if data else 0.0

    device = torch_xla.device()
    model, opt, step, (x, y) = build(model_name, device)
    torch_xla.sync()
    xm.wait_device_ops()
    compiled = torch.compile(step, backend=backend)

    def timed_call():
        start_b, start_t = outbound(), time.perf_counter()
        loss = compiled(x, y)
        torch_xla.sync()
        xm.wait_device_ops()
        return time.perf_counter() - start_t, outbound() - start_b, loss

    warm = [timed_call() for _ in range(WARM_CALLS)]
    steady = [timed_call() for _ in range(steps)]
    step_s = median([t for t, _, _ in steady])
    step_b = median([b for _, b, _ in steady])
    records = donate_backend.reports()
    split = donate_backend.compile_phases()
    phases = {"dynamo": split.dynamo, "backend before aot_autograd": split.backend,
              "aot_autograd": split.aot_autograd, **split.graphs}
    return dict(
        phases=phases,
        model=model_name,
        backend=backend,
        compile_s=sum(t for t, _, _ in warm) - WARM_CALLS * step_s,
        warm_calls_s=[t for t, _, _ in warm],
        first_step_s=warm[0][0],
        steady_s=[t for t, _, _ in steady],
        warm_bytes=sum(b for _, b, _ in warm),
        steady_bytes=step_b,
        step_s=step_s,
        record_bytes=sum(r.transfers_bytes for r in records),
        record_transfers=sum(r.transfers_count for r in records),
        graphs=len(records),
        loss=float(warm[-1][2].detach().cpu()),
    )


def main() -> None:
    from xla_common import bench_arguments

    parser = bench_arguments(__doc__.splitlines()[0])
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return

    from jax_common import JAX_MODELS, jax_python
    from xla_common import median, run_repeated, summarize, write_results

    rows, results, more_versions = [], [], {}
    if jax_python() is None:
        print("JAX row skipped: no JAX environment (`make bench` creates .venv-jax from "
              "requirements-jax.txt; DONATE_XLA_JAX_PYTHON names another interpreter)")
    for model_name in args.models.split(","):
        backends = ("openxla", "donate_xla")
        if model_name in JAX_MODELS and jax_python() is not None:
            backends += ("jax",)
        runs = run_repeated(
            __file__, model_name, backends, args.repeats, "--steps", str(args.steps),
            warm_up=True, alternate=True,
        )
        if "jax" in runs:
            more_versions["jax"] = runs["jax"][0]["jax"]
        print(f"\n== {model_name}: time to the first step (its first call), median s [min-max] over "
              f"{args.repeats} repeats")
        for b in backends:
            first = [r["first_step_s"] for r in runs[b]]
            print(f"  {b:<12}{median(first):8.2f} [{min(first):.2f}-{max(first):.2f}]")
        for b in ("openxla", "donate_xla") if "jax" in runs else ():
            ratios = sorted(r["first_step_s"] / j["first_step_s"] for r, j in zip(runs[b], runs["jax"]))
            print(f"  {b} / jax per repeat: {' '.join(f'{x:.2f}' for x in ratios)}")
        med = {b: {k: summarize(runs[b], k)[0] for k in ("warm_bytes", "steady_bytes", "record_bytes", "compile_s", "step_s", "loss")}
               for b in ("openxla", "donate_xla")}
        rows.append(med)
        results.append(dict(model=model_name, runs=runs))
        ours, ref = med["donate_xla"], med["openxla"]
        step_ratios = sorted(o["step_s"] / r["step_s"] for o, r in zip(runs["donate_xla"], runs["openxla"]))
        compile_ratios = sorted(
            o["compile_s"] / r["compile_s"] for o, r in zip(runs["donate_xla"], runs["openxla"])
        )
        med["compile_ratios"] = compile_ratios
        print(f"\n== {model_name} ({args.steps} steady steps x {args.repeats} repeats, medians)")
        print(f"{'':28}{'openxla':>14}{'donate_xla':>14}{'ratio':>10}")
        print(f"{'bytes sent, first 3 calls':28}{ref['warm_bytes']:>14.0f}{ours['warm_bytes']:>14.0f}")
        print(f"{'bytes sent per steady call':28}{ref['steady_bytes']:>14.0f}{ours['steady_bytes']:>14.0f}")
        print(f"{'bytes sent while lowering':28}{'n/a':>14}{ours['record_bytes']:>14.0f}")
        print(
            f"{'compile seconds':28}{ref['compile_s']:>14.2f}{ours['compile_s']:>14.2f}"
            f"{ours['compile_s'] / ref['compile_s']:>10.2f}"
        )
        print(f"{'  compile ratio per repeat':28}{'':>14}{'':>14}  {' '.join(f'{r:.2f}' for r in compile_ratios)}")
        # time to the steady state: the first three calls' wall clock, nothing subtracted
        first_ratios = sorted(
            sum(o["warm_calls_s"]) / sum(r["warm_calls_s"]) for o, r in zip(runs["donate_xla"], runs["openxla"])
        )
        med["first_calls_ratios"] = first_ratios
        print(f"{'  first 3 calls ratio/repeat':28}{'':>14}{'':>14}  {' '.join(f'{r:.2f}' for r in first_ratios)}")
        for b in ("openxla", "donate_xla"):  # in run order: which side a bad ratio came from
            seconds = " ".join(f"{run['compile_s']:.2f}" for run in runs[b])
            print(f"{'  ' + b + ' s, run order':28}{'':>28}  {seconds}")
            # the two terms of compile_s: the first calls' wall clock, and the step subtracted
            first = " ".join(f"{sum(run['warm_calls_s']):.2f}" for run in runs[b])
            steps = " ".join(f"{run['step_s']:.3f}" for run in runs[b])
            print(f"{'    first calls s':28}{'':>28}  {first}")
            print(f"{'    steady step s':28}{'':>28}  {steps}")
        print(
            f"{'step seconds':28}{ref['step_s']:>14.4f}{ours['step_s']:>14.4f}"
            f"{ours['step_s'] / ref['step_s']:>10.2f}"
        )
        print(f"{'  step ratio per repeat':28}{'':>14}{'':>14}  {' '.join(f'{r:.2f}' for r in step_ratios)}")
        print(f"{'loss after warm-up':28}{ref['loss']:>14.4f}{ours['loss']:>14.4f}")
        # where the compile time goes (dynamo's timers cover openxla too; the graph phases are ours)
        for b in ("openxla", "donate_xla"):
            names = [n for n in runs[b][0]["phases"] if any(r["phases"].get(n) is not None for r in runs[b])]
            print(f"  {b} compile phases, median s (min-max):")
            for name in names:
                values = [r["phases"][name] for r in runs[b] if r["phases"].get(name) is not None]
                print(f"    {name:<34}{median(values):8.3f}  ({min(values):.3f}-{max(values):.3f})")
    write_results("compile", results, repeats=args.repeats, steps=args.steps, path=args.json,
                  warm_calls=WARM_CALLS, warm_up_runs=1, more_versions=more_versions or None)


if __name__ == "__main__":
    main()
