"""The benchmark GPT trained on XLA:CPU four ways: donate_xla's JAX target, donate_xla and openxla on torch_xla, and JAX.

The model is ``gpt6x512_adamw`` (``xla_common.SmallGPT``: 6 layers, width 512, AdamW), from the
same initial weights and batch in every row. The rows:

  - jax_target: ``torch.compile(step, backend="donate_xla")`` on ``donate_backend.jax_device()``
    (current torch with jax, no torch_xla: the graphs are lowered to JAX and compiled by its
    XLA), in the newest environment (``.venv-newest``; ``--newest-python`` names another);
  - donate_xla: the same ``torch.compile`` call on torch_xla's device (``.venv``, PJRT_DEVICE=CPU;
    ``--xla-python`` names another interpreter);
  - openxla: torch_xla's own dynamo backend, in that environment;
  - jax: JAX's whole-step ``jax.jit`` with ``donate_argnums`` (``bench/jax_gpt.py`` through
    ``jax_common.jax_worker``), in the JAX environment: ``.venv-jax``, the interpreter
    ``DONATE_XLA_JAX_PYTHON`` names, or else ``.venv-newest`` (it has jax and numpy).

Each (row, repeat) runs in a fresh process; the repeats are interleaved, the order of the rows
rotated by one every repeat, and the figures are medians over the repeats with their range.
Every worker runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (every buffer of 64 KiB or more is its
own mapping, given back when freed, so the RSS follows the live bytes; on XLA:CPU device
buffers are host memory). Measured per run:

  - time to the first step: the first call's wall clock, with a wait for the device after it
    (it compiles the forward, the backward and the optimizer's first step, and runs them);
    the inputs are on the device before it;
  - step: the median over `--steps` steps of one call and a wait for the device, after the
    warm-up calls (the torch rows: ``xla_common.WARM_UP_CALLS``, the first call included, so
    the default has chosen and compiled its step; jax: two steps, as ``bench/jax_gpt.py``
    runs them). The wait on torch_xla is ``torch_xla.sync()`` and ``wait_device_ops()``; on
    the JAX device a read of the loss (``loss.item()``) and a wait on every parameter's and
    optimizer-state tensor's JAX array (JAX dispatches asynchronously: the loss comes from the
    forward, the optimizer's executable may still run after it is read); jax:
    ``jax.block_until_ready`` on the step's outputs;
  - growth: peak minus trough of the RSS (sampled every 5 ms, ``measure.RssSampler``) while the
    measured steps run: what a step needs on top of its persistent state (the "live" figure of
    ``bench/donation.py``);
  - the first loss: the four rows start from the same numbers, so their first losses must
    agree (within 1e-3; a row that does not is flagged).

Ratios are to the jax row and to the donate_xla row (medians over medians). Prints a markdown
table, writes every run to bench/results/jax_target.json (``--out``).
Run: `python bench/jax_target.py [--repeats 3] [--steps 10]` (any interpreter: the parent
imports no torch; the rows run in the environments above, which `make test` creates).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import RssSampler, current_rss, median, write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = "gpt6x512_adamw"
BACKENDS = ("jax_target", "donate_xla", "openxla", "jax")
XLA_ROWS = ("donate_xla", "openxla")  # torch_xla's environment
LOSS_TOLERANCE = 1e-3
WORKER_ENV = {"PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}
WORKER_TIMEOUT_S = 3600


def _versions(*modules: str) -> dict:
    import importlib.metadata

    out = {}
    for module in modules:
        try:
            out[module] = importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# -- the workers (one row, one process) ---------------------------------------------------------

def timed_run(model_name: str, backend: str, steps: int, compiled, x, y, sync, read_loss, state) -> dict:
    """The first call, the warm-up calls, then ``steps`` measured steps under the RSS sampler.

    ``sync(loss)`` waits for the device after a call; ``read_loss(loss)`` is the loss as a
    float; ``state()`` the parameters and optimizer-state tensors."""
    from xla_common import WARM_UP_CALLS

    start = time.perf_counter()
    loss = compiled(x, y)
    sync(loss)
    first_step_s = time.perf_counter() - start
    first_loss = read_loss(loss)
    for _ in range(WARM_UP_CALLS - 1):
        sync(compiled(x, y))
    times = []
    rss_before = current_rss()
    with RssSampler() as sampler:
        for _ in range(steps):
            start = time.perf_counter()
            loss = compiled(x, y)
            sync(loss)
            times.append(time.perf_counter() - start)
    tensors = state()
    return dict(
        model=model_name,
        backend=backend,
        first_step_s=first_step_s,
        step_s=median(times),
        step_times=times,
        growth=sampler.peak - sampler.trough,
        peak_growth=sampler.peak - rss_before,
        first_loss=first_loss,
        last_loss=read_loss(loss),
        warm_up_calls=WARM_UP_CALLS,
        state_buffers=len(tensors),
        state_bytes=sum(t.numel() * t.element_size() for t in tensors),
        rss=[(t, r - sampler.trough) for t, r in sampler.samples[::4]],
    )


def jax_target_worker(model_name: str, steps: int) -> dict:
    import donate_backend

    device = donate_backend.jax_device()  # before any backward: the autograd engine counts devices then
    import jax
    import torch

    from donate_backend.jax.device import buffer_of
    from xla_common import build, state_tensors

    model, opt, step, (x, y) = build(model_name, device)

    def arrays():
        return [buffer_of(t).array for t in state_tensors(model, opt)] + [buffer_of(x).array, buffer_of(y).array]

    def sync(loss):
        loss.item()
        jax.block_until_ready(arrays())

    jax.block_until_ready(arrays())  # the weights and the batch are on the device before the first call
    compiled = torch.compile(step, backend="donate_xla")
    result = timed_run(model_name, "jax_target", steps, compiled, x, y, sync, lambda loss: float(loss.item()),
                       lambda: state_tensors(model, opt))
    records = donate_backend.reports()
    return dict(result, graphs=len(records), paths=sorted({r.path for r in records}), jax_backend=jax.default_backend(),
                versions=_versions("torch", "jax", "jaxlib"))


def torch_xla_worker(model_name: str, backend: str, steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import donate_backend
    from xla_common import build, state_tensors

    device = torch_xla.device()
    model, opt, step, (x, y) = build(model_name, device)
    torch_xla.sync()
    xm.wait_device_ops()  # the weights and the batch are on the device before the first call
    compiled = torch.compile(step, backend=backend)

    def sync(loss):
        torch_xla.sync()
        xm.wait_device_ops()

    result = timed_run(model_name, backend, steps, compiled, x, y, sync, lambda loss: float(loss.detach().cpu()),
                       lambda: state_tensors(model, opt))
    extra = {}
    if backend == "donate_xla":
        records = donate_backend.reports()
        extra = dict(graphs=len(records), stitched=any(r.stitched for r in records if r.kind == "backward"))
    return dict(result, **extra, versions=_versions("torch", "torch_xla"))


def jax_row_worker(model_name: str, steps: int) -> dict:
    from jax_common import jax_worker

    result = jax_worker(model_name, steps)
    keep = ("first_step_s", "step_s", "step_times", "first_loss", "last_loss", "peak_growth", "state_buffers",
            "params", "torch_first_loss", "rss")
    return dict({k: result[k] for k in keep if k in result}, model=model_name, backend="jax",
                growth=result["transient"], versions={"jax": result["jax"]})


def worker(model_name: str, backend: str, steps: int) -> dict:
    if backend == "jax_target":
        return jax_target_worker(model_name, steps)
    if backend == "jax":
        return jax_row_worker(model_name, steps)
    return torch_xla_worker(model_name, backend, steps)


# -- the parent -----------------------------------------------------------------------------------

def jax_environment(newest_python: str) -> str | None:
    """The interpreter bench/jax_gpt.py runs in: jax_common's choice, else the newest environment."""
    from jax_common import jax_python

    found = jax_python()
    if found is not None:
        return found
    return newest_python if os.path.exists(newest_python) else None


