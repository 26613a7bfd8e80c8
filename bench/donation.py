"""Peak memory of a training step: donate_xla vs openxla vs openxla with donors flagged by hand.

Each backend runs `--repeats` times (default 5), interleaved, each in a fresh
process; the figures are medians over the repeats, with their range. After four
warm-up calls (they compile, create the optimizer state, and let the default choose and
compile its step: ``xla_common.WARM_UP_CALLS``) the process samples its RSS every 5 ms over
`--steps` steps. On XLA:CPU device buffers live in host memory,
so RSS is device memory. Every configuration runs under two allocator settings:

  - glibc: the default malloc, as a user runs it. Reported: peak RSS growth over
    the steps (peak - RSS before the first measured step). It includes what the
    allocator keeps after a free (fragmentation), which is real memory the
    process holds, but it varies a lot from run to run.
  - live: MALLOC_MMAP_THRESHOLD_=65536, so every buffer of 64 KiB or more is its
    own mapping, given back to the OS when freed, and RSS follows the live
    bytes. Reported: peak - trough (the least RSS during the steps, when only
    the parameters and optimizer state are live): what a step needs on top of
    its persistent state. Stable to a few MiB.

Also reported: state buffers reused per step (parameters and optimizer-state
tensors whose new device address is one of the old ones; buffer-donor semantics
let XLA give a parameter the old buffer of a same-shaped momentum, so sets are
compared), how many of them got their own buffer back (XLA pairs donated buffers
with same-sized results in parameter order, so two state tensors can swap buffers,
which costs a copy of each), the median step time (from the glibc runs) and the share of
a step after which the compiled call returned (torch_xla runs asynchronously: a call that
waits for nothing returns long before the device is done).
Rows: donate_xla (the default: separate forward, backward and optimizer executables,
or the stitched step where its plan chooses it after two steps), donate_xla_separate
(DONATE_XLA_STITCH=0: never stitched, the default before it chose), donate_xla_stitch
(DONATE_XLA_STITCH=1: they run as one lazy whole-step graph),
donate_xla_budget (DONATE_XLA_ACTIVATION_BUDGET=0.1: recompute instead of saving
most activations), donate_xla_budget_0.45 (DONATE_XLA_ACTIVATION_BUDGET=0.45: a bit
under half the activations saved, cheap ones recomputed), donate_xla_stitch_budget_0.45 (both
switches), donate_xla_budget_sched (budget
0.1 with XLA's memory-minimising CPU scheduler,
XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false), donate_xla_segments
(DONATE_XLA_BACKWARD_SEGMENTS=8: each backward runs as 8 executables, releasing saved
activations as it goes), donate_xla_segments_budget_0.8 and _0.7 (that and the
activation budget), donate_xla_limit_0.7 and _0.8 (``options={"memory_limit": ...}`` at the
default step's predicted resident bytes plus 0.7 or 0.8 of its predicted growth: the planner chooses segments
or an activation budget to fit, with the optimizer state counted from the third step, or
refuses before a step runs, which the row then reports), openxla, openxla
with every state buffer flagged for donation by hand, lazy (plain torch_xla: no torch.compile, torch_xla.sync() per step) and
lazy_sched (lazy with the memory-minimising scheduler), and on the GPT jax and jax_remat
(JAX's whole-step jit with donate_argnums, from the same weights, plain and with each block
under jax.checkpoint: bench/jax_gpt.py; skipped without a JAX environment). `--backends`
runs a subset.
The floor is what a step must hold at its peak however it is compiled: the
gradients plus the activations saved for backward, measured as the bytes of
donate_xla's backward inputs that are neither parameters nor incoming
gradients (openxla's default partitioner saves more: transposed weights too), in
a run whose backward is one executable (``floor_bytes``).
Writes every run (its RSS trace included) to bench/results/donation.json; bench/render.py
draws docs/donation_rss.png from it. Run: `make bench`. `make bench` also writes
bench/results/donation_default.json: the default against the rows it chooses between and the
references, on the four models of bench/xla_common.py (`--json`), one run.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from jax_common import jax_python, jax_worker  # noqa: E402

BACKENDS = (
    "donate_xla", "donate_xla_separate", "donate_xla_stitch", "donate_xla_budget", "donate_xla_budget_0.45", "donate_xla_stitch_budget_0.45",
    "donate_xla_budget_sched", "donate_xla_one_backward", "donate_xla_segments", "donate_xla_segments_budget_0.8", "donate_xla_segments_budget_0.7",
    "donate_xla_limit_0.7", "donate_xla_limit_0.8", "openxla", "openxla_flagged", "lazy", "lazy_sched", "jax", "jax_remat",
)
# memory_limit rows: the limit is the default step's predicted resident bytes (parameters,
# optimizer state, batch) plus this share of its predicted growth (``memory_plan()`` after
# two default steps in the same process, then compiled again with
# ``options={"memory_limit": ...}``); a limit no plan meets is reported as refused
LIMIT_ROWS = {"donate_xla_limit_0.7": 0.7, "donate_xla_limit_0.8": 0.8}
# JAX's whole-step jit with donate_argnums (bench/jax_gpt.py), on the GPT only: plain, and with
# each block under jax.checkpoint
JAX_ROWS = {"jax": [], "jax_remat": ["--remat"]}
JAX_MODEL = "gpt6x512_adamw"
MEMORY_SCHEDULER = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=false"}
# variants: the switches they run under (set before the XLA client starts)
VARIANTS = {
    "donate_xla_separate": {"DONATE_XLA_STITCH": "0"},
    "donate_xla_stitch": {"DONATE_XLA_STITCH": "1"},
    "donate_xla_one_backward": {"DONATE_XLA_BACKWARD_SEGMENTS": "0"},
    "donate_xla_segments": {"DONATE_XLA_BACKWARD_SEGMENTS": "8"},
    "donate_xla_segments_budget_0.8": {"DONATE_XLA_BACKWARD_SEGMENTS": "8", "DONATE_XLA_ACTIVATION_BUDGET": "0.8"},
    "donate_xla_segments_budget_0.7": {"DONATE_XLA_BACKWARD_SEGMENTS": "8", "DONATE_XLA_ACTIVATION_BUDGET": "0.7"},
    "donate_xla_budget": {"DONATE_XLA_ACTIVATION_BUDGET": "0.1"},
    "donate_xla_budget_0.45": {"DONATE_XLA_ACTIVATION_BUDGET": "0.45"},
    "donate_xla_stitch_budget_0.45": {"DONATE_XLA_STITCH": "1", "DONATE_XLA_ACTIVATION_BUDGET": "0.45"},
    "donate_xla_budget_sched": {"DONATE_XLA_ACTIVATION_BUDGET": "0.1", **MEMORY_SCHEDULER},
    "lazy_sched": MEMORY_SCHEDULER,
}
ALLOCATORS = {"glibc": {}, "live": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
FIGURE = {"glibc": "peak_growth", "live": "transient"}  # the growth each setting reports


def saved_activation_bytes(backward_gm) -> int:
    """Bytes of a backward graph's inputs that the forward saved for it."""
    total = 0
    for node in backward_gm.graph.nodes:
        if node.op != "placeholder" or node.name.startswith(("primals_", "tangents_")):
            continue
        value = node.meta.get("val")
        if hasattr(value, "untyped_storage"):
            total += value.numel() * value.element_size()
    return total


