"""A training loop as people write it, on the XLA path, against eager torch_xla.

tests/test_xla_real_models.py trains real models with the plainest loop. Here
the loop does what training scripts around a model usually do, all in one
program so the idioms meet: gradient accumulation over two micro-batches,
``clip_grad_norm_``, an LR scheduler stepped outside the compiled step (a new
learning rate every step, held in a tensor), a compiled evaluation under ``torch.no_grad()`` in
``eval()`` mode between training steps, ``zero_grad(set_to_none=False)`` on odd
steps, and a checkpoint: state dicts copied to the host after step 1 and
loaded back (``load_state_dict`` copies into the parameters and optimizer state
donate_xla has been donating) after step 2, so step 3 repeats step 2 and step 4
goes on from there.

Each mode runs the loop compiled and eagerly from the same weights and data;
training and evaluation losses, parameters and optimizer state must match
eager's. Modes: the whole step compiled (separate executables, donating
parameters and state), the same under an activation budget (the backward
recomputes), the same stitched into one lazy graph, the same with the backward
run in segments, and only the model compiled (optimizer and clipping eager).

Each mode runs in a process of its own (this file as a script): XLA:CPU maps
memory for every kernel it compiles, torch_xla keeps every executable, and
this loop compiles many graphs; in the suite's one process it took the
process past the kernel's limit on memory mappings (``vm.max_map_count``).

``make test`` runs the ``step`` mode (about 4 minutes on a 2-core machine); ``make test-slow``
runs the other four.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import XLA_SKIP_REASON

pytest.importorskip("torch_xla", reason=XLA_SKIP_REASON)

import torch_xla

import donate_backend
from donate_backend import config
import training_loop
from real_models import MODELS, available

MODES = {
    "step": dict(),
    "step-budget": dict(activation_budget=0.5),
    "step-stitched": dict(stitch=True),
    "step-segments": dict(backward_segments=3),
    "model": dict(),
}


def check(mode):
    """Run the loop eagerly and in ``mode``; raise on any difference."""
    device = torch_xla.device()
    eager = training_loop.run(None, device, torch_xla.sync)
    torch._dynamo.reset()
    donate_backend.clear_reports()
    with config.patch(**MODES[mode]):
        got = training_loop.run(mode, device, torch_xla.sync)
    records = [r for r in donate_backend.reports() if r.path == "xla"]
    assert records, "nothing was compiled on the XLA path"
    if mode in ("step", "step-budget", "step-segments"):  # stitched graphs donate at the sync instead
        assert any(r.donated for r in records), "the compiled step donated nothing"
    if mode == "step-stitched":
        assert all(r.stitched for r in records)
    if mode == "step-budget":
        assert any(r.recompute_gated for r in records if r.kind == "backward")
    if mode == "step-segments":
        assert any(r.backward_segments >= 2 for r in records)
    training_loop.compare(got, eager)


@pytest.mark.parametrize("mode", list(MODES))
def test_training_loop_with_accumulation_clipping_schedule_eval_and_checkpoint(mode):
    if not available(training_loop.MODEL):
        pytest.skip(f"{MODELS[training_loop.MODEL].package} is not installed")
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(
        [sys.executable, __file__, mode], capture_output=True, text=True, timeout=900, env=env,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert proc.returncode == 0, f"mode {mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


if __name__ == "__main__":
    check(sys.argv[1])
    print("ok")
