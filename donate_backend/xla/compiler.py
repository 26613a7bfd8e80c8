"""The XLA path's compiler: analysis -> donor set -> lowering -> executable.

Each graph is lowered once per switch setting (``builds.BuildsPerSetting``):
the returned callable picks the build for the switches in force on every
call, so flipping a switch recompiles instead of reusing code built under the
other setting. Under ``DONATE_XLA_BACKWARD_SEGMENTS`` a backward's build is a
``segments.ReleasingRunner`` whose segments are compiled here like any graph.
"""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Optional, Sequence

import torch
import torch_xla

from .. import budget, config, graph_memory, graph_meta, report, torch_compat
from ..analysis import aliasing, mutation
from ..analysis import host_part as host
from ..builds import BuildsPerSetting
from . import compat, fallback, metrics, segments
from . import memory as xla_memory
from . import spmd
from .lower import LoweringRequest, lower
from .dispatch import PerSignatureExecutable
from .runtime import XlaExecutable
from .stitched import StitchedExecutable
from .trace import check_inputs, host_input_bytes, output_nodes

_warned_unusable: set[str] = set()
_warned_no_donation: set[str] = set()


def saved_bytes(gm, num_user_outputs: Optional[int]) -> Optional[int]:
    """A forward graph's bytes saved for backward (outputs past the user's); else None."""
    if num_user_outputs is None:
        return None
    total = 0
    for node in output_nodes(gm)[num_user_outputs:]:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            if is_symbolic([val]):
                return None
            total += val.numel() * val.element_size()
    return total


def _num_user_outputs(ctx) -> Optional[int]:
    """For forward graphs: outputs at or past this index are saved for backward. Only
    inside aot_autograd's compile (``compile_graph`` reads it once there)."""
    if ctx.kind != "forward" or ctx.segment is not None:
        return None
    return torch_compat.forward_output_count()


def _role(roles: Sequence[str], num_inputs: int, index: int, kind: str) -> str:
    if kind == "backward":
        return "other"
    if len(roles) == num_inputs:
        return roles[index]
    return "other"


@dataclasses.dataclass(frozen=True)
class DonorChoice:
    donors: list  # overwritten inputs to donate (each gets its new value written back)
    requested: list  # inputs the user asked to donate that the graph does not overwrite
    exclusions: list  # report.InputExclusion for every candidate not donated
    # inputs that could be donated if asked at run time (torch_xla's per-buffer flag,
    # ``_set_buffer_donation``): not overwritten, and nothing returns or saves them
    requestable: tuple = ()


def _requested_donors(ctx) -> tuple:
    if ctx.kind == "backward" or ctx.captured is None:
        return ()
    return tuple(ctx.captured.requested_donors)


def choose_donors(gm, example_inputs, ctx, roles, host_inputs: Sequence[int],
                  num_user_outputs: Optional[int]) -> DonorChoice:
    """Split the overwritten (and the requested) inputs into donors and exclusions.
    ``host_inputs``: the indices of host (CPU) tensors (``check_inputs``), never donated;
    ``num_user_outputs``: a forward's outputs past this index are saved for its backward."""
    candidates = mutation.mutated_input_indices(gm.graph)
    requested = [i for i in _requested_donors(ctx) if i < len(example_inputs) and i not in candidates]
    host_scalars = set(host_inputs)
    shared = aliasing.shared_storage_partner(example_inputs)
    reaching = aliasing.inputs_reaching_outputs(gm.graph)
    returned = aliasing.inputs_returned_as_is(gm.graph)

    def unsafe(i: int, overwritten: bool) -> Optional[str]:
        if i in host_scalars:
            return aliasing.HOST_SCALAR
        if example_inputs[i].dim() == 0:
            return aliasing.DEVICE_SCALAR
        if i in shared:
            return shared[i]
        if i in reaching:
            return aliasing.classify_output_use(reaching[i], num_user_outputs)
        if not overwritten and i in returned:  # its old buffer is an output
            return aliasing.classify_output_use(returned[i], num_user_outputs)
        return None

    reasons: dict[int, str] = {}
    for i in candidates + requested:
        reason = unsafe(i, i in candidates)
        if reason is not None:
            reasons[i] = reason
    donors = [i for i in candidates if i not in reasons]
    metas = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in output_nodes(gm)]
    if not is_symbolic(metas):  # with dynamic shapes the output shapes are symbolic: no check
        metas += [example_inputs[i] for i in candidates]  # the written-back new values
        for i in aliasing.outputs_without_slot(donors, example_inputs, metas):
            reasons[i] = aliasing.NO_MATCHING_OUTPUT
    donors = [i for i in donors if i not in reasons]
    exclusions = [
        report.InputExclusion(i, _role(roles, len(example_inputs), i, ctx.kind), reason)
        for i, reason in sorted(reasons.items())
    ]
    _warn_unusable(ctx.name, exclusions)
    requestable = tuple(
        i for i, t in enumerate(example_inputs)
        if isinstance(t, torch.Tensor) and i not in candidates and i not in requested and unsafe(i, False) is None
    )
    return DonorChoice(donors, [i for i in requested if i not in reasons], exclusions, requestable)


