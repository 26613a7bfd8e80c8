"""Native path: step time and peak memory of a training step against eager and Inductor.

Variants: eager, Inductor (``torch.compile`` default backend), donate_xla with
the ATen executor, donate_xla with the Inductor executor. Models are those of
``bench/backward_memory.py`` (two MLPs and HF GPT-2 from a config). The step
is forward, backward, ``AdamW.step()`` and ``zero_grad()`` (the model is
compiled; the optimizer runs eagerly, the same in every variant).

Each (model, variant) runs ``--repeats`` times in a fresh process, the
variants interleaved and their order rotated each repeat. In a process: three
warm-up steps (compilation), then ``--steps`` timed steps; the step time is
their median (CUDA: synchronised). The peak is the most bytes allocated
during one steady step above the level before it (CUDA:
``max_memory_allocated``; CPU: the profiler's memory events). donate_xla rows
also give the memory plan's predicted growth of a forward+backward
(``donate_backend.memory_plan``). Figures: medians over repeats, with the
spread (min-max), and ratios to Inductor.

Usage: python bench/native_speed.py [--device cpu|cuda] [--models 1,3] [--repeats 3]
       [--steps 10] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("eager", "inductor", "donate_xla aten", "donate_xla inductor")
MIB = 2**20


def worker(model_name: str, variant: str, device: str, steps: int) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    if variant.startswith("donate_xla"):
        os.environ["DONATE_XLA_NATIVE_COMPILER"] = variant.split()[1]
    import torch

    import donate_backend
    from backward_memory import MODELS, make_input, make_model, step
    from memtrack import profiler_peak_bytes

    spec = MODELS[model_name]
    model = make_model(spec).to(device)
    x = make_input(spec, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    backend = {"eager": None, "inductor": "inductor"}.get(variant, "donate_xla")
    run = model if backend is None else torch.compile(model, backend=backend)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def train_step():
        step(model, run, x)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        train_step()
    sync()
    predicted = None
    if backend == "donate_xla":
        predicted = donate_backend.memory_plan(optimizer=optimizer).growth_bytes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step()
        sync()
        times.append(time.perf_counter() - start)
    gc.collect()
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step()
        sync()
        peak = torch.cuda.max_memory_allocated() - base
        # the forward+backward alone, the part the plan predicts
        gc.collect()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, run, x)
        sync()
        fwd_bwd = torch.cuda.max_memory_allocated() - base
        optimizer.zero_grad(set_to_none=True)
    else:
        peak = profiler_peak_bytes(train_step)
        fwd_bwd = profiler_peak_bytes(lambda: step(model, run, x))
        optimizer.zero_grad(set_to_none=True)
    return dict(step_s=statistics.median(times), step_times=times, peak=peak, fwd_bwd=fwd_bwd, predicted=predicted)


def run_fresh(model_name: str, variant: str, device: str, steps: int) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", model_name, variant, "--device", device, "--steps", str(steps)],
        capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=(proc.stderr or proc.stdout)[-1500:])
    return json.loads(lines[-1])


def spread(values) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}-{max(values):.4g}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"))
    parser.add_argument("--models", default="1,3")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the results here instead of bench/results/")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.device is None:
        import torch

        options.device = "cuda" if torch.cuda.is_available() else "cpu"
    if options.worker:
        print(json.dumps(worker(*options.worker, options.device, options.steps)))
        return 0
    import torch

    variants = options.variants.split(",")
    models = options.models.split(",")
    machine = dict(
        device=options.device,
        name=torch.cuda.get_device_name(0) if options.device == "cuda" else platform.processor() or platform.machine(),
        cpus=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
    )
    print(f"native_speed: {machine}; {options.repeats} fresh processes per variant, {options.steps} steps each")
    samples = {(m, v): [] for m in models for v in variants}
    for repeat in range(options.repeats):
        for model_name in models:
            order = variants[repeat % len(variants):] + variants[: repeat % len(variants)]
            for variant in order:
                result = run_fresh(model_name, variant, options.device, options.steps)
                samples[(model_name, variant)].append(result)
                if "error" in result:
                    print(f"  model {model_name} {variant}: failed\n{result['error']}")
                else:  # each sample as it comes, so a run cut short still shows what it measured
                    print(f"  repeat {repeat} model {model_name} {variant:<20} step {result['step_s'] * 1e3:8.2f} ms, "
                          f"peak {result['peak'] / MIB:8.1f} MiB, fwd+bwd {result['fwd_bwd'] / MIB:8.1f} MiB", flush=True)
    for model_name in models:
        print(f"\nmodel {model_name}")
        base = [s for s in samples[(model_name, "inductor")] if "error" not in s] if "inductor" in variants else []
        base_t = statistics.median(s["step_s"] for s in base) if base else None
        base_p = statistics.median(s["peak"] for s in base) if base else None
        print(f"  {'variant':<20} {'step ms':>26} {'step peak MiB':>26} {'fwd+bwd MiB':>12} {'plan MiB':>9}  vs Inductor")
        for variant in variants:
            ok = [s for s in samples[(model_name, variant)] if "error" not in s]
            if not ok:
                print(f"  {variant:<20} failed")
                continue
            t = [s["step_s"] * 1e3 for s in ok]
            p = [s["peak"] / MIB for s in ok]
            f = statistics.median(s["fwd_bwd"] / MIB for s in ok)
            pred = [s["predicted"] / MIB for s in ok if s.get("predicted") is not None]
            ratio = ""
            if base_t:
                ratio = f"time {statistics.median(t) / (base_t * 1e3):.2f}x, peak {statistics.median(p) / (base_p / MIB):.2f}x"
            plan = f"{statistics.median(pred):9.1f}" if pred else f"{'':>9}"
            print(f"  {variant:<20} {spread(t):>26} {spread(p):>26} {f:12.1f} {plan}  {ratio}")
    sys.path.insert(0, HERE)
    from backward_memory import MODELS, describe
    from measure import write_results

    write_results("native_speed", [dict(model=m, variant=v, runs=r) for (m, v), r in samples.items()],
                  repeats=options.repeats, steps=options.steps, path=options.json,
                  variant=None if options.device == "cpu" else "cuda", device=options.device,
                  device_name=machine["name"] if options.device == "cuda" else None, warm_up_steps=3,
                  models={m: describe(MODELS[m]) for m in models})
    failed = any("error" in s for runs in samples.values() for s in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
