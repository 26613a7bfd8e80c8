"""The XLA path's compiler: analysis -> donor set -> lowering -> executable.

Each graph is lowered once per switch setting (``builds.BuildsPerSetting``):
the returned callable picks the build for the switches in force on every
call, so flipping a switch recompiles instead of reusing code built under the
other setting.
"""
from __future__ import annotations

import time
import warnings
from typing import Optional, Sequence

import torch

from .. import config, report
from ..analysis import aliasing, mutation
from ..builds import BuildsPerSetting
from . import compat, metrics
from . import spmd
from .lower import LoweredGraph, input_shardings, lower, sharding_signature
from .runtime import PerShardingExecutable, XlaExecutable
from .trace import check_inputs, output_nodes

_warned_unusable: set[str] = set()


def _num_user_outputs(kind: str) -> Optional[int]:
    """For forward graphs: outputs at or past this index are saved for backward."""
    if kind != "forward":
        return None
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    return getattr(meta, "num_forward", None)


def _role(roles: Sequence[str], num_inputs: int, index: int, kind: str) -> str:
    if kind == "backward":
        return "other"
    if len(roles) == num_inputs:
        return roles[index]
    return "other"


def choose_donors(gm, example_inputs, ctx, roles) -> tuple[list[int], list]:
    """Split the overwritten inputs into donors and exclusions (with reasons)."""
    candidates = mutation.mutated_input_indices(gm.graph)
    host_scalars = set(check_inputs(example_inputs, ctx.name))
    shared = aliasing.shared_storage_partner(example_inputs)
    reaching = aliasing.inputs_reaching_outputs(gm.graph)
    num_user_outputs = _num_user_outputs(ctx.kind)
    reasons: dict[int, str] = {}
    for i in candidates:
        if i in host_scalars:
            reasons[i] = aliasing.HOST_SCALAR
        elif example_inputs[i].dim() == 0:
            reasons[i] = aliasing.DEVICE_SCALAR
        elif i in shared:
            reasons[i] = shared[i]
        elif i in reaching:
            reasons[i] = aliasing.classify_output_use(reaching[i], num_user_outputs)
    donors = [i for i in candidates if i not in reasons]
    metas = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in output_nodes(gm)]
    metas += [example_inputs[i] for i in candidates]  # the written-back new values
    for i in aliasing.outputs_without_slot(donors, example_inputs, metas):
        reasons[i] = aliasing.NO_MATCHING_OUTPUT
    donors = [i for i in donors if i not in reasons]
    exclusions = [
        report.InputExclusion(i, _role(roles, len(example_inputs), i, ctx.kind), reason)
        for i, reason in sorted(reasons.items())
    ]
    _warn_unusable(ctx.name, exclusions)
    return donors, exclusions


def _warn_unusable(graph_name: str, exclusions) -> None:
    unusable = [e.index for e in exclusions if e.reason == aliasing.NO_MATCHING_OUTPUT]
    if unusable and graph_name not in _warned_unusable:
        _warned_unusable.add(graph_name)
        warnings.warn(
            f"donate_xla: {graph_name}: some overwritten inputs could not be donated because "
            f"no output can reuse their buffers: {unusable}",
            stacklevel=2,
        )


def _donation_record(example_inputs, donors, roles, kind, shardings: tuple = ()) -> list:
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
            )
        )
    return records


class SwitchAwareExecutable:
    """The boxed callable aot_autograd gets: the ``XlaExecutable`` built for the
    switches in force."""

    def __init__(self, builds: BuildsPerSetting):
        # An instance attribute: dynamo's disable() wrapper copies __dict__ only.
        self._boxed_call = True
        self._builds = builds

    def executable(self) -> XlaExecutable:
        return self._builds.current()

    def __call__(self, args):
        return self._builds.current()(args)


def compile_graph(gm, example_inputs, ctx):
    """Analyse ``gm`` and compile it for the switches in force (see module docstring).

    Under SPMD the lowering waits for the first call: the HLO parameters must
    carry the shardings of the real inputs (``PerShardingExecutable``).
    """
    example_inputs = list(example_inputs)
    roles = tuple(getattr(ctx, "input_roles", ()) or ())
    donors, exclusions = choose_donors(gm, example_inputs, ctx, roles)

    def executable_for(settings: config.Settings, real_inputs=None) -> XlaExecutable:
        active = donors if settings.donation else []

        pinned = None
        if real_inputs is not None and ctx.kind == "forward":
            spmd.remember_forward_inputs(ctx.graph_id, real_inputs, input_shardings(real_inputs))
        elif real_inputs is not None and ctx.kind == "backward":
            pinned = spmd.gradient_shardings(ctx.graph_id, len(output_nodes(gm)))

        def relower(donate: bool, device_args=None) -> LoweredGraph:
            return lower(
                gm, example_inputs, active if donate else [], ctx.name,
                real_inputs=device_args if real_inputs is not None else None,
                output_shardings=pinned,
            )

        start, before = time.perf_counter(), metrics.transfer_snapshot()
        lowered = relower(True, real_inputs)
        seconds = time.perf_counter() - start
        transfers = metrics.transfer_snapshot().minus(before)
        report.add(
            report.GraphRecord(
                graph_id=ctx.graph_id,
                kind=ctx.kind,
                device="xla",
                path="xla",
                num_inputs=len(example_inputs),
                compile_seconds=seconds,
                transfers_count=transfers.transfer_count,
                transfers_bytes=int(transfers.outbound_bytes),
                constants_uploaded=lowered.constants_uploaded,
                donated=_donation_record(
                    example_inputs, lowered.donors, roles, ctx.kind,
                    sharding_signature(real_inputs) if real_inputs is not None else (),
                ),
                excluded=list(exclusions),
                donation_enabled=settings.donation,
                lowered=lowered,
            )
        )
        return XlaExecutable(ctx.name, lowered, relower, tags_untrusted=real_inputs is not None)

    def build(settings: config.Settings):
        if compat.is_spmd():
            return PerShardingExecutable(ctx.name, lambda device_args: executable_for(settings, device_args))
        return executable_for(settings)

    executable = SwitchAwareExecutable(BuildsPerSetting(build))
    executable.executable()  # compile now (SPMD: at the first call), under the settings in force
    return executable
