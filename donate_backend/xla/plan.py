"""Stage 2 of lowering: which traced tensors the HLO returns, and what feeds its parameters.

torch_xla decides the outputs of an HLO computation itself, from the tensors
it is given: it keeps each XLA tensor once (by its tensor id: ``t.detach()``
is the same tensor as ``t``) and leaves out every tensor whose value is plain
device data (an input passed through, ``q.copy_(p)``, a tensor constant). The
executable then returns fewer results than it was given tensors, and every
result after the first left-out one lands on the wrong output (wrong values,
wrong shapes, or XLA's "Executable expected parameter ... incompatible size").

``plan_results`` makes that decision explicit instead of guessing at it:

- an output that *is* a graph input (by tensor id) is returned from the
  caller's arguments, not computed;
- every other output and every input write-back becomes a result that is
  pending IR, so torch_xla keeps all of them: values that are plain device
  data get an identity view, which XLA compiles to a copy (for a donated
  write-back, into the donor's own buffer);
- results are unique by tensor id, so what torch_xla returns is exactly, and
  in order, the list planned.

``plan_parameters`` maps each HLO parameter (torch_xla's device-data order)
to the graph input, RNG seed or captured constant that feeds it, and checks
every input parameter's shape and dtype against the input it will receive.
A mismatch is a ``LoweringMismatchError`` naming the graph and the input.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch

from ..errors import DonateXlaError
from . import compat

log = logging.getLogger("donate_xla")


class LoweringMismatchError(DonateXlaError):
    """The lowered HLO does not line up with the graph's inputs or outputs."""

    help_section = "Our own checks failed"


@dataclasses.dataclass(frozen=True)
class HloParam:
    """Where one HLO parameter comes from at run time."""

    kind: str  # "input", "seed" or "constant"
    input_index: int = -1
    constant: Optional[torch.Tensor] = None
    shape: tuple = ()
    dtype: Optional[torch.dtype] = None


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """One graph output: a computed result, a graph input, or a plain value."""

    kind: str  # "result", "input", "value" or "host" (computed on the host: host.py)
    index: int = -1
    value: Any = None
    to_host: bool = False  # a host scalar the graph computes on the device


@dataclasses.dataclass(frozen=True)
class ResultSpec:
    """One HLO result: its shape and dtype, and whether it had to be forced."""

    shape: tuple
    dtype: torch.dtype
    forced: bool = False  # plain device data made a result by an identity view


@dataclasses.dataclass
class ResultPlan:
    """Live tensors to compile (``tensors``) and how results map back to the graph."""

    tensors: list  # live XLA tensors; dropped by the caller when lowering ends
    specs: list  # ResultSpec per tensor
    writebacks: tuple  # (input index, result index)
    outputs: tuple  # OutputSlot per graph output

    def reorder(self, order: Sequence[int]) -> None:
        """Apply ``order`` (new position -> old index) and renumber what refers to results."""
        position = {old: new for new, old in enumerate(order)}
        self.tensors = [self.tensors[i] for i in order]
        self.specs = [self.specs[i] for i in order]
        self.writebacks = tuple((i, position[r]) for i, r in self.writebacks)
        self.outputs = tuple(
            dataclasses.replace(s, index=position[s.index]) if s.kind == "result" else s
            for s in self.outputs
        )


def written_inputs(live) -> list[int]:
    """Inputs whose stand-in no longer holds its own value after tracing.

    Either it has pending IR (an in-place op computed a new value) or its
    value is other device data (``q.copy_(p)``).
    """
    inputs = [i for i, h in enumerate(live.holders) if isinstance(h, torch.Tensor)]
    stand_ins = [live.holders[i] for i in inputs]
    written = []
    for i, t, is_pending in zip(inputs, stand_ins, compat.need_materialization(stand_ins)):
        if is_pending or live.data_read_by([t])[2] != [i]:
            written.append(i)
    return written


