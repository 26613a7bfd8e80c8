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

import copy
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
from real_models import MODELS, available

MODEL = "gpt2"
STEPS = 4
LR = 1e-3
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
# AdamW moves an element by about lr whatever its gradient (tests/test_xla_real_models.py)
PARAM_TOL = dict(rtol=1e-4, atol=2.5 * LR)
STATE_TOL = dict(rtol=1e-3, atol=1e-6)

MODES = {
    "step": dict(),
    "step-budget": dict(activation_budget=0.5),
    "step-stitched": dict(stitch=True),
    "step-segments": dict(backward_segments=3),
    "model": dict(),
}


def _loop(mode):
    """Losses (train and eval, in order), parameters and optimizer state after the loop.

    ``mode`` None: eager torch_xla.
    """
    real = MODELS[MODEL]
    device = torch_xla.device()
    torch.manual_seed(0)
    model = real.build_on(device)
    # the learning rate as a tensor, as docs/trainers.md recommends: the scheduler writes a new
    # value into it every step, and the compiled step reads it instead of recompiling for it
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LR))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    forward = torch.compile(model, backend="donate_xla") if mode == "model" else model

    def step(batch, set_to_none: bool):
        halves = [{k: v[:1] for k, v in batch.items()}, {k: v[1:] for k, v in batch.items()}]
        total = 0.0
        for half in halves:
            loss = real.loss(forward, half) / len(halves)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return total

    def evaluate(batch):
        model.eval()
        with torch.no_grad():
            loss = real.loss(forward, batch)
        model.train()
        return loss

    compiled = mode is not None and mode != "model"
    train_step = torch.compile(step, backend="donate_xla") if compiled else step
    eval_step = torch.compile(evaluate, backend="donate_xla") if compiled else evaluate
    losses, saved = [], None
    for s in range(STEPS):
        seed = s if s < 2 else s - 1  # step 3 sees step 2's data again
        batch = {k: v.to(device) for k, v in real.batch(seed).items()}
        losses.append(train_step(batch, s % 2 == 0).detach())
        sched.step()
        losses.append(eval_step(batch).detach())
        if s == 0:
            saved = (
                {k: v.detach().cpu() for k, v in model.state_dict().items()},
                copy.deepcopy(opt.state_dict()),  # deep copies of XLA tensors: new buffers
                copy.deepcopy(sched.state_dict()),
            )
        if s == 1:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            sched.load_state_dict(saved[2])
        torch_xla.sync()
    state = {
        f"{i}.{k}": v.detach().cpu()
        for i, p in enumerate(model.parameters())
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor)
    }
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return torch.stack(losses).cpu(), params, state


def check(mode):
    """Run the loop eagerly and in ``mode``; raise on any difference."""
    eager_losses, eager_params, eager_state = _loop(None)
    torch._dynamo.reset()
    donate_backend.clear_reports()
    with config.patch(**MODES[mode]):
        losses, params, state = _loop(mode)
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
    # restored to its state after step 1, step 3 repeats step 2 (train and eval)
    torch.testing.assert_close(eager_losses[4:6], eager_losses[2:4], **LOSS_TOL)
    torch.testing.assert_close(losses, eager_losses, **LOSS_TOL)
    for name, value in eager_params.items():
        torch.testing.assert_close(params[name], value, **PARAM_TOL, msg=lambda m: f"parameter {name}: {m}")
    assert state.keys() == eager_state.keys()
    for name, value in eager_state.items():
        torch.testing.assert_close(state[name], value, **STATE_TOL, msg=lambda m: f"optimizer state {name}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
def test_training_loop_with_accumulation_clipping_schedule_eval_and_checkpoint(mode):
    if not available(MODEL):
        pytest.skip(f"{MODELS[MODEL].package} is not installed")
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(
        [sys.executable, __file__, mode], capture_output=True, text=True, timeout=900, env=env,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert proc.returncode == 0, f"mode {mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


if __name__ == "__main__":
    check(sys.argv[1])
    print("ok")
