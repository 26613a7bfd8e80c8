"""Whether the bucket rewrite may be used for a DDP module, and if not, why.

Every reason here means "DDP's normal path gives the right gradient and ours
might not", so the backend leaves that module's gradients alone. The reasons
are checked again before every DDP forward (``integration.ModuleBinding``),
so a switch flipped or a ``Join`` set up after compiling is honoured.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import compat


def _has_sparse_gradients(module: torch.nn.Module) -> bool:
    return any(
        isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
        for m in module.modules()
    )


def settings_reason(settings) -> Optional[str]:
    """Why the switches in force keep every DDP module on DDP's normal path, or None."""
    if not settings.bucket_view:
        return "DONATE_XLA_BUCKET_VIEW=0"
    if settings.native_compiler != "aten":
        return f"native compiler {settings.native_compiler!r} cannot run the slot writes"
    return None


def fixed_reason(ddp_module) -> Optional[str]:
    """What keeps a module on DDP's path for good (fixed when DDP was built, or by torch)."""
    if getattr(ddp_module, "mixed_precision", None) is not None:
        return "DDP mixed_precision (it installs its own communication hook)"
    if _has_sparse_gradients(ddp_module.module):
        return "the module has sparse gradients"
    if getattr(ddp_module, "static_graph", False):
        return "static_graph=True"
    mode = compat.reducer_mode_reason(ddp_module)
    if mode is not None:
        return mode
    if not compat.can_rebuild_reducer(ddp_module):
        return "this torch cannot rebuild DDP's reducer (private API missing)"
    if compat.module_parameters(ddp_module) is None:
        return "this torch does not list DDP's parameters (private API missing)"
    return None


def changing_reason(ddp_module) -> Optional[str]:
    """What may start to hold after DDP was built: a user comm hook, a Join, no reducer."""
    hook = compat.user_comm_hook_name(ddp_module)
    if hook is not None:
        return f"a communication hook is registered ({hook})"
    if getattr(ddp_module, "reducer", None) is None:
        return "the DDP module has no reducer"
    if compat.join_divides_by_live_ranks(ddp_module):
        return (
            "a Join context with divide_by_initial_world_size=False (DDP divides by the "
            "ranks still training, which our communication hook cannot know)"
        )
    return None


_NOT_GIVEN = object()


def module_fallback_reason(ddp_module, settings, fixed=_NOT_GIVEN) -> Optional[str]:
    """Why the whole DDP module must keep DDP's normal gradient path now, or None.

    ``fixed`` is ``fixed_reason(ddp_module)`` computed once by the caller
    (it walks every submodule); without it, it is computed here.
    """
    return (
        settings_reason(settings)
        or changing_reason(ddp_module)
        or (fixed_reason(ddp_module) if fixed is _NOT_GIVEN else fixed)
    )


def param_fallback_reason(param: torch.Tensor) -> Optional[str]:
    """Why one parameter's gradient must keep DDP's normal path, or None."""
    if compat.tensor_hooks(param):
        return "a gradient hook is registered on the parameter (it may replace the gradient)"
    if not param.requires_grad:
        return "the parameter does not require grad"
    return None