def saved_activations_of_compiled_backwards() -> int:
    """Saved-activation bytes of every backward graph donate_xla compiled (from its records)."""
    import donate_backend

    return sum(
        saved_activation_bytes(r.lowered.traced.gm)
        for r in donate_backend.reports()
        if r.path == "xla" and r.kind == "backward" and r.lowered is not None
    )


def worker(model_name: str, backend: str, steps: int) -> dict:
    if backend in JAX_ROWS:
        return dict(jax_worker(model_name, steps, JAX_ROWS[backend]), backend=backend, saved_bytes=None)
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    os.environ.update(VARIANTS.get(backend, {}))  # read when donate_backend is imported
    import donate_backend
    from xla_common import WARM_UP_CALLS, RssSampler, build, current_rss, median, state_tensors

    XLAC = torch_xla._XLAC
    device = torch_xla.device()
    model, opt, step, (x, y) = build(model_name, device)
    if backend == "openxla_flagged":
        import torch_xla.experimental.dynamo_set_buffer_donor  # noqa: F401

        plain_step = step

        def step(x, y):  # noqa: F811 - flag every parameter and state buffer by hand
            for t in state_tensors(model, opt):
                torch.ops.xla.dynamo_set_buffer_donor_(t, True)
            return plain_step(x, y)

    limit = None
    if backend.startswith("lazy"):  # plain torch_xla: one lazy graph per step, traced again every step
        compiled = step
    elif backend in LIMIT_ROWS:
        default = torch.compile(step, backend="donate_xla")
        for _ in range(2):
            default(x, y)
            torch_xla.sync()
        xm.wait_device_ops()
        default_plan = donate_backend.memory_plan()
        limit = default_plan.resident_bytes + int(LIMIT_ROWS[backend] * default_plan.growth_bytes)
        del default
        torch._dynamo.reset()
        donate_backend.clear_reports()
        compiled = torch.compile(step, backend="donate_xla", options={"memory_limit": limit})
    else:
        compiled = torch.compile(step, backend="openxla" if backend.startswith("openxla") else "donate_xla")

    def run_step():
        loss = compiled(x, y)
        torch_xla.sync()
        xm.wait_device_ops()
        return loss

    try:
        for _ in range(WARM_UP_CALLS):  # the default and a limit settle (xla_common)
            run_step()
    except Exception as error:  # noqa: BLE001 - a limit no plan meets: refused before the step runs
        if limit is None or "memory_limit" not in str(error):
            raise
        return dict(model=model_name, backend=backend, limit=limit, refused=str(error).splitlines()[0][:600])
    state = state_tensors(model, opt)
    before = [XLAC._unsafe_buffer_pointer(t) for t in state]
    before_ptrs = set(before)
    times = []
    rss_before = current_rss()
    returns = []  # the share of a step after which the compiled call returned (the host went on)
    with RssSampler() as sampler:
        for i in range(steps):
            start = time.perf_counter()
            compiled(x, y)
            returned = time.perf_counter() - start
            torch_xla.sync()
            xm.wait_device_ops()
            times.append(time.perf_counter() - start)
            returns.append(returned / times[-1])
            if i == 0:
                after_ptrs = [XLAC._unsafe_buffer_pointer(t) for t in state_tensors(model, opt)]
    reused = sum(p in before_ptrs for p in after_ptrs)
    own = sum(a == b for a, b in zip(before, after_ptrs))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    backwards = [r for r in donate_backend.reports() if r.path == "xla" and r.kind == "backward"]
    plan = donate_backend.memory_plan() if limit is not None else None  # the step as planned under the limit
    return dict(
        model=model_name,
        backend=backend,
        backward_segments=max((r.backward_segments for r in backwards), default=0),
        # the step ran stitched (chosen by default, donate_backend.choice, or by the switch)
        stitched=any(r.stitched for r in backwards),
        limit=limit,
        state_bytes=sum(t.numel() * t.element_size() for t in state),
        choices=list(plan.choices) if plan is not None else None,
        predicted_peak=plan.peak_bytes if plan is not None else None,
        predicted_resident=plan.resident_bytes if plan is not None else None,
        peak_growth=sampler.peak - rss_before,
        transient=sampler.peak - sampler.trough,
        state_buffers=len(state),
        reused=reused,
        own=own,
        step_s=median(times),
        step_times=times,
        return_fraction=median(returns),
        grad_bytes=grad_bytes,
        saved_bytes=saved_activations_of_compiled_backwards() if backend.startswith("donate_xla") else None,
        rss=[(t, r - sampler.trough) for t, r in sampler.samples[::4]],
    )


