"""Backward segments (``DONATE_XLA_BACKWARD_SEGMENTS=N``): an XLA backward run as
up to N executables, each saved tensor released after the last one that reads it.

An XLA executable holds every parameter until it ends, so a backward compiled
as one executable keeps all the activations the forward saved until its last
gradient is computed, while the gradients pile up beside them. Split into
segments that run one after another, in the backward's own order (last layer
first), a saved activation lives only until the segment that last reads it
has run. Where the step's peak is the end of the backward, it falls from
"all saved + all gradients" towards the larger of the two.

Splitting changes no value: each segment holds the same ops, and is compiled
by the XLA path like any graph (abstractly, donating nothing it does not
overwrite). What crosses a boundary (the gradient flowing down the residual
stream, a value two layers share) is one segment's result and a later one's
input. Releasing only drops this runner's references: under ``retain_graph``
autograd still holds the saved tensors, and nothing is freed early.

Three stages, each printable: ``segment_ids`` (where the cuts fall),
``split_backward`` (the split graph, ``SplitBackward.as_text``),
``ReleasingRunner`` (what aot_autograd calls, over the segments the compiler built from
``fallback.parts``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
from torch.fx.passes.split_module import split_module


# Automatic splitting (``backward_segments`` unset): into this many segments, where the
# split releases at least AUTO_MIN_RELEASED bytes and AUTO_MIN_SHARE of the activations
# the forward saved before the backward's last segment. Below that the memory gained is small beside what
# each extra executable costs a call.
AUTO_SEGMENTS = 8
AUTO_MIN_RELEASED = 32 * 2**20
AUTO_MIN_SHARE = 0.25


def _tensor_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not any(isinstance(s, torch.SymInt) for s in val.shape):
        return val.numel() * val.element_size()
    return 0


def _is_unpacking(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its input (``t``, ``detach``, ``view``, ``expand``...)."""
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def _follows_its_reader(node: torch.fx.Node) -> bool:
    """Nodes that go where they are read: views, and constants (``get_attr``)."""
    return _is_view(node) or node.op == "get_attr"


def _sources(graph: torch.fx.Graph) -> dict:
    """Node -> the non-view nodes it reads, looking through chains of views."""
    sources = {}
    for node in graph.nodes:
        found = []
        for used in node.all_input_nodes:
            found.extend(sources[used] if _is_view(used) else [used])
        sources[node] = list(dict.fromkeys(found))
    return sources


def last_readers(graph: torch.fx.Graph) -> dict:
    """Placeholder -> the last op that reads it, through views (placeholders only
    the output reads are left out)."""
    sources = _sources(graph)
    readers = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or _is_view(node):
            continue
        for used in sources[node]:
            if used.op == "placeholder":
                readers[used] = node
    return readers


def segment_ids(graph: torch.fx.Graph, count: int) -> dict:
    """Node -> segment number: the backward's ops cut into at most ``count``
    stretches that release about the same bytes of inputs each.

    An input is released after the op that reads it last; a cut falls where the
    running total of released bytes passes k/count of the whole. Only values
    cross a cut, never views: a view goes with the first op that reads it (or,
    read by nothing but the output, with what it views), since a view handed
    to the next segment is a copy there (a transposed weight, a gradient); a
    constant (``get_attr``) goes with its first reader too. An
    op's ``getitem`` nodes stay with it, so a segment hands on tensors, never a
    tuple.
    """
    released = {}
    for placeholder, node in last_readers(graph).items():
        released[node] = released.get(node, 0) + _tensor_bytes(placeholder)
    total = sum(released.values())
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    ids, current, running = {}, 0, 0
    for node in nodes:
        if _follows_its_reader(node):
            continue
        if _is_unpacking(node) and node.args[0] in ids:
            ids[node] = ids[node.args[0]]
            continue
        ids[node] = current
        running += released.get(node, 0)
        if total and current < count - 1 and running >= total * (current + 1) / count:
            current += 1
    viewed = {}  # view -> the segment of the value it views (first input's; 0 for an input)
    for node in nodes:
        if _follows_its_reader(node):
            base = node.all_input_nodes[0] if node.all_input_nodes else None
            viewed[node] = viewed[base] if base in viewed else ids.get(base, 0)
    for node in reversed(nodes):
        if _follows_its_reader(node):
            readers = [ids[u] for u in node.users if u.op != "output"]
            ids[node] = min(readers) if readers else viewed[node]
    return ids


@dataclasses.dataclass(frozen=True)
class SplitBackward:
    """The split graph: ``top`` calls ``submod_<k>`` in order."""

    top: torch.fx.GraphModule
    count: int
    released_bytes: int  # inputs released before the last segment runs
    input_bytes: int  # all tensor inputs (saved tensors and incoming gradients)
    requested: int = 0  # the most segments asked for
    released_saved_bytes: int = 0  # of released_bytes, activations saved by the forward
    saved_bytes: int = 0  # all activations saved by the forward (inputs that are not its primals)

    @property
    def choice(self) -> str:
        return (
            f"backward in {self.count} segments (at most {self.requested} asked), releasing "
            f"{self.released_saved_bytes / 2**20:.1f} of {self.saved_bytes / 2**20:.1f} MiB of saved "
            "activations before the last; recomputes nothing"
        )

    def as_text(self) -> str:
        parts = [
            f"backward in {self.count} segments; {self.released_bytes} of {self.input_bytes} B of inputs "
            f"released before the last one runs",
            self.top.code.strip(),
        ]
        parts += [f"{name}:\n{sub.code.strip()}" for name, sub in self.top.named_children()]
        return "\n".join(parts)


