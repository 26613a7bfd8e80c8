"""The memory model every path plans with: what a graph holds, by category, and the sizes it counts.

A path predicts each graph's allocations its own way (the native path replays them on
fake tensors, ``native.memory``; the XLA path models XLA's fusion, ``xla.memory``; the
JAX target reads XLA's own buffer assignment, ``jax.memory``) and returns a
``GraphMemory``; ``donate_backend.planner`` composes a step from them with what lives
across graphs. What is shared lives here, owned by no path: the categories of bytes,
``GraphMemory``, which tensors a caller holds between steps, and how a symbolic size is
read without guarding on it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

PARAMETERS = "parameters"
BUFFERS = "buffers"
OPTIMIZER_STATE = "optimizer state"
INPUTS = "inputs"
GRADIENTS = "gradients"
ACTIVATIONS = "activations"  # saved by a forward for its backward
OUTPUTS = "outputs"  # what a forward returns to the caller
TEMPORARIES = "temporaries"
WORKSPACE = "kernel workspace"  # scratch memory inside a kernel (``workspace``)


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """What one graph allocates and frees when it runs (bytes, relative to its call)."""

    name: str  # "graph 0 forward"
    kind: str
    peak_bytes: int  # most bytes above the level at the call, at any node
    end_bytes: int  # level at return minus level at the call (outputs kept, inputs released)
    peak_parts: Tuple[Tuple[str, int], ...]  # (category, bytes) at the peak; released inputs negative
    end_parts: Tuple[Tuple[str, int], ...]  # (category, bytes) at return
    peak_node: str  # the node at which the peak is reached
    released_input_bytes: int = 0  # inputs let go before return
    # A backward: its tangents (made by the caller just before it runs: the loss's ones,
    # zeros for outputs that got no gradient, or a later graph's input gradients), and the
    # gradients it returns for inputs that are not parameters (an earlier graph's tangents).
    tangent_bytes: int = 0
    passed_grad_bytes: int = 0
    tangent_indices: Tuple[int, ...] = ()  # which arguments are tangents
    # Ops that may use a kernel workspace: (level right after the op's result is made,
    # bytes by category then, ``workspace.OpCall``); the plan measures the workspaces.
    workspace_points: Tuple[tuple, ...] = ()
    # The largest single output (XLA: a stitched step's backward holds one gradient at a
    # time, each consumed by its update as it is made; ``planner``).
    largest_output_bytes: int = 0
    # The largest new value written into an input (XLA: in a stitched step an update's
    # new value may take a buffer of its own while the old one is still read; ``planner``).
    largest_written_bytes: int = 0

    def as_text(self) -> str:
        parts = ", ".join(f"{c} {b / 2**20:.1f}" for c, b in self.peak_parts if b)
        return (
            f"{self.name}: peak +{self.peak_bytes / 2**20:.1f} MiB at {self.peak_node} ({parts}); "
            f"after it {self.end_bytes / 2**20:+.1f} MiB"
        )
CATEGORIES = (PARAMETERS, BUFFERS, OPTIMIZER_STATE, INPUTS, GRADIENTS, ACTIVATIONS, OUTPUTS, TEMPORARIES, WORKSPACE)
# The category of a resident input by its role (``analysis.mutation``)
ROLE_CATEGORY = {"parameter": PARAMETERS, "buffer": BUFFERS, "optimizer_state": OPTIMIZER_STATE, "other": INPUTS}


def output_category(kind: str, index: int, saved_from: Optional[int]) -> str:
    """What a graph's ``index``-th output is: a backward's, a gradient; a forward's at or past
    ``saved_from`` (aot_autograd's count of the caller's outputs), an activation saved for
    its backward; else an output the caller holds."""
    if kind == "backward":
        return GRADIENTS
    if kind == "forward" and saved_from is not None and index >= saved_from:
        return ACTIVATIONS
    return OUTPUTS


def node_tensors(node: torch.fx.Node) -> List[torch.Tensor]:
    """The tensors of a node's fake value (``meta["val"]``), strided ones only."""
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return [v for v in tree_leaves(val) if isinstance(v, torch.Tensor) and v.layout == torch.strided]


