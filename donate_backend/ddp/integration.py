"""How the native path uses DDP: capture, keep each module in the right mode, prepare backwards.

Three steps, each called by someone else:

* ``capture(gm, example_inputs)`` -- the native path's capture hook, called
  by ``backend.donate_xla`` on the dynamo graph (before aot_autograd) while
  DDP's forward is traced. It binds the DDP module (``ModuleBinding``, once
  per module) and returns a ``DDPGraphInfo``: which graph inputs are which
  DDP parameters. It does so whatever the switches say, so that a switch
  turned on later can still rewrite this graph.
* ``ModuleBinding.reconcile(settings)`` -- before every forward of the DDP
  module (a forward pre-hook, run eagerly before DDP's own ``_pre_forward``),
  and at capture. It puts the module in *bucket mode* (reducer with bucket
  views, our comm hook on it) when ``eligibility`` finds no reason against
  it, and takes it out again (a fresh reducer as the user configured it, with
  no hook of ours) when a reason appears: a switch flipped, a ``Join`` with
  ``divide_by_initial_world_size=False``, ... Each change is logged once with
  its reason. Doing this before ``_pre_forward`` means DDP prepares the
  reducer that will really run the step.
* ``prepare(gm, info, ctx, settings)`` -- called by the native path for every aot
  graph it builds (a copy it owns). A DDP backward built under settings that
  allow it gets its parameter gradients routed through slot writers
  (``grad_slots.py``); whether each write happens is decided per call
  (``writer.py``). Returns a ``PreparedGraph``.

See docs/ddp.md.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Optional

import torch

from .. import config
from ..analysis.mutation import graph_attributes
from . import comm, compat, eligibility, grad_slots, parameters
from .state import DDPBucketState, WriteCounts

log = logging.getLogger("donate_xla")

_bindings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_logged: set = set()
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DDPGraphInfo:
    """What capture learnt about a graph traced inside a DDP forward."""

    binding: "ModuleBinding"
    param_indices: tuple  # per graph input: index into binding.params when traced, or None
    edges: tuple  # per graph input: its index among the tensor inputs, or None


@dataclasses.dataclass(frozen=True)
class PreparedGraph:
    """A graph after the DDP step, and how many gradients it routes into buckets."""

    gm: torch.fx.GraphModule
    bucket_grads: Optional[int] = None  # None: not a DDP backward graph
    bucket_bytes: Optional[int] = None


def log_once(key, level: int, message: str, *args) -> None:
    """Log a message once per key (per-graph reasons would otherwise repeat)."""
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, message, *args)


def _level(reason: str) -> int:
    return logging.INFO if reason.startswith("DONATE_XLA_BUCKET_VIEW") else logging.WARNING


class ModuleBinding:
    """Our link with one DDP module: its parameters, its mode, and its bucket state.

    ``state`` is a ``DDPBucketState`` while the module is in bucket mode (our
    hook is on its current reducer), else None; slot writers read it on every
    call, so leaving bucket mode sends every gradient down DDP's normal path
    at once.
    """

    def __init__(self, ddp_module, params: list):
        self._ddp = weakref.ref(ddp_module)
        self.name = type(ddp_module.module).__name__
        self.params = params
        self.user_bucket_view = bool(ddp_module.gradient_as_bucket_view)
        self.counts = WriteCounts()
        self.state: Optional[DDPBucketState] = None
        self.reason: Optional[str] = None  # why the module is on DDP's normal path now
        self.fixed_reason = eligibility.fixed_reason(ddp_module)  # checked once
        # torch.compile(options=...) of the compiled function that traced the module: its
        # forward pre-hook runs outside the compiled graphs, so it enters them itself
        self.overrides: tuple = ()
        self._lock = threading.Lock()

    def module(self):
        return self._ddp()

    def reconcile(self, settings: config.Settings) -> None:
        """Enter or leave bucket mode as the switches and the module's state ask."""
        ddp = self._ddp()
        if ddp is None:
            return
        reason = eligibility.module_fallback_reason(ddp, settings, self.fixed_reason)
        with self._lock:
            if reason is None and self.state is None:
                reason = self._enter_bucket_mode(ddp)
            elif reason is not None and self.state is not None:
                self._leave_bucket_mode(ddp, reason)
            if reason is not None and reason != self.reason:
                log.log(
                    _level(reason),
                    "donate_xla: DDP gradient buckets off for %s: %s; gradients take DDP's normal path",
                    self.name,
                    reason,
                )
            self.reason = reason

    def _enter_bucket_mode(self, ddp) -> Optional[str]:
        if not ddp.gradient_as_bucket_view:
            # With gradient_as_bucket_view=False the reducer asserts that a
            # gradient is *not* a view of its bucket.
            compat.rebuild_reducer(ddp, bucket_view=True)
            log.info(
                "donate_xla: rebuilt DDP's reducer for %s with gradient_as_bucket_view=True "
                "(gradients are written into its buckets)",
                self.name,
            )
        state = DDPBucketState(ddp, self.params, self.counts)
        if not comm.register(ddp.reducer, state):
            compat.rebuild_reducer(ddp, bucket_view=self.user_bucket_view)
            return "this torch cannot register a comm hook on the reducer (private API missing)"
        self.state = state
        return None

    def _leave_bucket_mode(self, ddp, reason: str) -> None:
        # A fresh reducer, as the user configured it, drops our hook and its buckets.
        compat.rebuild_reducer(ddp, bucket_view=self.user_bucket_view)
        self.state = None
        log.log(
            _level(reason),
            "donate_xla: rebuilt DDP's reducer for %s without our communication hook "
            "(gradient_as_bucket_view=%s, as given)",
            self.name,
            self.user_bucket_view,
        )

    def before_forward(self, _module, _args) -> None:
        """Forward pre-hook of the DDP module: runs before DDP prepares its reducer."""
        with config.overriding(self.overrides) as settings:
            self.reconcile(settings)


