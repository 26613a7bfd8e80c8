"""XLA path: the memory plan's predicted step against live bytes measured on XLA:CPU.

Each model and setting runs in a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536``
(RSS follows the live bytes, docs/benchmarks.md): the whole training step is
compiled with donate_xla, runs 4 times (compiles, creates optimizer state; a step
the default stitches is rebuilt at the third call and first donates, compiling
that variant, at the fourth), then ``donate_backend.memory_plan()`` predicts one
step and the process samples its RSS every 2 ms over 4 more steps. Compared:

- growth: the plan's ``growth_bytes`` against the measured peak - trough (the
  trough is when only parameters, optimizer state and the batch are live);
- peak: the plan's ``peak_bytes`` against the state's exact bytes plus the
  measured growth (what the plan's accuracy target is stated on).

On XLA:CPU the compiler runs in the same process, so RSS also holds what XLA
uses while it compiles. On an accelerator that is host memory, not device
memory, and the plan does not predict it: samples taken while XLA compiles
(torch_xla's ``CompileTime`` intervals, 3 ms either side) are left out of the
peak, and, where XLA compiled during the measured steps, each step's growth is
taken over the trough just before it (the executables a compile adds stay in
host memory, and the trough climbs with them). Only a step that compiles again
every time is changed by this: the measured steps' compiles are counted and the
growth with them kept beside it.

Models: the four of bench/xla_common.py (``MODELS``: a 50M-parameter MLP with SGD
momentum, a 6-layer GPT with AdamW; ``MORE_MODELS``: 8 x (Linear 2048 + GELU) batch 256
with SGD momentum, a 4-layer pre-LN transformer d=512 with AdamW). Settings: default,
DONATE_XLA_STITCH=1, DONATE_XLA_BACKWARD_SEGMENTS=8.

And the real models of tests/test_xla_real_models.py (HF transformers from configs,
torchvision), built at width 256, vocabulary 4096, 8 x 128 tokens
(``real_models.sized``: at the tests' size their buffers are below the 64 KiB that
RSS can tell apart), whole step with AdamW, default settings only.

With ``--repeats N`` each row runs in N fresh processes, interleaved over the rows, and
the run with the median measured growth is kept (the others' growth beside it).

Usage: python bench/xla_plan_accuracy.py [--models a,b] [--settings default,stitch]
       [--repeats N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 2**20
SETTINGS = {
    "default": {},
    "stitch": {"DONATE_XLA_STITCH": "1"},
    "segments": {"DONATE_XLA_BACKWARD_SEGMENTS": "8"},
}
MODELS = ("mlp50m_sgd", "gpt6x512_adamw", "mlp8x2048_gelu", "preln4x512_adamw")
REAL_MODELS = ("gpt2", "bert", "llama", "t5", "bart", "mixtral", "albert", "whisper", "clip", "resnet18", "vit",
               "convnext", "swin")
VISION_MODELS = ("resnet18", "vit", "convnext", "swin")
REAL_SIZE = dict(width=256, vocab=4096, seq=128, batch=8)


def _real_model(name: str, device):
    """A model of tests/real_models.py at ``REAL_SIZE``, AdamW, its whole step."""
    import torch

    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import real_models

    with real_models.sized(**REAL_SIZE):
        spec = real_models.MODELS[name]
        model = spec.build_on(device)
        batch = {k: v.to(device) for k, v in spec.batch(0).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        loss = spec.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return model, opt, step, (batch,)


def _tensors(inputs) -> list:
    out = []
    for value in inputs:
        out += list(value.values()) if isinstance(value, dict) else [value]
    return out


class _TorchXla:
    """The XLA path's device, its wait and torch_xla's record of XLA's compiles."""

    def __init__(self):
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        self.device = torch_xla.device()
        self._torch_xla, self._xm, self._met = torch_xla, xm, met

    def wait(self, model, opt, inputs) -> None:
        self._torch_xla.sync()
        self._xm.wait_device_ops()

    def compiles(self) -> list:
        data = self._met.metric_data("CompileTime")
        return list(data[2]) if data else []  # (end time in s, duration in ns)

    def compile_count(self) -> int:
        data = self._met.metric_data("CompileTime")
        return data[0] if data else 0