def run_one(python: str, backend: str, steps: int, env: dict) -> dict:
    """One row in a fresh ``python``; a failure is kept (its error) and the benchmark goes on."""
    command = [python, os.path.abspath(__file__), "--worker", MODEL, backend, "--steps", str(steps)]
    start = time.perf_counter()
    try:
        out = subprocess.run(command, env=dict(os.environ, **WORKER_ENV, **env), capture_output=True, text=True,
                             timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(backend=backend, error=f"timed out after {WORKER_TIMEOUT_S} s")
    wall = time.perf_counter() - start
    if out.returncode != 0:
        return dict(backend=backend, error=out.stderr[-6000:], returncode=out.returncode, wall_s=wall)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), wall_s=wall)


def spread(runs: list, key: str) -> tuple[float, float, float]:
    values = [r[key] for r in runs]
    return median(values), min(values), max(values)


def summarize(runs_by_backend: dict) -> dict:
    """Per row: the medians and ranges, and the ratios to the jax and donate_xla rows."""
    good = {b: [r for r in runs if "error" not in r] for b, runs in runs_by_backend.items()}
    rows = {}
    for backend, runs in good.items():
        if runs:
            rows[backend] = {key: spread(runs, key) for key in ("first_step_s", "step_s", "growth", "first_loss")}
    for backend, row in rows.items():
        for ref in ("jax", "donate_xla"):
            for key in ("first_step_s", "step_s", "growth"):
                denominator = rows[ref][key][0] if ref in rows else None
                row[f"{key}_x_{ref}"] = row[key][0] / denominator if denominator else None
    return rows


