"""Whether the bucket rewrite may be used for a DDP module, and if not, why.

Every reason here means "DDP's normal path gives the right gradient and ours
might not", so the backend leaves that module's gradients alone.
"""
from __future__ import annotations

from typing import Optional

import torch


def _comm_hook_name(ddp_module) -> Optional[str]:
    if getattr(ddp_module, "_comm_hooks", None):
        hook = ddp_module._comm_hooks[0][0]
        return getattr(hook, "__qualname__", repr(hook))
    try:
        name = ddp_module._get_ddp_logging_data().get("comm_hook")
    except Exception:  # logging data is best effort
        name = None
    return name or None


def _has_sparse_gradients(module: torch.nn.Module) -> bool:
    return any(
        isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        for m in module.modules()
    )


def module_fallback_reason(ddp_module, settings) -> Optional[str]:
    """Why the whole DDP module must keep DDP's normal gradient path, or None."""
    if not settings.bucket_view:
        return "DONATE_XLA_BUCKET_VIEW=0"
    if settings.native_compiler != "aten":
        return f"native compiler {settings.native_compiler!r} cannot run the slot writes"
    hook = _comm_hook_name(ddp_module)
    if hook is not None:
        return f"a communication hook is registered ({hook})"
    if getattr(ddp_module, "mixed_precision", None) is not None:
        return "DDP mixed_precision (it installs its own communication hook)"
    if _has_sparse_gradients(ddp_module.module):
        return "the module has sparse gradients"
    if getattr(ddp_module, "static_graph", False):
        return "static_graph=True"
    if getattr(ddp_module, "_delay_all_reduce_params", None):
        return "delay_all_reduce_named_params is set"
    if getattr(ddp_module, "_use_python_reducer", False):
        return "optimize_ddp='python_reducer' (compiled autograd owns the all-reduce)"
    if getattr(ddp_module, "reducer", None) is None:
        return "the DDP module has no reducer"
    return None


def param_fallback_reason(param: torch.Tensor) -> Optional[str]:
    """Why one parameter's gradient must keep DDP's normal path, or None."""
    if getattr(param, "_backward_hooks", None):
        return "a gradient hook is registered on the parameter (it may replace the gradient)"
    if not param.requires_grad:
        return "the parameter does not require grad"
    return None
