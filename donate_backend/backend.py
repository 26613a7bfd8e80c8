"""The ``donate_xla`` dynamo backend: aot_autograd, then route each graph by device.

Dynamo hands us an FX graph. aot_autograd turns it into functional forward,
backward or inference graphs (input mutations kept in the graph as ``copy_``),
and each of those is compiled by the path that owns its device: XLA graphs by
``donate_backend.xla``, CUDA/CPU graphs by ``donate_backend.native``.

Each path module provides the same four functions, and this entry knows
nothing about any one path:

- ``check_dynamo_graph(gm, example_inputs, graph_id)``: refuse a graph early;
- ``capture(gm, example_inputs)``: whatever the path must learn from the
  dynamo graph itself, before aot_autograd (the native path: which inputs are
  the parameters of the DDP module being traced); handed to its compilers as
  ``GraphContext.captured``;
- ``aot_options()``: extra aot_autograd options;
- ``compile_graph(gm, example_inputs, ctx)``: compile one aot graph.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from typing import Callable, Optional, Sequence

import torch

from . import budget, config
from . import choice as step_choice
from .torch_compat import aot_autograd
from .analysis import stale_reads
from .analysis.mutation import dynamo_input_roles
from .errors import DonateXlaError
from .hidden_mutations import rewrite_hidden_writes

_graph_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class GraphContext:
    """What a path compiler knows about the graph besides the graph itself."""

    graph_id: int
    kind: str  # "forward", "backward" or "inference"
    input_roles: tuple = ()  # one role per dynamo input (see analysis.mutation)
    captured: object = None  # what the path's ``capture`` hook returned for this graph
    # a part of the graph compiled on its own (XLA: backward segments, CPU fallback): its
    # index, dotted for a part of a part ("2.1")
    segment: Optional[str] = None
    # the settings chosen for this dynamo graph's graphs once its step has run
    # (``choice.StepChoice``); None: its settings are fixed
    choice: object = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        whole = f"graph {self.graph_id} {self.kind}"
        return whole if self.segment is None else f"{whole} (segment {self.segment})"

    def for_segment(self, index: int) -> "GraphContext":
        """The context of the graph's ``index``-th segment: its inputs are not the graph's,
        so it carries no input roles and nothing captured for the whole graph."""
        segment = str(index) if self.segment is None else f"{self.segment}.{index}"
        return dataclasses.replace(self, input_roles=(), captured=None, segment=segment)


def graph_device_type(example_inputs: Sequence) -> str:
    """``"xla"`` if any tensor input lives on an XLA device, else ``"native"``."""
    for value in torch.utils._pytree.tree_leaves(list(example_inputs)):
        # compiled autograd passes its tensors in a list
        if isinstance(value, torch.Tensor) and value.device.type == "xla":
            return "xla"
    return "native"


def _path_module(device_type: str, graph_id: int, example_inputs: Sequence):
    if device_type != "xla":
        from . import native as path

        return path
    try:
        import torch_xla  # noqa: F401  (the XLA path needs it; the native path does not)
    except ImportError as error:
        raise DonateXlaError(
            _no_torch_xla_message(graph_id, example_inputs), help_section="Refused before anything runs"
        ) from error
    from . import xla as path

    return path


def _no_torch_xla_message(graph_id: int, example_inputs: Sequence) -> str:
    leaves = torch.utils._pytree.tree_leaves(list(example_inputs))
    index, tensor = next(
        (i, v)
        for i, v in enumerate(leaves)
        if isinstance(v, torch.Tensor) and v.device.type == "xla"
    )
    return (
        f"donate_xla: graph {graph_id} has an input on an XLA device (input {index}, "
        f"shape {tuple(tensor.shape)}, device {tensor.device}), but torch_xla is not installed. "
        "The XLA path needs the xla extra: pip install 'donate_backend[xla]' "
        "(torch==2.9.0 and torch_xla==2.9.0). CUDA and CPU tensors need no torch_xla."
    )


def _kind_compiler(
    path_compile: Callable, graph_id: int, roles: tuple, kind: str, captured=None, overrides: tuple = (),
    choice=None,
) -> Callable:
    def compile_one(gm: torch.fx.GraphModule, example_inputs):
        # A backward is compiled when it first runs, outside the backend call: the
        # function's options are entered again here.
        ctx = GraphContext(graph_id, kind, roles, captured, choice=choice)
        with config.overriding(overrides + (choice.overrides if choice is not None else ())):
            compiled = path_compile(gm, list(example_inputs), ctx)
        if overrides or choice is not None:
            return CompiledWithOptions(compiled, overrides, choice, graph_id if kind == "forward" else None)
        return compiled

    return compile_one


class CompiledWithOptions:
    """A compiled graph of a function given ``torch.compile(options=...)``, or whose
    settings are chosen once its step has run (``choice.StepChoice``): every call runs
    under those settings (``config.overriding``). A forward's ``choice.STEPS + 1``-th
    call first lets ``choice.decide`` choose. Boxed, like the graph it wraps."""

    def __init__(self, compiled: Callable, overrides: tuple, choice=None, forward_of: Optional[int] = None) -> None:
        self._boxed_call = True  # an instance attribute: dynamo's disable() copies __dict__
        self.compiled = compiled
        self.overrides = overrides
        self.choice = choice
        self._forward_of = forward_of  # the graph id, for a forward whose step is chosen
        self._calls = 0

    def __call__(self, args):
        choice = self.choice
        if choice is not None and self._forward_of is not None:
            if not choice.decided:
                self._calls += 1
                if self._calls == step_choice.STEPS + 1:
                    with config.overriding(self.overrides):
                        step_choice.decide(self._forward_of)
            trial = choice.trial
            if trial is not None and trial.graph_id == self._forward_of:
                trial.step_started()
        with config.overriding(self.overrides + (choice.overrides if choice is not None else ())):
            return self.compiled(args)

    def __getattr__(self, name):  # the wrapped graph's attributes (report, source)
        return getattr(self.__dict__["compiled"], name)


def compile_options(graph_id: int, mode=None, options=None, **others) -> tuple:
    """``torch.compile``'s ``mode`` and ``options`` reach a custom backend as keyword
    arguments. ``options`` sets fields of ``config.Settings`` for this compiled function
    (checked here: an unknown key or a bad value is refused); a ``mode`` other than the
    default is ignored with a warning (Inductor's modes: CUDA graphs, autotuning); any
    other argument is refused."""
    if others:
        raise DonateXlaError(
            f"donate_xla: graph {graph_id}: unknown torch.compile argument(s) "
            f"{', '.join(sorted(others))}; donate_xla takes options={{...}} with fields of "
            "donate_backend.config.Settings.",
            help_section="Settings and `torch.compile` arguments",
        )
    if mode not in (None, "default"):
        _warn_once(
            f"donate_xla ignores torch.compile(mode={mode!r}): the modes select Inductor's "
            "features (CUDA graphs, autotuning); donate_xla compiles the same way in every mode."
        )
    try:
        return config.options_overrides(options)
    except ValueError as error:
        raise DonateXlaError(
            f"donate_xla: graph {graph_id}: torch.compile(options=...) refused: {error}. "
            "Options apply to this compiled function only; DONATE_XLA_* variables and "
            "donate_backend.config.patch(...) set the process defaults (README, 'Switches').",
            help_section="Settings and `torch.compile` arguments",
        ) from None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


@dataclasses.dataclass(frozen=True)
class GraphRequest:
    """What the backend compiles one dynamo graph from, besides its example inputs:
    the graph after the path's rewrites, what was learnt from it, and the settings of
    its compiled function. A graph planned under a memory limit keeps it (with fake
    inputs) to compile the graph again under a lower limit (``limit.LimitedGraph``)."""

    graph_id: int
    gm: torch.fx.GraphModule
    path: object  # the path module: donate_backend.xla or donate_backend.native
    roles: tuple  # one role per dynamo input (analysis.mutation)
    captured: object  # what the path's ``capture`` hook returned
    overrides: tuple  # torch.compile(options=...) of this function, as config overrides
    choice: object = None  # choice.StepChoice: settings chosen once the step has run

    def with_limit(self, limit: int) -> "GraphRequest":
        """The same graph under another ``memory_limit`` (for this function only)."""
        others = tuple((k, v) for k, v in self.overrides if k != "memory_limit")
        return dataclasses.replace(self, overrides=others + (("memory_limit", limit),))


def donate_xla(gm: torch.fx.GraphModule, example_inputs, **compile_arguments):
    """Dynamo backend entry point (registered as ``"donate_xla"``)."""
    graph_id = next(_graph_ids)
    overrides = compile_options(graph_id, **compile_arguments)
    with config.overriding(overrides):
        path = _path_module(graph_device_type(example_inputs), graph_id, example_inputs)
        path.check_dynamo_graph(gm, example_inputs, graph_id)
        rewrite_hidden_writes(gm)
        path.prepare_dynamo_graph(gm)
        roles = dynamo_input_roles(gm, example_inputs)
        captured = path.capture(gm, example_inputs)  # here: inside dynamo, before aot_autograd
        settings = config.current()
        # XLA steps whose levers are not set are chosen once they have run (``choice``)
        choice = step_choice.StepChoice() if path.__name__.endswith(".xla") and settings.stitch is None else None
        request = GraphRequest(graph_id, gm, path, roles, captured, overrides, choice)
        compiled = compile_request(request, example_inputs)
        limit = settings.memory_limit
    if limit is None:
        return compiled
    from .limit import LimitedGraph

    return LimitedGraph(request, example_inputs, compiled, compile_request, limit)


def compile_request(request: GraphRequest, example_inputs) -> Callable:
    """aot_autograd over ``request.gm``, each of its graphs compiled by the request's path."""
    with config.overriding(request.overrides):
        make = functools.partial(
            _kind_compiler, request.path.compile_graph, request.graph_id, request.roles,
            captured=request.captured, overrides=request.overrides, choice=request.choice,
        )
        aot_options = dict(
            fw_compiler=make("forward"),
            bw_compiler=make("backward"),
            inference_compiler=make("inference"),
            keep_inference_input_mutations=True,
        )
        aot_options.update(request.path.aot_options())
        if "partition_fn" in aot_options:
            aot_options["partition_fn"] = guard_stale_reads(aot_options["partition_fn"], request.graph_id)
        return aot_autograd(**aot_options)(request.gm, example_inputs)


def guard_stale_reads(partition_fn: Callable, graph_id: int) -> Callable:
    """``partition_fn`` that never lets the backward read an input the forward
    overwrote (``analysis/stale_reads.py``): it saves the readers' results instead
    of recomputing them, or refuses the graph when the backward needs the old value."""

    def partition(joint, joint_inputs, **kwargs):
        overwritten = stale_reads.pin_reads_of_overwritten_inputs(joint)
        try:
            fw_module, bw_module = partition_fn(joint, joint_inputs, **kwargs)
        except budget.MemoryLimitError as error:
            raise budget.MemoryLimitError(
                str(error.args[0]).replace("this graph's", f"graph {graph_id}'s", 1),
                least_bytes=error.least_bytes,
            ) from None
        stale_reads.check_backward_reads(fw_module, bw_module, overwritten, f"graph {graph_id}")
        return fw_module, bw_module

    return partition
