"""The communication hook that owns the all-reduce of every DDP bucket.

It replaces DDP's default all-reduce with the same arithmetic (scale the flat
bucket by 1/world_size, then one in-place SUM all-reduce), and on the way it
learns the bucket's slots for the compiled backward to write into.

DDP's reducer still decides when a bucket is ready (after its last gradient,
in bucket order, across however many compiled graphs wrote it), handles
``no_sync``, unused parameters and bucket rebuilding, and waits for the
futures at the end of the backward, so the communication overlaps the rest of
the backward exactly as in eager DDP. The hook is registered on the reducer
directly (``compat.register_comm_hook``), so ``ddp._comm_hooks`` stays empty;
it goes away with the reducer when ``integration`` rebuilds it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import compat
from .state import DDPBucketState


def bucket_allreduce_hook(state: DDPBucketState, bucket) -> torch.futures.Future:
    """Scale, all-reduce in place, return the same buffer (DDP then sees no copy)."""
    state.learn(bucket)
    buffer = bucket.buffer()
    # Eager DDP multiplies by the wrapped scalar 1/world_size while copying into
    # the bucket (``at::mul_out``); multiplying in place gives the same values.
    buffer.mul_(1.0 / state.world_size)
    state.counts.buckets_reduced += 1
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: buffer)


def register(reducer, state: DDPBucketState) -> bool:
    """Install the hook on ``reducer``; False when this torch cannot."""
    return compat.register_comm_hook(reducer, state, bucket_allreduce_hook)
