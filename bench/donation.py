"""Peak memory of a training step: donate_xla vs openxla vs openxla with donors flagged by hand.

Each backend runs `--repeats` times (default 3), interleaved, each in a fresh
process; the figures are medians over the repeats, with their range. (compiles, creates optimizer state) the process samples its RSS every 5 ms over `--steps` steps.
On XLA:CPU device buffers live in host memory, so RSS growth is device memory
growth. Reported per backend:
  - peak RSS growth over the steps (peak - RSS before the first measured step)
  - state buffers reused per step: parameters and optimizer-state tensors whose
    new device address is one of the old ones (buffer-donor semantics let XLA
    give a parameter the old buffer of a same-shaped momentum, so sets compare)
  - median step time
The floor is what a step must allocate however it is compiled: the gradients
plus the activations saved for backward (computed from the model, see below).
Writes docs/donation_rss.png (RSS over the steps). Run: `make bench`.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

BACKENDS = ("donate_xla", "openxla", "openxla_flagged")
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


def activation_bytes(model_name: str) -> int:
    """Bytes of activations saved for backward, from the model's shapes (fp32)."""
    if model_name == "mlp50m_sgd":
        batch, width, depth = 64, 2560, 8
        return 4 * batch * width * (depth + 1)  # each layer saves its input (relu output)
    batch, seq, width, depth, heads, vocab = 8, 128, 512, 6, 8, 8192
    per_block = 4 * batch * seq * (16 * width) + 4 * batch * heads * seq * seq * 2
    return depth * per_block + 4 * batch * seq * (vocab + width)


def worker(model_name: str, backend: str, steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import donate_backend  # noqa: F401
    from xla_common import RssSampler, build, current_rss, median, state_tensors

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

    compiled = torch.compile(step, backend="openxla" if backend.startswith("openxla") else backend)

    def run_step():
        loss = compiled(x, y)
        torch_xla.sync()
        xm.wait_device_ops()
        return loss

    for _ in range(2):  # compile every graph and create the optimizer state
        run_step()
    state = state_tensors(model, opt)
    before_ptrs = {XLAC._unsafe_buffer_pointer(t) for t in state}
    times = []
    rss_before = current_rss()
    with RssSampler() as sampler:
        for i in range(steps):
            start = time.perf_counter()
            run_step()
            times.append(time.perf_counter() - start)
            if i == 0:
                after_ptrs = [XLAC._unsafe_buffer_pointer(t) for t in state_tensors(model, opt)]
    reused = sum(p in before_ptrs for p in after_ptrs)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(
        model=model_name,
        backend=backend,
        peak_growth=sampler.peak - rss_before,
        state_buffers=len(state),
        reused=reused,
        step_s=median(times),
        floor=grad_bytes + activation_bytes(model_name),
        grad_bytes=grad_bytes,
        rss=[(t, r - rss_before) for t, r in sampler.samples[::4]],
    )


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, result in zip(axes[0], rows):
        for backend in BACKENDS:
            r = result[backend]
            ax.plot([t for t, _ in r["rss"]], [m / 2**20 for _, m in r["rss"]], label=backend)
        floor = result["donate_xla"]["floor"] / 2**20
        ax.axhline(floor, color="gray", linestyle="--", label="floor (grads + activations)")
        ax.set_title(result["donate_xla"]["model"])
        ax.set_xlabel("seconds into the measured steps")
        ax.set_ylabel("RSS above the start (MiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    from xla_common import bench_arguments

    parser = bench_arguments(__doc__.splitlines()[0])
    parser.add_argument("--plot", default=os.path.join(DOCS, "donation_rss.png"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return

    from xla_common import run_repeated, summarize, write_json

    mib = lambda b: b / 2**20  # noqa: E731
    rows, summary = [], []
    for model_name in args.models.split(","):
        runs = run_repeated(__file__, model_name, BACKENDS, args.repeats, "--steps", str(args.steps))
        rows.append({b: runs[b][0] for b in BACKENDS})  # the plot shows the first repeat
        ref_peak = summarize(runs["openxla"], "peak_growth")[0]
        ref_step = summarize(runs["openxla"], "step_s")[0]
        first = runs["donate_xla"][0]
        print(f"\n== {model_name}: {args.steps} steps x {args.repeats} repeats (medians, [min-max]); floor "
              f"{mib(first['floor']):.0f} MiB (grads {mib(first['grad_bytes']):.0f} + activations "
              f"{mib(first['floor'] - first['grad_bytes']):.0f})")
        print(f"{'backend':18}{'peak growth MiB':>26}{'x openxla':>11}{'x floor':>9}{'reused/state':>14}{'step s':>9}{'x openxla':>11}")
        for backend in BACKENDS:
            peak, lo, hi = summarize(runs[backend], "peak_growth")
            step = summarize(runs[backend], "step_s")[0]
            reused = summarize(runs[backend], "reused")[0]
            state = runs[backend][0]["state_buffers"]
            print(
                f"{backend:18}{mib(peak):>10.1f} [{mib(lo):>6.0f}-{mib(hi):<6.0f}]"
                f"{peak / ref_peak:>11.2f}{peak / first['floor']:>9.2f}{reused:>8.0f}/{state:<5d}"
                f"{step:>9.3f}{step / ref_step:>11.2f}"
            )
            summary.append(dict(model=model_name, backend=backend, peak_growth=peak, peak_min=lo, peak_max=hi,
                                step_s=step, reused=reused, state_buffers=state, floor=first["floor"]))
    if args.plot:
        plot(rows, args.plot)
        print(f"\nplot: {args.plot}")
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
