"""donate_xla: a memory-lean ``torch.compile`` backend.

``torch.compile(model, backend="donate_xla")``. Importing this package also
registers the backend (it is registered through the ``torch_dynamo_backends``
entry point too, so no import is needed).
"""
from __future__ import annotations

from . import config
from .errors import DonateXlaError, UnsupportedGraphError
from .phases import CompilePhases, compile_phases
from .planner import MemoryPlan, memory_plan
from .report import GraphRecord, clear_reports, format_record, format_table, reports


def jax_device(index: int = 0):
    """The torch device whose tensors hold JAX arrays, for the JAX lowering target (needs
    jax and torch 2.15 or newer; docs/jax.md): ``model.to(donate_backend.jax_device())``."""
    from .jax.device import jax_device as device

    return device(index)


def _register() -> None:
    from .backend import donate_xla
    from .torch_compat import register_backend

    register_backend("donate_xla", donate_xla)


_register()


def _adjust_dynamo() -> None:
    from .dynamo_compat import keep_xla_step_counters_on_host, watch_recompile_limit

    keep_xla_step_counters_on_host()
    watch_recompile_limit()


_adjust_dynamo()

__all__ = [
    "CompilePhases",
    "compile_phases",
    "config",
    "reports",
    "clear_reports",
    "format_table",
    "format_record",
    "GraphRecord",
    "jax_device",
    "DonateXlaError",
    "UnsupportedGraphError",
    "MemoryPlan",
    "memory_plan",
]
