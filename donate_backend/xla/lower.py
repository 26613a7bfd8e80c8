"""Lowering: an FX graph and fake inputs -> compiled HLO in torch_xla's cache.

The graph runs on placeholder tensors (no device data), so compiling sends no
bytes to the device. Donor placeholders are flagged before the graph mutates
them. The result, ``LoweredGraph``, says how to feed the HLO parameters and
how to turn its results into the graph's outputs and input write-backs.
Every placeholder-derived tensor is dropped before ``lower`` returns.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Optional, Sequence

import torch
import torch.fx
import torch_xla

from ..errors import UnsupportedGraphError
from . import metrics
from .placeholders import (
    XLAC,
    make_placeholder,
    outside_fake_tracing,
    seed_info_id,
    tensor_id,
    tracing_settings,
)

log = logging.getLogger("donate_xla")

_LOWERABLE_KEYS = ("XLA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")


def has_xla_lowering(op: torch._ops.OpOverload) -> bool:
    """False for ATen ops torch_xla would run through its CPU fallback.

    The fallback copies inputs to the host, which a placeholder cannot do
    (it crashes the process), so such ops are rejected before they run.
    """
    if op.namespace != "aten":
        return True
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in _LOWERABLE_KEYS)


# Ops with no XLA kernel that mean the same as one that has one.
_EQUIVALENT_OPS = {
    torch.ops.aten.lift_fresh_copy.default: torch.ops.aten.clone.default,
}

_HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default: ".item() / a Python number read",
}


@dataclasses.dataclass(frozen=True)
class HloParam:
    """Where one HLO parameter comes from at run time."""

    kind: str  # "input", "seed" or "constant"
    input_index: int = -1
    constant: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """One graph output: a computed result, an input, or a plain value."""

    kind: str  # "result", "input" or "value"
    index: int = -1
    value: Any = None
    to_host: bool = False  # a host scalar the graph computes on the device


@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    graph_hash: Optional[object]  # None: nothing to run on the device
    params: tuple
    writebacks: tuple  # (input index, result index)
    outputs: tuple
    donors: tuple
    constants_uploaded: int
    transfers: metrics.TransferSnapshot
    hlo_text: Optional[str] = None
    aliased: int = 0  # InputOutputAliasCount torch_xla recorded when compiling


def check_inputs(example_inputs: Sequence, graph_name: str) -> list[int]:
    """Validate inputs; return indices of host (CPU) scalar tensors."""
    host_scalars = []
    for i, value in enumerate(example_inputs):
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise UnsupportedGraphError(
                f"{graph_name}: input #{i} is a symbolic size ({value}); dynamic shapes are "
                "not supported by donate_xla. Compile with torch.compile(..., dynamic=False) "
                "or keep input shapes fixed (pad the last batch)."
            )
        if not isinstance(value, torch.Tensor):
            continue
        if any(isinstance(s, torch.SymInt) for s in value.shape):
            raise UnsupportedGraphError(
                f"{graph_name}: input #{i} has a dynamic shape {tuple(value.shape)}; dynamic "
                "shapes are not supported by donate_xla. Use torch.compile(..., dynamic=False)."
            )
        if value.device.type == "xla":
            continue
        if value.device.type == "cpu" and value.numel() == 1 and value.dim() == 0:
            host_scalars.append(i)
            continue
        raise UnsupportedGraphError(
            f"{graph_name}: input #{i} is a {value.device.type} tensor of shape "
            f"{tuple(value.shape)} in a graph on the XLA device. Move it to the XLA device "
            "(tensor.to(torch_xla.device())) before calling the compiled function."
        )
    return host_scalars


def _meta_device(node: torch.fx.Node) -> Optional[torch.device]:
    val = node.meta.get("val")
    return val.device if isinstance(val, torch.Tensor) else None


class _PlaceholderTracer(torch.fx.Interpreter):
    """Runs the graph on placeholders; host tensors are kept on the device."""

    def __init__(self, gm: torch.fx.GraphModule, graph_name: str, device: torch.device):
        super().__init__(gm, garbage_collect_values=True)
        self.graph_name = graph_name
        self.device = device
        self.constants_uploaded = 0

    def run_node(self, node: torch.fx.Node):
        if node.op == "call_function":
            self._reject_host_reads(node)
            self._reject_unlowerable(node)
        try:
            return super().run_node(node)
        except UnsupportedGraphError:
            raise
        except Exception as exc:  # noqa: BLE001 - rethrown with the op's name
            raise UnsupportedGraphError(
                f"{self.graph_name}: op {node.target} (node {node.name!r}) could not be "
                f"lowered to XLA: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}. "
                "If torch_xla has no lowering for it, move that op outside the compiled "
                "region (torch._dynamo.disable) or replace it with supported ops."
            ) from exc

    def _reject_unlowerable(self, node: torch.fx.Node) -> None:
        target = _EQUIVALENT_OPS.get(node.target, node.target)
        if isinstance(target, torch._ops.OpOverload) and not has_xla_lowering(target):
            raise UnsupportedGraphError(
                f"{self.graph_name}: op {node.target} (node {node.name!r}) has no XLA lowering "
                "in torch_xla, so it cannot be compiled for the XLA device. Move it outside "
                "the compiled region (wrap it in torch._dynamo.disable) or replace it with "
                "supported ops."
            )

    def _reject_host_reads(self, node: torch.fx.Node) -> None:
        if node.target in _HOST_READ_OPS:
            raise UnsupportedGraphError(
                f"{self.graph_name}: node {node.name!r} reads device data on the host "
                f"({_HOST_READ_OPS[node.target]}) inside the compiled graph. Move the read "
                "out of the compiled function, or let dynamo break the graph there."
            )
        out_device = _meta_device(node)
        if out_device is None or out_device.type != "cpu":
            return
        for arg in node.all_input_nodes:
            arg_device = _meta_device(arg)
            if arg_device is not None and arg_device.type == "xla":
                raise UnsupportedGraphError(
                    f"{self.graph_name}: node {node.name!r} ({node.target}) copies an XLA "
                    "tensor to the host (.cpu() / .to('cpu')) inside the compiled graph. "
                    "Do that after the compiled function returns."
                )

    def call_function(self, target, args, kwargs):
        target = _EQUIVALENT_OPS.get(target, target)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            kwargs = {**kwargs, "device": self.device}
        return super().call_function(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and value.device.type != "xla":
            self.constants_uploaded += 1
            value = value.to(self.device)
        return value


def flatten_outputs(out) -> list:
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence,
    donors: Sequence[int],
    graph_name: str,
    keep_hlo_text: bool = False,
) -> LoweredGraph:
    """Trace ``gm`` on placeholders, compile it, and describe how to run it.

    If tracing fails, the error is raised afresh once every placeholder-derived
    tensor is gone: a traceback that kept one alive would crash the process at
    the next ``torch_xla.sync()``.
    """
    host_scalars = set(check_inputs(example_inputs, graph_name))
    before = metrics.transfer_snapshot()
    failure: Optional[str] = None
    try:
        lowered, constants_uploaded = _trace_and_compile(
            gm, example_inputs, host_scalars, tuple(donors), graph_name, keep_hlo_text
        )
    except UnsupportedGraphError as exc:
        failure = str(exc)
    except Exception as exc:  # noqa: BLE001 - XLA's own compile errors, re-raised below
        failure = (
            f"{graph_name}: XLA could not compile the graph: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}. Set DONATE_XLA_DEBUG=1 "
            "to log the graph reports, and please report this with the graph."
        )
    if failure is not None:
        raise UnsupportedGraphError(failure)
    transfers = metrics.transfer_snapshot().minus(before)
    return dataclasses.replace(lowered, transfers=transfers, constants_uploaded=constants_uploaded)


def _trace_and_compile(gm, example_inputs, host_scalars, donors, graph_name, keep_hlo_text):
    with outside_fake_tracing(), tracing_settings(donate=bool(donors)):
        holders = [
            make_placeholder(t.shape, t.dtype) if isinstance(t, torch.Tensor) else t
            for t in example_inputs
        ]
        tracer = _PlaceholderTracer(gm, graph_name, torch_xla.device())
        try:
            for i in donors:
                XLAC._set_buffer_donation(holders[i], True)
            traced = flatten_outputs(tracer.run(*holders))
            fingerprint = graph_fingerprint(gm, example_inputs, donors)
            lowered = _describe_and_compile(
                gm, holders, traced, host_scalars, donors, keep_hlo_text, fingerprint
            )
            traced.clear()
        finally:
            holders.clear()
            tracer.env.clear()
    return lowered, tracer.constants_uploaded


def graph_fingerprint(gm: torch.fx.GraphModule, example_inputs: Sequence, donors: Sequence[int]) -> int:
    """A 62-bit number that differs for graphs that compute different things.

    torch_xla's graph hash does not tell apart graphs that differ only in which
    of several same-shaped inputs an op reads (``b + a`` vs ``b + c``), so two
    such graphs would share one cache entry and one would run the other's code.
    """
    signature = [
        (tuple(t.shape), str(t.dtype), t.device.type) if isinstance(t, torch.Tensor) else repr(t)
        for t in example_inputs
    ]
    text = f"{gm.code}\n{signature}\n{sorted(donors)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _fingerprint_output(fingerprint: int, device) -> torch.Tensor:
    """An HLO constant carrying the fingerprint, so it is part of torch_xla's hash."""
    return torch.full((), fingerprint, dtype=torch.int64, device=device)


