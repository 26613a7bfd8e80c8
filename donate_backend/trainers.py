"""Helpers for training loops that someone else's code drives (HF ``Trainer``, Lightning).

Such trainers compile the model (forward and backward) but run the optimizer step
eagerly, so on XLA nothing is donated: the parameters and optimizer state the step
overwrites are inputs of no compiled graph. ``compile_optimizer_step(optimizer)`` makes
``optimizer.step()`` run compiled under donate_xla, leaving the trainer as it is::

    opt = compile_optimizer_step(torch.optim.AdamW(model.parameters(), lr=1e-3))
    trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None), ...)

Two things the compiled step takes care of (docs/trainers.md):

- The learning rate. A scheduler writes a new Python float into ``param_groups`` every
  step, and dynamo bakes a float into the graph, so each new value would recompile the
  step until dynamo's recompile limit (after which the step runs eagerly). The compiled
  step reads each group's learning rate from a 0-dim tensor instead, filled with the
  group's float before each call; between steps ``param_groups`` holds the float as before.
- A learning rate of exactly 0.0 (the first step of a warmup that starts at 0) for Adam
  and AdamW. Compiled, their step divides by the learning rate and writes NaN into every
  element whose gradient is zero (upstream PyTorch, any backend). Such a step runs
  eagerly, as it would without the helper, with a warning that says so.
"""
from __future__ import annotations

import types
import warnings

import torch

_MARK = "_donate_xla_compiled_step"


class ZeroLearningRateWarning(UserWarning):
    """A compiled Adam/AdamW step was asked to run with a learning rate of 0.0."""


def _zero_lr_adam(optimizer: torch.optim.Optimizer) -> bool:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    return any(type(group["lr"]) is float and group["lr"] == 0.0 for group in optimizer.param_groups)


def compile_optimizer_step(optimizer: torch.optim.Optimizer, *, backend: str = "donate_xla") -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run compiled with ``backend``; returns ``optimizer``.

    The same object is returned (its class, state and state dict are unchanged), so a
    scheduler, a checkpoint or a trainer that wraps it works as before; call it before
    building the scheduler. On XLA, the parameters and optimizer state the step overwrites
    are donated. A step with a closure, and an Adam/AdamW step at a learning rate of 0.0
    (with a warning), run eagerly. Calling it twice does nothing the second time.
    """
    if getattr(optimizer, _MARK, False):
        return optimizer
    eager_step = optimizer.step
    lr_tensors: list = []

    def run(closure=None):
        return eager_step(closure)

    compiled = torch.compile(run, backend=backend)

    def step(self, closure=None):
        if closure is not None:
            return eager_step(closure)
        if _zero_lr_adam(self):
            warnings.warn(
                f"{type(self).__name__} step with a learning rate of 0.0 runs eagerly: compiled, "
                "Adam and AdamW turn every element whose gradient is zero into NaN at lr=0 (an "
                "upstream PyTorch bug, any backend). Start the warmup above 0 to keep every step "
                "compiled (docs/trainers.md).",
                ZeroLearningRateWarning,
                stacklevel=2,
            )
            return eager_step()
        floats = [group["lr"] for group in self.param_groups]
        while len(lr_tensors) < len(floats):
            lr_tensors.append(torch.zeros((), dtype=torch.float32))
        for group, value, holder in zip(self.param_groups, floats, lr_tensors):
            if isinstance(value, float):
                holder.fill_(value)
                group["lr"] = holder
        try:
            return compiled()
        finally:
            for group, value in zip(self.param_groups, floats):
                group["lr"] = value

    step.__doc__ = compile_optimizer_step.__doc__
    # A bound method, so that LR schedulers, which rewrap ``optimizer.step`` through its
    # ``__func__``, keep calling this one.
    optimizer.step = types.MethodType(step, optimizer)
    setattr(optimizer, _MARK, True)
    return optimizer


__all__ = ["compile_optimizer_step", "ZeroLearningRateWarning"]
