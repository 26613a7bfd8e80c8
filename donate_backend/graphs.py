"""What a path compiles from: a dynamo graph's request and each aot graph's context, as data.

``GraphRequest`` is one dynamo graph after the backend's and its path's rewrites, with
what was learnt from it and the settings of its compiled function (``step.StepCompiled``
compiles it, and again under a lower memory limit). ``GraphContext`` is what a path's
``compile_graph`` knows about one aot graph besides the graph itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


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


@dataclasses.dataclass(frozen=True)
class GraphRequest:
    """What the backend compiles one dynamo graph from, besides its example inputs:
    the graph after the path's rewrites, what was learnt from it, and the settings of
    its compiled function. A graph planned under a memory limit keeps it (with fake
    inputs) to compile the graph again under a lower limit."""

    graph_id: int
    gm: torch.fx.GraphModule
    path: object  # the ``paths.Path`` that owns the graph
    roles: tuple  # one role per dynamo input (analysis.mutation)
    captured: object  # what the path's ``capture`` hook returned
    overrides: tuple  # torch.compile(options=...) of this function, as config overrides

    def with_limit(self, limit: int) -> "GraphRequest":
        """The same graph under another ``memory_limit`` (for this function only)."""
        others = tuple((k, v) for k, v in self.overrides if k != "memory_limit")
        return dataclasses.replace(self, overrides=others + (("memory_limit", limit),))

    def context(self, kind: str, choice=None) -> GraphContext:
        return GraphContext(self.graph_id, kind, self.roles, self.captured, choice=choice)