def plan_results(
    live,
    traced_outputs: Sequence,
    to_host: Sequence[bool],
    graph_name: str,
    donors: Sequence[int] = (),
    host_values=None,
) -> ResultPlan:
    """Decide the HLO results: write-backs of written inputs first, then the outputs.

    Every donor is written back, even one whose traced value ended up unchanged
    (``v1.copy_(v0); v0.add_(1); v0.copy_(v1)``): XLA invalidates a donated
    buffer whether or not an output takes it over. ``host_values`` (a
    ``analysis.host_part.HostPart``) names the write-backs and outputs computed on the host.
    """
    holders = live.holders
    tensor_inputs = [i for i, h in enumerate(holders) if isinstance(h, torch.Tensor)]
    input_of_id = {compat.tensor_id(holders[i]): i for i in tensor_inputs}
    tensors: list = []
    specs: list = []
    result_of_id: dict[int, int] = {}

    def add(t: torch.Tensor) -> int:
        key = compat.tensor_id(t)
        if key in result_of_id:
            return result_of_id[key]
        forced = not compat.need_materialization([t])[0]
        if forced:
            t = t.view(t.shape)  # pending IR, so torch_xla keeps it; XLA copies
        result_of_id[key] = len(tensors)
        tensors.append(t)
        specs.append(ResultSpec(tuple(t.shape), t.dtype, forced))
        return len(tensors) - 1

    on_host_written = {i for i, _ in host_values.writebacks} if host_values is not None else set()
    on_host_outputs = dict(host_values.outputs) if host_values is not None else {}
    written = sorted((set(written_inputs(live)) | set(donors)) - on_host_written)
    writebacks = tuple((i, add(holders[i])) for i in written)
    outputs = []
    for position, (value, host) in enumerate(zip(traced_outputs, to_host)):
        if position in on_host_outputs:
            outputs.append(OutputSlot("host", on_host_outputs[position]))
        elif not isinstance(value, torch.Tensor):
            outputs.append(OutputSlot("value", value=value))
        elif compat.tensor_id(value) in input_of_id:
            outputs.append(OutputSlot("input", input_of_id[compat.tensor_id(value)]))
        else:
            outputs.append(OutputSlot("result", add(value), to_host=host))
    _check_all_kept(tensors, graph_name)
    return ResultPlan(tensors, specs, writebacks, tuple(outputs))


def _check_all_kept(tensors: Sequence, graph_name: str) -> None:
    """Every planned result must be pending IR with its own tensor id."""
    ids = compat.tensor_ids(tensors)
    pending = compat.need_materialization(tensors)
    if len(set(ids)) != len(ids) or not all(pending):
        raise LoweringMismatchError(
            f"donate_xla: {graph_name}: internal error planning the HLO results (a result is "
            "not pending IR or appears twice); please report this with the graph "
            "(DONATE_XLA_DEBUG=1 writes it to a file)."
        )


def plan_parameters(results: Sequence, live, example_inputs: Sequence, graph_name: str) -> tuple:
    """The source of every HLO parameter, checked against the inputs that feed it."""
    seed_id = compat.seed_info_id()
    tags, values, inputs = live.data_read_by(results)
    params = []
    for position, (tag, value, index) in enumerate(zip(tags, values, inputs)):
        shape, dtype = tuple(value.shape), value.dtype
        if index is not None:
            param = HloParam("input", input_index=index, shape=shape, dtype=dtype)
            _check_input_param(param, position, example_inputs[index], graph_name)
        elif tag == seed_id:
            param = HloParam("seed", shape=shape, dtype=dtype)
        elif compat.is_placeholder(value):
            raise LoweringMismatchError(
                f"donate_xla: {graph_name}: HLO parameter {position} reads a placeholder that "
                "is none of the graph's inputs; please report this with the graph."
            )
        else:
            param = HloParam("constant", constant=value, shape=shape, dtype=dtype)
        params.append(param)
    return tuple(params)


