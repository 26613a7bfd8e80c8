"""Native path: the memory plan's predicted step growth against the measured one.

For each model (the three of ``bench/backward_memory.py`` and the real models of
``tests/real_models.py``) and executor: compile with donate_xla, run two
forward+backwards (the first compiles; in the second dynamo compiles again, with
symbolic sizes, a graph that met a second size, as a mixture of experts' expert
does), then predict the growth of the next one with
``donate_backend.memory_plan()`` and measure it (gradients set to None first,
peak above the level before the forward): CPU, the profiler's memory events
(every c10 allocation, kernel workspaces included) and the storage tracker of
tests/memtrack.py (tensors made by ATen ops only); CUDA,
``torch.cuda.max_memory_allocated``. Prints the error per model and the
largest. With ``--meta``, each model is also traced on the meta device (a copy
of its weights' shapes, no data) and that plan's growth is printed against the
same measurement: the plan a user makes before a device is there.

Usage: python bench/plan_accuracy.py [--device cpu|cuda] [--executors aten,inductor]
       [--models bench1,bench2,bench3,gpt2,...] [--meta] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import donate_backend  # noqa: E402
from donate_backend import config  # noqa: E402
from memtrack import StorageTracker, cuda_peak_bytes, profiler_peak_bytes  # noqa: E402

MIB = 2**20


class BenchModel:
    """A model of bench/backward_memory.py in the shape of a tests/real_models.py entry."""

    def __init__(self, key: str):
        import backward_memory

        self.spec = backward_memory.MODELS[key]
        self._bm = backward_memory

    def available(self) -> bool:
        if self.spec.get("hf"):
            import importlib.util

            return importlib.util.find_spec("transformers") is not None
        return True

    def build(self, device):
        return self._bm.make_model(self.spec).to(device)

    def step(self, model, run, device):
        x = self._bm.make_input(self.spec, device)
        return lambda: self._bm.step(model, run, x)


class RealModel:
    def __init__(self, name: str):
        import real_models

        self.spec = real_models.MODELS[name]
        self._available = lambda: real_models.available(name)

    def available(self) -> bool:
        return self._available()

    def build(self, device):
        return self.spec.build().to(device)

    def step(self, model, run, device):
        batch = {k: v.to(device) for k, v in self.spec.batch(100).items()}
        return lambda: self.spec.loss(run, batch).backward()


def models() -> dict:
    import real_models

    out = {f"bench{k}": BenchModel(k) for k in ("1", "2", "3")}
    out.update({name: RealModel(name) for name in sorted(real_models.MODELS)})
    return out


def planned_on_meta(entry, executor: str) -> int:
    """The growth the plan predicts for ``entry``'s step traced on the meta device."""
    torch._dynamo.reset()
    donate_backend.clear_reports()
    model = entry.build("meta")
    with config.patch(native_compiler=executor):
        run = torch.compile(model, backend="donate_xla")
        entry.step(model, run, "meta")()
        model.zero_grad(set_to_none=True)
        return donate_backend.memory_plan().growth_bytes


def measure(entry, executor: str, device: str, meta: bool = False) -> dict:
    meta_growth = None
    if meta:
        try:
            meta_growth = planned_on_meta(entry, executor)
        except Exception as error:  # torch cannot trace every model on meta: reported, not fatal
            meta_growth = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    torch._dynamo.reset()
    donate_backend.clear_reports()
    model = entry.build(device)
    with config.patch(native_compiler=executor):
        run = torch.compile(model, backend="donate_xla")
        step = entry.step(model, run, device)
        for _ in range(2):  # compiles (the second: graphs that met a second size)
            step()
            model.zero_grad(set_to_none=True)
        gc.collect()
        plan = donate_backend.memory_plan()
        result = dict(predicted=plan.growth_bytes, graphs=len(plan.graphs))
        if device == "cuda":
            result["measured"] = cuda_peak_bytes(step)
        else:
            result["measured"] = profiler_peak_bytes(step)
            model.zero_grad(set_to_none=True)
            gc.collect()
            tracker = StorageTracker()
            with tracker:
                step()
            result["tensors"] = tracker.peak_bytes
    if meta:
        result["planned_on_meta"] = meta_growth
    return result


def _meta_text(r: dict, asked: bool) -> str:
    if not asked:
        return ""
    on_meta = r.get("planned_on_meta")
    if not isinstance(on_meta, int):
        return f"; on meta: failed ({on_meta})"
    return f"; planned on meta {on_meta / MIB:8.3f} MiB ({on_meta / r['measured'] - 1:+.1%})" if r["measured"] else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--executors", default="aten,inductor")
    parser.add_argument("--models", default=None)
    parser.add_argument("--meta", action="store_true", help="also plan each step traced on the meta device")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    table = models()
    names = options.models.split(",") if options.models else list(table)
    print(f"plan_accuracy: torch {torch.__version__}, {options.device}"
          + (f" ({torch.cuda.get_device_name(0)})" if options.device == "cuda" else ""))
    rows = []
    for executor in options.executors.split(","):
        for name in names:
            entry = table[name]
            if not entry.available():
                print(f"  {name:<9} [{executor}] skipped: not installed")
                continue
            try:
                r = measure(entry, executor, options.device, meta=options.meta)
            except Exception as error:  # a model that fails is reported, the rest still run
                print(f"  {name:<9} [{executor}] failed: {type(error).__name__}: {str(error)[:300]}")
                continue
            error = r["predicted"] / r["measured"] - 1 if r["measured"] else 0.0
            tensors = f", tensors only {r['tensors'] / MIB:8.3f} ({r['predicted'] / r['tensors'] - 1:+.1%})" if r.get("tensors") else ""
            print(f"  {name:<9} [{executor}] predicted {r['predicted'] / MIB:8.3f} MiB, measured "
                  f"{r['measured'] / MIB:8.3f} MiB ({error:+.1%}){tensors}, {r['graphs']} graphs"
                  + _meta_text(r, options.meta), flush=True)
            rows.append(dict(model=name, executor=executor, error=error, **r))
    if rows:
        worst = max(rows, key=lambda r: abs(r["error"]))
        print(f"largest error: {worst['model']} [{worst['executor']}] {worst['error']:+.1%}")
    from measure import torch_variant, write_results

    variant = torch_variant() if options.device == "cpu" else f"cuda-{torch_variant()}"
    write_results("plan_accuracy", rows, repeats=1, steps=1, path=options.json, variant=variant,
                  device=options.device, device_name=torch.cuda.get_device_name(0) if options.device == "cuda" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
