"""Predicted memory of one native graph: its allocations replayed on fake tensors.

Every value of an aot_autograd graph carries a fake tensor (``meta["val"]``)
with its shape, dtype and storage. ``replay`` walks the graph in order, as the
executor runs it, and keeps a running count of the bytes the graph holds above
what it was called with:

- a node whose result has a storage not seen before allocates it (views and
  the items of a multi-output op allocate nothing);
- a node planned to write into a dying buffer (``reuse``) allocates nothing;
- a storage is freed when the last value that holds it dies
  (``analysis.liveness``), unless the graph returns it;
- inputs stay alive (the caller holds them), except those the graph owns and
  lets go at their last use: in a backward, the saved tensors aot_autograd
  donates (their storage belongs to the backward alone) and its tangents, those
  something else holds (seen at its second call) only as it returns.

The peak is taken right after each node runs, when its result and all its
inputs are alive. The result is a ``GraphMemory``: the peak above the level at
the call, the change from call to return, and the bytes by category at the
peak. ``donate_backend.planner`` composes these into a step.

Sizes on CUDA are the caching allocator's blocks (multiples of 512 bytes).
Ops that may use a kernel workspace (convolutions, fused attention) are noted
with the level at which they run; the plan measures their workspaces
(``workspace``). What a replay cannot see: memory cached but not allocated
(the CUDA allocator keeps freed blocks: ``memory_reserved`` is above
``memory_allocated``), library handles set up once (cuBLAS workspaces), and
for the Inductor executor its fusions (fused intermediates are never
allocated, so the replay of the unfused graph is an upper bound there).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx

from .. import graph_memory
from ..analysis import liveness
from ..analysis.aliasing import storage_address, storage_key
from ..graph_memory import (
    ACTIVATIONS, GRADIENTS, INPUTS, TEMPORARIES, GraphMemory, held_between_steps, held_bytes, passed_outputs,
)
from ..graph_memory import node_tensors as _tensors
from . import workspace

# Devices whose tensors are counted in CUDA's allocator blocks: CUDA, and the meta
# device, on which a step is traced to plan it for a GPU it does not run on.
_BLOCK_DEVICES = ("cuda", "meta")


def cuda_block_bytes(size: int) -> int:
    """What CUDA's caching allocator counts for a request of ``size`` bytes: blocks
    are multiples of 512 bytes (``max_memory_allocated`` counts blocks)."""
    return 0 if size <= 0 else (size + 511) // 512 * 512


# Inside the replay of a graph on an accelerator (or the meta device that plans for one),
# a tensor in host memory takes none of the device's: a saved activation offloaded to the
# host (``offload_saved``), a CPU scalar. Set by ``replay`` and ``predict_step``.
_host_bytes_free: contextvars.ContextVar[bool] = contextvars.ContextVar("donate_xla_host_bytes_free", default=False)


@contextlib.contextmanager
def _device_bytes_of(*graphs: torch.fx.Graph):
    """Count only device bytes while replaying ``graphs`` (see above)."""
    on_device = any(
        v.device.type != "cpu" for graph in graphs for node in graph.find_nodes(op="placeholder")
        for v in _tensors(node)
    )
    token = _host_bytes_free.set(on_device)
    try:
        yield
    finally:
        _host_bytes_free.reset(token)


def nbytes(value: torch.Tensor) -> int:
    """Bytes of the storage behind ``value`` (symbolic sizes at their hint); on CUDA,
    the allocator's block; 0 for a host tensor in a graph on a device (above)."""
    if value.device.type == "cpu" and _host_bytes_free.get():
        return 0
    try:
        size = value.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        size = value.numel() * value.element_size()
    size = graph_memory.size_hint(size)  # never int(): that would guard on a symbolic size
    if size is None:  # a data-dependent size
        return 0
    return cuda_block_bytes(size) if value.device.type in _BLOCK_DEVICES else size


def _keys(node: torch.fx.Node) -> List[Tuple[object, int]]:
    out = []
    for value in _tensors(node):
        key = storage_key(value)
        if key is not None:
            out.append((key, nbytes(value)))
    return out


