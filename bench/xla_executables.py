"""XLA memory plan, executable by executable, against XLA's own buffer assignment.

The step-level figures of ``bench/xla_plan_accuracy.py`` compare the plan with RSS. This
benchmark looks one level down: each executable the step runs is compiled with XLA's dump
switched on (``--xla_dump_to``), and the plan's figures for that graph are set beside what XLA
assigned it:

- *temporaries*: the plan's ``temporaries`` at the graph's peak against the size of XLA's
  ``preallocated-temp`` allocation (the block every value that lives only inside the
  executable is packed into);
- *outputs*: the plan's output bytes against XLA's ``maybe-live-out`` allocations (a result
  written into a donated input is in neither).

An executable is matched to its graph by the fingerprint constant each lowered graph carries
(``LoweredGraph.fingerprint``). Executables with no graph record (a variant compiled at a call,
such as the one that runs without donation) are listed without a plan. A stitched step is one
XLA computation holding several graphs; it is reported as one row without a per-graph plan.

The model of temporaries (``donate_backend/xla/memory.py``) follows XLA's fusion and the FX
graph's order; XLA:CPU's default scheduler orders for concurrency, so a row can differ where
XLA computed something earlier or later than the graph's order.

Usage: python bench/xla_executables.py [--models clip,bert] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 2**20
DEFAULT_MODELS = ("gpt6x512_adamw", "mlp8x2048_gelu", "preln4x512_adamw", "gpt2", "bert", "bart", "whisper", "clip",
                  "resnet18", "vit", "convnext", "swin")
_FINGERPRINT = re.compile(r"s64\[\] constant\((\d+)\)")
_TEMP = re.compile(r"^allocation \d+: size (\d+), preallocated-temp", re.M)
# a result's own buffer; one written into a donated input is that parameter's allocation
_LIVE_OUT = re.compile(r"^allocation \d+: size (\d+), maybe-live-out", re.M)


def worker(model_name: str) -> dict:
    """Run the model's step in this process (XLA's dump set by the caller); the planned
    figures of each graph record, by fingerprint."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import donate_backend
    import xla_common
    import xla_plan_accuracy

    device = torch_xla.device()
    if model_name in xla_plan_accuracy.REAL_MODELS:
        _, _, step, inputs = xla_plan_accuracy._real_model(model_name, device)
    else:
        _, _, step, inputs = xla_common.build(model_name, device)
    compiled = torch.compile(step, backend="donate_xla")
    for _ in range(xla_common.WARM_UP_CALLS):
        compiled(*inputs)
        torch_xla.sync()
        xm.wait_device_ops()
    graphs = {}
    for record in donate_backend.reports():
        lowered = record.lowered
        if lowered is None or lowered.fingerprint is None or record.memory is None:
            continue
        parts = dict(record.memory.peak_parts)
        graphs[str(lowered.fingerprint)] = dict(
            name=lowered.graph_name, kind=record.kind, stitched=record.stitched,
            temporaries=parts.get("temporaries", 0),
            outputs=record.memory.peak_bytes - parts.get("temporaries", 0),
            peak_node=record.memory.peak_node,
        )
    return dict(graphs=graphs, peak=donate_backend.memory_plan().peak_bytes)


def assigned(dump: str) -> list:
    """Per XLA executable in ``dump``: the fingerprints it holds, its temporaries and its
    live-out bytes (from ``*after_optimizations-buffer-assignment.txt``)."""
    out = []
    for hlo_path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        assignment_path = hlo_path.replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt")
        if not os.path.exists(assignment_path):
            continue
        with open(hlo_path) as f:
            fingerprints = sorted({m.group(1) for m in _FINGERPRINT.finditer(f.read())})
        with open(assignment_path) as f:
            text = f.read()
        out.append(dict(
            module=os.path.basename(hlo_path).split(".")[0], fingerprints=fingerprints,
            temporaries=sum(int(m) for m in _TEMP.findall(text)),
            live_out=sum(int(m) for m in _LIVE_OUT.findall(text)),
        ))
    return out


def rows_for(model_name: str, planned: dict, executables: list) -> list:
    rows = []
    for executable in executables:
        known = [planned[f] for f in executable["fingerprints"] if f in planned]
        if not known:
            continue  # torch_xla's own graphs (syncs of lazy code), or a variant without a record
        row = dict(model=model_name, module=executable["module"], xla_temporaries=executable["temporaries"],
                   xla_outputs=executable["live_out"])
        if len(known) == 1 and not known[0]["stitched"]:
            row.update(graph=known[0]["name"], kind=known[0]["kind"], planned_temporaries=known[0]["temporaries"],
                       planned_outputs=known[0]["outputs"], peak_node=known[0]["peak_node"])
        else:
            row.update(graph=f"stitched step ({len(known)} graph{'s' if len(known) > 1 else ''})", kind="stitched")
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--worker", default=None, help="internal: one run")
    parser.add_argument("--json", default=None)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker)))
        return 0
    import xla_common
    from measure import write_results

    rows = []
    print("xla_executables: XLA:CPU, each executable's temporaries and outputs, planned against XLA's buffer "
          "assignment (MiB)")
    for model_name in options.models.split(","):
        with tempfile.TemporaryDirectory(prefix="donate_xla_dump_") as dump:
            flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}"]))
            try:
                result = xla_common.run_worker(__file__, "--worker", model_name, env={"XLA_FLAGS": flags})
            except Exception as error:  # a failing model is reported, the rest still run
                print(f"  {model_name}: failed: {str(error)[-400:]}")
                continue
            model_rows = rows_for(model_name, result["graphs"], assigned(dump))
        print(f"  {model_name}")
        for r in model_rows:
            def planned(key):
                return f"{r[key] / MIB:8.2f}" if key in r else f"{'-':>8}"

            print(f"    {r['graph']:<34} temporaries: XLA {r['xla_temporaries'] / MIB:8.2f}, planned "
                  f"{planned('planned_temporaries')}; outputs: XLA {r['xla_outputs'] / MIB:8.2f}, planned "
                  f"{planned('planned_outputs')}", flush=True)
        rows += model_rows
    write_results("xla_executables", rows, repeats=1, steps=xla_common.WARM_UP_CALLS, path=options.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
