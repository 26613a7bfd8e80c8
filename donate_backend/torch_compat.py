"""Private torch API that both paths use, each looked up here once and guarded.

The rule (CONTRIBUTING.md, checked by ``tests/test_fence.py``): a private
torch or torch_xla name (``torch._...``, ``torch_xla._XLAC``) is used only in a
compat module: this one for what both paths need, ``native/compat.py``,
``xla/compat.py``, ``ddp/compat.py``, ``autograd_compat.py`` and
``dynamo_compat.py`` for their own. Each function says what it falls back to
when the API is missing, and ``tests/test_torch_compat.py`` checks each against
the torch installed.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional


def current_tracing_context():
    """aot_autograd's active ``TracingContext`` (to re-enter when compiling lazily, or to
    read its forward metadata), or None."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return None
    try_get = getattr(TracingContext, "try_get", None)
    return try_get() if try_get is not None else None


def tracing(context):
    """Context manager that re-enters ``context`` (a no-op for None)."""
    if context is None:
        return contextlib.nullcontext()
    from torch._guards import tracing as enter_tracing

    return enter_tracing(context)


def fake_copies(values):
    """``(fake_mode, values)`` with each tensor of ``values`` replaced by a fake tensor
    of a new ``FakeTensorMode`` (static shapes; a parameter stays a parameter), for
    aot_autograd to trace again later without holding the real tensors; None when a
    value is symbolic (dynamic shapes) or not a tensor or a number, or fake tensors
    are missing."""
    import torch

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return None
    mode = FakeTensorMode()
    copies = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if any(not isinstance(size, int) for size in value.shape):
                return None
            copies.append(mode.from_tensor(value, static_shapes=True))
        elif value is None or (isinstance(value, (int, float, bool)) and not isinstance(value, torch.SymInt)):
            copies.append(value)
        else:
            return None
    return mode, copies


def fresh_tracing(fake_mode):
    """Context manager: a new aot_autograd ``TracingContext`` over ``fake_mode``, as
    dynamo gives one to a backend (the compilers read the forward's metadata from it);
    a no-op when torch has none."""
    try:
        from torch._guards import TracingContext, tracing as enter_tracing
    except ImportError:
        return contextlib.nullcontext()
    return enter_tracing(TracingContext(fake_mode))


def forward_output_count() -> Optional[int]:
    """In a forward's compiler: how many of its outputs are the caller's (the rest are
    saved for the backward), from the tracing context's metadata; None if unknown."""
    context = current_tracing_context()
    meta = getattr(context, "fw_metadata", None)
    count = getattr(meta, "num_forward", None)
    return count if isinstance(count, int) else None


def min_cut_partition() -> Optional[Callable]:
    """aot_autograd's min-cut rematerialisation partitioner, or None."""
    try:
        from torch._functorch.partitioners import min_cut_rematerialization_partition
    except ImportError:
        return None
    return min_cut_rematerialization_partition


def activation_memory_budget(share: float):
    """Context manager: aot_autograd's memory-budget partitioning at ``share`` (the
    min-cut partitioner saves that share of the activations by its own estimate)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=share)


def aot_autograd(**kwargs):
    """dynamo's helper that turns forward/backward compilers into a backend."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def register_backend(name: str, compiler_fn: Callable) -> None:
    """Register ``compiler_fn`` as ``torch.compile(backend=name)``, unless dynamo has it
    already (it registers a backend it finds through an entry point itself)."""
    from torch._dynamo.backends import registry

    known = set(getattr(registry, "_BACKENDS", {})) | set(getattr(registry, "_COMPILER_FNS", {}))
    if name not in known:
        registry.register_backend(name=name)(compiler_fn)


def nn_function(name: str):
    """``torch._C._nn.<name>`` (what dynamo records for some ``torch.nn.functional``
    calls), or None."""
    import torch

    return getattr(getattr(torch._C, "_nn", None), name, None)


# How dynamo records ``no_grad`` blocks and ``w.data`` (present in torch 2.9 through
# 2.15; where one is gone, the graphs that would use it are left as they are).
def set_grad_enabled_function():
    import torch

    return getattr(torch._C, "_set_grad_enabled", None)


def get_data_attr_function():
    import torch

    return getattr(getattr(torch._C, "_autograd", None), "_get_data_attr", None)


def dynamo_compile_seconds() -> dict:
    """dynamo's compile timers since the process started: name -> total seconds
    (``_compile.compile_inner`` per frame, ``OutputGraph.call_user_compiler``,
    ``create_aot_dispatcher_function``, ``backward._backward_impl``...); {} on a torch
    without them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return {name: float(sum(times)) for name, times in dict(compilation_time_metrics).items()}