def held_between_steps(value: torch.Tensor) -> bool:
    """A parameter, a leaf that requires grad, or a view of one (weights tied in eager
    code): resident, not made by the step."""
    for tensor in (value, value._base):
        if tensor is not None and (isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)):
            return True
    return False


def held_bytes(refs: tuple) -> int:
    """Bytes of the storages in ``refs`` (``storage_refs``) that are still alive."""
    return sum(size for ref, size in refs if not ref.expired())


def first_call_identities(roles: Sequence[str], inputs: Sequence, outputs: Sequence, identity, size):
    """What a graph's first call tells the step's plan (``GraphRecord.runs``): the
    ``(role, identity, bytes)`` of each tensor it reads, which its caller may hold between
    steps, and the identities of the tensors it returned that it did not read. ``identity``
    names a tensor across graphs (a storage, or a tensor object where there is no storage
    address) and is None for one the path does not place (a host scalar); ``size`` gives
    its bytes on the device."""
    held = []
    for role, value in zip(roles, inputs):
        key = identity(value) if isinstance(value, torch.Tensor) else None
        if key is not None:
            held.append((role, key, size(value)))
    read = {key for _, key, _ in held}
    returned = frozenset(
        key for key in (identity(v) for v in outputs if isinstance(v, torch.Tensor)) if key is not None and key not in read
    )
    return tuple(held), returned


def outputs_held(records) -> dict:
    """Graph id -> bytes of that forward's outputs still alive, for each forward record in
    ``records`` that noted its outputs' storages (``GraphRecord.output_storages``)."""
    return {
        r.graph_id: held_bytes(r.output_storages)
        for r in records
        if r.kind == "forward" and r.output_storages is not None
    }


def passed_outputs(graph: torch.fx.Graph, kind: str, input_roles: Sequence[str]) -> List[int]:
    """In a backward, the outputs that are gradients of inputs that are not parameters or
    state (``input_roles``: the forward's inputs): an earlier graph's backward takes them
    as its tangents (graph breaks). Empty where the outputs do not line up with the inputs."""
    if kind != "backward" or not input_roles:
        return []
    outputs = graph.output_node().args[0]
    if not isinstance(outputs, (list, tuple)) or len(outputs) != len(input_roles):
        return []  # the outputs do not line up with the inputs: count all as gradients
    return [i for i, role in enumerate(input_roles) if role == "other"]


# -- symbolic sizes -------------------------------------------------------------------------

_bound_sizes: contextvars.ContextVar = contextvars.ContextVar("donate_xla_bound_sizes", default=None)


@contextlib.contextmanager
def sizes_bound(binding: dict):
    """``size_hint`` reads symbolic sizes at ``binding`` (sympy symbol -> int) inside."""
    token = _bound_sizes.set(binding)
    try:
        yield
    finally:
        _bound_sizes.reset(token)


def size_hint(value) -> Optional[int]:
    """A size as an int, without guarding on it: ``int()`` of a symbolic size would add a
    guard to the graph being traced. Inside ``sizes_bound`` the size is read at those
    values of its symbols; else at the hint the shape environment keeps (None where it has
    none: a data-dependent size)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = getattr(value, "node", None)
        binding = _bound_sizes.get()
        if binding:
            bound = _evaluated(getattr(node, "expr", None), binding)
            if bound is not None:
                return bound
        hint = getattr(node, "hint", None)
        return int(hint) if isinstance(hint, int) else None
    return None


def _evaluated(expr, binding: dict) -> Optional[int]:
    """``expr`` (sympy) with ``binding`` substituted, as an int; None where a symbol is
    left or sympy cannot evaluate it."""
    if expr is None:
        return None
    try:
        value = expr.xreplace(binding)
        return int(value) if value.is_number else None
    except (TypeError, ValueError, AttributeError):
        return None


def dense_bytes(value: torch.Tensor) -> int:
    """Bytes of a dense buffer holding ``value`` (no strides; a symbolic size at its hint,
    0 without one): what an XLA buffer of it holds."""
    size = size_hint(value.numel() * value.element_size())
    return int(size) if size is not None else 0
