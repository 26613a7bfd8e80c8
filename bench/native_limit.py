"""Native path: does a ``memory_limit`` hold? Measured use against the limit, values against eager.

For each model a whole training step (forward, loss, backward, ``AdamW.step()`` and
``zero_grad()``, all inside one ``torch.compile(backend="donate_xla")``) runs on the CPU
in fresh processes:

1. the default (no limit): the resident bytes (parameters, optimizer state, the batch)
   and the step's growth above them, measured with the profiler's memory events (every
   c10 allocation) over one steady step after four warm-up steps;
2. for each share ``f`` of ``--shares``, ``options={"memory_limit": resident + f x growth}``:
   the same measurement, so ``used = resident + measured growth`` against the limit, or
   the refusal when no plan fits (``MemoryLimitError`` before a step runs, with the bytes
   it needs);
3. eager PyTorch from the same weights and batch: every run's losses and final
   parameters are compared with it (the largest difference, relative to the largest
   magnitude of each compared tensor plus 1e-3: a bias whose gradient is zero in exact
   arithmetic, such as an attention key's, holds only rounding).

Rows: ``used / limit`` (at most 1.0 is a limit that holds), the plan the limit chose,
and the value differences. Usage: python bench/native_limit.py [--models gpt2,bert,llama,resnet18]
[--shares 0.7,0.85] [--steps 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

MIB = 2**20
MODELS = ("gpt2", "bert", "llama", "resnet18")
# the HF models at the size of bench/backward_memory.py's GPT-2 (width 256, 8 x 128 tokens,
# vocabulary 1024), their tiny configs' two layers; ResNet-18 on 64 images of 64 x 64 (with
# fewer, AdamW's own step, not the activations, sets the peak, and no limit lies between
# the least plan and the default)
SIZE = dict(width=256, vocab=1024, seq=128, batch=8)
RESNET_BATCH = 64


def _build(name: str):
    import torch

    import real_models

    if name == "gpt2":  # bench/backward_memory.py's: 4 layers
        from backward_memory import MODELS as BM, make_input, make_model

        spec = BM["3"]
        model = make_model(spec)
        x = make_input(spec, "cpu")
        return model, lambda m: m(input_ids=x, labels=x).loss
    with real_models.sized(**SIZE):
        entry = real_models.MODELS[name]
        model = entry.build()
        batch = entry.batch(7) if name != "resnet18" else real_models._images(7, batch=RESNET_BATCH)
    return model, lambda m: entry.loss(m, batch)


def worker(name: str, mode: str, limit: int, steps: int) -> dict:
    import torch

    import donate_backend
    from memtrack import profiler_peak_bytes

    torch.manual_seed(0)
    model, loss_of = _build(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = loss_of(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if mode != "eager":
        options = {"memory_limit": limit} if limit else {}
        step = torch.compile(step, backend="donate_xla", options=options)
    losses = []
    try:
        for _ in range(4):
            losses.append(float(step()))
    except donate_backend.DonateXlaError as error:
        if "memory_limit" not in str(error):
            raise
        return dict(refused=str(error).splitlines()[0][:700], least=getattr(error, "least_bytes", None))
    gc.collect()
    state = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0]
    resident = sum(t.numel() * t.element_size() for t in state)
    holder = []
    growth = profiler_peak_bytes(lambda: holder.append(step()))
    losses.append(float(holder[0]))
    for _ in range(steps - 5):
        losses.append(float(step()))
    out = dict(resident=resident, growth=growth, losses=losses,
               params=[p.detach().flatten()[:4096].tolist() for p in model.parameters()])
    if mode != "eager":
        plan = donate_backend.memory_plan()
        out.update(predicted=plan.peak_bytes, choices=list(plan.choices))
    return out


def run_fresh(*args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=(proc.stderr or proc.stdout)[-2000:])
    return json.loads(lines[-1])


def largest_difference(run: dict, eager: dict) -> float:
    import torch

    worst = 0.0
    pairs = [(run["losses"], eager["losses"])] + list(zip(run["params"], eager["params"]))
    for ours, theirs in pairs:
        a, b = torch.tensor(ours), torch.tensor(theirs)
        worst = max(worst, float((a - b).abs().max() / (b.abs().max() + 1e-3)))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--shares", default="0.7,0.85")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "LIMIT"), help="internal: one run")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.worker:
        name, mode, limit = args.worker
        print(json.dumps(worker(name, mode, int(limit), max(args.steps, 5))))
        return 0
    steps = str(max(args.steps, 5))
    rows, failures = [], []
    for name in args.models.split(","):
        eager = run_fresh(name, "eager", "0", "--steps", steps)
        default = run_fresh(name, "compiled", "0", "--steps", steps)
        if "error" in eager or "error" in default:
            print(f"{name}: failed\n{eager.get('error') or default.get('error')}")
            failures.append(name)
            continue
        used = default["resident"] + default["growth"]
        print(f"\n== {name}: default: resident {default['resident'] / MIB:.1f} MiB, growth "
              f"{default['growth'] / MIB:.1f} MiB (used {used / MIB:.1f}, planned {default['predicted'] / MIB:.1f}); "
              f"values against eager: {largest_difference(default, eager):.1e}")
        row = dict(model=name, default=default, limits=[])
        for share in map(float, args.shares.split(",")):
            limit = default["resident"] + int(share * default["growth"])
            run = run_fresh(name, "compiled", str(limit), "--steps", steps)
            entry = dict(share=share, limit=limit, run=run)
            if "error" in run:
                print(f"  limit {share:g}: failed\n{run['error']}")
                failures.append(f"{name} {share:g}")
            elif "refused" in run:
                print(f"  limit {share:g} ({limit / MIB:.1f} MiB): refused before a step ran: {run['refused']}")
            else:
                use = run["resident"] + run["growth"]
                entry.update(used=use, ratio=use / limit, difference=largest_difference(run, eager))
                print(f"  limit {share:g} ({limit / MIB:.1f} MiB): used {use / MIB:.1f} MiB = {use / limit:.3f} x the "
                      f"limit (planned {run['predicted'] / MIB:.1f}); values against eager {entry['difference']:.1e}")
                for choice in run["choices"]:
                    if "memory_limit" in choice or "budget" in choice:
                        print(f"    {choice}")
                if use > limit:
                    failures.append(f"{name} {share:g}: {use / limit:.3f}x")
            row["limits"].append(entry)
        rows.append(row)
    from measure import torch_variant, write_results

    write_results("native_limit", rows, repeats=1, steps=int(steps), path=args.json, variant=torch_variant(),
                  shares=args.shares)
    print("\nlimits " + ("all held" if not failures else "missed: " + "; ".join(failures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
