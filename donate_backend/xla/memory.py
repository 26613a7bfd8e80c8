"""Predicted memory of one XLA executable, from its FX graph on fake tensors.

XLA runs a graph as one executable. What it holds while it runs, on top of
the inputs its caller holds (XLA's buffer assignment, CPU and TPU alike):

- **outputs**: a buffer per result, except a result written back into a
  donated input, which takes that input's buffer (``donors``);
- **temporaries**: one block for the values that live only inside the
  executable, as large as the most of them live at once.

XLA fuses elementwise ops and views into the ops that read them, so their
results never exist on their own. The model here: a node's result is
materialised when it is not elementwise or a view, when the graph returns
it, or when a dot or convolution reads it, itself or through views (XLA does
not fuse into those, and its reshapes are the same buffer).
A materialised value lives until the last materialised node that reads it,
directly or through fused ones; a returned value, and a new value written into
an input, are materialised readers too (their buffer is computed where they
stand, not at the end of the graph). An elementwise value computed for one
reader is fused again into its other elementwise readers, so what it reads
lives until the last of those too. A returned view or reshape is its base's
buffer. The temporaries block is the most bytes of such values live at any
node, in graph order, with what XLA:CPU adds while some ops run
(``_layout_scratch``: convolutions, a depthwise kernel's gradient, a max-pool's
backward, a log-softmax whose result is returned) and computes first
(``_hoisted_kernel_copies``, ``_exact_gelu_parts``). ``bench/xla_executables.py``
sets these figures beside XLA's buffer assignment of each executable.

After the executable: its outputs are live (a forward's to the caller and
saved for its backward, a backward's gradients); a backward's saved
tensors and tangents are let go (autograd drops them when the backward
returns); an overwritten input keeps its size (its new value replaces it).

What the model cannot see: XLA's scheduler may order the work differently
(its default CPU scheduler favours concurrency over memory, so the
temporaries block can be larger), and fusion decisions beyond the rule
above. ``bench/xla_plan_accuracy.py`` gives the error against measured
live bytes.
"""
from __future__ import annotations

import functools
import operator
import weakref
from typing import Dict, List, Optional, Sequence, Set

import torch
import torch.fx

from .. import graph_memory, graph_meta
from ..graph_memory import ACTIVATIONS, GRADIENTS, INPUTS, TEMPORARIES, GraphMemory

# Ops XLA does not fuse their operands into: their operands are materialised.
_FUSION_BARRIERS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "matmul", "dot", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "sort", "topk", "scatter", "scatter_add", "scatter_reduce", "index_put", "_index_put_impl_",
    "embedding_dense_backward", "cumsum", "_cdist_forward",
})


def xla_bytes(value: torch.Tensor) -> int:
    """Bytes of an XLA buffer holding ``value`` (dense, no strides; symbolic sizes at
    their hint)."""
    return _size(value.numel() * value.element_size())


def _values(node: torch.fx.Node) -> List[torch.Tensor]:
    return graph_memory.node_tensors(node)


def _bytes(node: torch.fx.Node) -> int:
    return sum(xla_bytes(v) for v in _values(node))


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def _fusible(node: torch.fx.Node) -> bool:
    """Elementwise or a view: XLA computes it inside the op that reads it."""
    if node.op != "call_function":
        return False
    if is_view(node) or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return True
    if _op_name(node).startswith("_foreach_"):  # elementwise over a list
        return True
    return _op_name(node) in {"clone", "_to_copy", "expand", "view", "reshape", "t", "permute",
                              "transpose", "unsqueeze", "squeeze", "slice", "select", "alias",
                              "_unsafe_view", "lift_fresh_copy", "where", "full", "zeros", "ones",
                              "scalar_tensor", "empty", "arange", "iota"}


@functools.lru_cache(maxsize=None)
def _cpu_layouts() -> bool:
    """Whether XLA compiles for the CPU, whose layouts ``_layout_scratch`` describes."""
    try:
        import torch_xla.runtime as xr

        return xr.device_type() == "CPU"
    except Exception:  # noqa: BLE001  (no runtime: nothing to describe)
        return False


