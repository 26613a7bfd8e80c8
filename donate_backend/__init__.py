"""donate_xla: a memory-lean ``torch.compile`` backend.

``torch.compile(model, backend="donate_xla")``. Importing this package also
registers the backend (it is registered through the ``torch_dynamo_backends``
entry point too, so no import is needed).
"""
from __future__ import annotations

from . import config
from .errors import DonateXlaError, UnsupportedGraphError
from .planner import MemoryPlan, memory_plan
from .report import GraphRecord, clear_reports, format_record, format_table, reports


def _register() -> None:
    from torch._dynamo.backends import registry

    from .backend import donate_xla

    # When dynamo found the entry point first, it registers the backend itself.
    if "donate_xla" not in registry._BACKENDS and "donate_xla" not in registry._COMPILER_FNS:
        registry.register_backend(name="donate_xla")(donate_xla)


_register()


def _adjust_dynamo() -> None:
    from .dynamo_compat import keep_xla_step_counters_on_host

    keep_xla_step_counters_on_host()


_adjust_dynamo()

__all__ = [
    "config",
    "reports",
    "clear_reports",
    "format_table",
    "format_record",
    "GraphRecord",
    "DonateXlaError",
    "UnsupportedGraphError",
    "MemoryPlan",
    "memory_plan",
]