class _JaxTarget:
    """The JAX target's device, its wait (every state tensor's JAX array and the batch's: JAX
    dispatches asynchronously) and JAX's record of XLA's compiles (its backend-compile
    events): a compiled graph compiles once, but an eager op between graphs compiles for
    each new shape (Mixtral's experts see a different number of tokens each step)."""

    def __init__(self):
        import jax

        import donate_backend

        self.device = donate_backend.jax_device()
        self._compiles = []  # (end time in s, duration in ns), as torch_xla's metric gives them

        def on_duration(event: str, duration: float, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self._compiles.append((time.time(), duration * 1e9))

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    def wait(self, model, opt, inputs) -> None:
        import jax

        import xla_common
        from donate_backend.jax.device import buffer_of

        tensors = xla_common.state_tensors(model, opt) + list(model.buffers()) + _tensors(inputs)
        jax.block_until_ready([buffer_of(t).array for t in tensors])

    def compiles(self) -> list:
        return list(self._compiles)

    def compile_count(self) -> int:
        return len(self._compiles)


def worker(model_name: str, path: str = "xla") -> dict:
    runtime = _JaxTarget() if path == "jax" else _TorchXla()  # the JAX device first: before any backward
    import torch

    import donate_backend
    import xla_common
    from measure import current_rss

    device = runtime.device
    if model_name in REAL_MODELS:
        model, opt, step, inputs = _real_model(model_name, device)
    else:
        model, opt, step, inputs = xla_common.build(model_name, device)
    compiled = torch.compile(step, backend="donate_xla")
    for _ in range(xla_common.WARM_UP_CALLS):
        compiled(*inputs)
        runtime.wait(model, opt, inputs)
    plan = donate_backend.memory_plan()
    state = sum(t.numel() * t.element_size() for t in xla_common.state_tensors(model, opt))
    state += sum(t.numel() * t.element_size() for t in [*model.buffers(), *_tensors(inputs)])
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.time(), current_rss()))
            time.sleep(0.002)

    compiles, compile_count = runtime.compiles, runtime.compile_count
    compiled_before = compile_count()
    thread = threading.Thread(target=sample)
    thread.start()
    starts = []
    for _ in range(4):
        time.sleep(0.01)
        starts.append(time.time())
        compiled(*inputs)
        runtime.wait(model, opt, inputs)
    time.sleep(0.01)
    stop.set()
    thread.join()
    count = compile_count() - compiled_before
    windows = [(end - duration / 1e9 - 0.003, end + 0.003) for end, duration in compiles()[-count:]] if count else []
    # Growth: the highest sample outside XLA's compiles over the lowest sample. Where XLA
    # compiled during the measured steps, the executables it added stay in host memory and
    # the trough climbs with them (Mixtral: about 12 MiB a step), so each step is measured
    # from the trough just before it. Not otherwise: a stitched step's memory is not always
    # released by the time the next one starts, and the lowest sample is the true trough.
    trough = min(rss for _, rss in samples)
    growth, with_compiles, left_out = 0, 0, 0
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else float("inf")
        before = [rss for t, rss in samples if start - 0.01 <= t < start] if count else []
        before = before or [trough]
        during = [(t, rss) for t, rss in samples if start <= t < end]
        outside = [rss for t, rss in during if not any(a <= t <= b for a, b in windows)]
        left_out += len(during) - len(outside)
        if outside:
            growth = max(growth, max(outside) - min(before))
        with_compiles = max(with_compiles, max(rss for _, rss in during) - min(before))
    import importlib.metadata

    return dict(
        versions={m: importlib.metadata.version(m) for m in (("torch", "jax", "jaxlib") if path == "jax"
                                                             else ("torch", "torch_xla"))},
        predicted_growth=plan.growth_bytes, predicted_peak=plan.peak_bytes, predicted_resident=plan.resident_bytes,
        measured_growth=growth, state=state, plan=plan.as_text(), compiles=count,
        growth_with_compiles=with_compiles, samples_left_out=left_out,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS + REAL_MODELS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--path", choices=("xla", "jax"), default="xla",
                        help="xla: torch_xla (this interpreter); jax: the JAX target (--newest-python)")
    parser.add_argument("--newest-python", default=os.path.join(HERE, "..", ".venv-newest", "bin", "python"),
                        help="the interpreter of the JAX target's rows (the newest torch with jax)")
    parser.add_argument("--worker", default=None, help="internal: one run")
    parser.add_argument("--verbose", action="store_true", help="print each plan")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="fresh processes per row, interleaved over the rows; the median growth is kept")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker, options.path)))
        return 0
    import xla_common

    rows = []
    jax = options.path == "jax"
    if jax:  # the JAX target's rows: the resnet and vision models need torchvision, which the newest torch lacks
        options.models = ",".join(m for m in options.models.split(",") if m not in VISION_MODELS)
        options.settings = "default"  # stitched steps and segments are the XLA path's levers
    print(f"xla_plan_accuracy ({'the JAX target' if jax else 'torch_xla'}): XLA:CPU, live bytes "
          "(MALLOC_MMAP_THRESHOLD_=65536), one fresh process per row"
          + (f", {options.repeats} interleaved repeats (median growth)" if options.repeats > 1 else ""))
    settings = options.settings.split(",")
    cells = [(model_name, setting) for model_name in options.models.split(",")
             for setting in (["default"] if model_name in REAL_MODELS and "default" in settings else []) or settings]
    runs: dict = {cell: [] for cell in cells}
    for _ in range(options.repeats):
        for model_name, setting in cells:
            env = dict(SETTINGS[setting], MALLOC_MMAP_THRESHOLD_="65536")
            try:
                runs[(model_name, setting)].append(xla_common.run_worker(
                    __file__, "--worker", model_name, "--path", options.path, env=env,
                    python=options.newest_python if jax else None))
            except Exception as error:  # a failing row is reported, the rest still run
                print(f"  {model_name:<17} {setting:<8} failed: {str(error)[-400:]}")
    for (model_name, setting), done in runs.items():
        if not done:
            continue
        done.sort(key=lambda r: r["measured_growth"])
        r = dict(done[len(done) // 2])  # the median run (the upper one of an even count)
        r["measured_growth_runs"] = [run["measured_growth"] for run in done]
        growth_error = r["predicted_growth"] / r["measured_growth"] - 1
        measured_peak = r["state"] + r["measured_growth"]
        peak_error = r["predicted_peak"] / measured_peak - 1
        spread = (f" [{done[0]['measured_growth'] / MIB:.1f}-{done[-1]['measured_growth'] / MIB:.1f}]"
                  if len(done) > 1 else "")
        print(
            f"  {model_name:<17} {setting:<8} growth: predicted {r['predicted_growth'] / MIB:7.1f} MiB, measured "
            f"{r['measured_growth'] / MIB:7.1f}{spread} ({growth_error:+.1%}); peak: predicted "
            f"{r['predicted_peak'] / MIB:7.1f}, state + measured growth {measured_peak / MIB:7.1f} "
            f"({peak_error:+.1%}); resident predicted {r['predicted_resident'] / MIB:.1f}, state {r['state'] / MIB:.1f}",
            flush=True,
        )
        if r["compiles"]:
            print(f"    XLA compiled {r['compiles']} times in the measured steps: {r['samples_left_out']} samples "
                  f"left out; growth with them {r['growth_with_compiles'] / MIB:.1f} MiB", flush=True)
        if options.verbose:
            print("    " + r["plan"].replace("\n", "\n    "))
        rows.append(dict(model=model_name, setting=setting, growth_error=growth_error, peak_error=peak_error,
                         **{k: v for k, v in r.items() if k != "plan"}))
    if rows:
        worst = max(rows, key=lambda r: abs(r["peak_error"]))
        print(f"largest peak error: {worst['model']} [{worst['setting']}] {worst['peak_error']:+.1%}; largest growth "
              f"error: {max(abs(r['growth_error']) for r in rows):.1%}")
    from measure import write_results

    versions = next((r["versions"] for r in rows), {})
    write_results("jax_plan_accuracy" if jax else "xla_plan_accuracy", rows, repeats=options.repeats, steps=4,
                  path=options.json, settings=SETTINGS, modules=(), more_versions=versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
