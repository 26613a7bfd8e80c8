"""dynamo internals that donate_xla adjusts (private torch API, each guarded).

Optimizer step counters of XLA parameters stay where the optimizer made them.
When dynamo traces ``optimizer.step()`` it calls ``OptimizerVariable.move_step_if_cpu``
before each parameter group's ``_init_group``: every step counter already in
the optimizer's state that is on the CPU is replaced by a copy on its parameter's
device. With two or more parameter groups of XLA parameters (not ``capturable``,
so Adam, AdamW, Adagrad, RMSprop... keep their counters on the CPU), the first
group's counters, made by its own ``_init_group`` earlier in the same trace and
already captured by the graph, are replaced in the state by XLA copies that no
graph updates. ``optimizer.state_dict()`` then reports ``step == 0`` for that
group, and once dynamo recompiles the step (a learning-rate scheduler changing
a Python float ``lr`` does it) the new graph counts from those copies again: the
bias correction restarts and the parameters take other values than eager
training (openxla too; measured: AdamW, two groups, StepLR, four steps).

Here the move skips the counters of XLA parameters in groups that are not
``capturable``, which is where eager torch_xla keeps them; CUDA, CPU and
capturable groups are left to dynamo as before.

Functions dynamo stops compiling are noted. After ``torch._dynamo.config.recompile_limit``
compiles of one function, dynamo runs it eagerly from then on. torch_xla turns dynamo's
automatic dynamic shapes off, so a function called with a new size each time reaches the
limit (Mixtral's experts, one size per expert's token count), and what it computes is then
lazy torch_xla code in no compiled graph, which no memory plan sees. torch counts no such
event; dynamo logs a warning (``torch._dynamo hit config.<limit>``, the same message in
torch 2.9 and 2.15), which a filter on its logger reads and passes on unchanged.
"""
from __future__ import annotations

import functools
import logging
import threading

_MARK = "_donate_xla_keeps_xla_host_steps"


def _host_step_params(optimizer) -> set:
    """ids of the XLA parameters whose step counters belong on the host: those of
    groups that are not ``capturable``."""
    kept = set()
    for group in getattr(optimizer, "param_groups", ()):
        if group.get("capturable", False):
            continue
        for p in group.get("params", ()):
            if getattr(p, "device", None) is not None and p.device.type == "xla":
                kept.add(id(p))
    return kept


def keep_xla_step_counters_on_host() -> bool:
    """Install the adjustment (once); whether it is in place. False where this
    torch has no ``OptimizerVariable.move_step_if_cpu`` (then nothing to adjust)."""
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # pragma: no cover - every torch donate_xla supports has it
        return False
    original = getattr(OptimizerVariable, "move_step_if_cpu", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def move_step_if_cpu(self, *args, **kwargs):
        optimizer = self.value
        kept_ids = _host_step_params(optimizer)
        state = getattr(optimizer, "state", {})
        kept = {
            p: entry["step"] for p, entry in state.items()
            if id(p) in kept_ids and isinstance(entry, dict) and "step" in entry
        }
        result = original(self, *args, **kwargs)
        for p, step in kept.items():
            if state[p].get("step") is not step:
                state[p]["step"] = step
        return result

    setattr(move_step_if_cpu, _MARK, True)
    OptimizerVariable.move_step_if_cpu = move_step_if_cpu
    return True


_DYNAMO_LOGGER = "torch._dynamo.convert_frame"
_LIMIT_MESSAGE = "torch._dynamo hit config."
_limit_hits: dict = {}  # "'name' (file:line)" -> "recompile_limit (8)"
_limit_lock = threading.Lock()
_limit_hit_count = 0  # len(_limit_hits), read without the lock on every call of a graph


class _RecompileLimitWatch(logging.Filter):
    """Notes each function dynamo reports reaching a recompile limit; filters nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        message, args = record.msg, record.args
        if isinstance(message, str) and message.startswith(_LIMIT_MESSAGE):
            if isinstance(args, tuple) and len(args) >= 3:
                global _limit_hit_count
                with _limit_lock:
                    _limit_hits[str(args[2])] = f"{args[0]} ({args[1]})"
                    _limit_hit_count = len(_limit_hits)
        return True


def watch_recompile_limit() -> None:
    """Install the filter on dynamo's logger (once)."""
    logger = logging.getLogger(_DYNAMO_LOGGER)
    if not any(isinstance(f, _RecompileLimitWatch) for f in logger.filters):
        logger.addFilter(_RecompileLimitWatch())


def recompile_limit_hits() -> dict:
    """``{function: limit}`` for the functions dynamo stopped compiling since the last
    ``clear_recompile_limit_hits()``, as its warnings named them."""
    with _limit_lock:
        return dict(_limit_hits)


def recompile_limit_hit_count() -> int:
    """``len(recompile_limit_hits())``, without copying or locking: cheap enough for
    every call of a compiled graph."""
    return _limit_hit_count


def clear_recompile_limit_hits() -> None:
    global _limit_hit_count
    with _limit_lock:
        _limit_hits.clear()
        _limit_hit_count = 0