def _check_input_param(param: HloParam, position: int, example, graph_name: str) -> None:
    expected = (tuple(example.shape), example.dtype)
    if (param.shape, param.dtype) != expected:
        raise LoweringMismatchError(
            f"donate_xla: {graph_name}: HLO parameter {position} would receive input "
            f"#{param.input_index} ({_sig(*expected)}) but was built for {_sig(param.shape, param.dtype)}; "
            "please report this with the graph (DONATE_XLA_DEBUG=1 writes it to a file)."
        )


def check_results(returned: Sequence, specs: Sequence[ResultSpec], graph_name: str) -> None:
    """What an execution returned must be the planned results, in order."""
    if len(returned) != len(specs) + 1:  # + the fingerprint
        raise LoweringMismatchError(
            f"donate_xla: {graph_name}: the executable returned {len(returned)} results, "
            f"{len(specs) + 1} were planned; please report this with the graph."
        )
    for k, (t, spec) in enumerate(zip(returned, specs)):
        if (tuple(t.shape), t.dtype) != (spec.shape, spec.dtype):
            raise LoweringMismatchError(
                f"donate_xla: {graph_name}: result {k} came back as {_sig(t.shape, t.dtype)}, "
                f"planned {_sig(spec.shape, spec.dtype)}; please report this with the graph."
            )


def _sig(shape, dtype) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def describe(params: Sequence[HloParam], specs: Sequence[ResultSpec], writebacks, outputs, donors) -> str:
    """The parameter and result tables as text (``Lowered.as_text``)."""
    donor_set = set(donors)
    lines = ["parameters:"]
    for k, p in enumerate(params):
        source = f"input #{p.input_index}" if p.kind == "input" else p.kind
        mark = "  donated" if p.kind == "input" and p.input_index in donor_set else ""
        lines.append(f"  p{k:<3} {source:<12} {_sig(p.shape, p.dtype)}{mark}")
    feeds: dict[int, list[str]] = {}
    for i, r in writebacks:
        feeds.setdefault(r, []).append(f"writes input #{i}")
    for pos, slot in enumerate(outputs):
        if slot.kind == "result":
            feeds.setdefault(slot.index, []).append(f"output {pos}" + (" (to host)" if slot.to_host else ""))
    lines.append("results:")
    for k, spec in enumerate(specs):
        forced = " (copy)" if spec.forced else ""
        lines.append(f"  r{k:<3} {_sig(spec.shape, spec.dtype)}{forced} -> {', '.join(feeds.get(k, ['?']))}")
    described = {"input": "input #{index}", "host": "computed on the host"}
    passthrough = [
        f"output {pos} = " + (described[s.kind].format(index=s.index) if s.kind in described else repr(s.value))
        for pos, s in enumerate(outputs)
        if s.kind != "result"
    ]
    if passthrough:
        lines.append("not computed: " + "; ".join(passthrough))
    return "\n".join(lines)


# -- the donor order ---------------------------------------------------------------------

def donors_first(donor_results: Sequence[int], result_count: int) -> list[int]:
    """A result order (new position -> old index): ``donor_results`` first, in
    the order given, then every other result in its old order."""
    chosen = set(donor_results)
    return list(donor_results) + [i for i in range(result_count) if i not in chosen]


def donors_first_order(plan, donors: Sequence[int], live) -> list[int]:
    """Order the results so that XLA pairs each donor with its own new value.

    XLA's buffer-donor pass (OptimizeInputOutputBufferAlias) pairs donors and
    outputs of equal byte size in order: the k-th donor among the HLO
    parameters with the k-th output. When a parameter and its same-shaped
    momentum are paired the other way round, XLA must copy both to keep the old
    values readable (docs/xla.md, "Measured reasons").
    """
    donor_set = set(donors)
    result_of_input = {i: r for i, r in plan.writebacks if i in donor_set}
    if not result_of_input:
        return list(range(len(plan.tensors)))
    def donor_results_in_parameter_order(order: list[int]) -> list[int]:
        _, _, inputs = live.data_read_by([plan.tensors[i] for i in order])
        return [result_of_input[i] for i in inputs if i in result_of_input]

    order, stable = settle_donor_order(donor_results_in_parameter_order, len(plan.tensors))
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
