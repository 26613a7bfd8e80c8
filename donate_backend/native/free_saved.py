"""The freeing boxed backward: every saved tensor and tangent goes at its last use.

aot_autograd calls a compiled backward with one list of arguments (symints,
saved tensors, tangents) and ``steal_args=True``. A backward that takes its
arguments unpacked keeps every saved tensor alive until it returns
(lightning-thunder #606). ``build_freeing`` generates a boxed function
(``codegen``): it unpacks what it uses, clears the list and deletes each value
right after its last reader.

With reuse on, a second variant also writes pointwise results into buffers
that die there (``reuse``). Which variant runs is decided on every call:

- the reusing variant only while the backward does not keep its graph
  (``retain_graph``/``create_graph`` off, ``compat.keep_graph()`` is False)
  and grad mode is off (double backward records ops, and ``out=`` ops do not
  support autograd);
- the freeing variant otherwise. It is always correct: it only drops
  references, it never writes into a buffer it did not make.

``freed_early_count`` says how many saved tensors the backward lets go before
it returns.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, List, Optional, Set

import torch
import torch.fx

from . import codegen, compat, reuse


@dataclasses.dataclass
class FreeingProgram:
    """The generated functions for one graph and what they do."""

    freeing: Callable  # boxed, frees at last use, never writes into inputs
    reusing: Optional[Callable]  # boxed, also writes into dying buffers; None if no reuse
    freeing_source: str
    reusing_source: Optional[str]
    saved_freed_early: int
    buffers_reused: int

    def __call__(self, args: list):
        if self.reusing is not None and may_reuse_saved_buffers():
            return self.reusing(args)
        return self.freeing(args)


def may_reuse_saved_buffers() -> bool:
    """Whether the running backward may overwrite its saved tensors (decided per call)."""
    return compat.keep_graph() is False and not torch.is_grad_enabled()


def is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and node.name.startswith("tangents")


def saved_tensor_inputs(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    """Backward placeholders that are saved tensors (not symints, not tangents)."""
    return [
        n
        for n in graph.find_nodes(op="placeholder")
        if not is_tangent(n) and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def freed_early_count(graph: torch.fx.Graph) -> int:
    """Saved tensors released before the backward returns (not returned by it)."""
    returned = set(graph.output_node().all_input_nodes)
    return sum(1 for n in saved_tensor_inputs(graph) if n not in returned)


def donated_placeholders(graph: torch.fx.Graph, donated_indices) -> Set[torch.fx.Node]:
    """Placeholders at aot_autograd's donated indices that are saved tensors."""
    if not donated_indices:
        return set()
    placeholders = graph.find_nodes(op="placeholder")
    saved = set(saved_tensor_inputs(graph))
    return {placeholders[i] for i in donated_indices if i < len(placeholders) and placeholders[i] in saved}


def build_freeing(
    gm: torch.fx.GraphModule,
    name: str,
    *,
    reuse_buffers: bool,
    donated_indices=None,
) -> FreeingProgram:
    """Generate the freeing (and, if asked and possible, reusing) boxed functions for ``gm``."""
    freeing, freeing_source = codegen.compile_boxed(gm.graph, name, owner=gm)
    reusing = reusing_source = None
    reused = 0
    if reuse_buffers:
        # Plan on the original graph (its fake values carry the storage
        # sharing), then apply the plan to a copy, matching nodes by name.
        plans = reuse.plan_reuse(gm.graph, donated_placeholders(gm.graph, donated_indices))
        if plans:
            rewritten = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
            by_name = {n.name: n for n in rewritten.graph.nodes}
            reused = reuse.apply_reuse(
                [
                    dataclasses.replace(p, node=by_name[p.node.name], buffer=by_name[p.buffer.name])
                    for p in plans
                ]
            )
            reusing, reusing_source = codegen.compile_boxed(
                rewritten.graph, name + "_reusing", owner=rewritten
            )
    return FreeingProgram(
        freeing=freeing,
        reusing=reusing,
        freeing_source=freeing_source,
        reusing_source=reusing_source,
        saved_freed_early=freed_early_count(gm.graph),
        buffers_reused=reused,
    )
