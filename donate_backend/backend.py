"""The ``donate_xla`` dynamo backend: aot_autograd, then each graph compiled by the path that owns it.

Dynamo hands us an FX graph. aot_autograd turns it into functional forward,
backward or inference graphs (input mutations kept in the graph as ``copy_``),
and each of those is compiled by the path whose devices the graph's tensors live
on (``paths``: CUDA/CPU tensors by ``donate_backend.native``, XLA tensors by
``donate_backend.xla``). This entry knows nothing about any one path: it reads the
function's options, asks ``paths.path_for`` who owns the graph, lets that path refuse
or rewrite dynamo's graph and learn from it, and hands a ``graphs.GraphRequest`` to
``step.compiled_step``, which runs aot_autograd and the step-level feedback.
"""
from __future__ import annotations

import functools
import itertools
import warnings

from . import config, fixed_sizes, paths
from .analysis.mutation import dynamo_input_roles
from .errors import DonateXlaError
from .graphs import GraphRequest
from .hidden_mutations import rewrite_hidden_writes
from .step import compiled_step

_graph_ids = itertools.count()


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


def donate_xla(gm, example_inputs, **compile_arguments):
    """Dynamo backend entry point (registered as ``"donate_xla"``)."""
    graph_id = next(_graph_ids)
    overrides = compile_options(graph_id, **compile_arguments)
    with config.overriding(overrides):
        path = paths.path_for(gm, example_inputs, graph_id)
        path.check_dynamo_graph(gm, example_inputs, graph_id)
        rewrite_hidden_writes(gm)
        path.prepare_dynamo_graph(gm)
        roles = dynamo_input_roles(gm, example_inputs)
        captured = path.capture(gm, example_inputs)  # here: inside dynamo, before aot_autograd
        if path.fixed_sizes and fixed_sizes.symbolic(example_inputs):
            return fixed_sizes.PerSizes(f"graph {graph_id}", functools.partial(
                _compile_for_sizes, gm, path, roles, captured, overrides))
        request = GraphRequest(graph_id, gm, path, roles, captured, overrides)
        return compiled_step(request, example_inputs)


def _compile_for_sizes(gm, path, roles, captured, overrides, args):
    """A graph that dynamo traced with symbolic sizes, compiled for the sizes of ``args``
    (``fixed_sizes.PerSizes``), as a graph of its own."""
    with config.overriding(overrides):
        request = GraphRequest(next(_graph_ids), gm, path, roles, captured, overrides)
        return compiled_step(request, args)


__all__ = ["compile_options", "donate_xla"]