def _layout_scratch(node: torch.fx.Node) -> int:
    """Bytes XLA:CPU holds only while ``node`` runs, beyond its operands and results.

    Measured in XLA:CPU's buffer assignments (one op per executable, and ResNet-18's
    backward): a convolution copies its kernel into a layout of its own (for the input's
    gradient, reversed), and its activation operands into a channels-last layout; a
    max-pool's backward is expanded into int32 indices of the pooled input (one per
    dimension) and a search over each window. The counts here are within one activation
    of those assignments; the kernel copy and the indices are the large terms. A
    log-softmax whose result is returned holds one more buffer of its input's size (the
    training forwards of the benchmark GPT, BERT and GPT-2's loss:
    ``bench/xla_executables.py``)."""
    name = _op_name(node)
    args = node.args
    if name == "convolution" and len(args) >= 2:
        return _arg_bytes(args[1]) + _arg_bytes(args[0])
    if name == "convolution_backward" and len(args) >= 3:
        mask = args[10] if len(args) > 10 else (True, True, True)
        scratch = _arg_bytes(args[2]) + _arg_bytes(args[0]) + (_arg_bytes(args[1]) if mask[0] else 0)
        # a depthwise kernel's expanded gradient holds the layout copies inside it
        return max(scratch, _depthwise_kernel_expansion(args) if mask[1] else 0)
    if name == "_log_softmax" and args and any(user.op == "output" for user in node.users):
        # the shifted logits (or their exponentials) in a buffer of their own beside the input
        # and the returned result (saved for the backward): a language model's training
        # forward holds two logits-sized temporaries. A result read only inside the graph is
        # fused into its reader, and that buffer takes its place (counted as the result).
        return _arg_bytes(args[0])
    if name in ("max_pool2d_backward", "max_pool2d_with_indices_backward") and len(args) >= 2:
        # XLA:CPU expands the select-and-scatter: an int32 iota of the pooled input per
        # dimension, and a reduce-window over the window's values and indices, a
        # result-sized buffer each, beside a copy of the incoming gradient.
        grads = _values(args[0]) if isinstance(args[0], torch.fx.Node) else []
        pooled = _values(args[1]) if isinstance(args[1], torch.fx.Node) else []
        if not grads or not pooled:
            return 0
        rank = pooled[0].dim()
        return _size(rank * pooled[0].numel() * 4) + (rank + 2) * _size(grads[0].numel() * 4)
    return 0


def _depthwise_kernel_expansion(args) -> int:
    """Bytes XLA:CPU adds for a depthwise convolution's kernel gradient (one input channel
    per group, as ConvNeXt's 7 x 7 blocks have): it computes the gradient as a dense
    convolution over every pair of channels, then keeps the diagonal with a select, and
    holds both at once, a ``channels x channels x kernel`` buffer each (docs/xla.md,
    "Measured reasons"; the layout copies fit inside them). Other
    grouped convolutions (two or more input channels per group) are reshaped instead, and
    add nothing beyond the layout copies."""
    groups = args[9] if len(args) > 9 else 1
    weights = _values(args[2]) if isinstance(args[2], torch.fx.Node) else []
    if not isinstance(groups, int) or groups <= 1 or not weights or weights[0].dim() < 3 or weights[0].shape[1] != 1:
        return 0
    return 2 * _size(weights[0].numel() * weights[0].element_size() * groups)


def _size(value) -> int:
    """A byte count that may be symbolic, at its hint (0 without one)."""
    size = graph_memory.size_hint(value)
    return int(size) if size is not None else 0


def _hoisted_kernel_copies(graph: torch.fx.Graph) -> Dict[torch.fx.Node, int]:
    """convolution -> the bytes of its kernel's copy, for each convolution of a forward
    whose kernel is a graph input. XLA:CPU's scheduler makes these copies, which read
    nothing but the input, at the start of the executable and holds each until its
    convolution: a ResNet's forward holds every kernel's copy at once (docs/xla.md,
    "Measured reasons")."""
    hoisted = {}
    for node in graph.nodes:
        if node.op == "call_function" and _op_name(node) == "convolution" and len(node.args) >= 2:
            kernel = node.args[1]
            if isinstance(kernel, torch.fx.Node) and kernel.op == "placeholder":
                hoisted[node] = _bytes(kernel)
    return hoisted


# XLA:CPU rewrites a reduction over a dimension longer than this into a reduce-window
# and a reduce (a tree, for precision); the reduce-window is fused with nothing.
_TREE_REDUCTION_WINDOW = 32


def _exact_gelu_parts(graph: torch.fx.Graph) -> Dict[torch.fx.Node, int]:
    """exact GELU's backward -> the bytes XLA:CPU computes for it at the start of the
    executable, where its input is computed from graph inputs alone (a saved activation).

    The gradient is read by a reshape into the weight's matmul and by the bias's sum (a
    ``Linear`` over 3-d or 4-d activations; over 2-d ones a matmul reads it as it is, and
    XLA computes it once for both). Where that sum reduces only dimensions of 32 or
    fewer, XLA fuses the gradient into both readers and computes its two costly parts,
    ``erf`` and ``exp`` of the input, once, an input-sized buffer each; its scheduler
    computes them first, since they read only inputs (``_reads_only_inputs``), and holds
    them until those readers (ConvNeXt's, Swin's and ViT's backwards, in XLA:CPU's
    schedule and buffer assignment). Where the sum runs over a longer dimension (a GPT's
    batch x 128 tokens), XLA first rewrites it into a reduce-window
    (``_TREE_REDUCTION_WINDOW``), which reads the gradient computed once, parts fused in."""
    parts = {}
    for node in graph.nodes:
        if node.op != "call_function" or _op_name(node) != "gelu_backward" or len(node.args) < 2:
            continue
        source = node.args[1]  # ``approximate`` is keyword-only
        if (node.kwargs.get("approximate", "none") == "none" and isinstance(source, torch.fx.Node) and _reads_only_inputs(source)
                and any(_short_sum(user) for user in node.users)
                and not any(_op_name(user) in _FUSION_BARRIERS for user in node.users)):
            parts[node] = 2 * _bytes(source)
    return parts


