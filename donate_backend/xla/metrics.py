"""Host-to-device transfer accounting from torch_xla's metrics.

The ``openxla`` backend clears counters while it compiles, so deltas are taken
from metrics (cumulative samples), and from the one counter we need, read
immediately around our own compile.
"""
from __future__ import annotations

import dataclasses

import torch_xla.debug.metrics as met


@dataclasses.dataclass(frozen=True)
class TransferSnapshot:
    transfer_count: int  # TransferToDeviceTime samples
    outbound_bytes: float  # OutboundData total
    ir_value_to_data: int  # IrValueTensorToXlaData counter

    def minus(self, earlier: "TransferSnapshot") -> "TransferSnapshot":
        return TransferSnapshot(
            self.transfer_count - earlier.transfer_count,
            self.outbound_bytes - earlier.outbound_bytes,
            self.ir_value_to_data - earlier.ir_value_to_data,
        )


def transfer_snapshot() -> TransferSnapshot:
    timing = met.metric_data("TransferToDeviceTime")
    outbound = met.metric_data("OutboundData")
    return TransferSnapshot(
        transfer_count=int(timing[0]) if timing else 0,
        outbound_bytes=float(outbound[1]) if outbound else 0.0,
        ir_value_to_data=int(met.counter_value("IrValueTensorToXlaData") or 0),
    )


def alias_count_total() -> tuple[int, float]:
    """(executions recorded, sum of aliased buffers) of InputOutputAliasCount."""
    data = met.metric_data("InputOutputAliasCount")
    if not data:
        return 0, 0.0
    return int(data[0]), float(data[1])


def fallback_ops() -> set[str]:
    return set(met.executed_fallback_ops())
