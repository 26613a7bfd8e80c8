"""XLA path: abstract lowering with automatic buffer donation (needs torch_xla)."""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

from .. import budget, torch_compat
from ..analysis.aliasing import overlapping_inputs_written
from ..analysis.mutation import donation_requests
from ..errors import UnsupportedGraphError
from . import compat, update_order
from .compiler import compile_graph
from .rewrite import rewrite_for_xla
from .sharding import MeshDescription, describe_mesh, mark_sharding

log = logging.getLogger("donate_xla")


def aot_options() -> dict:
    """Use the min-cut partitioner, which saves a parameter rather than a view of it.

    The default partitioner saves ``t(weight)`` for backward. An XLA graph
    output is always a buffer of its own, so every saved transpose was a full
    copy of its weight, held from forward to backward (docs/xla.md, "Measured
    reasons"). Min-cut recomputes such views in backward instead.
    """
    min_cut_rematerialization_partition = torch_compat.min_cut_partition()
    if min_cut_rematerialization_partition is None:
        log.warning(
            "donate_xla: torch has no min-cut partitioner here; the XLA forward will save "
            "transposed weights for backward (more memory, same results)"
        )
        return {}
    from .memory import predict_step

    partition_fn = functools.partial(
        budget.partition, min_cut_rematerialization_partition, fit=True, predict_step=predict_step
    )
    return {"partition_fn": functools.partial(_recording_input_grads, partition_fn)}


def _recording_input_grads(partition_fn, joint, *args, **kwargs):
    """``partition_fn``, then which backward inputs are forward inputs and where their
    gradients are (``update_order.record_input_grads``: a stitched step orders each
    parameter's reads before its update with it)."""
    fw_module, bw_module = partition_fn(joint, *args, **kwargs)
    update_order.record_input_grads(fw_module, bw_module)
    return fw_module, bw_module


def check_dynamo_graph(gm, example_inputs, graph_id: int) -> None:
    """Refuse graphs that torch/torch_xla would compute wrongly, before tracing them.

    Writing to one of two overlapping views of a tensor needs aot_autograd's
    synthetic bases, which give wrong values for XLA tensors on torch 2.9 /
    torch_xla 2.9 (``aot_eager`` included), so it is an error rather than a
    silently wrong result.

    Without torch_xla's functionalization (XLA_DISABLE_FUNCTIONALIZATION=1) a
    view taken before a call does not follow its base's new value, a lazy clone
    taken before a donating call lost its value, and reads failed with "Check
    failed: handle->HasValue()" (openxla computes wrong values there): refused.
    """
    switch = compat.functionalization_disabled()
    if switch is not None:
        raise UnsupportedGraphError(
            f"graph {graph_id}: donate_xla needs torch_xla's functionalization, which {switch} "
            "turns off: views, clones and copies of the graph's inputs would read wrong or deleted "
            "buffers. Unset XLA_DISABLE_FUNCTIONALIZATION (it is a torch_xla debugging switch)."
        )
    for first, second in overlapping_inputs_written(gm):
        raise UnsupportedGraphError(
            f"graph {graph_id}: inputs #{first} and #{second} are views of one XLA tensor and "
            "the graph writes to them in place. aot_autograd cannot handle that correctly for "
            "XLA tensors (torch 2.9 / torch_xla 2.9). Pass the base tensor and slice it inside "
            "the compiled function, or .clone() one of the views before the call."
        )


def prepare_dynamo_graph(gm) -> None:
    """Rewrite, in place, the calls aot_autograd cannot trace for XLA tensors (``xla/rewrite.py``)."""
    count = rewrite_for_xla(gm)
    if count:
        log.debug("donate_xla: %d call(s) rewritten before aot_autograd (xla/rewrite.py)", count)


@dataclasses.dataclass(frozen=True)
class XlaCapture:
    """What the XLA compilers learn from dynamo's graph."""

    requested_donors: tuple = ()  # inputs the user asked to donate (dynamo_set_buffer_donor_)


def capture(gm, example_inputs) -> Optional[XlaCapture]:
    """Dynamo-level facts for the compilers: explicit donation requests."""
    requested = donation_requests(gm)
    return XlaCapture(tuple(requested)) if requested else None


__all__ = [
    "MeshDescription", "aot_options", "capture", "check_dynamo_graph", "compile_graph", "describe_mesh", "mark_sharding",
    "prepare_dynamo_graph",
]
