"""``donate_backend.mark_sharding``: shard an intermediate inside a compiled function.

torch_xla's ``xs.mark_sharding`` returns an ``XLAShardedTensor`` wrapper that
dynamo cannot trace (torch_xla 2.9 fails with "'XLAShardedTensor' object has
no attribute '_local_tensor'", under ``openxla`` too), and its dynamo-facing
op ``torch.ops.xla.dynamo_mark_sharding`` has no gradient, so in a training
step it silently cuts the backward at the annotation.

``mark_sharding(t, mesh, partition_spec)`` is an op of our own: in the graph
it is an identity whose result carries the sharding (an HLO sharding
annotation, no data moves); its gradient is the incoming gradient with the
same sharding; outside a compiled function it annotates eagerly. The XLA path
also honours ``torch.ops.xla.dynamo_mark_sharding`` when it meets it.
"""
from __future__ import annotations

import ast
from typing import NamedTuple, Sequence

import torch

_LIB = "donate_xla"
_OP_NAME = f"{_LIB}::mark_sharding"


def _op_sharding(device_ids: Sequence[int], mesh_shape: Sequence[int], axis_names: str, partition_spec: str):
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(list(device_ids), tuple(mesh_shape), ast.literal_eval(axis_names))
    return mesh.get_op_sharding(ast.literal_eval(partition_spec))


def annotated(t: torch.Tensor, device_ids, mesh_shape, axis_names: str, partition_spec: str) -> torch.Tensor:
    """An identity of ``t`` (pending IR) whose HLO value carries the sharding."""
    from . import compat

    out = t.view(t.shape)  # an identity view: IR, so the annotation is an HLO op, not a data move
    compat.annotate_sharding(out, _op_sharding(device_ids, mesh_shape, axis_names, partition_spec))
    return out


@torch.library.custom_op(_OP_NAME, mutates_args=())
def _mark_sharding_op(
    t: torch.Tensor, device_ids: list[int], mesh_shape: list[int], axis_names: str, partition_spec: str
) -> torch.Tensor:
    if t.device.type != "xla":
        return t.clone()
    return annotated(t, device_ids, mesh_shape, axis_names, partition_spec)


@_mark_sharding_op.register_fake
def _(t, device_ids, mesh_shape, axis_names, partition_spec):
    return torch.empty_like(t)


def _setup_context(ctx, inputs, output):
    ctx.mesh_args = inputs[1:]


def _backward(ctx, grad):
    return (_mark_sharding_op(grad, *ctx.mesh_args), None, None, None, None)


_mark_sharding_op.register_autograd(_backward, setup_context=_setup_context)

OP = torch.ops.donate_xla.mark_sharding.default


class MeshDescription(NamedTuple):
    """A torch_xla Mesh as plain Python values, which dynamo reads as constants."""

    device_ids: tuple
    mesh_shape: tuple
    axis_names: tuple


def describe_mesh(mesh) -> MeshDescription:
    """``mesh`` (a ``torch_xla.distributed.spmd.Mesh``) for ``mark_sharding`` inside a
    compiled function. Call it outside the function: the Mesh's device ids are a
    numpy array, which dynamo reads element by element, breaking the graph."""
    return MeshDescription(
        tuple(int(d) for d in mesh.device_ids), tuple(int(n) for n in mesh.mesh_shape), tuple(mesh.axis_names)
    )


def mark_sharding(t: torch.Tensor, mesh, partition_spec) -> torch.Tensor:
    """Shard ``t`` (an activation, inside or outside ``torch.compile``) over ``mesh``.

    Returns the sharded tensor (use it in place of ``t``); its gradient gets the
    same sharding. ``mesh`` is a ``torch_xla.distributed.spmd.Mesh`` or, inside
    a compiled function, better its ``describe_mesh(mesh)`` made outside it (a
    Mesh read there breaks the graph at this call); ``partition_spec`` is a
    tuple as for ``xs.mark_sharding``.
    """
    if len(partition_spec) != t.dim():
        raise ValueError(
            f"donate_xla: mark_sharding: partition_spec {partition_spec!r} has {len(partition_spec)} "
            f"entries for a tensor of rank {t.dim()}; give one per dimension (None to replicate it)"
        )
    described = mesh if isinstance(mesh, MeshDescription) else describe_mesh(mesh)
    return _mark_sharding_op(
        t, list(described.device_ids), list(described.mesh_shape), repr(tuple(described.axis_names)),
        repr(tuple(partition_spec)),
    )