def _describe_and_compile(gm, holders, traced, host_scalars, donors, keep_hlo_text, fingerprint):
    tensor_inputs = [i for i, h in enumerate(holders) if isinstance(h, torch.Tensor)]
    index_of_holder = {id(holders[i]): i for i in tensor_inputs}
    pending = XLAC._check_tensor_need_materialization([holders[i] for i in tensor_inputs])
    mutated = [i for i, need in zip(tensor_inputs, pending) if need]

    results: list[torch.Tensor] = []
    result_index: dict[int, int] = {}

    def add_result(t: torch.Tensor) -> int:
        if id(t) not in result_index:
            result_index[id(t)] = len(results)
            results.append(t)
        return result_index[id(t)]

    writebacks = tuple((i, add_result(holders[i])) for i in mutated)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    output_metas = flatten_outputs(output_node.args[0])
    slots = []
    for value, meta_node in zip(traced, output_metas):
        if isinstance(value, torch.Tensor) and id(value) in index_of_holder:
            slots.append(OutputSlot("input", index_of_holder[id(value)]))
        elif isinstance(value, torch.Tensor):
            to_host = isinstance(meta_node, torch.fx.Node) and (
                (_meta_device(meta_node) or torch.device("xla")).type == "cpu"
            )
            slots.append(OutputSlot("result", add_result(value), to_host=to_host))
        else:
            slots.append(OutputSlot("value", value=value))

    if not results:
        return LoweredGraph(None, (), writebacks, tuple(slots), (), 0, None)

    holder_by_id = {tensor_id(holders[i]): i for i in tensor_inputs}
    order = _results_order_pairing_donors(
        results, writebacks, donors, holder_by_id, [holders[i] for i in tensor_inputs]
    )
    results, writebacks, slots = _reorder_results(order, results, writebacks, slots)
    results.append(_fingerprint_output(fingerprint, torch_xla.device()))
    graph_hash = XLAC._get_graph_hash(results)
    param_ids, param_values = XLAC._get_tensors_xla_device_data_node(results)
    seed_id = seed_info_id()
    params = []
    for pid, value in zip(param_ids, param_values):
        if pid in holder_by_id:
            params.append(HloParam("input", input_index=holder_by_id[pid]))
        elif pid == seed_id:
            params.append(HloParam("seed"))
        else:
            params.append(HloParam("constant", constant=value))
    hlo_text = XLAC._get_xla_tensors_hlo(results) if keep_hlo_text else None
    aliased = _compile_into_cache(results, graph_hash)
    return LoweredGraph(
        graph_hash, tuple(params), writebacks, tuple(slots), donors, 0, None, hlo_text, aliased
    )


