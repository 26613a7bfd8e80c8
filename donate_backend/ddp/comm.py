"""The communication hook that owns the all-reduce of every DDP bucket.

It replaces DDP's default all-reduce with the same arithmetic (scale the flat
bucket by 1/world_size, then one in-place SUM all-reduce), and on the way it
learns the bucket's slots for the compiled backward to write into.

DDP's reducer still decides when a bucket is ready (after its last gradient,
in bucket order, across however many compiled graphs wrote it), handles
``no_sync``, unused parameters and bucket rebuilding, and waits for the
futures at the end of the backward, so the communication overlaps the rest of
the backward exactly as in eager DDP. The hook is registered on the reducer
directly (``dist._register_comm_hook``), so ``ddp._comm_hooks`` stays empty.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .state import DDPBucketState


def bucket_allreduce_hook(state: DDPBucketState, bucket) -> torch.futures.Future:
    """Scale, all-reduce in place, return the same buffer (DDP then sees no copy)."""
    state.learn(bucket)
    buffer = bucket.buffer()
    # Eager DDP multiplies by the wrapped scalar 1/world_size while copying into
    # the bucket (``at::mul_out``); multiplying in place gives the same values.
    buffer.mul_(1.0 / state.world_size)
    state.buckets_reduced += 1
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: buffer)


def register(ddp_module, state: DDPBucketState) -> None:
    """Install the hook on the module's reducer once."""
    if state.hook_registered:
        return
    dist._register_comm_hook(ddp_module.reducer, state, bucket_allreduce_hook)
    state.hook_registered = True
