"""XLA path: abstract lowering with automatic buffer donation (needs torch_xla)."""
from __future__ import annotations

from .compiler import compile_graph


def aot_options() -> dict:
    return {}


__all__ = ["compile_graph", "aot_options"]
