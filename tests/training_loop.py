"""A training loop as people write it, shared by the XLA path's and the JAX target's tests.

One program where the idioms of training scripts meet: gradient accumulation over two
micro-batches, ``clip_grad_norm_``, an LR scheduler stepped outside the compiled step (a
new learning rate every step, held in a tensor), a compiled evaluation under
``torch.no_grad()`` in ``eval()`` mode between training steps,
``zero_grad(set_to_none=False)`` on odd steps, and a checkpoint: state dicts copied to
the host after step 1 and loaded back after step 2 (``load_state_dict`` copies into the
parameters and optimizer state donate_xla has been donating), so step 3 repeats step 2
and step 4 goes on from there.

``run(mode, device, sync)`` runs it on ``device`` (``mode`` None: eagerly, "model": only
the model compiled, any other: the whole step compiled); ``compare`` checks a run against
the eager one.
"""
from __future__ import annotations

import copy

import torch

from real_models import MODELS

MODEL = "gpt2"
STEPS = 4
LR = 1e-3
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
# AdamW moves an element by about lr whatever its gradient (tests/test_xla_real_models.py)
PARAM_TOL = dict(rtol=1e-4, atol=2.5 * LR)
STATE_TOL = dict(rtol=1e-3, atol=1e-6)


def run(mode, device, sync=lambda: None):
    """Losses (train and eval, in order), parameters and optimizer state after the loop, on the host."""
    real = MODELS[MODEL]
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
        losses.append(train_step(batch, s % 2 == 0).detach().cpu())
        sched.step()
        losses.append(eval_step(batch).detach().cpu())
        if s == 0:
            saved = (
                {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                copy.deepcopy(opt.state_dict()),  # deep copies of device tensors: new buffers
                copy.deepcopy(sched.state_dict()),
            )
        if s == 1:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            sched.load_state_dict(saved[2])
        sync()
    state = {
        f"{i}.{k}": v.detach().cpu()
        for i, p in enumerate(model.parameters())
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor)
    }
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return torch.stack(losses), params, state


def compare(got, eager) -> None:
    """Raise where the run ``got`` differs from the eager run (both ``run``'s results)."""
    losses, params, state = got
    eager_losses, eager_params, eager_state = eager
    # restored to its state after step 1, step 3 repeats step 2 (train and eval)
    torch.testing.assert_close(eager_losses[4:6], eager_losses[2:4], **LOSS_TOL)
    torch.testing.assert_close(losses, eager_losses, **LOSS_TOL)
    for name, value in eager_params.items():
        torch.testing.assert_close(params[name], value, **PARAM_TOL, msg=lambda m: f"parameter {name}: {m}")
    assert state.keys() == eager_state.keys()
    for name, value in eager_state.items():
        torch.testing.assert_close(state[name], value, **STATE_TOL, msg=lambda m: f"optimizer state {name}: {m}")
