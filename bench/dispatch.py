"""Does the host wait? donate_xla vs openxla: when a compiled call returns, and per-call host time.

Three measurements, each backend in fresh processes, `--repeats` interleaved runs, medians:
  - heavy: a 6 x Linear(2048) SGD-momentum step, batch 512. `return` is the time
    until `step(x)` returns, `done` until the device has finished
    (`xm.wait_device_ops()`); reported as return / done (torch_xla executes
    asynchronously: a call that returns early lets Python prepare the next step).
  - tiny: a 32 -> 64 -> 8 MLP step, batch 16: host seconds per call, the median of
    5 windows of 200 calls, each window followed by a wait for the device (the
    device work is negligible, so this is the backend's own per-call cost).
  - micro: 8 compiled forward/backward micro-batches, then a compiled optimizer
    step, per training step (gradient accumulation): seconds per training step.
The heavy step also runs under each lever of donate_xla (``LEVERS``: backward segments,
the stitched step, the separate executables, a memory limit), since each adds its own
work to a call. Targets: heavy return/done <= 5% on every row; tiny and micro <= 1.0x
openxla. Run: `make bench`.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

BACKENDS = ("donate_xla", "openxla")
# donate_xla under each lever, on the heavy step: row -> torch.compile options
LEVERS = {
    "donate_xla_segments": {"backward_segments": 8},
    "donate_xla_stitch": {"stitch": True},
    "donate_xla_separate": {"stitch": False},
    "donate_xla_limit": {"memory_limit": 2**31},
}
HEAVY_STEPS, TINY_CALLS, TINY_WINDOWS, MICRO_STEPS, MICRO_BATCHES = 5, 200, 5, 6, 8


def _mlp(widths):
    import torch

    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _compiled_sgd_step(widths, batch: int, backend: str):
    """A compiled SGD-momentum training step of an MLP on the XLA device, and its input."""
    import torch
    import torch_xla

    import donate_backend  # noqa: F401

    device = torch_xla.device()
    torch.manual_seed(0)
    model = _mlp(widths).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    options = LEVERS.get(backend)
    compiled = torch.compile(backend="donate_xla", options=options) if options else torch.compile(backend=backend)

    @compiled
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, torch.randn(batch, widths[0]).to(device)


def heavy(backend: str) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm

    step, x = _compiled_sgd_step([2048] * 7, 512, backend)

    for _ in range(3):
        step(x)
        xm.wait_device_ops()
    returns, dones = [], []
    for _ in range(HEAVY_STEPS):
        start = time.perf_counter()
        step(x)
        returns.append(time.perf_counter() - start)
        torch_xla.sync()
        xm.wait_device_ops()
        dones.append(time.perf_counter() - start)
    from xla_common import median

    return dict(return_s=median(returns), done_s=median(dones), fraction=median(r / d for r, d in zip(returns, dones)),
                returns=returns, dones=dones)


def tiny(backend: str) -> dict:
    import torch_xla
    import torch_xla.core.xla_model as xm

    step, x = _compiled_sgd_step([32, 64, 8], 16, backend)

    for _ in range(5):
        step(x)
    torch_xla.sync()
    xm.wait_device_ops()
    windows = []
    for _ in range(TINY_WINDOWS):
        start = time.perf_counter()
        for _ in range(TINY_CALLS):
            step(x)
        windows.append((time.perf_counter() - start) / TINY_CALLS)
        torch_xla.sync()
        xm.wait_device_ops()
    from xla_common import median

    return dict(host_s_per_call=median(windows), windows=windows)


def micro(backend: str) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import donate_backend  # noqa: F401

    device = torch_xla.device()
    torch.manual_seed(0)
    model = _mlp([256, 512, 512, 16]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randn(32, 256).to(device) for _ in range(MICRO_BATCHES)]

    @torch.compile(backend=backend)
    def forward_backward(x):
        loss = model(x).square().mean() / MICRO_BATCHES
        loss.backward()
        return loss

    @torch.compile(backend=backend)
    def optimizer_step():
        opt.step()
        opt.zero_grad()

    def train_step():
        for x in batches:
            forward_backward(x)
        optimizer_step()
        torch_xla.sync()
        xm.wait_device_ops()

    for _ in range(3):
        train_step()
    times = []
    for _ in range(MICRO_STEPS):
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
    from xla_common import median

    return dict(step_s=median(times), step_times=times)


KINDS = {"heavy": heavy, "tiny": tiny, "micro": micro}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "BACKEND"), help="internal: one run")
    parser.add_argument("--json", help="write the results here instead of bench/results/")
    args = parser.parse_args()
    if args.worker:
        kind, backend = args.worker
        print(json.dumps(KINDS[kind](backend)))
        return

    from xla_common import run_worker, summarize, write_results

    rows = [(k, b) for k in KINDS for b in BACKENDS + (tuple(LEVERS) if k == "heavy" else ())]
    runs = {row: [] for row in rows}
    for _ in range(args.repeats):
        for kind, backend in rows:
            runs[kind, backend].append(run_worker(__file__, "--worker", kind, backend))
    figure = {"heavy": "fraction", "tiny": "host_s_per_call", "micro": "step_s"}
    print(f"\n== dispatch: {args.repeats} repeats, medians [min-max]")
    summary = {}
    for kind, key in figure.items():
        for backend in BACKENDS + (tuple(LEVERS) if kind == "heavy" else ()):
            median, lo, hi = summarize(runs[kind, backend], key)
            summary[f"{kind}_{backend}"] = dict(median=median, min=lo, max=hi)
            extra = ""
            if kind == "heavy":
                done = summarize(runs[kind, backend], "done_s")[0]
                extra = f"  (returns after {summarize(runs[kind, backend], 'return_s')[0] * 1e3:.1f} ms of {done * 1e3:.0f} ms)"
            print(f"{kind:6} {backend:11} {key:16} {median:10.4g} [{lo:.4g}-{hi:.4g}]{extra}")
        if kind != "heavy":
            ratio = summary[f"{kind}_donate_xla"]["median"] / summary[f"{kind}_openxla"]["median"]
            summary[f"{kind}_ratio"] = ratio
            print(f"{kind:6} ratio donate_xla / openxla: {ratio:.2f}")
    write_results("dispatch", [dict(kind=k, backend=b, runs=r) for (k, b), r in runs.items()],
                  repeats=args.repeats, steps=None, path=args.json,
                  per_process=dict(heavy_steps=HEAVY_STEPS, tiny_calls=TINY_CALLS, tiny_windows=TINY_WINDOWS,
                                   micro_steps=MICRO_STEPS, micro_batches=MICRO_BATCHES))


if __name__ == "__main__":
    main()
