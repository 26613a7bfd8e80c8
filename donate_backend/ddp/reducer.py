"""Make DDP's reducer keep ``param.grad`` as views of its buckets.

With ``gradient_as_bucket_view=False`` the reducer asserts that a gradient is
*not* a view of its bucket, so gradients written into bucket slots would trip
it. The rewrite is on by default whatever the user passed, so for such a
module we rebuild the reducer with ``gradient_as_bucket_view=True``, the way
``DistributedDataParallel.__setstate__`` builds one. The old reducer and its
buckets are freed; bucket order and size caps are the same.
"""
from __future__ import annotations


def ensure_bucket_view(ddp_module) -> bool:
    """Switch the module to bucket views; True if the reducer was rebuilt."""
    if ddp_module.gradient_as_bucket_view:
        return False
    ddp_module.gradient_as_bucket_view = True
    parameters, expect_sparse_gradient = ddp_module._build_params_for_reducer()
    param_to_name_mapping = ddp_module._build_debug_param_to_name_mapping(parameters)
    ddp_module._ddp_init_helper(
        parameters, expect_sparse_gradient, param_to_name_mapping, ddp_module.static_graph
    )
    # The new reducer rebuilds its buckets after its first backward; the flag
    # tells DDPBucketState when learned slots go stale.
    ddp_module._has_rebuilt_buckets = False
    return True