def markdown_table(rows: dict, runs_by_backend: dict, steps: int, repeats: int) -> str:
    mib = 2**20
    ratio = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    head = ("| row | first step s | x jax | x donate_xla | step s | x jax | x donate_xla "
            "| growth MiB | x jax | x donate_xla | first loss |")
    lines = [f"{MODEL} on XLA:CPU: {steps} measured steps x {repeats} repeats, medians [min-max]", "", head,
             "|" + "---|" * head.count(" | ") + "---|"]
    for backend, runs in runs_by_backend.items():
        if backend not in rows:
            failed = sum("error" in r for r in runs)
            lines.append(f"| {backend} | failed ({failed}/{len(runs)} runs) |" + " |" * 9)
            continue
        row = rows[backend]
        cells = [backend]
        for key, scale, fmt in (("first_step_s", 1, ".2f"), ("step_s", 1, ".3f"), ("growth", mib, ".1f")):
            value, lo, hi = (v / scale for v in row[key])
            cells += [f"{value:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]", ratio(row[f"{key}_x_jax"]),
                      ratio(row[f"{key}_x_donate_xla"])]
        cells.append(f"{row['first_loss'][0]:.5f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_check(runs_by_backend: dict) -> list[str]:
    """Rows whose first loss is more than LOSS_TOLERANCE from the others' median."""
    losses = [(b, r["repeat"], r["first_loss"]) for b, runs in runs_by_backend.items() for r in runs
              if "error" not in r]
    if not losses:
        return []
    ref = median([v for _, _, v in losses])
    return [f"{b} (repeat {i}): first loss {v:.6f} differs from the rows' median {ref:.6f} by "
            f"{abs(v - ref):.2e} (> {LOSS_TOLERANCE})" for b, i, v in losses if abs(v - ref) > LOSS_TOLERANCE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="the results file (default bench/results/jax_target.json)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated subset of {', '.join(BACKENDS)}")
    parser.add_argument("--xla-python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                        help="torch_xla's environment (donate_xla, openxla, and the jax row's torch side)")
    parser.add_argument("--newest-python", default=os.path.join(ROOT, ".venv-newest", "bin", "python"),
                        help="the interpreter of the JAX target's environment (torch 2.15 with jax)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "BACKEND"), help="internal: one run")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return

    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(BACKENDS)}")
    plans = {}  # row -> (interpreter, extra environment)
    for backend in backends:
        if backend == "jax_target":
            plans[backend] = (args.newest_python, {})
        elif backend == "jax":
            jax_python = jax_environment(args.newest_python)
            if jax_python is None:
                print("jax row skipped: no JAX environment (.venv-jax, DONATE_XLA_JAX_PYTHON or .venv-newest)")
                continue
            plans[backend] = (args.xla_python, {"DONATE_XLA_JAX_PYTHON": os.path.abspath(jax_python)})
        else:
            plans[backend] = (args.xla_python, {})
    for backend, (python, _) in plans.items():
        if not os.path.exists(python):
            parser.error(f"{backend}: no interpreter at {python}")
    rows_in_order = list(plans)
    runs = {b: [] for b in rows_in_order}
    for repeat in range(args.repeats):
        shift = repeat % len(rows_in_order)
        order = rows_in_order[shift:] + rows_in_order[:shift]
        for backend in order:
            python, env = plans[backend]
            run = run_one(python, backend, args.steps, env)
            run["repeat"] = repeat
            runs[backend].append(run)
            if "error" in run:
                print(f"[repeat {repeat}] {backend} FAILED:\n{run['error']}", flush=True)
            else:
                print(f"[repeat {repeat}] {backend}: first step {run['first_step_s']:.2f} s, step "
                      f"{run['step_s']:.3f} s, growth {run['growth'] / 2**20:.1f} MiB, first loss "
                      f"{run['first_loss']:.6f}", flush=True)
    rows = summarize(runs)
    versions = {}
    for backend, backend_runs in runs.items():
        for run in backend_runs:
            for module, version in run.get("versions", {}).items():
                key = module if backend in XLA_ROWS or module.startswith("jax") else f"{module} ({backend})"
                versions.setdefault(key, version)
    write_results("jax_target", dict(model=MODEL, runs=runs, summary=rows), repeats=args.repeats, steps=args.steps,
                  path=args.out, modules=(), more_versions=versions, backends=rows_in_order,
                  worker_env=WORKER_ENV, loss_tolerance=LOSS_TOLERANCE)
    print()
    print(markdown_table(rows, runs, args.steps, args.repeats))
    problems = loss_check(runs)
    print()
    print("\n".join(problems) if problems else f"first losses agree within {LOSS_TOLERANCE}")


if __name__ == "__main__":
    main()
