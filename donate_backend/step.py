"""The compiled function of one dynamo graph, and the step-level feedback around it, in layers.

``StepCompiled`` is what the backend hands dynamo for a graph. It runs aot_autograd
over the graph's ``graphs.GraphRequest`` (each forward, backward and inference graph
compiled by the request's path) and counts its calls, once. Around that, in the manner
of aot_autograd's compiler wrappers (``pre_compile`` / ``post_compile``), each layer
adds one kind of feedback:

- the function's settings (``torch.compile(options=...)``) and the levers chosen for its
  step (``choice.StepChoice``) are entered on every call of every aot graph
  (``_WithSettings``; a backward runs outside the dynamo-level call);
- ``ChoiceLayer``: at the ``choice.STEPS + 1``-th call the step's levers are chosen
  (``choice.decide``), and timed over the next calls where it runs one;
- ``limit.LimitLayer``: under ``memory_limit``, at that call the whole step is planned
  with the optimizer state counted, and the graph compiled again under a lower limit
  where it is over (``StepCompiled.recompile``).
"""
from __future__ import annotations

import functools
from typing import Callable

from . import budget, config, report
from . import choice as step_choice
from .analysis import stale_reads
from .torch_compat import aot_autograd


class _WithSettings:
    """One aot graph of a ``StepCompiled``: every call runs under the settings it was
    compiled with (its request's options: a graph planned again under a lower limit keeps
    that limit) and the levers chosen for the step. Boxed, like the graph it wraps."""

    def __init__(self, compiled: Callable, overrides: tuple, choice) -> None:
        self._boxed_call = True  # an instance attribute: dynamo's disable() copies __dict__
        self.compiled = compiled
        self.overrides = overrides
        self.choice = choice

    def __call__(self, args):
        choice = self.choice
        with config.overriding(self.overrides + (choice.overrides if choice is not None else ())):
            return self.compiled(args)

    def __getattr__(self, name):  # the wrapped graph's attributes (report, source)
        return getattr(self.__dict__["compiled"], name)


class ChoiceLayer:
    """The levers of the step chosen once it has run, and timed (``choice``)."""

    def __init__(self, choice: step_choice.StepChoice) -> None:
        self.choice = choice

    def before_call(self, owner: "StepCompiled") -> None:
        choice = self.choice
        if not owner.trains:
            return
        if not choice.decided and owner.calls == step_choice.STEPS + 1:
            with config.overriding(owner.request.overrides):
                step_choice.decide(owner.records(), owner.request.graph_id)
        trial = choice.trial
        if trial is not None and trial.graph_id == owner.request.graph_id:
            trial.step_started()


class StepCompiled:
    """One dynamo graph compiled (module docstring); dynamo calls it with the graph's inputs."""

    def __init__(self, request, example_inputs) -> None:
        self.request = request  # graphs.GraphRequest
        self.calls = 0  # calls since the graph was last compiled
        self.trains = False  # whether aot_autograd compiled a forward (a training graph)
        with config.overriding(request.overrides):
            settings = config.current()
        levers = request.path.levers()
        self.choice = step_choice.StepChoice(levers) if levers is not None and levers.chosen_by_default(settings) else None
        self.layers: list = [ChoiceLayer(self.choice)] if self.choice is not None else []
        self.compiled = self.recompile(request, example_inputs)
        if settings.memory_limit is not None:
            from .limit import LimitLayer

            self.layers.append(LimitLayer(self, example_inputs, settings.memory_limit))
        if getattr(self.compiled, "_boxed_call", False):
            self._boxed_call = True  # an instance attribute: dynamo's disable() copies __dict__

    def records(self) -> list:
        """The records of this function's path, for the layers' decisions."""
        return [r for r in report.reports() if r.path == self.request.path.name]

    def __call__(self, *args):
        self.calls += 1
        for layer in self.layers:
            layer.before_call(self)
        return self.compiled(*args)

    def recompile(self, request, example_inputs) -> Callable:
        """aot_autograd over ``request.gm``, each of its graphs compiled by the request's path."""
        with config.overriding(request.overrides):
            make = functools.partial(self._kind_compiler, request)
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

    def _kind_compiler(self, request, kind: str) -> Callable:
        def compile_one(gm, example_inputs):
            # A backward is compiled when it first runs, outside the backend call: the
            # function's settings are entered again here.
            if kind == "forward":
                self.trains = True
            ctx = request.context(kind, self.choice)
            with config.overriding(request.overrides + (self.choice.overrides if self.choice is not None else ())):
                compiled = request.path.compile_graph(gm, list(example_inputs), ctx)
            if request.overrides or self.choice is not None:
                return _WithSettings(compiled, request.overrides, self.choice)
            return compiled

        return compile_one


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


def compiled_step(request, example_inputs) -> Callable:
    """The callable dynamo runs for one dynamo graph: the ``StepCompiled``, or where it
    has no layer (settings fixed, no limit) the aot-compiled function itself, so that a
    call pays for no wrapper."""
    step = StepCompiled(request, example_inputs)
    return step if step.layers else step.compiled