def _torch_xla_donates() -> bool:
    """False (with a warning, once) where torch_xla's settings rule donation out."""
    reason = compat.donation_turned_off()
    if reason is not None and reason not in _warned_no_donation:
        _warned_no_donation.add(reason)
        warnings.warn(
            f"donate_xla: {reason}; graphs are compiled without donating their inputs (values are "
            "unaffected, memory is not saved). Unset it to donate.",
            stacklevel=3,
        )
    return reason is None


def _warn_unusable(graph_name: str, exclusions) -> None:
    unusable = [e.index for e in exclusions if e.reason == aliasing.NO_MATCHING_OUTPUT]
    if unusable and graph_name not in _warned_unusable:
        _warned_unusable.add(graph_name)
        warnings.warn(
            f"donate_xla: {graph_name}: some overwritten inputs could not be donated because "
            f"no output can reuse their buffers: {unusable}",
            stacklevel=2,
        )


def _donation_record(example_inputs, donors, roles, kind, shardings: tuple = (), requested=frozenset()) -> list:
    """One ``InputDonation`` per donor; ``shardings``: the spec per input (SPMD)."""
    records = []
    for i in donors:
        t = example_inputs[i]
        records.append(
            report.InputDonation(
                index=i,
                role=_role(roles, len(example_inputs), i, kind),
                shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
                nbytes=t.numel() * t.element_size(),
                sharding=(shardings[i] or "") if shardings else "",
                requested=i in requested,
            )
        )
    return records


class CompiledGraph:
    """The boxed callable aot_autograd gets: the ``XlaExecutable`` built for the
    switches in force."""

    def __init__(self, builds: BuildsPerSetting, graph: torch.fx.GraphModule):
        # An instance attribute: dynamo's disable() wrapper copies __dict__ only.
        self._boxed_call = True
        self._builds = builds
        self._graph = graph

    def executable(self) -> XlaExecutable:
        return self._builds.current()

    def __call__(self, args):
        if compat.traced_call(args):
            # traced, not run (torch_xla's scan traces its body with aot_function on fake
            # tensors): the graph's own ops, recorded by whoever traces, as aot_eager would
            return self._graph(*args)
        # under torch_xla's eager mode too, the call's own IR (copies, write-backs, a
        # stitched step) stays lazy: run op by op, a clone would share its source's buffer
        with compat.lazy_mode():
            return self._builds.current()(args)


def is_symbolic(example_inputs: Sequence) -> bool:
    """Whether dynamo traced the graph with dynamic shapes (SymInt inputs or sizes)."""
    for value in example_inputs:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def concrete_examples(example_inputs: Sequence, args: Sequence) -> list:
    """The graph's inputs as this call has them: real tensors (for shapes and
    dtypes) and plain ints for the symbolic sizes."""
    return [int(a) if isinstance(e, torch.SymInt) else a for e, a in zip(example_inputs, args)]


def _split_backward(gm, ctx, settings: config.Settings, symbolic: bool) -> Optional[segments.SplitBackward]:
    """The backward split into segments (``DONATE_XLA_BACKWARD_SEGMENTS``), or None.

    Not for a segment itself, dynamic shapes (one executable per signature),
    SPMD (gradient shardings are pinned per whole backward) or stitched steps
    (XLA schedules the whole step as one executable there).
    """
    if ctx.kind != "backward" or ctx.segment is not None:
        return None
    if symbolic or compat.is_spmd() or settings.stitch:
        return None
    if settings.backward_segments is None:  # automatic: where it releases enough
        split = segments.split_backward(gm, segments.AUTO_SEGMENTS)
        chosen = gm.meta.get(graph_meta.BACKWARD_SEGMENTS)  # the split a memory limit chose
        return split if split is not None and (chosen or segments.worth_splitting(split)) else None
    if settings.backward_segments < 2:
        return None
    return segments.split_backward(gm, settings.backward_segments)


def _record_split(split: segments.SplitBackward, ctx, num_inputs: int, how: str) -> None:
    report.add(
        report.GraphRecord(
            graph_id=ctx.graph_id, kind=ctx.kind, device="xla", path="xla", num_inputs=num_inputs,
            backward_segments=split.count, released_bytes=split.released_bytes,
            segments_choice=how + split.choice, build_key=config.cache_key(),
        )
    )


