"""What torch_xla can lower from an FX graph on placeholders, and the ops it
computes wrongly there.

- **The catalogue** (``lowerable_node``, ``has_xla_lowering``): an op is lowered
  when torch_xla has an XLA or composite kernel for it that, for these
  arguments, does not hand its inputs to torch_xla's CPU fallback (which would
  read a placeholder and crash the process). The rest run on the CPU between
  XLA segments (``fallback.py``) or are refused (``trace.check_graph``).
- **The workarounds**: torch_xla 2.9 lowerings that give a wrong value or the
  wrong dtype for some arguments, each replaced at trace time by torch's own
  decomposition or an equivalent (``with_every_dim``, ``eval_batch_norm_backward``,
  ``dropout_as_torch``, ``copy_into_fresh_tensor``, the BatchNorm dtype fixes,
  ``conform_dtypes``). Each names what torch_xla does instead.
"""
from __future__ import annotations

import torch
import torch.fx

from ..errors import UnsupportedGraphError
from . import compat

_LOWERABLE_KEYS = (
    "XLA",
    "CompositeImplicitAutograd",
    "CompositeExplicitAutograd",
)

# Ops with no XLA kernel that mean the same as one that has one.
EQUIVALENT_OPS = {
    torch.ops.aten.lift_fresh_copy.default: torch.ops.aten.clone.default,
}

_aten = torch.ops.aten

# Ops torch_xla 2.9 has a kernel for that crash the process when traced on a
# placeholder (segmentation fault, or an abort in TransferFromDevice: the kernel
# reads its input's data, or hands it to torch_xla's CPU fallback). They run on
# the CPU, like ops with no kernel. Found by tracing torch's OpInfo samples and
# these ops on placeholders, each in a fresh process.
_CRASH_ON_PLACEHOLDERS = frozenset({
    "aten::rrelu_with_noise",  # F.rrelu in training
    "aten::rrelu_with_noise_functional",
    "aten::cummin",
    "aten::median.dim",
    "aten::nanmedian.dim",
    "aten::frexp.Tensor",
    "aten::linspace.Tensor_Tensor",
    "aten::linspace.Tensor_Scalar",
    "aten::linspace.Scalar_Tensor",
    "aten::logcumsumexp",
    "aten::mvlgamma",
    "aten::huber_loss",
    "aten::huber_loss_backward",
    "aten::_embedding_bag",
    "aten::_embedding_bag_forward_only",
    "aten::_embedding_bag_backward",
    "aten::_conj_physical",  # torch.fft.ihfft*, x.conj_physical() of a complex tensor
    "aten::conj_physical",
    "aten::complex",
    "aten::polar",
    "aten::_batch_norm_with_update_functional",  # a direct call (nn.BatchNorm takes another op)
    "aten::embedding_renorm",  # nn.Embedding(max_norm=...): the weight renormalised in place
    "aten::embedding_renorm_",
})


def _indivisible(input_shape, output_size, dims: int) -> bool:
    """torch_xla lowers adaptive pooling only when each spatial size divides by its output size."""
    pairs = list(zip(list(input_shape)[-dims:], list(output_size)[-dims:]))
    return any(not isinstance(i, int) or not isinstance(o, int) or o == 0 or i % o for i, o in pairs)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


