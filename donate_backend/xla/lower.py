"""Lowering: an FX graph and fake inputs -> compiled HLO in torch_xla's cache.

A ``LoweringRequest`` (frozen data: graph, inputs, donors, shardings, host part,
stitched or not) goes through three stages, each with an artefact you can print:

1. ``trace``: the graph runs on placeholder tensors (no device data, so
   nothing is sent to the device); donors are flagged first
   (``TracedGraph``);
2. ``plan``: which traced tensors become HLO results, in an order that pairs
   each donor with its own new value, and what feeds each HLO parameter,
   checked against the graph's inputs;
3. compile into torch_xla's computation cache without running anything
   (``LoweredGraph``: hash, parameter and result tables, HLO text on request).

Every placeholder-derived tensor is dropped before ``lower`` returns, also
when it fails: a live one would crash the process at the next
``torch_xla.sync()``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
import traceback
from typing import Optional, Sequence

import torch
import torch.fx
import torch_xla

from .. import config
from ..errors import DonateXlaError, UnsupportedGraphError
from . import compat, metrics, mmap_guard, spmd
from .plan import (
    HloParam, LoweringMismatchError, OutputSlot, describe, donors_first_order, plan_parameters, plan_results,
)
from .trace import TracedGraph, check_inputs, input_specs, meta_device, output_nodes, traced_on_placeholders


__all__ = ["LoweringRequest", "LoweredGraph", "HloParam", "OutputSlot", "lower", "check_inputs", "graph_fingerprint"]


@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    """Stage 3: a graph compiled into torch_xla's cache, and how to run it."""

    graph_name: str
    graph_hash: Optional[bytes]  # None: nothing to run on the device
    params: tuple  # HloParam per HLO parameter
    results: tuple  # ResultSpec per HLO result (the fingerprint not included)
    writebacks: tuple  # (input index, result index)
    outputs: tuple  # OutputSlot per graph output
    donors: tuple
    traced: Optional[TracedGraph] = None
    constants_uploaded: int = 0
    transfers: Optional[metrics.TransferSnapshot] = None
    hlo_text: Optional[str] = None
    aliased: int = 0  # InputOutputAliasCount torch_xla recorded when compiling
    # stitched (DONATE_XLA_STITCH): the graph as an XLA computation that lazy IR calls,
    # not an executable of its own (see stitched.StitchedExecutable)
    computation: object = None
    # seconds per stage: ("trace", ...), ("plan", ...), ("xla compile", ...)
    phases: tuple = ()
    request: Optional["LoweringRequest"] = dataclasses.field(default=None, repr=False, compare=False)
    # the HLO constant that tells this graph apart in torch_xla's cache (``graph_fingerprint``);
    # it also names the graph's module in XLA's dumps (``bench/xla_executables.py``)
    fingerprint: Optional[int] = None

    def as_text(self) -> str:
        head = f"{self.graph_name}: lowered"
        if self.graph_hash is None:
            head += " (nothing to run on the device)"
        lines = [head, describe(self.params, self.results, self.writebacks, self.outputs, self.donors)]
        if self.hlo_text:
            lines += ["hlo:", self.hlo_text.strip()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class LoweringRequest:
    """Stage 0: what to lower, as data. An executable makes its variants (without
    donation, with inputs the user flagged, after a cache eviction) by replacing
    fields of the request it was built from, never by calling back into the
    compiler.

    The call's device tensors are not part of it: under SPMD (``sharded``) each
    lowering takes the call's inputs (``lower(request, real_inputs)``), so a
    request keeps no device buffer alive.
    """

    graph: torch.fx.GraphModule
    example_inputs: tuple  # fake tensors and host scalars, as the graph's inputs
    graph_name: str
    donors: tuple = ()  # inputs the graph overwrites, donated to their new values
    requested_donors: tuple = ()  # donated with no write-back (their buffers are invalid after)
    sharded: bool = False  # SPMD: traced on lazy clones of the call's inputs
    # a backward's gradients pinned to their leaves' shardings: {position: (shape, OpSharding)}
    output_shardings: Optional[dict] = dataclasses.field(default=None, compare=False)
    host_values: object = None  # analysis.host_part.HostPart: write-backs and outputs computed on the host
    stitch: bool = False  # an XLA computation for lazy IR to call, not an executable
    keep_hlo_text: bool = False
    # indices of the host (CPU) tensors among the inputs, as ``check_inputs`` found them
    # (None: ``lower`` checks the inputs itself)
    host_inputs: Optional[tuple] = None

    def without_donation(self) -> "LoweringRequest":
        return dataclasses.replace(self, donors=(), requested_donors=())

    def with_requested(self, flagged) -> "LoweringRequest":
        """Also donating ``flagged`` inputs (buffers the user flagged for donation)."""
        return dataclasses.replace(self, requested_donors=tuple(sorted(set(self.requested_donors) | set(flagged))))

    def as_text(self) -> str:
        parts = [f"{self.graph_name}: lowering request, {len(self.example_inputs)} inputs",
                 f"donors {list(self.donors)}"]
        if self.requested_donors:
            parts.append(f"requested donors {list(self.requested_donors)}")
        if self.sharded:
            parts.append("sharded" + (f", {len(self.output_shardings)} outputs pinned" if self.output_shardings else ""))
        if self.host_values is not None:
            parts.append("with a host part")
        if self.stitch:
            parts.append("stitched")
        return "; ".join(parts)


def lower(request: LoweringRequest, real_inputs: Optional[Sequence] = None) -> LoweredGraph:
    """Trace the request's graph on placeholders, plan its results and parameters,
    compile it. The result keeps its request (``LoweredGraph.request``).

    ``real_inputs`` (SPMD, ``request.sharded``): the call's device tensors. The
    graph is then traced on lazy clones of them, so each HLO parameter carries
    its input's sharding (no data moves), and every write-back keeps its
    input's sharding. ``requested_donors`` are donated without a write-back
    (the user asked for it: their buffers are invalid after the call).
    ``output_shardings`` pins the sharding of graph outputs by position, where
    the shape matches (a backward's gradients: see ``spmd.py``). ``stitch``:
    build the XLA computation (for lazy IR to call) instead of compiling an
    executable.

    A failure is raised as ``UnsupportedGraphError`` with the original
    exception chained; its traceback's frames are cleared first, so it keeps
    no placeholder alive.
    """
    if request.sharded != (real_inputs is not None):
        raise ValueError(
            f"{request.graph_name}: lower() takes the call's inputs (real_inputs) for a sharded request, "
            "and only for one"
        )
    gm, example_inputs, graph_name = request.graph, request.example_inputs, request.graph_name
    donors, requested_donors = request.donors, request.requested_donors
    output_shardings, host_values, stitch = request.output_shardings, request.host_values, request.stitch
    keep_hlo_text = request.keep_hlo_text
    mmap_guard.check_room(graph_name)  # a clear error, not a crash, when XLA:CPU's kernels used them up
    supported = compat.supports_donation()
    written_donors = tuple(donors) if supported else ()
    donors = written_donors + (tuple(requested_donors) if supported else ())
    host_scalars = (
        list(request.host_inputs) if request.host_inputs is not None else check_inputs(example_inputs, graph_name)
    )
    if real_inputs is not None:  # host scalars are uploaded per call: traced on placeholders
        real_inputs = [None if i in host_scalars else t for i, t in enumerate(real_inputs)]
    before = metrics.transfer_snapshot()
    traced = TracedGraph(
        graph_name, gm, input_specs(example_inputs, donors, host_scalars), example_inputs=tuple(example_inputs)
    )
    try:
        lowered = _lower_live(
            gm, example_inputs, donors, graph_name, traced, keep_hlo_text, real_inputs, output_shardings or {},
            written_donors, host_values, stitch,
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with the graph's name
        raise _lowering_error(exc, traced) from _without_frames(exc)
    transfers = metrics.transfer_snapshot().minus(before)
    return dataclasses.replace(lowered, transfers=transfers, request=request)


def _lower_live(
    gm, example_inputs, donors, graph_name, traced, keep_hlo_text, real_inputs, output_shardings, written_donors,
    host_values, stitch,
) -> LoweredGraph:
    to_host = [(meta_device(n) or torch.device("xla")).type == "cpu" for n in output_nodes(gm)]
    shardings = spmd.input_shardings(real_inputs) if real_inputs is not None else {}
    if shardings:  # replicated optimizer state takes its parameter's sharding
        specs = spmd.sharding_signature(real_inputs)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in example_inputs]
        for i, source in spmd.inherited_shardings(gm, specs, shapes).items():
            shardings[i] = shardings[source]
    started = time.perf_counter()
    with traced_on_placeholders(gm, example_inputs, donors, graph_name, real_inputs, stitch) as live:
        traced_at = time.perf_counter()
        traced = dataclasses.replace(
            traced, constants_uploaded=live.constants_uploaded, recompute_gated=live.recompute_gated,
            updates_ordered=live.updates_ordered,
        )
        plan = plan_results(live, live.outputs, to_host, graph_name, written_donors, host_values)
        try:
            if not plan.tensors:
                return LoweredGraph(
                    graph_name, None, (), (), plan.writebacks, plan.outputs, donors, traced,
                    live.constants_uploaded,
                )
            for i, r in plan.writebacks:  # new values keep their input's sharding
                if i in shardings:
                    compat.annotate_sharding(plan.tensors[r], shardings[i])
            for position, slot in enumerate(plan.outputs):
                pinned = output_shardings.get(position)
                if slot.kind == "result" and pinned and tuple(plan.tensors[slot.index].shape) == pinned[0]:
                    compat.annotate_sharding(plan.tensors[slot.index], pinned[1])
            plan.reorder(donors_first_order(plan, donors, live))
            fingerprint = graph_fingerprint(gm, example_inputs, donors, spmd.sharding_signature(real_inputs))
            plan.tensors.append(_fingerprint_output(fingerprint))
            params = plan_parameters(plan.tensors, live, example_inputs, graph_name)
            graph_hash = compat.graph_hash(plan.tensors)
            hlo = compat.hlo_text(plan.tensors) if keep_hlo_text or config.current().debug else None
            planned_at = time.perf_counter()
            if stitch:
                computation = _computation(plan.tensors, params, graph_name)
                return LoweredGraph(
                    graph_name, graph_hash, params, tuple(plan.specs), plan.writebacks, plan.outputs,
                    donors, traced, live.constants_uploaded, None, hlo, 0, computation,
                    phases=(("trace", traced_at - started), ("plan", planned_at - traced_at),
                            ("xla computation", time.perf_counter() - planned_at)),
                    fingerprint=fingerprint,
                )
            aliased = _compile_into_cache(plan.tensors, graph_hash)
            return LoweredGraph(
                graph_name, graph_hash, params, tuple(plan.specs), plan.writebacks, plan.outputs,
                donors, traced, live.constants_uploaded, None, hlo, aliased,
                phases=(("trace", traced_at - started), ("plan", planned_at - traced_at),
                        ("xla compile", time.perf_counter() - planned_at)),
                fingerprint=fingerprint,
            )
        finally:
            plan.tensors.clear()


def _computation(results: list, params: tuple, graph_name: str):
    """The graph as a callable XLA computation, its parameters checked against the plan's."""
    computation, signature = compat.computation(results, f"donate_xla::{graph_name.replace(' ', '_')}")
    if signature != [(p.shape, p.dtype) for p in params]:
        raise LoweringMismatchError(
            f"donate_xla: {graph_name}: the stitched computation's parameters are not the "
            "planned ones; please report this with the graph (DONATE_XLA_DEBUG=1 writes it)."
        )
    return computation


def _without_frames(exc: BaseException) -> BaseException:
    """Clear the locals of every finished frame in ``exc``'s traceback chain.

    The frames of a failed trace hold placeholder tensors; keeping them alive
    in a chained exception would crash the process at the next sync.
    """
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    return exc


def _lowering_error(exc: BaseException, traced: TracedGraph) -> DonateXlaError:
    if isinstance(exc, UnsupportedGraphError):
        message = str(exc)
    elif isinstance(exc, DonateXlaError):
        message = str(exc)
    else:
        first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
        message = (
            f"{traced.graph_name}: XLA could not compile the graph: {type(exc).__name__}: "
            f"{first_line}. Please report this with the graph."
        )
    dump = dump_failed_graph(traced, exc)
    if dump:
        message += f" The graph was written to {dump}."
    elif "DONATE_XLA_DEBUG" not in message:
        message += " Set DONATE_XLA_DEBUG=1 to write the failing graph to a file."
    return UnsupportedGraphError(message)


def dump_failed_graph(traced: TracedGraph, exc: BaseException) -> Optional[str]:
    """Under DONATE_XLA_DEBUG=1: write the failing graph to a file; return its path."""
    if not config.current().debug:
        return None
    folder = os.path.join(tempfile.gettempdir(), "donate_xla_failures")
    os.makedirs(folder, exist_ok=True)
    name = traced.graph_name.replace(" ", "_")
    path = os.path.join(folder, f"{name}.{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(traced.as_text())
        f.write(f"\n\nerror: {type(exc).__name__}: {exc}\n")
    return path


def graph_fingerprint(
    gm: torch.fx.GraphModule, example_inputs: Sequence, donors: Sequence[int], shardings: tuple = ()
) -> int:
    """A 62-bit number that differs for graphs that compute different things.

    torch_xla's graph hash does not tell apart graphs that differ only in which
    of several same-shaped inputs an op reads (``b + a`` vs ``b + c``), so two
    such graphs would share one cache entry and one would run the other's code.
    """
    signature = [
        (tuple(t.shape), str(t.dtype), t.device.type) if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]
    text = f"{gm.code}\n{signature}\n{sorted(donors)}\n{shardings}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _fingerprint_output(fingerprint: int) -> torch.Tensor:
    """An HLO constant carrying the fingerprint, so it is part of torch_xla's hash."""
    return torch.full((), fingerprint, dtype=torch.int64, device=torch_xla.device())


# torch_xla compiles a graph hash once per process (until its cache evicts it) and
# records InputOutputAliasCount only then; a later lowering of the same graph
# (after torch._dynamo.reset(), or a switch flipped back) finds it compiled.
_alias_count_of_hash: dict = {}


def _compile_into_cache(results: list, graph_hash) -> int:
    """Compile without running; return the number of donors XLA aliased."""
    samples_before, aliases_before = metrics.alias_count_total()
    compat.warm_up_cache(results)
    samples_after, aliases_after = metrics.alias_count_total()
    if samples_after > samples_before:
        _alias_count_of_hash[graph_hash] = int(aliases_after - aliases_before)
    return _alias_count_of_hash.get(graph_hash, 0)