def floor_bytes(live_runs: dict):
    """Gradient bytes plus the activations saved for the backward, from the first run of the
    rows that save every activation in one backward (donate_xla, donate_xla_stitch; not one
    split into segments, whose inputs include the values passed between segments); None when
    no such row ran."""
    for backend in ("donate_xla", "donate_xla_separate", "donate_xla_stitch"):
        for run in live_runs.get(backend, []):
            if not run.get("backward_segments") and run.get("saved_bytes") is not None:
                return run["grad_bytes"] + run["saved_bytes"], run["grad_bytes"], run["saved_bytes"]
    return None


def print_table(model_name: str, runs_by_allocator: dict, floor: int, summary: list) -> None:
    from xla_common import summarize

    mib = lambda b: b / 2**20  # noqa: E731
    glibc = runs_by_allocator["glibc"]
    ref_step = summarize(glibc["openxla"], "step_s")[0]
    print(f"{'backend':24}{'allocator':>10}{'growth MiB':>24}{'x openxla':>11}{'x floor':>9}"
          f"{'reused/state':>14}{'own':>5}{'step s':>9}{'x openxla':>11}")
    for allocator, runs in runs_by_allocator.items():
        figure = FIGURE[allocator]
        ref = summarize(runs["openxla"], figure)[0]
        for backend in runs:
            growth, lo, hi = summarize(runs[backend], figure)
            step = summarize(glibc[backend], "step_s")[0]
            reused = summarize(runs[backend], "reused")[0]
            own = summarize(runs[backend], "own")[0]
            state = runs[backend][0]["state_buffers"]
            print(
                f"{backend:24}{allocator:>10}{mib(growth):>8.1f} [{mib(lo):>5.0f}-{mib(hi):<5.0f}]"
                f"{growth / ref:>11.2f}{growth / floor:>9.2f}{reused:>8.0f}/{state:<5d}{own:>5.0f}"
                f"{step:>9.3f}{step / ref_step:>11.2f}"
            )
            summary.append(dict(model=model_name, backend=backend, allocator=allocator, growth=growth,
                                growth_min=lo, growth_max=hi, x_openxla=growth / ref, x_floor=growth / floor,
                                step_s=step, x_openxla_step=step / ref_step, reused=reused, own=own,
                                state_buffers=state, floor=floor))