# Ops whose torch_xla 2.9 kernel hands these arguments to its CPU fallback,
# which crashes on a placeholder (aten_xla_type.cpp): op -> (args, kwargs) ->
# whether it would. Their arguments here are fake tensors and Python values.
_FALLS_BACK_WITH = {
    _aten._adaptive_avg_pool2d.default: lambda a, k: _indivisible(a[0].shape, a[1], 2),
    _aten._adaptive_avg_pool3d.default: lambda a, k: _indivisible(a[0].shape, a[1], 3),
    _aten.adaptive_max_pool2d.default: lambda a, k: _indivisible(a[0].shape, a[1], 2),
    _aten._adaptive_avg_pool2d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 2),
    _aten._adaptive_avg_pool3d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 3),
    _aten.adaptive_max_pool2d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 2),
    _aten.addmm.default: lambda a, k: k.get("beta", 1) != 1 or k.get("alpha", 1) != 1,
    _aten.avg_pool2d_backward.default: lambda a, k: bool(a[5] and a[6]) or a[7] is not None,
    _aten.avg_pool3d_backward.default: lambda a, k: bool(a[5] and a[6]) or a[7] is not None,
    _aten.max_pool2d_with_indices.default: lambda a, k: any(d != 1 for d in _listed(_arg(a, k, 4, "dilation", 1))),
    _aten.max_pool3d_with_indices.default: lambda a, k: any(d != 1 for d in _listed(_arg(a, k, 4, "dilation", 1))),
    _aten.scatter.reduce: lambda a, k: _arg(a, k, 4, "reduce") != "add",
    _aten.scatter.value_reduce: lambda a, k: _arg(a, k, 4, "reduce") != "add",
    _aten.scatter_reduce.two: lambda a, k: not (
        _arg(a, k, 4, "reduce") in ("sum", "prod", "amin", "amax") and _arg(a, k, 5, "include_self", True)
    ),
    _aten.linalg_inv_ex.default: lambda a, k: bool(_arg(a, k, 1, "check_errors", False)),
    _aten.index_put.default: lambda a, k: any(_is_mask(i) for i in a[1]),  # x[mask] = v
    _aten.norm.ScalarOpt_dim: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.norm.ScalarOpt_dtype: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.norm.ScalarOpt_dim_dtype: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.roll.default: lambda a, k: a[0].numel() == 0,  # SIGFPE on real empty tensors too
    _aten.cholesky_solve.default: lambda a, k: a[0].numel() == 0 or a[1].numel() == 0,
}


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Control flow (``torch.cond``, ``while_loop``, ``scan``, ``control_flow.map``): torch_xla
# runs it by reading the predicate or iterating over the data, which a placeholder does not
# have ("Check failed: handle->HasValue()", or a fake tensor meeting a real one, while tracing)
_CONTROL_FLOW = frozenset(
    op for op in (
        getattr(getattr(torch.ops, "higher_order", None), name, None)
        for name in ("cond", "while_loop", "scan", "map_impl", "associative_scan")
    ) if op is not None
)


def lowerable_node(node: torch.fx.Node) -> bool:
    """Whether torch_xla can trace ``node`` on placeholders: an op with an XLA (or
    composite) kernel that, for these arguments, does not hand them to its CPU fallback."""
    target = EQUIVALENT_OPS.get(node.target, node.target)
    if target in _CONTROL_FLOW:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if not has_xla_lowering(target):
        return False
    falls_back = _FALLS_BACK_WITH.get(target)
    if falls_back is None:
        return True
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return not falls_back(tuple(args), dict(kwargs))
    except Exception:  # noqa: BLE001 - an unexpected signature: the CPU is the safe side
        return False

# Reductions whose empty dim list means "every dimension" (``x.amax()`` is
# ``amax(x, [])``). torch_xla 2.9 reduces over no dimension instead and returns x
# unchanged, a silently wrong value, in eager mode too. op -> index of the dim argument.
_EMPTY_DIMS_MEAN_ALL = {
    _aten.amax.default: 1,
    _aten.amin.default: 1,
    _aten.sum.dim_IntList: 1,
    _aten.mean.dim: 1,
    _aten.nansum.default: 1,
    _aten.var.dim: 1,
    _aten.var.correction: 1,
    _aten.std.dim: 1,
    _aten.std.correction: 1,
    _aten.var_mean.correction: 1,
    _aten.std_mean.correction: 1,
    _aten.linalg_vector_norm.default: 2,
}