def _compiled_parts(top, ctx, skip=frozenset()) -> dict:
    """Each part of a split graph compiled as a graph of its own: name -> (callable,
    whether it returns one value)."""
    return {
        part.name: (compile_graph(part.graph, part.example_inputs, part.ctx), part.single_output)
        for part in fallback.parts(top, ctx, skip)
    }


def compile_graph(gm, example_inputs, ctx):
    """Analyse ``gm`` and compile it for the switches in force (see module docstring).

    With dynamic shapes, or under SPMD, the lowering waits for the first call
    with each new signature (``PerSignatureExecutable``): a static executable
    per concrete shape combination; HLO parameters that carry the real
    inputs' shardings.
    """
    example_inputs = list(example_inputs)
    mutation.strip_donation_requests(gm)  # read at dynamo level (xla.capture)
    around_cpu_ops = fallback.split_at_fallbacks(gm)
    if around_cpu_ops is not None:  # ops torch_xla cannot lower run on the CPU between XLA segments
        report.add(
            report.GraphRecord(
                graph_id=ctx.graph_id, kind=ctx.kind, device="cpu", path="xla",
                num_inputs=len(example_inputs), fallback_ops=around_cpu_ops.fallback_ops,
            )
        )
        return fallback.runner(around_cpu_ops, _compiled_parts(around_cpu_ops.top, ctx, around_cpu_ops.fallback_names), torch_xla.device())
    graph = _XlaGraph(gm, example_inputs, ctx)
    executable = CompiledGraph(BuildsPerSetting(graph.build), gm)
    executable.executable()  # compile now (dynamic shapes, SPMD: at the first call), under the switches in force
    return executable