def main() -> None:
    from xla_common import bench_arguments

    parser = bench_arguments(__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of the rows")
    parser.set_defaults(repeats=3)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return

    from xla_common import run_repeated, write_results

    mib = lambda b: b / 2**20  # noqa: E731
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not {"donate_xla", "openxla"} <= set(backends):
        parser.error(f"rows {backends}: donate_xla and openxla are needed (the floor, the ratios); "
                     f"choose from {', '.join(BACKENDS)}")
    if set(backends) & set(JAX_ROWS) and jax_python() is None:
        print("JAX rows skipped: no JAX environment (`make bench` creates .venv-jax from "
              "requirements-jax.txt; DONATE_XLA_JAX_PYTHON names another interpreter)")
        backends = [b for b in backends if b not in JAX_ROWS]
    summary, results = [], []
    for model_name in args.models.split(","):
        rows_here = [b for b in backends if b not in JAX_ROWS or model_name == JAX_MODEL]
        runs_by_allocator = {
            allocator: run_repeated(__file__, model_name, rows_here, args.repeats, "--steps", str(args.steps), env=env)
            for allocator, env in ALLOCATORS.items()
        }
        refused = {}
        for runs in runs_by_allocator.values():
            for backend in list(runs):
                if any("refused" in r for r in runs[backend]):
                    refused[backend] = next(r for r in runs[backend] if "refused" in r)
                    del runs[backend]
        floor, grad_bytes, saved_bytes = floor_bytes(runs_by_allocator["live"]) or (float("nan"),) * 3
        print(f"\n== {model_name}: {args.steps} steps x {args.repeats} repeats (medians, [min-max]); floor "
              f"{mib(floor):.0f} MiB (grads {mib(grad_bytes):.0f} + saved activations {mib(saved_bytes):.0f})")
        print_table(model_name, runs_by_allocator, floor, summary)
        for backend, run in refused.items():
            print(f"{backend:24} refused before a step ran (limit {mib(run['limit']):.1f} MiB): {run['refused']}")
        for backend in LIMIT_ROWS:
            for run in runs_by_allocator["live"].get(backend, [])[:1]:
                peak = run["state_bytes"] + run["transient"]
                print(f"{backend:24} limit {mib(run['limit']):.1f} MiB; measured peak (state + live growth) "
                      f"{mib(peak):.1f} MiB: {'within' if peak <= run['limit'] else 'OVER'} the limit; "
                      f"predicted peak {mib(run['predicted_peak']):.1f} MiB (resident "
                      f"{mib(run['predicted_resident']):.1f}, growth "
                      f"{mib(run['predicted_peak'] - run['predicted_resident']):.1f}); "
                      f"plan: {'; '.join(run['choices'] or [])}")
        results.append(dict(model=model_name, runs=runs_by_allocator, refused=refused))  # the floor: floor_bytes(runs)
    jax_versions = {r["jax"] for m in results for runs in m["runs"].values() for b in JAX_ROWS
                    for r in runs.get(b, [])}
    write_results("donation", results, repeats=args.repeats, steps=args.steps, path=args.json,
                  more_versions={"jax": sorted(jax_versions)[0]} if jax_versions else None,
                  backends=backends, allocators=ALLOCATORS, variants=VARIANTS)


if __name__ == "__main__":
    main()
