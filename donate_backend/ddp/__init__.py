"""Gradients written straight into DDP's buckets under ``torch.compile``.

Two entry points:

* ``capture(gm, example_inputs)`` -- called by ``backend.donate_xla`` on the
  dynamo graph, before aot_autograd. If the graph is traced inside a
  ``DistributedDataParallel`` forward and the module is eligible, it installs
  our communication hook on the DDP reducer (once per module) and returns a
  ``DDPGraphInfo``: which graph inputs are which DDP parameters.
* ``prepare(gm, example_inputs, ctx)`` -- called by the native path on every
  aot graph. For a backward graph with ``ctx.ddp`` set, it routes each
  parameter gradient through a slot writer (``rewrite.py``) and returns the
  ``GraphRecord`` fields ``bucket_grads`` and ``bucket_bytes``.

See docs/ddp.md for the design, what it changes about ``param.grad`` and its
limits. ``DONATE_XLA_BUCKET_VIEW=0`` turns it off.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Optional

from .. import config
from . import comm, eligibility, plan, reducer, rewrite
from .state import DDPBucketState

log = logging.getLogger("donate_xla")

_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_logged: set = set()
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DDPGraphInfo:
    """The DDP facts a graph's compilers need."""

    state: DDPBucketState
    param_indices: tuple  # per graph input: index into state.params, or None


def log_once(key, level: int, message: str, *args) -> None:
    """Log a message once per key (fallback reasons would otherwise repeat per graph)."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, message, *args)


def active_ddp_module():
    """The DDP module whose forward dynamo is tracing now, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def state_for(ddp_module, create: bool = False) -> Optional[DDPBucketState]:
    """Our state for a DDP module; ``create`` also switches it to bucket views."""
    with _lock:
        state = _states.get(ddp_module)
        if state is None and create:
            if reducer.ensure_bucket_view(ddp_module):
                log.info(
                    "donate_xla: rebuilt DDP's reducer with gradient_as_bucket_view=True "
                    "(gradients are written into its buckets)"
                )
            state = DDPBucketState(ddp_module, ddp_module.process_group)
            _states[ddp_module] = state
        return state


def capture(gm, example_inputs) -> Optional[DDPGraphInfo]:
    """Dynamo-level step: map graph inputs to DDP parameters, install our hook."""
    ddp_module = active_ddp_module()
    if ddp_module is None:
        return None
    reason = eligibility.module_fallback_reason(ddp_module, config.current())
    if reason is not None:
        level = logging.INFO if reason.startswith("DONATE_XLA_BUCKET_VIEW") else logging.WARNING
        log_once(
            (id(ddp_module), reason),
            level,
            "donate_xla: DDP gradient buckets off for %s: %s; gradients take DDP's normal path",
            type(ddp_module.module).__name__,
            reason,
        )
        return None
    state = state_for(ddp_module, create=True)
    comm.register(ddp_module, state)
    tensors = plan.placeholder_tensors(gm, example_inputs)
    return DDPGraphInfo(state, plan.input_param_indices(tensors, state.params))


def prepare(gm, example_inputs, ctx):
    """Native-path hook: rewrite a DDP backward graph; returns (gm, record fields)."""
    info = getattr(ctx, "ddp", None)
    if info is None or ctx.kind != "backward":
        return gm, {}
    if not config.current().bucket_view:
        return gm, {"bucket_grads": 0, "bucket_bytes": 0}
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    targets = plan.gradient_outputs(output_node.args[0], info.param_indices)
    if targets is None:
        log_once(
            ("outputs", ctx.graph_id),
            logging.WARNING,
            "donate_xla: %s: backward outputs do not match the forward inputs "
            "(aot_autograd merged inputs); its gradients take DDP's normal path",
            ctx.name,
        )
        return gm, {"bucket_grads": 0, "bucket_bytes": 0}
    params = info.state.params
    kept = []
    for position, index in targets:
        reason = eligibility.param_fallback_reason(params[index])
        if reason is None:
            kept.append((position, index))
        else:
            log_once(
                ("param", id(params[index]), reason),
                logging.WARNING,
                "donate_xla: DDP parameter #%d keeps DDP's normal path: %s",
                index,
                reason,
            )
    routed = rewrite.rewrite_backward(gm, kept, info.state) if kept else []
    nbytes = sum(params[i].numel() * params[i].element_size() for i in routed)
    return gm, {"bucket_grads": len(routed), "bucket_bytes": nbytes}
