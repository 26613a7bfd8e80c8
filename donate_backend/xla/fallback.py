"""CPU fallback: a graph with ops torch_xla cannot lower runs in segments.

torch_xla has no XLA kernel for some ATen ops (``aten::_foobar``,
``special_zeta``, ...). Tracing one on a placeholder would run torch_xla's CPU
fallback on a tensor with no data, which crashes. Instead the aot graph is
split at those ops (``torch.fx.passes.split_module``): every stretch of
lowerable ops is a segment compiled by the XLA path as usual (abstractly,
donating what it overwrites), and each unlowerable op runs eagerly on the CPU
between them, its XLA inputs copied to the host and its results back. The
graph's record lists the ops that fell back.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from .. import graph_meta
from .ops import lowerable_node


def fallback_nodes(gm: torch.fx.GraphModule) -> list:
    """The nodes of ``gm`` that have to run on the CPU: ops with no XLA lowering, and
    copies of XLA tensors to the host (``t.cpu()`` inside the function)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and (_unlowerable(n) or _copies_to_host(n))]


def _unlowerable(node: torch.fx.Node) -> bool:
    return not lowerable_node(node)


def _device(node) -> Optional[str]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.device.type if isinstance(val, torch.Tensor) else None


def _copies_to_host(node: torch.fx.Node) -> bool:
    return _device(node) == "cpu" and any(_device(a) == "xla" for a in node.all_input_nodes)


def partition_ids(gm: torch.fx.GraphModule, fallbacks: list) -> dict:
    """Node -> segment number: each fallback op alone (with the ``getitem`` nodes that
    unpack its results), the stretches between them together.

    A segment's inputs and outputs must be tensors: a fallback op that returns
    several values (``_weight_norm_interface``) is unpacked on its side, not
    handed to the next XLA segment as a tuple."""
    fallback_set = set(fallbacks)
    ids, current = {}, 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node in fallback_set:
            current += 1
            ids[node] = current
            current += 1
        elif _unpacks(node, fallback_set):
            ids[node] = ids[node.args[0]]
        else:
            ids[node] = current
    return ids


def _unpacks(node: torch.fx.Node, fallback_set: set) -> bool:
    return node.op == "call_function" and node.target is operator.getitem and node.args[0] in fallback_set


@dataclasses.dataclass(frozen=True)
class CpuSplit:
    """The split graph: ``top`` calls ``submod_<k>`` in order."""

    top: torch.fx.GraphModule
    fallback_names: frozenset  # names of the submodules that run on the CPU
    fallback_ops: tuple  # the op names, for the report


def split_at_fallbacks(gm: torch.fx.GraphModule) -> Optional[CpuSplit]:
    """Split ``gm`` around its unlowerable ops; None when it has none."""
    fallbacks = fallback_nodes(gm)
    if not fallbacks:
        return None
    ids = partition_ids(gm, fallbacks)
    top = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    fallback_ids = {ids[n] for n in fallbacks}
    names = frozenset(f"submod_{k}" for k in fallback_ids)
    return CpuSplit(top, names, tuple(str(n.target) for n in fallbacks))  # names: for the report


def segment_example_inputs(submodule: torch.fx.GraphModule) -> list:
    """The fake values of a segment's inputs (copied from the nodes they stand for)."""
    return [n.meta.get("val") for n in submodule.graph.find_nodes(op="placeholder")]


def on_cpu(submodule: torch.fx.GraphModule, device: torch.device) -> Callable:
    """Run ``submodule`` eagerly on the CPU: XLA inputs to the host, and each result
    to the device the graph has it on."""
    output = submodule.graph.output_node().args[0]
    single = not isinstance(output, (tuple, list))
    on_device = [_device(v) != "cpu" for v in ([output] if single else output)]

    def to_host(value):
        return value.cpu() if isinstance(value, torch.Tensor) and value.device.type == "xla" else value

    def placed(value, to_xla: bool):
        if to_xla and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return value.to(device)
        return value

    def run(*args):
        out = submodule(*[to_host(a) for a in args])
        if single:
            return placed(out, on_device[0])
        return type(out)(placed(v, d) for v, d in zip(out, on_device))

    return run


class _Segment(torch.nn.Module):
    """A compiled segment in the split graph's ``call_module`` slot."""

    def __init__(self, run: Callable, boxed: bool, single_output: bool):
        super().__init__()
        self._run = run
        self._boxed = boxed
        self._single = single_output

    def forward(self, *args):
        out = self._run(list(args)) if self._boxed else self._run(*args)
        if not self._boxed:
            return out
        return out[0] if self._single else tuple(out)


def returns_one_value(submodule: torch.fx.GraphModule) -> bool:
    return not isinstance(submodule.graph.output_node().args[0], (tuple, list))


@dataclasses.dataclass(frozen=True)
class Part:
    """One submodule of a split graph, to be compiled on its own (by the XLA path's
    ``compile_graph``): its graph, example inputs and context."""

    name: str  # its attribute on the split graph's top module
    graph: torch.fx.GraphModule
    example_inputs: list
    ctx: object  # graphs.GraphContext of the part (``ctx.for_segment``)
    single_output: bool  # it returns one value, not a tuple


# a part's module meta: the indices of its inputs that outlive it (read by a later part, or
# returned by the whole graph), which its memory prediction does not release


def parts(top: torch.fx.GraphModule, ctx, skip=frozenset()) -> list:
    """The submodules of ``top`` in order, as ``Part``s, but those named in ``skip``."""
    _mark_kept_inputs(top)
    return [
        Part(name, submodule, segment_example_inputs(submodule), ctx.for_segment(k), returns_one_value(submodule))
        for k, (name, submodule) in enumerate(top.named_children())
        if name not in skip
    ]


def _mark_kept_inputs(top: torch.fx.GraphModule) -> None:
    """Note on each submodule (``graph_meta.KEPT_INPUTS``) which of its inputs a later
    submodule reads, or the whole graph returns: a saved activation that two backward
    segments read is let go after the second, not after each."""
    from .memory import aliased_outputs

    calls = [n for n in top.graph.nodes if n.op == "call_module"]
    position = {n: i for i, n in enumerate(calls)}
    returned = set(top.graph.output_node().all_input_nodes)
    aliases = set()  # values a submodule returned as views of its inputs: no buffer of their own
    for node in calls:
        viewed = aliased_outputs(getattr(top, node.target).graph)
        if viewed is True:  # it returns one value, a view of an input
            aliases.add(node)
        for user in node.users:
            if user.target is operator.getitem and user.args[1] in viewed:
                aliases.add(user)
    for node in calls:
        kept = []
        for index, arg in enumerate(node.args):
            if not isinstance(arg, torch.fx.Node):
                continue
            later = any(u.op == "call_module" and position[u] > position[node] for u in arg.users)
            if later or arg in returned or arg in aliases:
                kept.append(index)
        getattr(top, node.target).meta[graph_meta.KEPT_INPUTS] = tuple(kept)


def runner(split: CpuSplit, compiled: dict, device: torch.device) -> Callable:
    """A boxed callable running ``split``: the XLA segments ``compiled`` holds
    (name -> (boxed callable, single output)), CPU runners for the ops between them."""
    top = split.top
    for name, submodule in list(top.named_children()):
        if name in split.fallback_names:
            setattr(top, name, _Segment(on_cpu(submodule, device), boxed=False, single_output=False))
        else:
            run, single = compiled[name]
            setattr(top, name, _Segment(run, boxed=True, single_output=single))

    def run(args):
        out = top(*args)
        args.clear()
        return list(out) if isinstance(out, (tuple, list)) else [out]

    run._boxed_call = True
    return run