class _Ledger:
    """Live storages, who holds them, and bytes by category."""

    def __init__(self) -> None:
        self.holders: Dict[object, Set[torch.fx.Node]] = {}
        self.owned: Dict[object, Tuple[int, str]] = {}  # storages whose death changes the level
        self.by_category: Dict[str, int] = {}
        self.level = 0

    def add(self, category: str, nbytes_: int) -> None:
        self.by_category[category] = self.by_category.get(category, 0) + nbytes_
        self.level += nbytes_

    def release(self, node: torch.fx.Node, keys: Iterable[object]) -> None:
        for key in keys:
            holders = self.holders.get(key)
            if holders is None:
                continue
            holders.discard(node)
            if not holders and key in self.owned:
                size, category = self.owned.pop(key)
                self.add(category, -size)
                del self.holders[key]


def replay(graph: torch.fx.Graph, name: str, kind: str, **options) -> GraphMemory:
    """Replay ``graph``'s allocations (``_replay``), counting only device bytes where the
    graph runs on a device."""
    with _device_bytes_of(graph):
        return _replay(graph, name, kind, **options)


def _replay(
    graph: torch.fx.Graph,
    name: str,
    kind: str,
    *,
    released_inputs: Sequence[torch.fx.Node] = (),
    released_at_return: Sequence[torch.fx.Node] = (),
    input_categories: Optional[Dict[torch.fx.Node, str]] = None,
    saved_outputs_from: Optional[int] = None,
    reused: Optional[Dict[torch.fx.Node, torch.fx.Node]] = None,
    passed_outputs: Sequence[int] = (),
) -> GraphMemory:
    """Replay ``graph``'s allocations (see the module docstring).

    ``released_inputs``: placeholders the graph owns and frees at their last
    use; of those, ``released_at_return`` are freed only once it returns.
    ``input_categories``: the category of a released input's bytes.
    ``saved_outputs_from``: in a forward, the index of the first output that
    is saved for the backward (the ones before it are the caller's).
    ``reused``: node -> the input whose buffer it writes its result into.
    ``passed_outputs``: in a backward, the indices of the outputs that are
    gradients of inputs other than parameters (an earlier graph takes them).
    """
    input_categories = input_categories or {}
    reused = reused or {}
    ledger = _Ledger()
    alias: Dict[object, object] = {}  # storage of a reusing node -> the buffer's storage

    def resolve(key):
        while key in alias:
            key = alias[key]
        return key

    output = graph.output_node()
    returned: Dict[object, str] = {}
    passed: Dict[object, int] = {}
    out_values = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for index, value in enumerate(out_values):
        if not isinstance(value, torch.fx.Node):
            continue
        category = graph_memory.output_category(kind, index, saved_outputs_from)
        for key, size in _keys(value):
            returned.setdefault(key, category)
            if kind == "backward" and index in passed_outputs:
                passed[key] = size

    released = set(released_inputs)
    tangents: Dict[object, int] = {}
    tangent_indices = []
    for index, node in enumerate(graph.find_nodes(op="placeholder")):
        if kind == "backward" and node.name.startswith("tangents"):
            tangents.update(_keys(node))
            tangent_indices.append(index)
        for key, size in _keys(node):
            ledger.holders.setdefault(key, set()).add(node)
            if node in released and key not in ledger.owned:
                ledger.owned[key] = (size, input_categories.get(node, INPUTS))
                ledger.by_category.setdefault(input_categories.get(node, INPUTS), 0)

    dying = liveness.values_dying_at(graph)
    at_return = set(released_at_return)
    for node in released:
        if not node.users and node not in at_return:  # an input nothing reads goes at once
            dying.setdefault(next(iter(graph.nodes)), []).append(node)
    if at_return:
        dying = {at: [v for v in values if v not in at_return] for at, values in dying.items()}

    peak, peak_parts, peak_node = 0, {}, "(inputs)"
    points = []
    released_bytes = 0
    node_keys: Dict[torch.fx.Node, List[object]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            node_keys[node] = [resolve(k) for k, _ in _keys(node)]
        elif node.op != "output":
            keys = []
            if node in reused:
                for key, _ in _keys(node):
                    target = node_keys.get(reused[node], [None])[0]
                    if target is not None and key != target:
                        alias[key] = target
            for key, size in _keys(node):
                key = resolve(key)
                keys.append(key)
                if key not in ledger.holders:  # a new storage
                    ledger.holders[key] = set()
                    category = returned.get(key, TEMPORARIES)
                    ledger.owned[key] = (size, category)
                    ledger.add(category, size)
                ledger.holders[key].add(node)
            node_keys[node] = keys
            if workspace.has_workspace(node.target):
                call = workspace.op_call(node)
                if call is not None:
                    points.append((ledger.level, tuple(sorted(ledger.by_category.items())), call))
            if ledger.level > peak:
                peak, peak_parts, peak_node = ledger.level, dict(ledger.by_category), node.name
        if node.op == "output":
            break
        for value in dying.get(node, ()):
            keys = node_keys.get(value, ())
            before = ledger.level
            ledger.release(value, [k for k in keys if k not in returned])
            if value.op == "placeholder":
                released_bytes += before - ledger.level
    for value in released_at_return:  # let go as the graph returns
        before = ledger.level
        ledger.release(value, [k for k in node_keys.get(value, ()) if k not in returned])
        released_bytes += before - ledger.level
    # A returned storage stays; a value read only by the output is never released.
    end_parts = {c: b for c, b in ledger.by_category.items() if b}
    return GraphMemory(
        name=name,
        kind=kind,
        peak_bytes=peak,
        end_bytes=ledger.level,
        peak_parts=tuple(sorted((c, b) for c, b in peak_parts.items() if b)),
        end_parts=tuple(sorted(end_parts.items())),
        peak_node=peak_node,
        released_input_bytes=released_bytes,
        tangent_bytes=sum(tangents.values()),
        passed_grad_bytes=sum(passed.values()),
        tangent_indices=tuple(tangent_indices),
        workspace_points=tuple(points),
    )


def for_build(gm: torch.fx.GraphModule, name: str, kind: str, *, free_saved_on: bool,
              reuses: bool, donated_indices, forward_returns: Optional[int],
              input_roles: Sequence[str] = (), tangents_held: Collection[int] = ()) -> GraphMemory:
    """The replay of one build: what its executor frees and reuses (``executor``).

    ``input_roles``: the roles of the forward's inputs (``analysis.mutation``); a
    backward returns one gradient (or None) per forward input, in that order.
    ``tangents_held``: the arguments (indices) of a backward's tangents that something
    else held until it returned (``held_until_return``, seen at its second call: the
    gradients autograd materialised for outputs that got none, the engine's buffer of an
    output's gradient); each other tangent goes at its last use.
    """
    from . import free_saved, reuse

    graph = gm.graph
    released: List[torch.fx.Node] = []
    held: List[torch.fx.Node] = []
    categories: Dict[torch.fx.Node, str] = {}
    reused: Dict[torch.fx.Node, torch.fx.Node] = {}
    if kind == "backward" and free_saved_on:
        donated = free_saved.donated_placeholders(graph, donated_indices)
        for index, node in enumerate(graph.find_nodes(op="placeholder")):
            if node in donated:
                released.append(node)
                categories[node] = ACTIVATIONS
            elif free_saved.is_tangent(node):
                released.append(node)
                if index in tangents_held:
                    held.append(node)
                categories[node] = GRADIENTS
        if reuses:
            reused = {plan.node: plan.buffer for plan in reuse.plan_reuse(graph, donated)}
    return replay(
        graph, name, kind,
        released_inputs=released,
        released_at_return=held,
        input_categories=categories,
        saved_outputs_from=forward_returns if kind == "forward" else None,
        reused=reused,
        passed_outputs=passed_outputs(graph, kind, input_roles),
    )


def tangent_refs(args: Sequence, indices: Sequence[int]) -> tuple:
    """``(index, weak storage reference)`` of each tangent of a backward's call."""
    return tuple((i, storage_key(args[i])) for i in indices
                 if i < len(args) and isinstance(args[i], torch.Tensor) and storage_key(args[i]) is not None)


def held_until_return(refs: Sequence[tuple]) -> frozenset:
    """Of ``(index, weak storage reference)`` taken of a backward's tangents before its
    first call, the indices whose storage is still alive once it returned: something other
    than the compiled code held them (it frees each tangent at its last use), so they
    were live through the whole call."""
    return frozenset(index for index, ref in refs if not ref.expired())


def tangent_bytes_of(args: Sequence, indices: Sequence[int]) -> int:
    """Bytes of the distinct storages behind the tangents a backward was called with
    (an expanded scalar, as ``sum().backward()`` passes, is a few bytes)."""
    return sum(size for _, size in storage_refs([args[i] for i in indices if i < len(args)]))


def eager_saved(args: Sequence) -> Tuple[Tuple[object, int], ...]:
    """``(storage, bytes)`` of what code run eagerly before a forward made in the step and
    holds into the backward (an encoder's convolutions between graph breaks): the tensors
    its autograd saved for the backward, reached from the forward's arguments, and the
    arguments it computed (a tensor with a ``grad_fn``: not held between steps).
    Parameters and views of them (resident) and host tensors of a graph on a device are
    left out."""
    from . import compat

    on_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
    out: Dict[object, int] = {}
    made = [a for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
    for value in made + compat.saved_by_eager_autograd(args):
        if held_between_steps(value):
            continue
        if value.layout != torch.strided or (on_device and value.device.type == "cpu"):
            continue
        key = storage_address(value)
        if key is not None and key not in out:
            out[key] = nbytes(value)
    return tuple(out.items())


def size_sources(graph: torch.fx.Graph) -> Tuple[Tuple[int, Optional[int], object], ...]:
    """Where a call's arguments give each symbol of the graph's symbolic sizes:
    ``(argument index, dimension or None for an int argument, sympy symbol)``, one per
    symbol (empty for a graph with static sizes)."""
    out, seen = [], set()
    for index, node in enumerate(graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            places = [(None, val)]
        elif isinstance(val, torch.Tensor):
            places = list(enumerate(val.shape))
        else:
            continue
        for dim, size in places:
            expr = getattr(getattr(size, "node", None), "expr", None) if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr not in seen:
                seen.add(expr)
                out.append((index, dim, expr))
    return tuple(out)


def sizes_of(args: Sequence, sources: Sequence[tuple]) -> Optional[tuple]:
    """The ints a call's ``args`` give the symbols of ``sources`` (``size_sources``);
    None where an argument is not what the graph was traced with."""
    try:
        return tuple(int(args[i]) if dim is None else int(args[i].shape[dim]) for i, dim, _ in sources)
    except (IndexError, TypeError, AttributeError, ValueError):
        return None


def storage_refs(values: Sequence) -> tuple:
    """``(weak reference, bytes)`` of the distinct storages behind ``values``' tensors."""
    refs, seen = [], set()
    for value in values:
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            key = storage_key(value)
            if key is not None and key not in seen:
                seen.add(key)
                refs.append((key, nbytes(value)))
    return tuple(refs)


def passed_tangent_bytes(args: Sequence, indices: Sequence[int], earlier: Sequence[tuple]) -> int:
    """Bytes of the tangents in ``args`` whose storage is one an earlier backward returned
    and that is still alive (``earlier``: ``storage_refs`` of each such backward)."""
    alive = {ref for refs in earlier for ref, _ in refs if not ref.expired()}
    tangents = storage_refs([args[i] for i in indices if i < len(args)])
    return sum(size for ref, size in tangents if ref in alive)


class DroppedOutputs:
    """Watches what a backward returned until the next graph runs: if that is a backward
    (the same backward pass), the bytes of the outputs dropped in between are noted in
    the first one's record (``GraphRecord.outputs_dropped``); each backward is watched
    until that is known (a graph run once per step is watched once). Nothing is held
    but weak references."""

    def __init__(self) -> None:
        self._record = None  # the backward whose last call's outputs are watched

    def returned(self, record, outputs: Sequence) -> None:
        """``record``'s backward returned ``outputs`` (call after it ran)."""
        if record.outputs_dropped is None:
            record.runs.output_storages = storage_refs(outputs)
            self._record = record

    def next_call(self, kind: str) -> None:
        """A graph of ``kind`` starts (call before it runs). After the last backward of a
        pass (a forward or another graph runs next) nothing is dropped before a backward:
        noted as 0, so that it is not watched again."""
        record, self._record = self._record, None
        if record is None or record.output_storages is None:
            return
        if kind != "backward":
            record.runs.outputs_dropped = 0
            return
        record.runs.outputs_dropped = sum(size for _, size in record.output_storages) - held_bytes(
            record.output_storages)


dropped_outputs = DroppedOutputs()


def predict_step(
    fw_module: torch.fx.GraphModule, bw_module: torch.fx.GraphModule, forward_returns: Optional[int] = None
) -> Tuple[int, Dict[str, int]]:
    """A candidate partition's step peak (bytes) and its parts, before anything is compiled:
    the forward's inputs are resident, its outputs held through the backward, every
    saved tensor is the backward's to free at its last use and every tangent is made
    for it (what a caller of ``loss.backward()`` gets). ``forward_returns``: how many of
    the forward's outputs are the caller's (the rest are saved). Used to choose an
    activation budget under a memory limit (``donate_backend.budget``)."""
    with _device_bytes_of(fw_module.graph):
        return _predict_step(fw_module, bw_module, forward_returns)


def _predict_step(fw_module, bw_module, forward_returns):
    resident: Dict[object, int] = {}
    for node in fw_module.graph.find_nodes(op="placeholder"):
        resident.update(_keys(node))
    forward = replay(fw_module.graph, "forward", "forward", saved_outputs_from=forward_returns)
    # a saved tensor that is a forward input (a weight the backward's matmul reads) stays
    # resident: the backward frees only what the forward made, the tangents as it returns
    # (``for_build``)
    released = [
        n for n in bw_module.graph.find_nodes(op="placeholder")
        if _keys(n) and not any(key in resident for key, _ in _keys(n))
    ]
    tangents = [n for n in released if n.name.startswith("tangents")]
    categories = {n: GRADIENTS if n in tangents else ACTIVATIONS for n in released}
    backward = replay(bw_module.graph, "backward", "backward", released_inputs=released,
                      released_at_return=tangents, input_categories=categories)
    base = sum(resident.values())
    parts: Dict[str, int] = {INPUTS: base}
    if forward.peak_bytes >= forward.end_bytes + backward.tangent_bytes + backward.peak_bytes:
        peak = base + forward.peak_bytes
        for category, size in forward.peak_parts:
            parts[category] = parts.get(category, 0) + size
    else:
        peak = base + forward.end_bytes + backward.tangent_bytes + backward.peak_bytes
        for category, size in forward.end_parts + backward.peak_parts + ((GRADIENTS, backward.tangent_bytes),):
            parts[category] = parts.get(category, 0) + size
    return peak, parts


def tensor_bytes(value: torch.Tensor) -> int:
    """Bytes a tensor takes on its device (``nbytes``), for the step's plan."""
    return nbytes(value)


def workspace_bytes(call) -> int:
    """Scratch memory a kernel takes while it runs (``workspace``), for the step's plan."""
    return workspace.workspace_bytes(call)


def plan_notes(facts) -> list:
    """What a memory plan of a native step cannot see (``planner.PlanFacts``), as sentences."""
    from .. import dynamo_compat
    from . import compat

    notes = []
    if any(r.device == "meta" for r in facts.step):
        notes.append(
            "planned on the meta device: sizes counted in CUDA's 512-byte blocks; no kernel ran, so "
            "kernel workspaces (convolutions, fused attention, cuBLAS) and memory an allocator caches "
            "are not counted, and ops take their meta form (scaled_dot_product_attention its math "
            "form, which saves the attention weights CUDA's fused kernels do not)"
        )
    if facts.forwards > 1 and not compat.reads_saved_tensors():
        notes.append(
            f"torch {compat.torch_version()} cannot read what eager autograd saved without "
            "unpacking it (which could rerun a checkpointed region): the activations that eager code "
            "between the graphs saves are not counted"
        )
    if facts.forwards > 1:
        notes.append(
            f"the step's forward runs {facts.forwards} compiled graphs (graph breaks): the code between "
            "them runs eagerly: what it passes to a graph and what its own autograd saves for the "
            f"backward are counted ({facts.eager_bytes / 1024:.1f} KiB, as activations held until that "
            "graph's backward, seen on each graph's first call; none that saved-tensor hooks packed), "
            "its other allocations are not"
        )
    for function, limit in sorted(dynamo_compat.recompile_limit_hits().items()):
        notes.append(
            f"dynamo reached its {limit} for {function} and runs it eagerly from then on: what it "
            "allocates and saves for the backward is in no compiled graph and not counted (a function "
            "called with a new size each time reaches the limit where dynamic shapes are off; raise "
            "torch._dynamo.config.recompile_limit, or give the function fixed sizes)"
        )
    return notes
