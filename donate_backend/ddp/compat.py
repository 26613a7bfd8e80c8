"""Guards around the private torch APIs the DDP integration uses (torch 2.9 and newer).

Each function touches one private API and says what happens when it is
missing or has changed, so the rest of ``ddp/`` never calls a private API
directly. The safe answer is always "DDP's normal path": no rewrite, no hook,
no write into a bucket. Every guard has a test that removes the API by
monkeypatching (tests/test_ddp_compat.py).

- ``active_ddp_module()``: the DDP module whose forward dynamo is tracing
  (``DistributedDataParallel._get_active_ddp_module``). None when unknown:
  the graph is then compiled without the bucket rewrite.
- ``module_parameters(ddp)``: the parameters DDP reduces, in its order
  (``DistributedDataParallel._module_parameters``). None when unknown.
- ``can_rebuild_reducer(ddp)`` / ``rebuild_reducer(ddp, bucket_view)``:
  reducer construction, the way ``DistributedDataParallel.__setstate__`` does
  it (``_build_params_for_reducer``, ``_build_debug_param_to_name_mapping``,
  ``_ddp_init_helper``). Without it we cannot later remove our hook again, so
  the module keeps DDP's normal path.
- ``has_rebuilt_buckets(ddp)``: DDP's flag that it rebuilt its buckets
  (``_has_rebuilt_buckets``), which tells when learned slots go stale. None
  when unknown; slots are then never trusted.
- ``register_comm_hook(reducer, state, hook)``: a comm hook registered on the
  reducer itself (``dist._register_comm_hook``), so that DDP's own
  ``register_comm_hook`` bookkeeping stays the user's. False when missing.
- ``user_comm_hook_name(ddp)``: the comm hook the user registered, from
  ``_comm_hooks`` or DDP's logging data. ``"unknown"`` when neither can be
  read (the module then falls back: it might have one).
- ``join_divides_by_live_ranks(ddp)``: a ``Join`` context set up with
  ``divide_by_initial_world_size=False`` (``_join_config``,
  ``_divide_by_initial_world_size``). True when unknown.
- ``reducer_mode_reason(ddp)``: DDP modes we do not handle, read from private
  flags (``_delay_all_reduce_params``, ``_use_python_reducer``).
- ``tensor_hooks(param)``: whether a tensor hook is registered on a parameter
  (``_backward_hooks``). True when unknown.
- ``running_node_inputs()`` / ``accumulated_variable(node)``: which tensors
  this backward call's gradients belong to, from ``donate_backend.autograd_compat``
  (re-exported here). None when unknown: no gradient is then written into a slot.
- ``engine_will_execute(node)``: whether the backward running now will run
  ``node`` (``torch._C._will_engine_execute_node``); for an ``AccumulateGrad``
  node, whether it writes ``param.grad``. False under ``backward(inputs=...)``
  without this parameter and under ``torch.autograd.grad``; None when torch
  cannot tell (the engine refuses to answer for a leaf that ``autograd.grad``
  captures, no backward is running, or the API is missing).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..autograd_compat import accumulated_variable, running_node_inputs  # noqa: F401 (ddp's guards in one place)


def active_ddp_module():
    """The DDP module whose forward dynamo is tracing now, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    if getter is None:
        return None
    return getter()


def module_parameters(ddp_module) -> Optional[list]:
    """The parameters DDP reduces, in DDP's order, or None."""
    params = getattr(ddp_module, "_module_parameters", None)
    return None if params is None else list(params)


_REDUCER_BUILDERS = ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper")


def can_rebuild_reducer(ddp_module) -> bool:
    return all(callable(getattr(ddp_module, name, None)) for name in _REDUCER_BUILDERS)


def rebuild_reducer(ddp_module, bucket_view: bool) -> bool:
    """Replace DDP's reducer by a new one with ``gradient_as_bucket_view=bucket_view``.

    The new reducer has DDP's bucket order and size caps and no comm hook; it
    rebuilds its buckets after its first backward, as a new DDP does. Existing
    ``param.grad`` tensors are copied into its buckets when bucket views are on.
    Returns False (and changes nothing) when this torch cannot do it.
    """
    if not can_rebuild_reducer(ddp_module):
        return False
    ddp_module.gradient_as_bucket_view = bucket_view
    parameters, expect_sparse_gradient = ddp_module._build_params_for_reducer()
    param_to_name_mapping = ddp_module._build_debug_param_to_name_mapping(parameters)
    ddp_module._ddp_init_helper(
        parameters, expect_sparse_gradient, param_to_name_mapping, ddp_module.static_graph
    )
    ddp_module._has_rebuilt_buckets = False
    return True


def has_rebuilt_buckets(ddp_module) -> Optional[bool]:
    flag = getattr(ddp_module, "_has_rebuilt_buckets", None)
    return None if flag is None else bool(flag)


def register_comm_hook(reducer, state, hook: Callable) -> bool:
    import torch.distributed as dist

    register = getattr(dist, "_register_comm_hook", None)
    if register is None:
        return False
    register(reducer, state, hook)
    return True


def user_comm_hook_name(ddp_module) -> Optional[str]:
    """Name of a comm hook registered through DDP, None if none, "unknown" if unreadable."""
    hooks = getattr(ddp_module, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0]
        return getattr(hook, "__qualname__", repr(hook))
    logging_data = getattr(ddp_module, "_get_ddp_logging_data", None)
    if hooks is None and logging_data is None:
        return "unknown"
    try:
        name = logging_data().get("comm_hook") if logging_data is not None else None
    except Exception:  # logging data is best effort
        name = None
    return name or None


def join_divides_by_live_ranks(ddp_module) -> bool:
    """True when a Join context divides gradients by the ranks still training."""
    join_config = getattr(ddp_module, "_join_config", None)
    if join_config is None:
        return True
    if not getattr(join_config, "enable", True):
        return False
    return not getattr(ddp_module, "_divide_by_initial_world_size", False)


def reducer_mode_reason(ddp_module) -> Optional[str]:
    """A DDP reduction mode we do not handle, read from private flags, or None."""
    if getattr(ddp_module, "_delay_all_reduce_params", None):
        return "delay_all_reduce_named_params is set"
    if getattr(ddp_module, "_use_python_reducer", False):
        return "optimize_ddp='python_reducer' (compiled autograd owns the all-reduce)"
    return None


def tensor_hooks(param: torch.Tensor) -> bool:
    hooks = getattr(param, "_backward_hooks", False)
    return True if hooks is False else bool(hooks)


def engine_will_execute(node) -> Optional[bool]:
    """Whether the backward running now runs ``node``; None when torch cannot tell."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None or node is None:
        return None
    try:
        return bool(will_execute(node))
    except RuntimeError:
        return None