# torch_xla compiles a graph hash once per process (until its cache evicts it) and
# records InputOutputAliasCount only then; a later lowering of the same graph
# (after torch._dynamo.reset(), or a switch flipped back) finds it compiled.
_alias_count_of_hash: dict = {}


def _compile_into_cache(results: list, graph_hash) -> int:
    """Compile without running; return the number of donors XLA aliased."""
    samples_before, aliases_before = metrics.alias_count_total()
    XLAC._xla_warm_up_cache(results, [])
    samples_after, aliases_after = metrics.alias_count_total()
    if samples_after > samples_before:
        _alias_count_of_hash[graph_hash] = int(aliases_after - aliases_before)
    return _alias_count_of_hash.get(graph_hash, 0)


def donors_first(donor_results: Sequence[int], result_count: int) -> list[int]:
    """A result order (new position -> old index): ``donor_results`` first, in
    the order given, then every other result in its old order."""
    chosen = set(donor_results)
    return list(donor_results) + [i for i in range(result_count) if i not in chosen]


def _results_order_pairing_donors(results, writebacks, donors, holder_by_id, placeholders) -> list[int]:
    """Order the results so that XLA pairs each donor with its own new value.

    XLA's buffer-donor pass (OptimizeInputOutputBufferAlias) pairs donors and
    outputs of equal byte size in order: the k-th donor among the HLO
    parameters with the k-th output. When a parameter and its same-shaped
    momentum are paired the other way round, XLA must copy both to keep the old
    values readable, which cost 150 MiB of temporaries in a 52M-parameter SGD
    step.
    """
    donor_set = set(donors)
    result_of_input = {i: r for i, r in writebacks if i in donor_set}

    def donor_results_in_parameter_order(order: list[int]) -> list[int]:
        # passing the placeholders back keeps torch_xla from wrapping their data in new tensors
        param_ids, _ = XLAC._get_tensors_xla_device_data_node([results[i] for i in order], placeholders)
        inputs = (holder_by_id.get(pid) for pid in param_ids)
        return [result_of_input[i] for i in inputs if i in result_of_input]

    order, stable = settle_donor_order(donor_results_in_parameter_order, len(results))
    if not stable:
        log.debug("donor order did not settle; XLA may copy some donors (memory only, values are right)")
    return order


def settle_donor_order(donor_results_in_parameter_order, result_count: int, rounds: int = 4):
    """Put the donors' results first in the order their donors take among the
    HLO parameters. That order follows the traversal of the results, so it is
    refined until it no longer changes. Returns (order, whether it settled)."""
    order = list(range(result_count))
    for _ in range(rounds):
        donor_results = donor_results_in_parameter_order(order)
        if order[: len(donor_results)] == donor_results:
            return order, True
        order = donors_first(donor_results, result_count)
    return order, False


def _reorder_results(order: list[int], results: list, writebacks: tuple, slots: list):
    """Apply ``order`` to the results and renumber what refers to them."""
    position = {old: new for new, old in enumerate(order)}
    writebacks = tuple((i, position[r]) for i, r in writebacks)
    slots = [dataclasses.replace(s, index=position[s.index]) if s.kind == "result" else s for s in slots]
    return [results[i] for i in order], writebacks, slots