def binding_of(ddp_module) -> Optional[ModuleBinding]:
    """The binding of a DDP module, if it was ever captured."""
    with _lock:
        return _bindings.get(ddp_module)


def _bind(ddp_module) -> Optional[ModuleBinding]:
    with _lock:
        binding = _bindings.get(ddp_module)
        if binding is not None:
            return binding
        params = compat.module_parameters(ddp_module)
        if params is None:
            return None
        binding = ModuleBinding(ddp_module, params)
        # Eager, outside the compiled region, before DDP's own ``_pre_forward``.
        ddp_module.register_forward_pre_hook(
            torch.compiler.disable(binding.before_forward), prepend=True
        )
        _bindings[ddp_module] = binding
        return binding


def capture(gm, example_inputs) -> Optional[DDPGraphInfo]:
    """Dynamo-level step: map graph inputs to DDP parameters, bind the module."""
    ddp_module = compat.active_ddp_module()
    if ddp_module is None:
        return None
    binding = _bind(ddp_module)
    if binding is None:
        log_once(
            ("params", id(ddp_module)),
            logging.WARNING,
            "donate_xla: DDP gradient buckets off for %s: this torch does not list DDP's "
            "parameters (private API missing); gradients take DDP's normal path",
            type(ddp_module.module).__name__,
        )
        return None
    binding.overrides = config.active_overrides()
    binding.reconcile(config.current())
    tensors = parameters.placeholder_tensors(gm, example_inputs)
    kinds = tensors if len(example_inputs) != len(tensors) else example_inputs
    # aot_autograd's inputs: the graph's own parameters and buffers, then the placeholders
    attributes = [tensor for _, tensor, _ in graph_attributes(gm)]
    tensors, kinds = attributes + tensors, attributes + list(kinds)
    return DDPGraphInfo(
        binding, parameters.input_param_indices(tensors, binding.params), parameters.tensor_edges(kinds)
    )


def prepare(
    gm: torch.fx.GraphModule, info: Optional[DDPGraphInfo], ctx, settings: config.Settings
) -> PreparedGraph:
    """Native-path step: route a DDP backward's parameter gradients through slot writers.

    ``info`` is what ``capture`` returned for the dynamo graph ``gm`` comes
    from. ``gm`` is the caller's own copy; it is rewritten in place and returned.
    """
    if info is None or ctx.kind != "backward":
        return PreparedGraph(gm)
    ddp_module = info.binding.module()
    if (
        ddp_module is None
        or eligibility.module_fallback_reason(ddp_module, settings, info.binding.fixed_reason)
        is not None
    ):
        return PreparedGraph(gm, 0, 0)
    output_node = gm.graph.output_node()
    targets = parameters.gradient_outputs(output_node.args[0], info.param_indices)
    if targets is not None and any(info.edges[position] is None for position, _ in targets):
        targets = None  # a parameter where the forward has no tensor input
    if targets is None:
        log_once(
            ("outputs", ctx.graph_id),
            logging.WARNING,
            "donate_xla: %s: backward outputs do not match the forward's tensor inputs "
            "(aot_autograd merged inputs); its gradients take DDP's normal path",
            ctx.name,
        )
        return PreparedGraph(gm, 0, 0)
    # which gradients each call may write (a parameter's hooks, whether the engine
    # accumulates it) is the writer's decision, made for the parameters of that call
    edges = [(position, info.edges[position], index) for position, index in targets]
    tensor_inputs = sum(edge is not None for edge in info.edges)
    routed = (
        grad_slots.rewrite_backward(gm, edges, info.binding, ctx.name, tensor_inputs) if targets else []
    )
    params = info.binding.params
    nbytes = sum(params[i].numel() * params[i].element_size() for i in routed)
    return PreparedGraph(gm, len(routed), nbytes)