def split_backward(gm: torch.fx.GraphModule, count: int) -> Optional[SplitBackward]:
    """Split ``gm`` into at most ``count`` segments; None when that leaves one."""
    if count < 2:
        return None
    ids = segment_ids(gm.graph, count)
    if len(set(ids.values())) < 2:
        return None
    last = max(ids.values())
    readers = last_readers(gm.graph)
    released = sum(_tensor_bytes(p) for p, node in readers.items() if ids[node] < last)
    inputs = sum(_tensor_bytes(p) for p in gm.graph.find_nodes(op="placeholder"))
    # a forward's inputs (parameters, the batch: "primals_*") live on with their owner;
    # the activations it saved die with the backward (tangents are neither)
    saved = [p for p in gm.graph.find_nodes(op="placeholder") if not p.name.startswith(("primals", "tangents"))]
    released_saved = sum(_tensor_bytes(p) for p in saved if p in readers and ids[readers[p]] < last)
    ordered, ids = _in_segment_order(gm, ids)
    top = split_module(ordered, None, lambda node: ids[node], keep_original_order=True)
    return SplitBackward(
        top, len(set(ids.values())), released, inputs, count, released_saved, sum(_tensor_bytes(p) for p in saved)
    )


def worth_splitting(split: SplitBackward) -> bool:
    """Whether an automatic split releases enough to pay for its extra executables."""
    return split.released_saved_bytes >= max(AUTO_MIN_RELEASED, AUTO_MIN_SHARE * split.saved_bytes)


def _in_segment_order(gm: torch.fx.GraphModule, ids: dict) -> tuple:
    """A copy of ``gm`` whose ops are listed segment by segment (a view moved to its
    reader's segment may stand before an op of an earlier one), and its ids.

    ``split_module`` emits the segments in the order it first meets them. Each
    value is read only in its own segment or a later one, so listing the ops by
    (segment, position) keeps every value before its readers.
    """
    graph, copies = torch.fx.Graph(), {}
    out = graph.graph_copy(gm.graph, copies)
    graph.output(out)
    new_ids = {copies[n]: k for n, k in ids.items()}
    position = {n: i for i, n in enumerate(graph.nodes)}
    output = graph.output_node()
    for node in sorted(new_ids, key=lambda n: (new_ids[n], position[n])):
        output.prepend(node)  # each moved to the end, after the ones before it
    return torch.fx.GraphModule(gm, graph), new_ids


class ReleasingRunner:
    """Runs the split graph's nodes in order and drops each value after its last use.

    Boxed, as aot_autograd calls a backward: it takes the argument list and
    clears it, so a saved tensor is referenced from here only until the last
    segment that reads it has been called (and from autograd under
    ``retain_graph``, which then keeps it).
    """

    def __init__(self, split: SplitBackward, segments: dict):
        self._boxed_call = True
        self.split = split
        self._segments = segments  # submodule name -> (boxed callable, returns one value)
        nodes = list(split.top.graph.nodes)
        self._placeholders = [n for n in nodes if n.op == "placeholder"]
        last_use = {}
        for node in nodes:
            for used in node.all_input_nodes:
                last_use[used] = node
        self._release_after = {}
        for value, node in last_use.items():
            if node.op != "output":
                self._release_after.setdefault(node, []).append(value)
        self._unused = [p for p in self._placeholders if p not in last_use]
        self._nodes = [n for n in nodes if n.op != "placeholder"]

    def __call__(self, args: list) -> list:
        env = dict(zip(self._placeholders, args))
        args.clear()
        for placeholder in self._unused:
            del env[placeholder]
        for node in self._nodes:
            if node.op == "output":
                out = torch.fx.node.map_arg(node.args[0], lambda n: env[n])
                env.clear()
                return list(out) if isinstance(out, (tuple, list)) else [out]
            inputs = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
            if node.op == "call_module":
                run, single = self._segments[node.target]
                result = run(inputs)  # boxed: the segment clears ``inputs``
                env[node] = result[0] if single else tuple(result)
            elif _is_unpacking(node):
                env[node] = operator.getitem(*inputs)
            elif node.op == "get_attr":  # a constant two segments read
                env[node] = operator.attrgetter(node.target)(self.split.top)
            else:
                raise RuntimeError(f"donate_xla: unexpected node in a split backward: {node.format_node()}")
            inputs.clear()
            for value in self._release_after.get(node, ()):
                del env[value]
        raise RuntimeError("donate_xla: a split backward has no output node")