def _short_sum(node: torch.fx.Node) -> bool:
    """A sum over given dimensions, each of ``_TREE_REDUCTION_WINDOW`` or fewer elements."""
    if node.op != "call_function" or _op_name(node) != "sum" or len(node.args) < 2:
        return False
    values = _values(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else []
    dims = node.args[1]
    if not values or not isinstance(dims, (list, tuple)) or not dims:
        return False
    sizes = [_size(values[0].shape[d]) for d in dims if isinstance(d, int) and -values[0].dim() <= d < values[0].dim()]
    return len(sizes) == len(dims) and all(0 < size <= _TREE_REDUCTION_WINDOW for size in sizes)


def _reads_only_inputs(node: torch.fx.Node) -> bool:
    """An input, or elementwise ops and views over inputs only (what the partitioner
    recomputes in a backward from saved values: XLA fuses it into its reader)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen or current.op == "placeholder":
            continue
        seen.add(current)
        if not _fusible(current) or len(seen) > 64:
            return False
        stack += [a for a in current.all_input_nodes]
    return True


def _arg_bytes(arg) -> int:
    return _bytes(arg) if isinstance(arg, torch.fx.Node) else 0


def _input_itself(node: torch.fx.Node) -> bool:
    """An input, or a ``detach`` of one: the same torch_xla tensor (``compat.tensor_id``),
    which the lowering returns as the caller's input."""
    for _ in range(64):
        if node.op == "placeholder":
            return True
        if node.op != "call_function" or _op_name(node) != "detach" or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


def _is_writeback(node: torch.fx.Node) -> bool:
    """``aten.copy_`` of a new value into an input (the end of a functionalised graph)."""
    if node.op != "call_function" or _op_name(node) != "copy_" or len(node.args) < 2:
        return False
    target, source = node.args[0], node.args[1]
    return isinstance(target, torch.fx.Node) and target.op == "placeholder" and isinstance(source, torch.fx.Node)


def _writebacks(graph: torch.fx.Graph) -> Dict[torch.fx.Node, torch.fx.Node]:
    """new value -> the placeholder it is copied into (``_is_writeback``)."""
    return {node.args[1]: node.args[0] for node in graph.nodes if _is_writeback(node)}


def predict(
    graph: torch.fx.Graph,
    name: str,
    kind: str,
    *,
    donors: Sequence[int] = (),
    forward_returns: Optional[int] = None,
    kept_inputs: Sequence[int] = (),
    passed_outputs: Sequence[int] = (),
) -> GraphMemory:
    """The executable's memory (see the module docstring), as a ``GraphMemory`` the
    planner composes like a native graph's. ``donors``: indices of the inputs donated;
    ``forward_returns``: in a forward, how many outputs are the caller's (the rest are
    saved for the backward); ``kept_inputs``: in a backward segment, the inputs that
    outlive it (a later segment reads them), which it does not release;
    ``passed_outputs``: in a backward, the outputs an earlier graph's backward takes as
    its tangents (``graph_memory.passed_outputs``), counted in ``passed_grad_bytes``.
    Where the runtime is XLA:CPU, the scratch its layouts add is counted too
    (``_layout_scratch``, ``_hoisted_kernel_copies``, ``_exact_gelu_parts``)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    donated = {placeholders[i] for i in donors if i < len(placeholders)}
    written = _writebacks(graph)
    outputs = _Outputs(graph, kind, forward_returns, passed_outputs)
    writeback_bytes = sum(_bytes(value) for value, target in written.items()
                          if target not in donated and value.op != "placeholder")  # a new buffer each
    temporaries, peak_node = _temporaries(graph, kind, outputs.returned, written)
    peak_parts = dict(outputs.parts)
    if temporaries or writeback_bytes:
        peak_parts[TEMPORARIES] = temporaries + writeback_bytes
    end_parts, tangent_bytes, released = _released_inputs(kind, placeholders, kept_inputs, dict(outputs.parts))
    return GraphMemory(
        name=name,
        kind=kind,
        peak_bytes=sum(outputs.parts.values()) + temporaries + writeback_bytes,
        end_bytes=sum(end_parts.values()),
        peak_parts=tuple(sorted((c, b) for c, b in peak_parts.items() if b)),
        end_parts=tuple(sorted((c, b) for c, b in end_parts.items() if b)),
        peak_node=peak_node,
        released_input_bytes=released,
        tangent_bytes=tangent_bytes,
        passed_grad_bytes=outputs.passed_bytes,
        tangent_indices=tuple(i for i, n in enumerate(placeholders) if n.name.startswith("tangents")),
        largest_output_bytes=outputs.largest,
        largest_written_bytes=max((_bytes(value) for value in written if value.op != "placeholder"), default=0),
    )


class _Outputs:
    """An executable's outputs: a buffer each, unless it is an input returned as it is or
    a new value written into a donated input. ``parts``: bytes by category; ``returned``:
    the nodes returned."""

    def __init__(self, graph: torch.fx.Graph, kind: str, forward_returns: Optional[int],
                 passed_outputs: Sequence[int]) -> None:
        output = graph.output_node()
        out_args = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        self.parts: Dict[str, int] = {}
        self.returned: Set[torch.fx.Node] = set()
        self.largest = 0
        self.passed_bytes = 0
        for index, value in enumerate(out_args):
            if not isinstance(value, torch.fx.Node) or value in self.returned:
                continue
            self.returned.add(value)
            if _input_itself(value):  # an input returned as it is: no buffer of its own
                continue
            # A view of an input is a buffer of its own: XLA's results never alias an input
            # that is not donated, so the lowering returns such a view as a copy.
            size = _bytes(value)
            self.largest = max(self.largest, size)
            category = graph_memory.output_category(kind, index, forward_returns)
            self.parts[category] = self.parts.get(category, 0) + size
            if kind == "backward" and index in passed_outputs:
                self.passed_bytes += size


class _LastReaders:
    """Node -> the index of its last materialised reader, and of the last op that fuses it
    in. XLA fuses an elementwise op into every op that reads it, also where its value is
    computed on its own for another reader (returned, or read by a matmul): BART's logits
    plus a bias are returned and fused again into the loss's log-softmax, so the matmul
    under them lives until the loss."""

    def __init__(self, graph: torch.fx.Graph, computed: Set[torch.fx.Node]) -> None:
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.computed = computed
        self.readers: Dict[torch.fx.Node, int] = {}
        self.fused_into: Dict[torch.fx.Node, int] = {}
        for node in reversed(list(graph.nodes)):  # users first: no deep recursion
            if node.op != "output":
                self.fused_reach(node)
                self.last_reader(node)

    def fused_reach(self, node: torch.fx.Node) -> int:
        if node in self.fused_into:
            return self.fused_into[node]
        last = -1
        for user in node.users:
            if user.op != "call_function" or _op_name(user) in _FUSION_BARRIERS:
                continue  # the output, or a matmul: they read the computed value
            if is_view(user):
                last = max(last, self.fused_reach(user))
            elif _fusible(user):
                last = max(last, self.order[user], self.fused_reach(user))
            else:
                last = max(last, self.order[user])
        self.fused_into[node] = last
        return last

    def last_reader(self, node: torch.fx.Node) -> int:
        if node in self.readers:
            return self.readers[node]
        last = self.order[node]
        for user in node.users:
            if user.op == "output" or user in self.computed:
                last = max(last, self.order[user])
                if user.op == "call_function" and _fusible(user):
                    last = max(last, self.fused_reach(user))
            else:
                last = max(last, self.last_reader(user))
        self.readers[node] = last
        return last


def _temporaries(graph: torch.fx.Graph, kind: str, returned: Set[torch.fx.Node], written: dict) -> tuple:
    """(the most bytes of temporaries live at once, the node where): materialised values
    that are not outputs, each live to its last materialised reader, and on XLA:CPU the
    scratch its layouts add."""
    materialised: Set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or _is_writeback(node):
            continue  # a write-back's buffer is its input's, or its new value's (counted apart)
        if not _fusible(node) or (not is_view(node) and _read_by_barrier(node)):
            materialised.add(node)
    # A returned view's base is the output buffer, not a temporary; so is what an
    # ``_unsafe_view`` reshapes (XLA's reshape is the same buffer), and every value between.
    returned = set(returned)
    for value in list(returned):
        returned.update(view_chain(value, through_reshapes=True))
    # A returned value or a new value written into an input has a buffer of its own,
    # computed where it stands: it is a materialised reader, however fusible its op.
    computed = materialised | {n for n in returned | set(written) if n.op == "call_function"}
    reach = _LastReaders(graph, computed)
    frees: Dict[int, List[int]] = {}
    cpu_layouts = _cpu_layouts()
    hoisted = _hoisted_kernel_copies(graph) if cpu_layouts and kind != "backward" else {}
    early: Dict[int, int] = {}  # node index -> what XLA computed at the start for it, let go after it
    for node, size in (_exact_gelu_parts(graph) if cpu_layouts else {}).items():
        early[reach.readers[node]] = early.get(reach.readers[node], 0) + size
    level = peak = sum(hoisted.values()) + sum(early.values())
    peak_node = "(inputs)"
    for node in graph.nodes:
        if node in materialised and node not in returned and node not in written:
            size = _bytes(node)
            level += size
            frees.setdefault(reach.readers[node], []).append(size)
            if level > peak:
                peak, peak_node = level, node.name
        if cpu_layouts and node.op == "call_function":
            extra = _layout_scratch(node) - hoisted.get(node, 0)
            if extra and level + extra > peak:
                peak, peak_node = level + extra, node.name
        level -= hoisted.get(node, 0) + early.pop(reach.order[node], 0)
        for size in frees.pop(reach.order[node], ()):
            level -= size
    return peak, peak_node


def _released_inputs(kind: str, placeholders: list, kept_inputs: Sequence[int], end_parts: Dict[str, int]) -> tuple:
    """(bytes by category at return, the tangents' bytes, the inputs' bytes released): a
    backward releases its saved activations and tangents (not the forward inputs the caller
    holds, nor a segment's inputs a later segment reads)."""
    tangent_bytes = released = 0
    if kind != "backward":
        return end_parts, tangent_bytes, released
    kept = {placeholders[i] for i in kept_inputs if i < len(placeholders)}
    for node in placeholders:
        if node in kept:
            continue
        size = _bytes(node)
        if node.name.startswith("tangents"):
            tangent_bytes += size
            end_parts[GRADIENTS] = end_parts.get(GRADIENTS, 0) - size
        elif node.name.startswith("primals"):
            continue  # a forward input the caller holds (a parameter, the batch)
        else:
            end_parts[ACTIVATIONS] = end_parts.get(ACTIVATIONS, 0) - size
        released += size
    return end_parts, tangent_bytes, released


def _read_by_barrier(node: torch.fx.Node) -> bool:
    """Whether a matmul or another fusion barrier reads ``node``, itself or through views
    (a reshape of a GELU's gradient into a weight's matmul: XLA's bitcast is the same
    buffer, computed on its own)."""
    stack, seen = list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if _op_name(user) in _FUSION_BARRIERS:
            return True
        if is_view(user) and len(seen) < 64:
            stack += list(user.users)
    return False


def is_view(node: torch.fx.Node) -> bool:
    """A view op (its first result aliases an input, not written) or a ``getitem``."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
    return alias is not None and not alias.is_write


def aliased_outputs(graph: torch.fx.Graph):
    """The indices of the outputs of ``graph`` that are its inputs or views of them
    (no buffer of their own); True when it returns one such value rather than a tuple."""
    value = graph.output_node().args[0]
    if not isinstance(value, (tuple, list)):
        return isinstance(value, torch.fx.Node) and view_base(value).op == "placeholder"
    return {i for i, v in enumerate(value) if isinstance(v, torch.fx.Node) and view_base(v).op == "placeholder"}


def view_chain(node: torch.fx.Node, through_reshapes: bool = False) -> List[torch.fx.Node]:
    """``node``, the node it is a view of, that node's base, and so on to the first node
    that is no view. With ``through_reshapes``, an ``_unsafe_view`` counts as a view too:
    in XLA a reshape is the same buffer (aot_autograd's graphs use it where eager would
    copy, so it is no alias for the donation rules)."""
    chain = [node]
    for _ in range(64):
        viewing = is_view(node) or (through_reshapes and _op_name(node) == "_unsafe_view")
        if not viewing or not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
        chain.append(node)
    return chain


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` is a view of (itself if it is none)."""
    return view_chain(node)[-1]


def predict_or_none(gm: torch.fx.GraphModule, name: str, kind: str, **kwargs) -> Optional[GraphMemory]:
    """``predict``, or None where it fails: a prediction never stops a graph from compiling."""
    try:
        return predict(gm.graph, name, kind, **kwargs)
    except Exception as error:  # noqa: BLE001  (reported, never raised)
        from .. import report

        report.log.debug("donate_xla: no memory prediction for %s: %s", name, error)
        return None


def note_call(record, roles: Sequence[str], args: Sequence, outputs: Sequence = (),
              forward_returns: Optional[int] = None) -> None:
    """After each call, that the graph ran (``report.mark_call``). After its first call:
    when it ran among all graphs (the plan's step order) and, for a forward or an
    optimizer step, the tensors it reads that its caller holds between steps
    (``(role, identity, bytes)``; one tensor read by two graphs is counted once) and
    the identities of the tensors it returned: a later graph of the step that reads one
    (a model's logits, read by a loss compiled as a graph of its own) reads a value of
    the step, not a tensor held between steps. XLA tensors have no storage address: the
    identity is the tensor object's, which the parameters and optimizer state keep
    across graphs.

    A forward also keeps weak references to the storages of the outputs it gives its
    caller (``forward_returns`` of them; the rest are saved for its backward), and a
    backward notes how many bytes of each forward's outputs are still alive when it
    first runs: the caller may have dropped them (an HF model's output object, once its
    loss is taken, drops the logits), and the plan then lets them go before the backward
    (``GraphRecord.outputs_held``, as on the native path)."""
    from .. import report

    if record.kind == "backward":
        _watch_gradients(record)
    if record.first_call is not None:
        report.mark_call(record)
        if record.kind == "forward" and record.eager_saved_after_limits != _limits_reached():
            _note_eager_saved(record, args)
        return
    report.mark_first_call(record)
    if record.kind == "backward":
        record.runs.outputs_held = graph_memory.outputs_held(r for r in report.reports() if r.path == "xla")
        return
    record.runs.held_inputs, returned = graph_memory.first_call_identities(
        roles, args, outputs, lambda t: ("xla", id(t)), xla_bytes)
    record.runs.parameter_refs = tuple(
        weakref.ref(value) for role, value in zip(roles, args)
        if role == "parameter" and isinstance(value, torch.Tensor)
    )
    inputs = {id(v) for v in args}
    made = [v for v in outputs if isinstance(v, torch.Tensor) and id(v) not in inputs]
    # an input returned as it is stays the caller's; each output also by its torch_xla
    # id, which an alias of it that eager autograd saved shares (``eager_saved``)
    record.runs.returned = returned | frozenset(key for key in map(_tensor_key, made) if key is not None)
    if record.kind == "forward":
        _note_eager_saved(record, args)
    if record.kind == "forward" and forward_returns is not None:
        record.runs.output_storages = _tensor_refs([v for v in list(outputs)[:forward_returns] if id(v) not in inputs])


def _limits_reached() -> int:
    from .. import dynamo_compat

    return dynamo_compat.recompile_limit_hit_count()


def _note_eager_saved(record, args: Sequence) -> None:
    """A forward's ``eager_saved``: found at its first call, and again at its next call
    each time dynamo has stopped compiling one more function. From then on that function
    runs in lazy mode (torch_xla turns dynamic shapes off, so a function called with a new
    size each time reaches the limit: Mixtral's experts), and what it saves for the
    backward lies between the graphs of later steps, not of the first. A walk that fails
    is logged and leaves the record as it was: a plan never stops a step."""
    try:
        found = eager_saved(args)
    except Exception as error:  # noqa: BLE001  (reported, never raised)
        from .. import report

        report.log.debug("donate_xla: what eager code saved before %s was not found: %s", record.name, error)
        record.runs.eager_saved_after_limits = _limits_reached()
        return
    if record.eager_saved_after_limits != _limits_reached():
        # found again: the arguments of the first call that eager code made stay named,
        # with no bytes, so that the plan still knows those inputs (``held_inputs``, taken
        # at the first call) as values of the step, not as tensors held between steps
        named = {key for key, _ in found}
        found += tuple((key, 0) for key, _ in record.eager_saved if key[0] == "xla" and key not in named)
    record.runs.eager_saved_after_limits = _limits_reached()
    record.runs.eager_saved = found


def _tensor_key(value: torch.Tensor):
    """An XLA tensor's identity in torch_xla, shared by its aliases (a detached copy, or
    what a saved-variable handle gives back); None for a tensor of another device."""
    from . import compat

    if not isinstance(value, torch.Tensor) or value.device.type != "xla":
        return None
    try:
        return ("xla-tensor", compat.tensor_id(value))
    except Exception:  # noqa: BLE001  (not an XLA tensor torch_xla can name)
        return None


def eager_saved(args: Sequence) -> tuple:
    """``(identity, bytes)`` of what code run eagerly before a forward (torch_xla's lazy
    mode, between graph breaks) made in the step and holds into the backward: the
    tensors its autograd saved, reached from the forward's arguments, and the arguments
    it computed (with a ``grad_fn``), as ``native.memory.eager_saved`` finds them. Each
    has a buffer of its own by the time the forward runs: a call first syncs every live
    tensor with pending IR (``ownership.materialize_pending``). Parameters, views of
    them and leaves that require grad are resident and left out."""
    from ..native import compat as native_compat

    out: Dict[object, int] = {}
    made = {id(a): (a, _tensor_key(a)) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    aliases = {key for _, key in made.values()}  # a saved alias of an argument is that argument
    # an argument another compiled graph returned is that graph's output
    made = {i: (a, key) for i, (a, key) in made.items() if "CompiledFunction" not in type(a.grad_fn).__name__}
    saved = [(t, key) for t in native_compat.saved_by_eager_autograd(args, identity=_tensor_key)
             for key in [_tensor_key(t)] if key not in aliases]
    for value, key in [*made.values(), *saved]:
        if key is not None and key not in out and not graph_memory.held_between_steps(value):
            out[key] = xla_bytes(value)
    # each argument also as ``held_inputs`` names it (the Python object), with no bytes:
    # the plan then knows it as a value of the step, not a tensor held between steps
    out.update({("xla", i): 0 for i, (_, key) in made.items() if key in out})
    return tuple(out.items())


class _TensorRef:
    """A weak reference to an XLA tensor with ``StorageWeakRef``'s ``expired()``, for
    ``graph_memory.held_bytes``. Not a ``StorageWeakRef``: one of those on an XLA
    tensor keeps the tensor's XLA data alive after the tensor is gone (never freed), and a
    lazy tensor's value an output of the next sync.
    The Python object lives as long as anything holds its tensor (torch preserves it)."""

    __slots__ = ("_ref",)

    def __init__(self, tensor: torch.Tensor):
        self._ref = weakref.ref(tensor)

    def expired(self) -> bool:
        return self._ref() is None


def _tensor_refs(values: Sequence) -> tuple:
    """``(_TensorRef, bytes)`` of each distinct tensor in ``values``."""
    refs, seen = [], set()
    for value in values:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            refs.append((_TensorRef(value), xla_bytes(value)))
    return tuple(refs)


_watched: set = set()  # id() of the backward records whose gradients a sync will look at


def _watch_gradients(record) -> None:
    """Note in ``record.gradients_at_sync`` the bytes of the ``.grad`` of its forward's
    parameters after the next ``torch_xla.sync()`` (a step closure, run after the
    sync launched the step). Zero: the program drops its gradients before the sync,
    so in a stitched step they are temporaries of the computation; more: they are its
    outputs. Watched at every sync after a call, so a program that starts keeping
    them is seen. The closure holds weak references to the parameters only: a
    reference to a gradient, even a ``StorageWeakRef``, keeps its lazy value alive
    through the sync, which makes it an output (it broke the stitched step's buffer
    pairing)."""
    if id(record) in _watched:
        return
    from .. import report
    from . import compat

    forward = next((r for r in report.reports() if r.graph_id == record.graph_id and r.kind == "forward"
                    and r.parameter_refs), None)
    if forward is None:
        return
    refs = forward.parameter_refs

    def after_sync():
        _watched.discard(id(record))
        grads = [getattr(ref(), "grad", None) for ref in refs]
        record.runs.gradients_at_sync = sum(xla_bytes(g) for g in grads if g is not None)

    if compat.add_step_closure(after_sync):
        _watched.add(id(record))




def predict_step(fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule,
                 forward_returns: Optional[int] = None):
    """A candidate partition's step peak (bytes) and its parts, before anything is
    lowered (``budget``, under a memory limit): the forward's inputs are resident, its
    saved activations held until the backward, which returns the gradients.

    The backward as one executable; where that step does not fit the
    ``memory_limit`` in force, or where the backward recomputes (a candidate at a
    budget below 1), the backward split into segments (``segments.py``), each
    releasing the saved tensors it read last. A split that makes the step fit
    is noted in ``bw_module.meta[graph_meta.BACKWARD_SEGMENTS]``, and the backward's compiler
    splits it so: it recomputes nothing, so it comes before any smaller activation
    budget. ``DONATE_XLA_BACKWARD_SEGMENTS`` set to a number is kept as it is."""
    from .. import config
    from . import segments

    resident = sum(_bytes(n) for n in fw_module.graph.find_nodes(op="placeholder"))
    forward = predict(fw_module.graph, "forward", "forward", forward_returns=forward_returns)
    backward = predict(bw_module.graph, "backward", "backward")
    parts: Dict[str, int] = {INPUTS: resident}
    tangents = ((GRADIENTS, backward.tangent_bytes),)
    in_backward = forward.end_bytes + backward.tangent_bytes + backward.peak_bytes
    backward_parts = backward.peak_parts
    settings = config.current()
    limit = settings.memory_limit
    bw_module.meta.pop(graph_meta.BACKWARD_SEGMENTS, None)
    # A backward that recomputes (a budget below 1) is split wherever it can be: as one
    # executable XLA:CPU's scheduler runs much of the recomputation at once, well above
    # what this model predicts, while each segment's order is fixed (docs/xla.md,
    # "Measured reasons").
    recomputes = bw_module.meta.get(graph_meta.BUDGET_SHARE, 1.0) < 1.0
    split = None
    if settings.backward_segments is None and limit is not None and (resident + in_backward > limit or recomputes):
        split = segments.split_backward(bw_module, segments.AUTO_SEGMENTS)
    if split is not None:  # the backward alone does not fit (or recomputes): would its segments?
        split_peak, split_parts = _split_peak(split)
        if recomputes or forward.end_bytes + backward.tangent_bytes + split_peak < in_backward:
            in_backward = forward.end_bytes + backward.tangent_bytes + split_peak
            backward_parts = split_parts
            if resident + max(in_backward, forward.peak_bytes) <= limit:
                bw_module.meta[graph_meta.BACKWARD_SEGMENTS] = split.count
    if forward.peak_bytes >= in_backward:
        for category, size in forward.peak_parts:
            parts[category] = parts.get(category, 0) + size
        return resident + forward.peak_bytes, parts
    for category, size in forward.end_parts + backward_parts + tangents:
        parts[category] = parts.get(category, 0) + size
    return resident + in_backward, parts


def _split_peak(split) -> tuple:
    """The most bytes a split backward holds above its start (its tangents and saved
    inputs aside), and its parts then: the segments run in order, each adding its
    outputs and releasing the saved activations it read last. What a segment passes
    on to later ones is counted until the backward ends (an upper bound: the runner,
    ``segments.ReleasingRunner``, drops it after its last reader)."""
    top = split.top
    last_use: Dict[torch.fx.Node, torch.fx.Node] = {}
    for node in top.graph.nodes:
        for used in node.all_input_nodes:
            last_use[used] = node
    level, peak, peak_parts = 0, 0, ()
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        segment = predict(getattr(top, node.target).graph, node.target, "inference")
        if level + segment.peak_bytes > peak:
            peak, peak_parts = level + segment.peak_bytes, ((GRADIENTS, level),) + segment.peak_parts
        level += segment.end_bytes
        for used in node.all_input_nodes:  # saved activations (parameters and tangents stay)
            saved = used.op == "placeholder" and not used.name.startswith(("primals", "tangents"))
            if saved and last_use.get(used) is node:
                level -= _bytes(used)
    return peak, peak_parts


def tensor_bytes(value: torch.Tensor) -> int:
    """Bytes an XLA buffer of ``value`` takes, for the step's plan."""
    return xla_bytes(value)


def workspace_bytes(call) -> int:
    """XLA executables' scratch is in their temporaries: nothing apart."""
    return 0


def plan_notes(facts) -> list:
    """What a memory plan of an XLA step cannot see (``planner.PlanFacts``), as sentences."""
    from .. import dynamo_compat

    notes = [
        "XLA: each executable's temporaries come from a model of XLA's fusion over the graph, "
        "not from XLA's buffer assignment; XLA's scheduler may hold more at once"
    ]
    if facts.stitched_step:
        notes.append(
            "stitched step: its graphs run as one XLA computation, in which the optimizer's graph "
            "updates each parameter as soon as its gradient exists; the plan counts one gradient "
            "and one update at a time, which holds when the step drops its gradients "
            "(optimizer.zero_grad()) before the torch_xla.sync() that runs it, and counts the "
            "rest as separate executables (XLA's schedule of the whole step may hold more)"
        )
    elif any(r.stitched for r in facts.step):
        notes.append(
            "stitched graphs with no stitched optimizer graph after their backward: the plan "
            "counts them as separate executables"
        )
    if any(r.backward_segments for r in facts.records):
        notes.append("backward segments: each segment counted as a backward of its own (approximate)")
    if facts.forwards > 1:
        notes.append(
            f"the step's forward runs {facts.forwards} compiled graphs (graph breaks): the code between "
            "them runs in torch_xla's lazy mode, outside any compiled graph: what it passes to a graph "
            "and what its own autograd saves for the backward are counted "
            f"({facts.eager_bytes / 1024:.1f} KiB, as activations held until that graph's backward, "
            "seen on each graph's first call and again once dynamo stopped compiling a function; none "
            "that saved-tensor hooks packed), its other allocations are not (the lazy graphs torch_xla "
            "runs for it, and their temporaries)"
        )
    for function, limit in sorted(dynamo_compat.recompile_limit_hits().items()):
        notes.append(
            f"dynamo reached its {limit} for {function} and runs it eagerly from then on (lazy "
            "torch_xla code): what it saves for the backward and passes to the next graph is counted "
            "as the code between graph breaks is (above), what else it allocates is not (a function "
            "called with a new size each time reaches the limit where dynamic shapes are off, as "
            "torch_xla turns them; raise torch._dynamo.config.recompile_limit, or give the function "
            "fixed sizes)"
        )
    return notes
