"""Writes hidden from autograd, made visible to aot_autograd before it traces.

A graph can write a parameter in place through an alias autograd does not see:
``w.detach().mul_(a)``, ``w.data.clamp_(...)``, or ``nn.Embedding(max_norm=...)``
(``F.embedding`` renormalises ``weight.detach()`` in place). torch 2.9's
aot_autograd applies such a write after the forward, outside the graph, and
when the same graph also returns one of its inputs (dynamo does that for
``self.count += 1``, to rebind the attribute) it hands back that input in place
of the user's output: the loss becomes the counter (with aot_eager and Inductor
too; fixed in later torch releases).

The same write made under ``no_grad`` on the parameter itself is one aot_autograd
keeps inside the graph, and that case is right on every torch. So, only in a
graph that has both ingredients, each hidden write is rewritten into that form:

- ``detach(w).op_(...)`` and ``w.data.op_(...)`` -> ``w.op_(...)`` under ``no_grad``;
- ``F.embedding(idx, w, max_norm=m, ...)`` -> ``torch.embedding_renorm_(w, idx, m, p)``
  under ``no_grad``, then ``F.embedding(idx, w, ...)`` without ``max_norm``.

The values are the ones eager PyTorch computes. (``.data`` shares no version
counter with ``w``, so a tensor saved from ``w`` before such a write and read by
a later backward now fails autograd's version check instead of silently reading
the new value.)
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from . import torch_compat

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
})
# How dynamo records ``no_grad`` blocks and ``w.data`` (private torch functions; where one
# is gone, such graphs are simply left as they are).
_SET_GRAD = torch_compat.set_grad_enabled_function()
_GET_DATA = torch_compat.get_data_attr_function()


def _is_inplace(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    return node.op == "call_function" and node.target in _INPLACE_OPERATORS


def _input_root(node) -> torch.fx.Node | None:
    """The placeholder an in-place result is (``x += 1`` returns ``x``), else None."""
    while isinstance(node, torch.fx.Node):
        if node.op == "placeholder":
            return node
        if not (_is_inplace(node) and node.args):
            return None
        node = node.args[0]
    return None


def _returns_an_input(gm: torch.fx.GraphModule) -> bool:
    outputs = torch.utils._pytree.tree_leaves(gm.graph.output_node().args)
    return any(_input_root(value) is not None for value in outputs)


def _hidden_alias_of_input(node) -> torch.fx.Node | None:
    """``w`` for ``w.detach()`` / ``torch.detach(w)`` / ``w.data`` of a placeholder ``w``."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    base = node.args[0]
    if not isinstance(base, torch.fx.Node) or base.op != "placeholder":
        return None
    if node.op == "call_method" and node.target == "detach":
        return base
    if node.op == "call_function" and node.target is torch.detach:
        return base
    if node.op == "call_function" and _GET_DATA is not None and node.target is _GET_DATA:
        return base
    return None


def _hidden_writes(gm: torch.fx.GraphModule) -> list:
    """(node, kind, parameter) for each write through a hidden alias, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and _is_inplace(node) and node.args:
            base = _hidden_alias_of_input(node.args[0])
            if base is not None:
                found.append((node, "inplace", base))
        elif node.op == "call_function" and node.target is torch.nn.functional.embedding:
            if _embedding_max_norm(node) is not None:
                found.append((node, "embedding", None))
    return found


_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding_arguments(node: torch.fx.Node) -> dict:
    bound = dict(zip(_EMBEDDING_ARGS, node.args))
    bound.update(node.kwargs)
    return bound


def _embedding_max_norm(node: torch.fx.Node):
    return _embedding_arguments(node).get("max_norm")


def _grad_mode_at(gm: torch.fx.GraphModule) -> dict:
    """Whether grad mode is on at each node (dynamo records ``no_grad`` blocks as
    ``_set_grad_enabled`` calls; the graph starts in the mode it is compiled under)."""
    enabled, at = torch.is_grad_enabled(), {}
    for node in gm.graph.nodes:
        at[node] = enabled
        if node.op == "call_function" and node.target is _SET_GRAD and node.args:
            enabled = bool(node.args[0])
    return at


def rewrite_hidden_writes(gm: torch.fx.GraphModule) -> int:
    """Rewrite, in place, the hidden writes of a graph that also returns an input;
    returns how many were rewritten."""
    writes = _hidden_writes(gm)
    if _SET_GRAD is None or not writes or not _returns_an_input(gm):
        return 0
    grad_on = _grad_mode_at(gm)
    graph, aliases = gm.graph, []
    for node, kind, base in writes:
        enabled = grad_on[node]
        with graph.inserting_before(node):
            if enabled:
                graph.call_function(_SET_GRAD, (False,))
            if kind == "inplace":
                aliases.append(node.args[0])
                node.replace_input_with(node.args[0], base)
            else:
                bound = _embedding_arguments(node)
                index = graph.call_method("contiguous", (bound["input"],))
                graph.call_function(
                    torch.embedding_renorm_,
                    (bound["weight"], index, bound["max_norm"], bound.get("norm_type", 2.0)),
                )
        if kind == "embedding":
            node.kwargs = {**{k: v for k, v in node.kwargs.items() if k != "max_norm"}}
            node.args = tuple(None if i == 3 else a for i, a in enumerate(node.args))
            if enabled:  # the lookup itself runs in the caller's grad mode
                with graph.inserting_before(node):
                    graph.call_function(_SET_GRAD, (True,))
        elif enabled:
            with graph.inserting_after(node):
                graph.call_function(_SET_GRAD, (True,))
    for alias in aliases:  # the hidden aliases nothing reads any more
        if not alias.users:
            graph.erase_node(alias)
    gm.recompile()
    return len(writes)