def with_every_dim(target, args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` with an empty dim list of a reduction (given, or
    ``amax``/``amin``'s default) replaced by every dimension of its input, which
    is what the empty list means; anything else unchanged."""
    position = _EMPTY_DIMS_MEAN_ALL.get(target)
    if position is None:
        return args, kwargs
    if len(args) > position:
        dims = args[position]
    else:
        default = target._schema.arguments[position].default_value
        dims = kwargs.get("dim", default)
    if not isinstance(dims, (list, tuple)) or len(dims) > 0:
        return args, kwargs
    every = list(range(args[0].dim()))
    if len(args) > position:
        return args[:position] + (every,) + args[position + 1:], kwargs
    return args, {**kwargs, "dim": every}


def batch_norm_as_torch(target, args: tuple, out):
    """``out`` of a BatchNorm op, with what torch defines where torch_xla 2.9
    computes something else; anything else unchanged.

    - ``_native_batch_norm_legit_functional`` in training: the new running
      variance takes the batch's *unbiased* variance (torch_xla: the biased one,
      in eager mode too: a running variance off by a factor (n-1)/n per update).
    - ``_native_batch_norm_legit_no_training``: the saved mean and inverse std are
      the running mean and ``rsqrt(running_var + eps)``, in the computation dtype,
      as torch defines them off the CPU (torch_xla: empty tensors). aot_autograd's
      graph saves these ``[C]`` values for the backward of an eval-mode BatchNorm
      with trainable parameters, so empty ones would not fit the backward's
      inputs; that backward runs torch's decomposition (``eval_batch_norm_backward``).
    """
    if target is _aten._native_batch_norm_legit_functional.default and len(args) >= 8 and args[5]:
        x, running_var, momentum = args[0], args[4], args[6]
        var = x.to(_computation_dtype(x.dtype)).var([d for d in range(x.dim()) if d != 1], correction=1)
        new_running_var = (running_var * (1 - momentum) + var * momentum).to(running_var.dtype)
        return (*out[:4], new_running_var)
    if target is _aten._native_batch_norm_legit_no_training.default and len(args) >= 7:
        output, save_mean, _ = out
        if save_mean.numel() != 0:
            return out
        running_mean, running_var, eps = args[3], args[4], args[6]
        dtype = _computation_dtype(output.dtype)
        return output, running_mean.to(dtype), torch.rsqrt(running_var.to(dtype) + eps)
    return out


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def batch_norm_backward_args(target, args: tuple) -> tuple:
    """``native_batch_norm_backward``'s tensor arguments in one floating dtype
    when they mix two; anything else unchanged.

    Under autocast a bf16/fp16 input comes with float32 saved statistics (torch
    keeps them in float32), and XLA's BatchNormGrad takes one element type (the
    HLO verifier refused the mix). Everything goes to float32, the dtype torch
    computes such a backward in; the results are cast back to the dtypes torch
    declares (``conform_dtypes``).
    """
    if target is not _aten.native_batch_norm_backward.default:
        return args
    floating = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if len(floating) < 2:
        return args
    return tuple(
        a.to(_computation_dtype(a.dtype)) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )


def conform_dtypes(node: torch.fx.Node, value):
    """``value`` (a node's traced result) with each tensor in the dtype torch
    declares for it (``node.meta["val"]``), where torch_xla's lowering gives
    another; anything else unchanged.

    torch_xla returns BatchNorm's saved statistics in a bf16 input's dtype where
    torch says float32, and ``native_dropout``'s mask says bool but is float32
    underneath (the executable returned a float32 buffer where a bool one was
    planned); the graph's other ops, the next graph's inputs and the user's
    outputs all assume torch's dtypes.
    """
    expected = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return _conformed(value, expected)
    if isinstance(value, (tuple, list)) and isinstance(expected, (tuple, list)) and len(expected) == len(value):
        conformed = [_conformed(v, e) for v, e in zip(value, expected)]
        if any(c is not v for c, v in zip(conformed, value)):
            return type(value)(conformed)
    return value


def _conformed(value, expected):
    if not isinstance(value, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return value
    if value.dtype != expected.dtype:
        return value.to(expected.dtype)
    if value.dtype == torch.bool and compat.stores_as_pred(value) is False:
        # says bool, is another XLA type underneath (``native_dropout``'s mask):
        # ``.to(bool)`` would change nothing, a comparison gives a real pred
        return value != 0
    return value


def eval_batch_norm_backward(target, args: tuple, kwargs: dict):
    """torch's decomposition of ``native_batch_norm_backward`` when ``train`` is
    False, else None.

    torch_xla 2.9 ignores ``train``: XLA's BatchNormGrad always differentiates
    through the batch's statistics, a silently wrong input gradient for an
    eval-mode BatchNorm (eager torch_xla and openxla fail before that, on the
    empty saved statistics). The decomposition uses the running statistics.
    """
    if target is not _aten.native_batch_norm_backward.default:
        return None
    train = args[7] if len(args) > 7 else kwargs.get("train", True)
    if train:
        return None
    return _as_decomposed(
        target, args, kwargs,
        "donate_xla: an eval-mode BatchNorm's backward needs torch's decomposition of "
        "native_batch_norm_backward, which this torch lacks (torch_xla's own computes a "
        "wrong gradient). Keep the BatchNorm in training mode or freeze its parameters.",
    )


def dropout_as_torch(target, args: tuple, kwargs: dict):
    """torch's decomposition of ``native_dropout`` (``rand_like(x) > p``, kept
    values scaled by ``1 / (1 - p)``), else None.

    torch_xla 2.9's lowering draws the kept positions with probability ``1 - p``
    but divides them by ``p``: every dropout with ``p != 0.5`` in a graph from
    aot_autograd gave silently wrong values (``p=0.1``: kept values times 10
    instead of 1.11). Eager torch_xla does not reach that lowering (its
    ``F.dropout`` is a composite of ``bernoulli_``), openxla does.
    """
    if target is not _aten.native_dropout.default:
        return None
    return _as_decomposed(
        target, args, kwargs,
        "donate_xla: dropout needs torch's decomposition of native_dropout, which this "
        "torch lacks (torch_xla's own lowering scales the kept values by 1/p instead of "
        "1/(1-p)). Use torch 2.9, or move the dropout out of the compiled region.",
    )


def _as_decomposed(target, args: tuple, kwargs: dict, without_it: str):
    """``target`` run as torch's decomposition; ``without_it`` is the refusal where torch
    has none (torch_xla's own lowering would be wrong)."""
    decomposition = compat.decomposition(target)
    if decomposition is None:
        raise UnsupportedGraphError(without_it)
    return decomposition(*args, **kwargs)


def copy_into_fresh_tensor(target, args: tuple, kwargs: dict):
    """``aten.copy(self, src)`` as ``src`` copied into a new tensor shaped like
    ``self``, else None.

    torch_xla 2.9's kernel of the functional ``aten.copy`` writes ``src`` into
    ``self`` as well as returning it. aot_autograd's graphs use it for every
    in-place copy of a functionalised input (``buffer.copy_(x)``), so a later
    reader of ``self`` (a value saved for the backward, a second copy of the
    same buffer) read the new value: a silently wrong gradient (aot_eager on
    XLA tensors computes the same wrong value).
    """
    if target is not _aten.copy.default:
        return None
    self_, src = args[0], args[1]
    non_blocking = _arg(args, kwargs, 2, "non_blocking", False)
    return torch.empty_like(self_).copy_(src, non_blocking=non_blocking)


HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default: ".item() / a Python number read",
}


def has_xla_lowering(op: torch._ops.OpOverload) -> bool:
    """False for ops (of any namespace) that torch_xla would run through its CPU fallback.

    The fallback copies inputs to the host, which a placeholder cannot do (it
    crashes the process), so such ops are rejected before they run. Custom ops
    count when they have an XLA kernel or a composite (Python) one, which then
    runs on placeholders like any other code.
    """
    name = op.name()
    if name in _CRASH_ON_PLACEHOLDERS:
        return False
    return any(compat.has_kernel_for_dispatch_key(name, k) for k in _LOWERABLE_KEYS)