class _XlaGraph:
    """One aot graph on the XLA path: what is read once, inside aot_autograd's compile, and
    the build for each switch setting (``build``: an executable, an executable per input
    signature, or a backward's segments)."""

    def __init__(self, gm, example_inputs: list, ctx) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        self.ctx = ctx
        self.roles = tuple(ctx.input_roles)
        self.symbolic = is_symbolic(example_inputs)
        # the one check: devices do not change per signature
        self.host_inputs = tuple(check_inputs(example_inputs, ctx.name))
        self.planning = budget.plan_phase(gm)  # a memory limit's choice: counted once, in the first build's record
        # aot_autograd increments the versions of inputs a forward or inference graph mutates
        # before each call; its backward increments nothing. Read here, inside aot_autograd's
        # compile: a build for other settings (a step stitched once it has run) comes later,
        # outside it, and without this no record would vouch for a donor (nothing donated).
        self.bumped = frozenset() if ctx.kind == "backward" else compat.aot_version_bumped_inputs()
        # Likewise which outputs are the caller's: a later build without it took the saved
        # activations for the caller's outputs (its plan dropped them as outputs let go).
        self.user_outputs = _num_user_outputs(ctx)

    def build(self, settings: config.Settings):
        ctx = self.ctx
        split = _split_backward(self.gm, ctx, settings, self.symbolic)
        if split is not None:
            how = "backward_segments setting: " if settings.backward_segments is not None else (
                "chosen to fit memory_limit: " if self.gm.meta.get(graph_meta.BACKWARD_SEGMENTS)
                else "chosen automatically: "
            )
            _record_split(split, ctx, len(self.example_inputs), how)
            return segments.ReleasingRunner(split, _compiled_parts(split.top, ctx))
        if self.symbolic or compat.is_spmd():
            return PerSignatureExecutable(
                ctx.name,
                lambda args, device_args: self.executable_for(settings, args, device_args),
                by_shape=self.symbolic,
                by_sharding=compat.is_spmd(),
                context=self._leaf_shardings if compat.is_spmd() and ctx.kind == "backward" else None,
            )
        return self.executable_for(settings)

    def _leaf_shardings(self) -> tuple:
        """A backward's gradients take their leaves' shardings."""
        count = len(output_nodes(self.gm))
        return spmd.leaf_signature(spmd.gradient_leaves(self.ctx.graph_id, count))

    def executable_for(self, settings: config.Settings, args=None, device_args=None):
        """Donors, lowering, prediction and record of one build (one signature)."""
        analysed = time.perf_counter()
        ctx, gm = self.ctx, self.gm
        examples = concrete_examples(self.example_inputs, args) if self.symbolic else self.example_inputs
        real_inputs = device_args if compat.is_spmd() else None
        choice = choose_donors(gm, examples, ctx, self.roles, self.host_inputs, self.user_outputs)
        stitch = bool(settings.stitch) and real_inputs is None and not self.symbolic
        donation = settings.donation and _torch_xla_donates()
        on_host = host.host_part(gm, list(self.host_inputs))
        request = self._request(examples, choice, real_inputs, donation, stitch, on_host)
        start, before = time.perf_counter(), metrics.transfer_snapshot()
        lowered = lower(request, real_inputs)
        if stitch and not lowered.params:  # torch_xla's user computations need an operand:
            stitch = False  # a graph that reads nothing (it makes constants) runs on its own
            lowered = lower(dataclasses.replace(request, stitch=False), real_inputs)
        transfers = metrics.transfer_snapshot().minus(before)
        predicted_at = time.perf_counter()
        predicted = xla_memory.predict_or_none(
            gm, ctx.name, ctx.kind, donors=lowered.donors if not stitch else (choice.donors if donation else ()),
            forward_returns=self.user_outputs, kept_inputs=gm.meta.get(graph_meta.KEPT_INPUTS, ()),
            passed_outputs=graph_memory.passed_outputs(gm.graph, ctx.kind, self.roles),
        )
        phases = self.planning + (("donors", start - analysed),) + lowered.phases + (
            ("memory prediction", time.perf_counter() - predicted_at),
        )
        self.planning = ()
        record = self._record(examples, choice, lowered, predicted, phases, transfers, real_inputs,
                              request.requested_donors, donation, stitch)
        input_roles = [_role(self.roles, len(examples), i, ctx.kind) for i in range(len(examples))]
        on_call = functools.partial(xla_memory.note_call, record, input_roles, forward_returns=self.user_outputs)
        if stitch:
            return StitchedExecutable(
                ctx.name, lowered, host_values=on_host,
                donors=choice.donors if donation else (), version_bumped=self.bumped, on_call=on_call,
            )
        return XlaExecutable(
            ctx.name, lowered, host_values=on_host, version_bumped=self.bumped,
            record_outputs=ctx.kind == "inference", requested=frozenset(request.requested_donors),
            requestable=choice.requestable if donation and real_inputs is None else (),
            sharded=compat.is_spmd(), on_call=on_call,
        )

    def _request(self, examples, choice: "DonorChoice", real_inputs, donation: bool, stitch: bool,
                 on_host) -> LoweringRequest:
        """What to lower: stitched, the buffers are donated at the sync (StitchedExecutable),
        not in the HLO; under SPMD a backward's gradients pinned to their leaves' shardings."""
        ctx = self.ctx
        active = choice.donors if donation and not stitch else []
        requested = choice.requested if donation and not stitch else []
        pinned = None
        if real_inputs is not None and ctx.kind == "forward":
            spmd.remember_forward_inputs(ctx.graph_id, real_inputs, spmd.input_shardings(real_inputs))
        elif real_inputs is not None and ctx.kind == "backward":
            count = len(output_nodes(self.gm))
            pinned = spmd.gradient_shardings(ctx.graph_id, count, spmd.gradient_leaves(ctx.graph_id, count))
        return LoweringRequest(
            self.gm, tuple(examples), ctx.name,
            donors=tuple(active), requested_donors=tuple(sorted(requested)),
            sharded=real_inputs is not None, output_shardings=pinned, host_values=on_host, stitch=stitch,
            host_inputs=self.host_inputs,
        )

    def _record(self, examples, choice, lowered, predicted, phases, transfers, real_inputs, requested,
                donation: bool, stitch: bool) -> report.GraphRecord:
        ctx, gm = self.ctx, self.gm
        input_roles = [_role(self.roles, len(examples), i, ctx.kind) for i in range(len(examples))]
        return report.add(
            report.GraphRecord(
                graph_id=ctx.graph_id,
                kind=ctx.kind,
                device="xla",
                path="xla",
                num_inputs=len(examples),
                compile_seconds=sum(s for _, s in phases),
                transfers_count=transfers.transfer_count,
                transfers_bytes=int(transfers.outbound_bytes),
                constants_uploaded=lowered.constants_uploaded,
                donated=_donation_record(
                    examples, lowered.donors, self.roles, ctx.kind,
                    spmd.sharding_signature(real_inputs) if real_inputs is not None else (),
                    requested=set(requested),
                ),
                excluded=list(choice.exclusions),
                donation_enabled=donation,
                stitched=stitch,
                overwritten_roles=tuple(sorted({input_roles[i] for i, _ in lowered.writebacks})),
                saved_bytes=saved_bytes(gm, self.user_outputs),
                recompute_gated=lowered.traced.recompute_gated if lowered.traced is not None else 0,
                updates_ordered=lowered.traced.updates_ordered if lowered.traced is not None else 0,
                host_input_bytes=host_input_bytes(examples),
                input_shapes=tuple(tuple(t.shape) for t in examples if isinstance(t, torch.Tensor))
                if self.symbolic else None,
                lowered=lowered,
                budget_choice=gm.meta.get(graph_meta.BUDGET_CHOICE),
                planned_peak=gm.meta.get(graph_meta.PLANNED_PEAK),
                memory=predicted,
                estimator=xla_memory,
                phases=phases,
                step_choice=ctx.choice,
                build_key=config.cache_key(),
            )
        )
