"""The ATen -> JAX lowering table (donate_backend/jax/lowerings.py) against torch eager CPU.

* op by op: the ATen calls torch makes while running OpInfo sample inputs and the
  programs below (forward and backward) are captured with a dispatch mode, then each
  is replayed through its lowering under ``jax.jit`` and compared with what torch
  returned (values, shapes, dtypes); composite ops, which never reach a dispatch
  mode, are called directly;
* graphs: real training steps traced by aot_autograd with ``decompositions()`` and
  run by a small interpreter over the table, against eager torch;
* random ops, refusals, dtype maps, the decomposition table.
"""
from __future__ import annotations

import inspect
import os
import itertools
import math
import operator

import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)  # as the JAX target does: int64/float64 stay 64-bit


def _start_jax_cpu():
    """Start JAX's CPU backend with XLA:CPU's older kernel emitters, which compile the
    hundreds of tiny programs below about three times faster (the values are the same:
    no fast-math either way). XLA reads XLA_FLAGS once, when the backend starts; the
    variable is restored at once so that no subprocess inherits the flag."""
    saved = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{saved or ''} --xla_cpu_use_fusion_emitters=false".strip()
    try:
        jax.devices("cpu")
    finally:
        if saved is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = saved


_start_jax_cpu()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from donate_backend.jax import lowerings as L  # noqa: E402

# prims.fma (which dynamo puts into graphs for addcmul_/addcdiv_ with value=) is
# registered by inductor's prims module, which dynamo imports when it traces
import torch._inductor.inductor_prims  # noqa: E402,F401

aten = torch.ops.aten
prims = torch.ops.prims


@pytest.fixture(autouse=True, scope="module")
def _x64():
    jax.config.update("jax_enable_x64", True)
    yield


# -- conversions ----------------------------------------------------------------------------------

def to_jax(t: torch.Tensor):
    t = t.detach().resolve_conj().resolve_neg()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.contiguous().numpy())


def to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _convertible(t: torch.Tensor) -> bool:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return False
    try:
        L.to_jax_dtype(t.dtype)
    except TypeError:
        return False
    return t.dtype in (torch.bfloat16,) or t.dtype.itemsize <= 16


# -- sample capture -------------------------------------------------------------------------------

MAX_SAMPLES = 4
SAMPLES: dict = {}  # op -> [(args, kwargs, out)]


def _clone(value):
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, value)


def _signature(args, kwargs):
    def one(x):
        return f"{x.dtype}{tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
    return tuple(one(x) for x in pytree.tree_leaves((args, kwargs)))


def _keep(op, args, kwargs, out):
    if L.lowering(op) is None or L.is_random(op):
        return
    tensors = [x for x in pytree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
    if not all(_convertible(t) for t in tensors):
        return
    if any(isinstance(x, torch.Generator) for x in pytree.tree_leaves((args, kwargs))):
        return
    if op in (aten.as_strided.default, aten.as_strided_scatter.default):
        base = args[0]
        if not base.is_contiguous() or base.storage_offset() != 0 \
                or base.untyped_storage().nbytes() != base.numel() * base.element_size():
            return  # the lowering's contract: a contiguous input owning its storage
    if op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default) \
            and args[5] and args[3] is not None:
        return  # in-place running stats: refused (test_in_place_batch_norm_is_refused)
    samples = SAMPLES.setdefault(op, [])
    signature = _signature(args, kwargs)
    if len(samples) >= MAX_SAMPLES or any(s[3] == signature for s in samples):
        return
    samples.append((_clone(args), _clone(kwargs), _clone(out), signature))


class Capture(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        _keep(func, args, kwargs, out)
        return out


RECORD_ERRORS = []  # direct samples torch itself refused (a broken sample, reported by a test)


def record(op, *args, **kwargs):
    """A direct sample: torch's own result of ``op`` (composite ops included)."""
    try:
        out = op(*args, **kwargs)
    except Exception as e:
        RECORD_ERRORS.append(f"{op}: {type(e).__name__}: {e}")
        return
    _keep(op, args, kwargs, out)


def _rand(*shape, dtype=torch.float32, requires_grad=False):
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, requires_grad=requires_grad)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(-5, 6, shape, dtype=dtype)


_OPINFO_FUNCTIONAL = {
    "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
    "nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d", "nn.functional.max_pool2d",
    "nn.functional.max_pool3d", "nn.functional.avg_pool2d", "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.layer_norm", "nn.functional.batch_norm",
    "nn.functional.group_norm", "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.nll_loss", "nn.functional.gelu", "nn.functional.silu", "nn.functional.pad",
    "nn.functional.scaled_dot_product_attention", "nn.functional.elu", "nn.functional.leaky_relu",
    "nn.functional.hardtanh", "nn.functional.softplus", "nn.functional.relu", "softmax",
    "log_softmax", "nn.functional.linear", "nn.functional.mse_loss",
}


def _opinfo_samples():
    from torch.testing._internal.common_methods_invocations import op_db

    packets = {str(op).split(".")[1] for op in L.lowered_ops()}
    for info in op_db:
        base = info.name.split(".")[-1]
        if info.name not in _OPINFO_FUNCTIONAL and base not in packets and (info.aten_name or "") not in packets:
            continue
        supported = info.supported_dtypes("cpu")
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            if dtype not in supported:
                continue
            try:
                # the raw generator: OpInfo.sample_inputs wraps it in an input tracker that
                # inspects the stack for every sample (seconds with many modules loaded)
                samples = list(itertools.islice(info.sample_inputs_func(info, "cpu", dtype, False), 2))
            except Exception:
                continue
            for sample in samples:
                try:
                    with Capture():
                        info.op(sample.input, *sample.args, **sample.kwargs)
                except Exception:
                    pass


def _backward_programs():
    """torch code whose forward and backward reach the table's training ops."""
    def grad_of(fn, *inputs):
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum((o.float() * torch.randn(o.shape)).sum() for o in outs if o.is_floating_point())
        total.backward()

    def leaf(*shape, dtype=torch.float32):
        return _rand(*shape, dtype=dtype, requires_grad=True)

    x4 = leaf(2, 3, 7, 7)
    grad_of(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), x4, leaf(4, 3, 3, 3), leaf(4))
    grad_of(lambda x, w: F.conv2d(x, w, None, padding=2, dilation=2, groups=3), leaf(2, 3, 6, 6), leaf(6, 1, 3, 3))
    grad_of(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
            leaf(1, 4, 5, 5), leaf(4, 3, 3, 3), leaf(6))
    grad_of(lambda x, w: F.conv1d(x, w, stride=2), leaf(2, 3, 9), leaf(5, 3, 4))
    grad_of(lambda x, w: F.conv3d(x, w, padding=1), leaf(1, 2, 4, 4, 4), leaf(3, 2, 3, 3, 3))
    grad_of(lambda x: F.max_pool2d(x, 3, 2, 1), x4)
    grad_of(lambda x: F.max_pool2d(x, 2, ceil_mode=True), x4)
    grad_of(lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0), dilation=(2, 1)), leaf(3, 8, 8))
    grad_of(lambda x: F.max_pool3d(x, 2, 2, 1), leaf(1, 2, 5, 5, 5))
    grad_of(lambda x: F.avg_pool2d(x, 3, 2, 1), x4)
    grad_of(lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), x4)
    grad_of(lambda x: F.avg_pool2d(x, 2, divisor_override=3), x4)
    grad_of(lambda x: F.avg_pool3d(x, 2, 2, 1), leaf(1, 2, 5, 5, 5))
    grad_of(lambda x: F.adaptive_avg_pool2d(x, (3, 2)), x4)
    grad_of(lambda x: F.adaptive_max_pool2d(x, (3, 4)), x4)
    grad_of(lambda x: F.adaptive_max_pool2d(x, 2), leaf(3, 6, 6))
    grad_of(lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), leaf(1, 2, 5, 5, 5))
    grad_of(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), leaf(1, 2, 5, 5, 5))
    grad_of(lambda x, w, b: F.layer_norm(x, (7,), w, b), x4, leaf(7), leaf(7))
    grad_of(lambda x: F.layer_norm(x, (7, 7)), x4)
    grad_of(lambda x, w, b: F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, training=True),
            x4, leaf(3), leaf(3))
    grad_of(lambda x, w, b: F.batch_norm(x, torch.rand(3), torch.rand(3) + 0.5, w, b, training=False),
            x4, leaf(3), leaf(3))
    grad_of(lambda x: F.batch_norm(x, None, None, training=True), leaf(4, 3))
    grad_of(lambda x, w, b: F.group_norm(x, 3, w, b), leaf(2, 6, 4, 4), leaf(6), leaf(6))
    grad_of(lambda w: F.embedding(torch.tensor([[0, 2, 2], [4, 1, 0]]), w, padding_idx=0), leaf(5, 3))
    grad_of(lambda w: F.embedding(torch.tensor([0, 2, 2, 4]), w, scale_grad_by_freq=True), leaf(5, 3))
    grad_of(lambda x: F.log_softmax(x, dim=1), x4)
    grad_of(lambda x: F.softmax(x, dim=-1), x4)
    grad_of(lambda x: F.nll_loss(F.log_softmax(x, 1), torch.tensor([1, 0, 3]), ignore_index=3), leaf(3, 4))
    grad_of(lambda x: F.nll_loss(x, torch.tensor([1, 0, 2]), weight=torch.rand(4), reduction="sum"), leaf(3, 4))
    grad_of(lambda x: F.nll_loss(x, torch.tensor([1, 0, 2]), reduction="none"), leaf(3, 4))
    grad_of(lambda x: F.nll_loss(x, torch.randint(0, 4, (2, 3, 3)), weight=torch.rand(4)), leaf(2, 4, 3, 3))
    grad_of(lambda x: F.cross_entropy(x, torch.tensor([1, 0, 2])), leaf(3, 4))
    for approximate in ("none", "tanh"):
        grad_of(lambda x: F.gelu(x, approximate=approximate), leaf(4, 5))
    grad_of(F.silu, leaf(4, 5))
    grad_of(torch.sigmoid, leaf(4, 5))
    grad_of(torch.tanh, leaf(4, 5))
    grad_of(F.relu, leaf(4, 5))
    grad_of(lambda x: F.leaky_relu(x, 0.2), leaf(4, 5))
    grad_of(lambda x: F.hardtanh(x, -0.5, 0.5), leaf(4, 5))
    grad_of(lambda x: F.elu(x, 0.7), leaf(4, 5))
    grad_of(lambda x: torch.ops.aten.elu(x, 1.0, 1.0, 1.0), leaf(4, 5))
    grad_of(lambda x: F.softplus(x, beta=2, threshold=1), leaf(4, 5))
    grad_of(lambda x: torch.logsumexp(x, dim=1), leaf(4, 5))
    grad_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            leaf(2, 2, 5, 4), leaf(2, 2, 5, 4), leaf(2, 2, 5, 4))
    grad_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
            leaf(1, 2, 3, 4), leaf(1, 2, 6, 4), leaf(1, 2, 6, 5))


def _direct_samples():
    """Ops called directly: composite ops (which never reach a dispatch mode), backward
    ops, overloads eager torch does not pick, prims, functional _foreach_* ops."""
    f, i, b = _rand(3, 4), _rand(3, 4, dtype=torch.int64), _rand(3, 4, dtype=torch.bool)
    i[i == 0] = 3  # a divisor everywhere below
    h = _rand(3, 4, dtype=torch.bfloat16)
    for x in (f, i, h):
        record(aten.add.Scalar, x, 2)
        record(aten.add.Scalar, x, 2.5)
        record(aten.sub.Scalar, x, 1.5, alpha=2)
        record(aten.mul.Scalar, x, 3)
        record(aten.rsub.Scalar, x, 2.5)
        record(aten.rsub.Tensor, x, f, alpha=2)
        record(aten.true_divide.Scalar, x, 3)
        record(aten.true_divide.Tensor, x, i)
        record(aten.div.Scalar_mode, x, -3, rounding_mode="floor")
        record(aten.div.Scalar_mode, x, 2.5, rounding_mode="trunc")
        record(aten.floor_divide.Scalar, x, 3)
        record(aten.fmod.Scalar, x, -2)
        record(aten.remainder.Scalar, x, -2.5)
        record(aten.remainder.Scalar_Tensor, 7, x)
        record(aten.pow.Scalar, 2, x.abs())
        record(aten.pow.Scalar, 0.5, x)
        record(aten.pow.Tensor_Scalar, x, 2)
        record(aten.pow.Tensor_Scalar, x, 3.0)
        record(aten.pow.Tensor_Scalar, x.abs(), 0.5)
        record(aten.pow.Tensor_Scalar, x.float(), -1)
        record(aten.copysign.Scalar, x, -1.0)
        for name in ("eq", "ne", "lt", "le", "gt", "ge"):
            record(getattr(aten, name).Scalar, x, 0.5)
        record(aten.max.other, x, f)
        record(aten.min.other, x, f)
        record(aten.clamp.default, x, -1, 2.5)
        record(aten.clamp.default, x, None, 0)
        record(aten.clamp_min.default, x, 0.5)
        record(aten.clamp_max.default, x, 1)
        record(aten.where.ScalarOther, b, x, 2.5)
        record(aten.where.ScalarSelf, b, 0, x)
        record(aten.where.Scalar, b, 1.5, 2)
        record(aten.square.default, x)
        record(aten.absolute.default, x)
        record(aten.positive.default, x)
        record(aten.isfinite.default, x)
        record(aten.zero.default, x)
        record(aten.var.dim, x.float(), [1], False, True)
        record(aten.count_nonzero.dim_IntList, x, [0])
        record(aten.count_nonzero.default, x)
    record(aten.pow.Tensor_Scalar, b, 2)
    record(aten.square.default, b)
    record(aten.add.Scalar, b, True)
    record(aten.sum.default, b)
    for name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        record(getattr(aten, name).Scalar, i, 6)
        record(getattr(aten, name).Scalar, b, True)
        record(getattr(aten, name).Scalar_Tensor, 5, i)
    for name in ("bitwise_left_shift", "bitwise_right_shift"):
        record(getattr(aten, name).Tensor_Scalar, i, 2)
        record(getattr(aten, name).Scalar_Tensor, 64, i.abs())
    u = torch.randint(0, 255, (5,), dtype=torch.uint8)
    record(aten.add.Scalar, u, 300)
    record(aten.all.default, u)
    record(aten.any.dims, i, [0, 1])
    record(aten.all.dims, i, [1], True)
    record(aten.any.dims, i, [])
    record(aten.lerp.Tensor, f, _rand(3, 4), torch.rand(3, 4))
    record(aten.lerp.Scalar, h, _rand(3, 4, dtype=torch.bfloat16), 0.7)
    record(prims.fma.default, f, _rand(3, 4), _rand(1, 4))
    record(aten.addcmul.default, f, _rand(3, 4), _rand(4), value=0.5)
    record(aten.addcdiv.default, f, _rand(3, 4), torch.rand(4) + 1, value=-2)
    record(aten.masked_fill.Scalar, i, b, 2.7)
    record(aten.masked_fill.Tensor, f, b, torch.tensor(-1.5))
    record(aten.threshold.default, f, 0.1, 20)
    record(aten.nan_to_num.default, torch.tensor([math.nan, math.inf, -math.inf, 1.0]), 0.0, 5.0)
    record(aten.round.decimals, f * 100, decimals=-1)
    record(aten.round.decimals, f, decimals=2)
    record(aten.digamma.default, torch.tensor([0.0, -0.0, 1.5, -2.5]))
    record(aten.complex.default, f, _rand(3, 4))
    c = torch.complex(f, _rand(3, 4))
    record(aten.view_as_real.default, c)
    record(aten.view_as_complex.default, _rand(3, 2))
    record(aten.conj_physical.default, c)
    record(aten.abs.default, c)
    record(aten.sgn.default, c)

    # reductions, scans, sorting
    record(aten.sum.dim_IntList, i, [], dtype=torch.float32)
    record(aten.sum.dim_IntList, h, [0], True)
    record(aten.mean.dim, i, [1], dtype=torch.float64)
    record(aten.mean.dim, h, None)
    record(aten.prod.dim_int, b, 1)
    record(aten.var.correction, f, [0], correction=0, keepdim=True)
    record(aten.var.correction, f, None, correction=4)
    record(aten.var_mean.correction, f, [1], correction=1)
    record(aten.std.correction, h, [1])
    record(aten.cumsum.default, b, 1)
    record(aten.cumsum.default, h, 0)
    record(aten.cumprod.default, i, 1, dtype=torch.float32)
    record(aten.logsumexp.default, i, [1])
    record(aten.logsumexp.default, torch.tensor([[-math.inf, -math.inf], [0.0, -math.inf]]), [1], True)
    record(aten.argmax.default, f, None, True)
    record(aten.argmin.default, i, 1)
    record(aten.max.dim, h, 0, True)
    record(aten.min.default, i)
    record(aten.amax.default, f, [])
    record(aten.sort.stable, torch.tensor([3, 1, 3, 2, 1]), stable=True, descending=True)
    record(aten.sort.default, torch.tensor([[2.0, math.nan, -1.0, 2.0]]), 1, True)
    record(aten.topk.default, _rand(4, 6), 3, 0, False)

    # softmax, matmul
    y = F.softmax(f, 1)
    record(aten._softmax_backward_data.default, _rand(3, 4), y, 1, torch.float32)
    record(aten._log_softmax_backward_data.default, _rand(3, 4), y.log(), 0, torch.float32)
    record(aten._softmax.default, h, -1, False)
    record(aten._log_softmax.default, h, 0, False)
    record(aten.matmul.default, _rand(2, 3, 4), _rand(4, 5))
    record(aten.matmul.default, _rand(4), _rand(2, 4, 3))
    record(aten.mm.default, h, _rand(4, 2, dtype=torch.bfloat16))
    record(aten.mm.default, i, _rand(4, 2, dtype=torch.int64))
    record(aten.addmm.default, _rand(2), f, _rand(4, 2), beta=0.5, alpha=2)
    record(aten.addmm.default, torch.full((3, 2), math.nan), f, _rand(4, 2), beta=0)
    record(aten.baddbmm.default, _rand(2, 3, 5), _rand(2, 3, 4), _rand(2, 4, 5), beta=2)
    record(aten.dot.default, _rand(5), _rand(5))
    record(aten.mv.default, f, _rand(4))
    record(aten.addmv.default, _rand(3), f, _rand(4), alpha=0.5)

    # normalization ops with their functional and eval variants, incl. bfloat16 input
    x = _rand(4, 3, 5, 5)
    w, bias, rm, rv = _rand(3), _rand(3), _rand(3), torch.rand(3) + 0.5
    for xx in (x, x.bfloat16()):
        record(aten._native_batch_norm_legit_functional.default, xx, w, bias, rm, rv, True, 0.1, 1e-5)
        record(aten._native_batch_norm_legit_functional.default, xx, None, None, rm, rv, False, 0.1, 1e-5)
        record(aten._native_batch_norm_legit_no_training.default, xx, w, bias, rm, rv, 0.1, 1e-5)
        record(aten._native_batch_norm_legit.no_stats, xx, w, bias, True, 0.1, 1e-5)
        record(aten.native_batch_norm.default, xx, w, bias, rm, rv, False, 0.1, 1e-5)
        record(aten.native_layer_norm.default, xx, [5, 5], None, None, 1e-5)
        record(aten.native_layer_norm.default, xx, [5], _rand(5), _rand(5), 1e-3)
        record(aten.native_group_norm.default, xx, w, bias, 4, 3, 25, 3, 1e-5)
    record(aten.native_layer_norm.default, x.bfloat16(), [5], _rand(5).bfloat16(), None, 1e-5)
    _, mean, invstd = aten.native_batch_norm(x, w, bias, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    g = _rand(4, 3, 5, 5)
    record(aten.native_batch_norm_backward.default, g, x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True])
    record(aten.native_batch_norm_backward.default, g, x, None, rm, rv, None, None, False, 1e-5,
           [True, False, True])
    v, gain = _rand(6, 4), _rand(6, 1).abs() + 0.5  # weight norm along dim 0 (torch.nn.utils.weight_norm)
    record(aten._weight_norm_interface.default, v, gain, 0)
    _, norms = aten._weight_norm_interface(v, gain, 0)
    record(aten._weight_norm_interface_backward.default, _rand(6, 4), v, gain, norms, 0)
    _, mean, rstd = aten.native_layer_norm(x, [5], w[:1].expand(5).contiguous(), None, 1e-5)
    record(aten.native_layer_norm_backward.default, g, x, [5], mean, rstd, _rand(5), None, [True, True, False])
    _, mean, rstd = aten.native_group_norm(x, None, None, 4, 3, 25, 3, 1e-5)
    record(aten.native_group_norm_backward.default, g, x, mean, rstd, None, 4, 3, 25, 3, [True, False, True])

    # convolution backward with a partial mask, transposed with uneven output padding
    xin, wt = _rand(2, 4, 5, 5), _rand(4, 3, 3, 3)
    out = aten.convolution(xin, wt, None, [2, 2], [1, 1], [1, 1], True, [1, 0], 2)
    record(aten.convolution.default, xin, wt, _rand(6), [2, 2], [1, 1], [1, 1], True, [1, 0], 2)
    record(aten.convolution_backward.default, _rand(*out.shape), xin, wt, [6], [2, 2], [1, 1], [1, 1],
           True, [1, 0], 2, [False, True, True])
    record(aten.convolution.default, xin.bfloat16(), _rand(6, 4, 3, 3).bfloat16(), None, [1, 1], [0, 0],
           [1, 1], False, [0, 0], 1)
    record(aten.convolution.default, _rand(1, 2, 6), _rand(3, 2, 2), None, [1], [3], [1], False, [0], 1)

    # losses, embedding, indexing, scatter
    logp = F.log_softmax(_rand(5, 4), 1)
    target = torch.tensor([0, 3, -100, 1, 3])
    for reduction in (0, 1, 2):
        out, total = aten.nll_loss_forward(logp, target, torch.rand(4), reduction, -100)
        record(aten.nll_loss_forward.default, logp, target, torch.rand(4), reduction, -100)
        record(aten.nll_loss_backward.default, _rand(*out.shape), logp, target, None, reduction, -100, total)
    record(aten.nll_loss_forward.default, F.log_softmax(_rand(4), 0), torch.tensor(2), None, 1, -100)
    record(aten.nll_loss_forward.default, logp, torch.full((5,), -100), None, 1, -100)
    logp2 = F.log_softmax(_rand(2, 4, 3, 3), 1)
    target2 = torch.randint(0, 4, (2, 3, 3))
    out, total = aten.nll_loss2d_forward(logp2, target2, None, 1, 2)
    record(aten.nll_loss2d_forward.default, logp2, target2, None, 1, 2)
    record(aten.nll_loss2d_backward.default, torch.tensor(0.7), logp2, target2, None, 1, 2, total)
    record(aten.embedding_dense_backward.default, _rand(2, 3, 4), torch.tensor([[1, 1, 0], [5, 2, 1]]), 6, 1, True)
    idx = torch.tensor([2, 0, 2])
    record(aten.index.Tensor, _rand(3, 4, 5), [None, torch.tensor([[0, 3]]), torch.tensor([1, 4])])
    record(aten.index.Tensor, _rand(3, 4, 5), [torch.tensor([0, 2]), None, torch.tensor([1, 4])])
    record(aten.index.Tensor, _rand(3, 4), [torch.tensor([True, False, True])])
    record(aten._unsafe_index.Tensor, _rand(3, 4), [idx])
    record(aten.index_put.default, _rand(3, 4), [idx], _rand(4), True)
    record(aten.index_put.default, _rand(3, 4), [None, torch.tensor([1, 3])], torch.tensor(2.0))
    record(aten.index_put.default, _rand(3, 4), [_rand(3, 4, dtype=torch.bool)], torch.tensor(0.5))
    record(aten.index_put.default, _rand(3, 4), [torch.tensor([True, False, True])], _rand(4), True)
    record(aten.index_put.default, i, [torch.tensor([True, False, True])], _rand(2, 4, dtype=torch.int64))
    record(aten._unsafe_index_put.default, _rand(3, 4), [idx, torch.tensor([0, 1, 2])], _rand(3), True)
    record(aten._index_put_impl.default, _rand(3, 4), [idx], _rand(4), True, False)
    record(aten._index_put_impl.default, _rand(3, 4), [torch.tensor([True, False, True])], _rand(4))
    record(aten.index_select.default, _rand(3, 4), 1, torch.tensor([3, 0, 0]))
    record(aten.index_select.default, _rand(3, 4), 0, torch.tensor(1))
    record(aten.gather.default, _rand(4, 5), 1, torch.tensor([[0, 4], [1, 1]]))
    src = _rand(3, 4)
    index = torch.tensor([[0, 1, 2, 0], [1, 2, 0, 1]])
    record(aten.scatter.src, _rand(3, 4), 0, index, src)
    record(aten.scatter.value, i, 1, torch.tensor([[0], [3]]), 7.9)
    record(aten.scatter.reduce, _rand(3, 4), 0, index, src, reduce="multiply")
    record(aten.scatter.value_reduce, _rand(3, 4), 0, index, 2.0, reduce="add")
    record(aten.scatter_add.default, _rand(3, 4), 0, index, src)
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            record(aten.scatter_reduce.two, _rand(3, 4), 0, index, src, reduce, include_self=include_self)
    record(aten.scatter_reduce.two, i, 0, index, src.long(), "mean", include_self=False)
    record(aten.masked_scatter.default, _rand(3, 4), b, _rand(12))
    record(aten.index_add.default, _rand(3, 4), 0, idx, _rand(3, 4), alpha=2)
    record(aten.nonzero.default, b)
    record(aten.bucketize.Tensor, _rand(3, 4), torch.tensor([-1.0, 0.0, 0.5]), right=True)

    # views and shapes
    record(aten._reshape_alias.default, f, [2, 6], [6, 1])
    record(aten.reshape.default, f, [4, -1])
    record(aten.view.dtype, f, torch.int32)
    record(aten.view.dtype, f, torch.bfloat16)
    record(aten.view.dtype, _rand(3, 4, dtype=torch.int16), torch.int32)
    record(aten.as_strided.default, _rand(4, 5), [3, 3], [5, 2], 1)
    record(aten.as_strided_scatter.default, _rand(4, 5), _rand(2, 3), [2, 3], [1, 5], 2)
    record(aten.alias.default, f)
    record(aten.detach.default, f)
    record(aten.lift_fresh_copy.default, f)
    record(aten.clone.default, h)
    record(aten._to_copy.default, f * 10, dtype=torch.int32)
    record(aten._to_copy.default, c, dtype=torch.float32)
    record(aten._to_copy.default, i, dtype=torch.bool)
    record(aten.copy.default, _rand(3, 4, dtype=torch.int64), _rand(4) * 3)
    record(aten.chunk.default, _rand(7, 2), 3)
    record(aten.split.Tensor, _rand(7, 2), 3)
    record(aten.unsafe_split_with_sizes.default, _rand(2, 7), [3, 4], 1)
    record(aten.unbind.int, _rand(2, 3), 1)
    record(aten.concat.default, [f, i], 1)
    record(aten.concatenate.default, [i, torch.zeros(0, dtype=torch.int64), i], 0)
    record(aten.cat.default, [b, h], 0)
    record(aten.stack.default, [f, i, b], 2)
    record(aten.narrow.default, _rand(5, 4), 0, -3, 2)
    record(aten.slice.Tensor, _rand(5, 4), 0, -3, 2**62, 2)
    record(aten.slice.Tensor, _rand(5, 4), 1, 3, 1)
    record(aten.slice_scatter.default, _rand(5, 4), _rand(2, 4), 0, 1, 5, 2)
    record(aten.select_scatter.default, _rand(5, 4), _rand(5), 1, -1)
    record(aten.diagonal_scatter.default, _rand(3, 4, 5), _rand(4, 3), -1, 2, 0)
    record(aten.diagonal.default, _rand(3, 4, 5), 2, -1, 1)
    record(aten.unfold.default, _rand(3, 8), 1, 3, 2)
    record(aten.squeeze.dims, _rand(1, 3, 1), [0, 2])
    record(aten.squeeze.dims, _rand(1, 3, 1), [])
    record(aten.expand.default, _rand(3, 1), [2, -1, 4])
    record(aten.t.default, _rand(3))
    record(aten.permute.default, _rand(2, 3, 4), [-1, 0, 1])
    record(aten.constant_pad_nd.default, _rand(3, 4), [1, -1, 2, 0], 1.5)
    record(aten.constant_pad_nd.default, i, [1, 1], 2.7)
    record(aten.roll.default, _rand(3, 4), [5])
    record(aten.roll.default, _rand(3, 4), [1, -2], [0, 1])
    record(aten.repeat.default, _rand(2, 3), [2, 1, 2])
    record(aten.flip.default, _rand(2, 3), [0, -1])
    record(aten.tril.default, _rand(2, 3, 4), 1)
    record(aten.triu.default, _rand(3, 4), -1)
    record(prims.broadcast_in_dim.default, _rand(3), [2, 3, 4], [1])
    record(prims.convert_element_type.default, h, torch.float32)
    record(prims.squeeze.default, _rand(3, 1), [1])
    record(prims.view_of.default, f)
    record(prims.iota.default, 5, start=2, step=3, dtype=torch.int64, device="cpu", requires_grad=False)

    # creation
    record(aten.full.default, [2, 3], 7)
    record(aten.full.default, [2, 3], True)
    record(aten.full.default, [2, 3], 1.5, dtype=torch.bfloat16)
    record(aten.full_like.default, i, 2.9)
    record(aten.scalar_tensor.default, 3)
    record(aten.scalar_tensor.default, 3, dtype=torch.int64)
    record(aten.zeros.default, [2, 3], dtype=torch.int32)
    record(aten.ones.default, [2])
    record(aten.ones_like.default, b, dtype=torch.float64)
    record(aten.zeros_like.default, h)
    record(aten.empty.memory_format, [2, 3], dtype=torch.float32)
    record(aten.empty_like.default, i)
    record(aten.empty_strided.default, [2, 3], [3, 1])
    record(aten.empty_permuted.default, [2, 3], [1, 0], dtype=torch.int64)
    record(aten.new_zeros.default, i, [3])
    record(aten.new_ones.default, h, [3])
    record(aten.new_empty.default, f, [3])
    record(aten.new_empty_strided.default, f, [3], [1])
    record(aten.new_full.default, f, [2], 4)
    record(aten.fill.Scalar, i, 2.5)
    record(aten.fill.Tensor, f, torch.tensor(3))
    record(aten.arange.default, 5)
    record(aten.arange.start, 2, 7.5)
    record(aten.arange.start_step, 0, 1, 0.1)
    record(aten.arange.start_step, 10, -3, -3)
    record(aten.arange.start_step, 0, 2, 0.3, dtype=torch.bfloat16)

    # flash attention (CPU), with a float mask and a bool mask
    q, k, v = _rand(1, 2, 3, 4), _rand(1, 2, 5, 4), _rand(1, 2, 5, 4)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    record(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, True)
    record(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _rand(1, 2, 3, 4), q, k, v, out, lse,
           0.0, True)
    mask = _rand(1, 1, 3, 5)
    record(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, attn_mask=mask, scale=0.2)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=0.2)
    record(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _rand(1, 2, 3, 4), q, k, v, out, lse,
           0.0, False, attn_mask=mask, scale=0.2)

    # activations' backward ops on their own
    g, xx = _rand(4, 5), _rand(4, 5)
    record(aten.gelu_backward.default, g, xx, approximate="tanh")
    record(aten.silu_backward.default, g, xx)
    record(aten.sigmoid_backward.default, g, torch.sigmoid(xx))
    record(aten.tanh_backward.default, g, torch.tanh(xx))
    record(aten.threshold_backward.default, g, xx, 0.3)
    record(aten.leaky_relu_backward.default, g, xx, 0.1, False)
    record(aten.hardtanh_backward.default, g, xx, -0.5, 0.5)
    record(aten.elu_backward.default, g, 1.0, 1.0, 1.0, True, F.elu(xx))
    record(aten.softplus_backward.default, g, xx, 2.0, 1.0)
    record(aten.native_dropout_backward.default, g, xx > 0, 1.25)
    record(aten.gelu.default, h)
    record(aten.silu.default, h)

    # functional _foreach_* ops
    def tensors(dtype=torch.float32):
        return [_rand(3, dtype=dtype), _rand(2, 2, dtype=dtype)]

    def positive():
        return [torch.rand(3) + 0.5, torch.rand(2, 2) + 0.5]

    for name in ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow"):
        op = getattr(aten, f"_foreach_{name}")
        base = positive() if name == "pow" else tensors()
        record(op.List, base, positive())
        record(op.Scalar, base, 0.5 if name != "pow" else 2)
        record(op.ScalarList, base, [0.5, 3])
        if name in ("add", "sub"):
            record(op.List, base, tensors(), alpha=-2)
        if hasattr(op, "Tensor"):
            record(op.Tensor, base, torch.tensor(1.5))
    record(aten._foreach_add.Scalar, tensors(torch.int64), 2)
    record(aten._foreach_div.Scalar, tensors(torch.int64), 2)
    record(aten._foreach_pow.ScalarAndTensor, 0.9, positive())
    for name in L._FOREACH_UNARY:
        op = getattr(aten, f"_foreach_{name}", None)
        if op is not None:
            record(op.default, positive())
    record(aten._foreach_zero.default, tensors())
    record(aten._foreach_copy.default, tensors(), [_rand(3, dtype=torch.int64), _rand(1, 2)])
    for name in ("addcmul", "addcdiv"):
        op = getattr(aten, f"_foreach_{name}")
        record(op.Scalar, tensors(), tensors(), positive(), 0.3)
        record(op.ScalarList, tensors(), tensors(), positive(), [0.3, -2])
        record(op.Tensor, tensors(), tensors(), positive(), torch.tensor([0.3, -2.0]))
    record(aten._foreach_lerp.List, tensors(), tensors(), [torch.rand(3), torch.rand(2, 2)])
    record(aten._foreach_lerp.Scalar, tensors(), tensors(), 0.6)
    if hasattr(aten._foreach_lerp, "ScalarList"):
        record(aten._foreach_lerp.ScalarList, tensors(), tensors(), [0.2, 0.9])
    for ord in (2, 1, math.inf, 3):
        record(aten._foreach_norm.Scalar, tensors(), ord)
    record(aten._foreach_norm.Scalar, [t.bfloat16() for t in tensors()], 2)
    record(aten._foreach_max.default, tensors())
    for ord in (2, 3):
        record(aten._foreach_powsum.Scalar, tensors(), ord)
    record(aten._foreach_clone.default, tensors())
    record(aten._foreach_mm.default, [_rand(2, 3), _rand(4, 1)], [_rand(3, 2), _rand(1, 5)])

    # graph utilities
    record(aten._local_scalar_dense.default, torch.tensor(2.5))
    record(aten._assert_tensor_metadata.default, f, dtype=torch.float32)
    record(aten._assert_async.default, torch.tensor(True))
    record(aten._assert_async.msg, torch.tensor(True), "fine")


@pytest.fixture(scope="module")
def samples():
    if not SAMPLES:
        import time; t = time.time()
        torch.manual_seed(0)
        _opinfo_samples()
        print("opinfo", time.time() - t); t = time.time()
        with Capture():
            _backward_programs()
        print("bw", time.time() - t); t = time.time()
        _direct_samples()
        print("direct", time.time() - t); t = time.time()
    return SAMPLES


# -- running a lowering ---------------------------------------------------------------------------

EAGER_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError,
                jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)


def _bind(op, args, kwargs):
    """(arrays, call): the sample's tensors as jax arrays and a function of them
    calling ``lowering(op)`` with the sample's other arguments."""
    fn = L.lowering(op)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [n for n, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def call(*arrays):
        filled = list(leaves)
        for n, a in zip(where, arrays):
            filled[n] = a
        a, k = pytree.tree_unflatten(filled, spec)
        return fn(*a, **k)
    return [to_jax(leaves[n]) for n in where], call


def run_lowering(op, args, kwargs):
    """``lowering(op)`` on the sample, under jax.jit where it traces (else eagerly: ops
    whose output shape depends on values), with every tensor as a jax array."""
    return run_lowerings(op, [(args, kwargs)])[0]


def run_lowerings(op, cases):
    """``run_lowering`` of several samples of one op, under one jax.jit (one compile)."""
    bound = [_bind(op, args, kwargs) for args, kwargs in cases]

    def together(*groups):
        return [call(*arrays) for (_, call), arrays in zip(bound, groups)]
    try:
        return jax.jit(together)(*[arrays for arrays, _ in bound])
    except EAGER_ERRORS:
        out = []
        for arrays, call in bound:
            try:
                out.append(jax.jit(call)(*arrays))
            except EAGER_ERRORS:
                out.append(call(*arrays))
        return out


UNDEFINED_VALUES = {  # uninitialized memory in torch: only shape and dtype compare
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.empty_permuted.default,
    aten.new_empty.default, aten.new_empty_strided.default,
}
TIE_ORDERED = {aten.sort.default, aten.sort.stable, aten.topk.default}  # indices of equal values may differ

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.complex64: dict(rtol=1e-5, atol=1e-5),
    torch.complex128: dict(rtol=1e-7, atol=1e-7),
}
LOOSER = {  # transcendental functions near their poles, long reductions: a few ulp more
    aten.lgamma.default: 1e-4, aten.digamma.default: 1e-4, aten.erfinv.default: 1e-4,
    aten.pow.Tensor_Tensor: 1e-4, aten.pow.Scalar: 1e-4, aten.tan.default: 1e-4,
    aten.special_i1e.default: 1e-4, aten.special_i1.default: 1e-4, aten.i0.default: 1e-4,
    aten.special_i0e.default: 1e-4, aten.special_ndtri.default: 1e-4, aten.cumprod.default: 1e-4,
    aten.prod.default: 1e-4, aten.prod.dim_int: 1e-4, aten._foreach_lgamma.default: 1e-4,
    aten.var.correction: 1e-4, aten.logaddexp2.default: 1e-4,
}
LOOSER_BF16 = {  # torch's bfloat16 CPU kernels round partial sums to bfloat16 on the way
    aten.convolution.default: 5e-2,
}


def compare(op, expected, got, where="out"):
    if isinstance(expected, torch.Tensor):
        assert got is not None, f"{where}: None where torch gave a tensor"
        actual = to_torch(got)
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        if op in UNDEFINED_VALUES:
            return
        tol = dict(TOLERANCES.get(expected.dtype, dict(rtol=0, atol=0)))
        if op in LOOSER and expected.dtype in (torch.float32, torch.complex64):
            tol = dict(rtol=LOOSER[op], atol=LOOSER[op])
        if op in LOOSER_BF16 and expected.dtype == torch.bfloat16:
            tol = dict(rtol=LOOSER_BF16[op], atol=LOOSER_BF16[op])
        torch.testing.assert_close(actual, expected.resolve_conj().resolve_neg(), equal_nan=True,
                                   msg=lambda m: f"{where}: {m}", **tol)
    elif isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)), f"{where}: {type(got).__name__} where torch gave a sequence"
        assert len(got) == len(expected), f"{where}: {len(got)} results, torch gave {len(expected)}"
        if isinstance(expected, list):
            assert isinstance(got, list), f"{where}: Tensor[] must come back as a list"
        for n, (e, g) in enumerate(zip(expected, got)):
            compare(op, e, g, f"{where}[{n}]")
    elif expected is None:
        assert got is None, f"{where}: {got} where torch gave None"
    else:
        assert np.ndim(got) == 0, f"{where}: {got} where torch gave the number {expected}"
        assert np.asarray(got).item() == pytest.approx(expected), f"{where}: {got} != {expected}"


def check_sample(op, args, kwargs, expected, got):
    if op in TIE_ORDERED:
        values, indices = expected
        compare(op, values, got[0], "values")
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) if op is aten.topk.default else \
            (args[1] if len(args) > 1 else kwargs.get("dim", -1))
        taken = args[0].gather(dim, to_torch(got[1])) if args[0].ndim else args[0]
        torch.testing.assert_close(taken, values, equal_nan=True)
        assert to_torch(got[1]).dtype == torch.int64
        return
    compare(op, expected, got)


NON_RANDOM = sorted((op for op in L.lowered_ops() if not L.is_random(op)), key=str)
CHUNK = 40  # ops compiled together: one XLA compile for many small programs
# ops some of whose samples have value-dependent shapes (boolean masks): run on their own
EAGER_SAMPLES = (aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default, aten.nonzero.default)


@pytest.fixture(scope="module")
def lowered(samples):
    """op -> its samples' results through the table (or the exception it raised),
    computed for many ops under one jax.jit, op by op where a chunk does not trace."""
    ops = [op for op in NON_RANDOM if op in samples and op not in EAGER_SAMPLES]
    results = {}
    for op in EAGER_SAMPLES:
        if op in samples:
            results[op] = run_lowerings(op, [(args, kwargs) for args, kwargs, _, _ in samples[op]])
    for start in range(0, len(ops), CHUNK):
        chunk = ops[start:start + CHUNK]
        bound = {op: [_bind(op, args, kwargs) for args, kwargs, _, _ in samples[op]] for op in chunk}

        def together(groups):
            return {str(op): [call(*arrays) for (_, call), arrays in zip(bound[op], groups[str(op)])]
                    for op in chunk}
        try:
            out = jax.jit(together)({str(op): [arrays for arrays, _ in bound[op]] for op in chunk})
            results.update({op: out[str(op)] for op in chunk})
        except Exception:
            for op in chunk:
                try:
                    results[op] = run_lowerings(op, [(args, kwargs) for args, kwargs, _, _ in samples[op]])
                except Exception as e:  # reported by the op's own test
                    results[op] = e
    return results


@pytest.mark.parametrize("op", NON_RANDOM, ids=str)
def test_lowering_matches_torch(op, samples, lowered):
    cases = samples.get(op)
    if not cases:
        pytest.skip("no sample reached this op (test_every_lowering_has_a_sample lists them)")
    results = lowered[op]
    if isinstance(results, Exception):
        raise results
    for (args, kwargs, out, signature), got in zip(cases, results):
        try:
            check_sample(op, args, kwargs, out, got)
        except AssertionError as e:
            raise AssertionError(f"{op} on {signature}: {e}") from None


def test_every_lowering_has_a_sample(samples):
    assert not RECORD_ERRORS, "samples torch refused:\n" + "\n".join(RECORD_ERRORS)
    missing = [str(op) for op in NON_RANDOM if op not in samples]
    assert not missing, "lowered ops no test sample reaches: " + ", ".join(missing)


def test_lowerings_bind_their_schemas():
    """Each lowering accepts the op's arguments by the schema's names (FX nodes carry
    keyword-only arguments by name)."""
    wrong = []
    for op in L.lowered_ops():
        params = inspect.signature(L.lowering(op)).parameters
        takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
        takes_varkw = any(p.kind == p.VAR_KEYWORD for p in params.values())
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        arguments = op._schema.arguments
        n_positional = sum(1 for a in arguments if not a.kwarg_only)
        if not takes_varargs and len(positional) < n_positional:
            wrong.append(f"{op}: takes {len(positional)} positional arguments, schema has {n_positional}")
        for a in arguments:
            if a.kwarg_only and a.name not in params and not takes_varkw:
                wrong.append(f"{op}: no keyword {a.name}")
        if L.is_random(op) and "key" not in params:
            wrong.append(f"{op}: random, but no key=")
    assert not wrong, "\n".join(wrong)


# -- semantics the samples pin down in particular -------------------------------------------------

def _j(t):
    return to_jax(t)


@pytest.mark.parametrize("case", [
    ("float32 + Python float stays float32", aten.add.Tensor, (torch.ones(2), 0.1), torch.float32),
    ("int / int true-divides to float32", aten.div.Tensor,
     (torch.tensor([3, 4]), torch.tensor([2, 2])), torch.float32),
    ("int64 + 2.5 is float32, not float64", aten.add.Tensor, (torch.tensor([1]), 2.5), torch.float32),
    ("int32 tensor + int64 0-d tensor stays int32", aten.add.Tensor,
     (torch.tensor([1], dtype=torch.int32), torch.tensor(2)), torch.int32),
    ("bfloat16 * float32 0-d tensor stays bfloat16", aten.mul.Tensor,
     (torch.ones(2, dtype=torch.bfloat16), torch.tensor(3.0)), torch.bfloat16),
    ("sum of bool is int64", aten.sum.default, (torch.tensor([True, True]),), torch.int64),
    ("comparison is bool", aten.lt.Scalar, (torch.tensor([1, 5]), 2.5), torch.bool),
    ("pow of bool is int64", aten.pow.Tensor_Scalar, (torch.tensor([True]), 2), torch.int64),
], ids=lambda c: c[0])
def test_type_promotion(case):
    _, op, args, dtype = case
    got = run_lowering(op, args, {})
    assert to_torch(got).dtype == dtype == op(*args).dtype


def test_integer_division_semantics():
    a, b = torch.tensor([7, -7, 7, -7]), torch.tensor([2, 2, -2, -2])
    for mode in ("trunc", "floor"):
        compare(aten.div.Tensor_mode, aten.div.Tensor_mode(a, b, rounding_mode=mode),
                run_lowering(aten.div.Tensor_mode, (a, b), {"rounding_mode": mode}))
    compare(aten.remainder.Tensor, torch.remainder(a, b), run_lowering(aten.remainder.Tensor, (a, b), {}))
    fa, fb = torch.tensor([7.5, -7.5, 0.0, -0.0, 1.0]), torch.tensor([-2.0, 2.0, -3.0, 3.0, 0.0])
    expected = aten.div.Tensor_mode(fa, fb, rounding_mode="floor")
    got = to_torch(run_lowering(aten.div.Tensor_mode, (fa, fb), {"rounding_mode": "floor"}))
    assert torch.equal(torch.signbit(got), torch.signbit(expected)) and torch.equal(got, expected)


def test_mean_of_integers_is_refused_as_torch_refuses():
    with pytest.raises(RuntimeError, match="mean"):
        torch.mean(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="mean"):
        L.lowering(aten.mean.dim)(jnp.array([1, 2]), [0])


def test_in_place_batch_norm_is_refused():
    x, stats = jnp.ones((2, 3, 4)), jnp.ones(3)
    for op in (aten.native_batch_norm.default, aten._native_batch_norm_legit.default):
        with pytest.raises(NotImplementedError, match="_native_batch_norm_legit_functional"):
            L.lowering(op)(x, None, None, stats, stats, True, 0.1, 1e-5)


def test_max_pool_indices_and_backward_scatter_add():
    """Overlapping windows (stride < kernel) pick the same input element more than
    once: the backward must add up all their gradients at torch's flat indices."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    out, idx = aten.max_pool2d_with_indices(x, [3, 3], [1, 1], [1, 1])
    got, got_idx = run_lowering(aten.max_pool2d_with_indices.default, (x, [3, 3], [1, 1], [1, 1]), {})
    assert torch.equal(to_torch(got_idx), idx)
    g = torch.randn(out.shape)
    expected = aten.max_pool2d_with_indices_backward(g, x, [3, 3], [1, 1], [1, 1], [1, 1], False, idx)
    grad = run_lowering(aten.max_pool2d_with_indices_backward.default,
                        (g, x, [3, 3], [1, 1], [1, 1], [1, 1], False, idx), {})
    torch.testing.assert_close(to_torch(grad), expected, rtol=1e-5, atol=1e-5)
    assert (expected != 0).sum() < expected.numel()  # some elements took several windows' gradients


# -- graph level: real training steps through aot_autograd ----------------------------------------

class GraphRecorder:
    def __init__(self):
        self.ops = set()
        self.missing = set()
        self.graphs = 0


def interpret(gm):
    """A JAX function running the FX graph ``gm`` node by node through the table;
    random ops get keys folded from ``key`` by node position."""
    nodes = list(gm.graph.nodes)

    def run(key, *inputs):
        env = {}
        inputs = iter(inputs)

        def value(arg):
            return torch.fx.node.map_arg(arg, lambda n: env[n])

        for position, node in enumerate(nodes):
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "call_function":
                args, kwargs = value(node.args), value(node.kwargs)
                if node.target is operator.getitem:
                    env[node] = args[0][args[1]]
                    continue
                fn = L.lowering(node.target)
                if L.is_random(node.target):
                    kwargs = dict(kwargs, key=jax.random.fold_in(key, position))
                env[node] = fn(*args, **kwargs)
            elif node.op == "output":
                return value(node.args[0])
            else:
                raise AssertionError(f"unexpected node {node.op}")
    return run


def jax_compiler(recorder: GraphRecorder, seed=0):
    from torch._functorch.aot_autograd import make_boxed_func

    def compile_graph(gm, example_inputs):
        recorder.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is not operator.getitem:
                recorder.ops.add(node.target)
                if L.lowering(node.target) is None:
                    recorder.missing.add(node.target)
        if recorder.missing:
            return make_boxed_func(gm)  # the test fails on recorder.missing
        jitted = jax.jit(interpret(gm))
        key = jax.random.key(seed + recorder.graphs)

        def run(args):
            arrays = [to_jax(a) if isinstance(a, torch.Tensor) else a for a in args]
            outs = jitted(key, *arrays)
            return [to_torch(o) if o is not None and not isinstance(o, (int, float)) else o for o in outs]
        run._boxed_call = True
        return run
    return compile_graph


def jax_backend(recorder):
    from torch._functorch.aot_autograd import aot_module_simplified

    compiler = jax_compiler(recorder)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler,
                                     decompositions=L.decompositions())
    return backend


def _assert_all_lowered(recorder, name):
    assert not recorder.missing, f"{name}: ops without a lowering: " + ", ".join(sorted(map(str, recorder.missing)))
    assert recorder.graphs > 0


def _close(a, b, name, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _train_and_compare(make_model, inputs, make_optimizer, steps=2, rtol=1e-5, atol=1e-6):
    """Train a copy of the model eagerly and one compiled through the JAX table; compare
    losses, gradients and parameters after each step."""
    torch.manual_seed(0)
    eager = make_model()
    compiled_model = make_model()
    compiled_model.load_state_dict(eager.state_dict())
    recorder = GraphRecorder()
    backend = jax_backend(recorder)
    forward = torch.compile(compiled_model, backend=backend)
    opt_eager, opt_compiled = make_optimizer(eager.parameters()), make_optimizer(compiled_model.parameters())
    step = torch.compile(opt_compiled.step, backend=backend)
    for n in range(steps):
        loss_eager = eager(*inputs)
        loss_eager.backward()
        loss = forward(*inputs)
        loss.backward()
        _close(loss, loss_eager, f"loss at step {n}", rtol, atol)
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            _close(q.grad, p.grad, f"grad of {name} at step {n}", rtol, atol)
        opt_eager.step()
        step()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            _close(q, p, f"{name} after step {n}", rtol, atol)
        for (name, p), q in zip(eager.named_buffers(), compiled_model.buffers()):
            _close(q, p, f"buffer {name} after step {n}", rtol, atol)
        opt_eager.zero_grad()
        opt_compiled.zero_grad()
    return recorder


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x, y):
        h = self.pool(F.relu(self.bn(self.conv(x))))
        h = self.avg(F.relu(self.conv2(h))).flatten(1)
        return F.cross_entropy(self.fc(h), y)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, norm_first=True, batch_first=True)
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        h = self.layer(x)
        q, k, v = self.proj(h).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (a.transpose(1, 2).reshape(2, 5, 16) + h).pow(2).mean()


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16, padding_idx=0)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 11)

    def forward(self, tokens, target):
        h = F.gelu(self.ln(self.emb(tokens)))
        logp = F.log_softmax(self.fc(h), dim=-1)
        return F.nll_loss(logp.view(-1, 11), target.view(-1), ignore_index=3)


GRAPH_OPS = {}  # model -> ops its graphs contained (reported by test_graph_ops_report)


def test_cnn_training_step():
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 0, 4, 2])
    recorder = _train_and_compare(CNN, (x, y), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    GRAPH_OPS["cnn"] = recorder.ops
    _assert_all_lowered(recorder, "cnn")
    assert aten._native_batch_norm_legit_functional.default in recorder.ops
    assert aten.max_pool2d_with_indices_backward.default in recorder.ops
    assert aten.native_batch_norm_backward.default in recorder.ops


def test_transformer_training_step():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    # Adam's eps 1e-3: the key projection's bias has a zero gradient (softmax ignores a
    # per-row shift) that float rounding leaves at +-1e-8; Adam's m/sqrt(v) would blow that
    # noise up to a full lr-sized step of either sign
    recorder = _train_and_compare(Transformer, (x,),
                                  lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-3, foreach=True),
                                  rtol=1e-4, atol=1e-5)
    GRAPH_OPS["transformer"] = recorder.ops
    _assert_all_lowered(recorder, "transformer")
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward.default in recorder.ops
    assert any("_foreach_" in str(op) for op in recorder.ops)


def test_token_model_training_step():
    torch.manual_seed(0)
    tokens = torch.tensor([[1, 2, 0, 4], [5, 3, 3, 10]])
    target = torch.tensor([[2, 3, 1, 0], [3, 9, 7, 1]])
    recorder = _train_and_compare(TokenModel, (tokens, target),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False))
    GRAPH_OPS["tokens"] = recorder.ops
    _assert_all_lowered(recorder, "tokens")
    assert aten.embedding_dense_backward.default in recorder.ops


def test_mlp_adamw_with_aot_function():
    """The loss and its gradients by aot_function over torch.func.functional_call; the
    AdamW step (foreach) through aot_module_simplified."""
    from torch._functorch.aot_autograd import aot_function

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    recorder = GraphRecorder()
    compiler = jax_compiler(recorder)

    def loss_fn(params, x, y):
        return F.mse_loss(torch.func.functional_call(model, params, (x,)), y)

    compiled_loss = aot_function(loss_fn, fw_compiler=compiler, bw_compiler=compiler,
                                 decompositions=L.decompositions())
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    eager_params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, foreach=True)
    opt_eager = torch.optim.AdamW(eager_params.values(), lr=1e-2, foreach=True)
    step = torch.compile(opt.step, backend=jax_backend(recorder))
    for n in range(2):
        loss = compiled_loss(params, x, y)
        loss_eager = loss_fn(eager_params, x, y)
        loss.backward()
        loss_eager.backward()
        _close(loss, loss_eager, f"loss {n}")
        for k in params:
            _close(params[k].grad, eager_params[k].grad, f"grad {k} {n}")
        step()
        opt_eager.step()
        for k in params:
            _close(params[k], eager_params[k], f"{k} after step {n}")
        opt.zero_grad()
        opt_eager.zero_grad()
    GRAPH_OPS["mlp"] = recorder.ops
    _assert_all_lowered(recorder, "mlp")
    assert any("_foreach_" in str(op) for op in recorder.ops)


def test_inference_graph():
    """Eval mode under no_grad (aot's inference graph): batch norm from running stats
    (_native_batch_norm_legit_no_training), attention with a boolean mask."""
    torch.manual_seed(0)
    model = CNN()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    model.eval()
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([1, 0, 4, 2])
    q, mask = torch.randn(2, 2, 5, 8), torch.rand(5, 5) > 0.3
    mask[:, 0] = True
    recorder = GraphRecorder()
    backend = jax_backend(recorder)
    attention = torch.compile(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m), backend=backend)
    with torch.no_grad():
        _close(torch.compile(model, backend=backend)(x, y), model(x, y), "eval loss")
        _close(attention(q, mask), F.scaled_dot_product_attention(q, q, q, attn_mask=mask), "attention")
    _assert_all_lowered(recorder, "inference")
    assert aten._native_batch_norm_legit_no_training.default in recorder.ops
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in recorder.ops


def test_graph_ops_report():
    """Every op the traced training graphs held has a lowering (the graph tests above
    fill GRAPH_OPS; this names what they saw, for the record)."""
    seen = set().union(*GRAPH_OPS.values()) if GRAPH_OPS else set()
    if not seen:
        pytest.skip("the graph tests did not run")
    assert all(L.lowering(op) is not None for op in seen)


# -- random ops -----------------------------------------------------------------------------------

def test_random_ops_shapes_dtypes_ranges_and_keys():
    k1, k2 = jax.random.key(1), jax.random.key(2)
    x = jnp.ones((64, 32), jnp.float32)
    draws = {
        "rand": lambda k: L.lowering(aten.rand.default)([64, 32], key=k),
        "randn_like bf16": lambda k: L.lowering(aten.randn_like.default)(x.astype(jnp.bfloat16), key=k),
        "rand_like f64": lambda k: L.lowering(aten.rand_like.default)(x, dtype=torch.float64, key=k),
        "randint": lambda k: L.lowering(aten.randint.low)(-3, 7, [64, 32], key=k),
        "randperm": lambda k: L.lowering(aten.randperm.default)(50, key=k),
        "bernoulli.p": lambda k: L.lowering(aten.bernoulli.p)(x, 0.3, key=k),
        "normal": lambda k: L.lowering(aten.normal.float_float)(2.0, 3.0, [64, 32], key=k),
        "uniform": lambda k: L.lowering(aten.uniform.default)(x, -2.0, 5.0, key=k),
        "exponential": lambda k: L.lowering(aten.exponential.default)(x, 2.0, key=k),
    }
    torch_refs = {
        "rand": torch.rand(64, 32), "randn_like bf16": torch.randn_like(torch.ones(64, 32, dtype=torch.bfloat16)),
        "rand_like f64": torch.rand_like(torch.ones(64, 32), dtype=torch.float64),
        "randint": torch.randint(-3, 7, (64, 32)), "randperm": torch.randperm(50),
        "bernoulli.p": torch.bernoulli(torch.ones(64, 32), 0.3), "normal": torch.normal(2.0, 3.0, (64, 32)),
        "uniform": torch.empty(64, 32).uniform_(-2, 5), "exponential": torch.empty(64, 32).exponential_(2.0),
    }
    for name, draw in draws.items():
        a, b, again = draw(k1), draw(k2), draw(k1)
        ref = torch_refs[name]
        assert tuple(a.shape) == tuple(ref.shape) and to_torch(a).dtype == ref.dtype, name
        assert not np.array_equal(np.asarray(a), np.asarray(b)), f"{name}: keys 1 and 2 drew the same"
        assert np.array_equal(np.asarray(a), np.asarray(again)), f"{name}: one key drew differently"
        v = to_torch(a).double()
        if name in ("rand", "rand_like f64"):
            assert 0 <= v.min() and v.max() < 1 and abs(v.mean() - 0.5) < 0.05
        elif name == "randint":
            assert v.min() == -3 and v.max() == 6
        elif name == "randperm":
            assert sorted(v.long().tolist()) == list(range(50))
        elif name == "bernoulli.p":
            assert set(v.unique().tolist()) <= {0.0, 1.0} and abs(v.mean() - 0.3) < 0.05
        elif name == "normal":
            assert abs(v.mean() - 2) < 0.3 and abs(v.std() - 3) < 0.3
        elif name == "uniform":
            assert -2 <= v.min() and v.max() < 5
        elif name == "exponential":
            assert v.min() >= 0 and abs(v.mean() - 0.5) < 0.05
    # a raw uint32 key works as well as a typed one
    raw = L.lowering(aten.rand.default)([3], key=jax.random.PRNGKey(0))
    assert raw.shape == (3,) and raw.dtype == jnp.float32


def test_dropout_mask_and_backward_agree():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((50, 40)), jnp.float32)
    out, mask = L.lowering(aten.native_dropout.default)(x, 0.25, True, key=jax.random.key(3))
    assert mask.dtype == jnp.bool_ and out.dtype == jnp.float32
    keep = np.asarray(mask)
    assert abs(keep.mean() - 0.75) < 0.03
    np.testing.assert_allclose(np.asarray(out), np.where(keep, np.asarray(x) / 0.75, 0), rtol=1e-6)
    g = jnp.ones_like(x)
    grad = L.lowering(aten.native_dropout_backward.default)(g, mask, 1 / 0.75)
    np.testing.assert_allclose(np.asarray(grad), keep / 0.75, rtol=1e-6)
    same, _ = L.lowering(aten.native_dropout.default)(x, 0.25, False, key=jax.random.key(3))
    assert same is x


def test_dropout_in_a_traced_graph():
    """F.dropout through aot_autograd: the graph's mask (forward) and its backward
    agree, and the output is the input scaled where kept."""
    from torch._functorch.aot_autograd import aot_function

    recorder = GraphRecorder()
    compiler = jax_compiler(recorder, seed=7)
    fn = aot_function(lambda x: F.dropout(x, 0.5, training=True) * 2, fw_compiler=compiler,
                      bw_compiler=compiler, decompositions=L.decompositions())
    x = (torch.rand(30, 30) + 0.5).requires_grad_()
    out = fn(x)
    out.sum().backward()
    kept = out != 0
    assert 0.35 < kept.float().mean() < 0.65
    torch.testing.assert_close(out[kept], (x * 4)[kept])
    torch.testing.assert_close(x.grad, kept.float() * 4)
    assert aten.native_dropout.default in recorder.ops and not recorder.missing


# -- refusals, dtype maps, the decomposition table ------------------------------------------------

def test_unsupported_names_the_op_and_what_to_do():
    assert L.lowering(aten.add_.Tensor) is None
    text = L.unsupported(aten.add_.Tensor)
    assert "aten.add_.Tensor" in text and "functional" in text
    assert "graph_break" in L.unsupported(aten.masked_select.default)
    assert "aten.masked_select.default" in L.unsupported(aten.masked_select.default)
    assert "foreach" in L.unsupported(aten._fused_adamw_.default)
    assert "aten.linalg_qr.default" in L.unsupported(aten.linalg_qr.default)
    assert "aten.mul.out" in L.unsupported(aten.mul.out)
    for op in (aten.cummax.default, aten.kthvalue.default):
        assert str(op) in L.unsupported(op)


def test_dtype_maps_round_trip():
    pairs = {
        torch.float32: jnp.float32, torch.float64: jnp.float64, torch.float16: jnp.float16,
        torch.bfloat16: jnp.bfloat16, torch.int8: jnp.int8, torch.int16: jnp.int16, torch.int32: jnp.int32,
        torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.bool: jnp.bool_,
        torch.complex64: jnp.complex64, torch.complex128: jnp.complex128,
        torch.uint16: jnp.uint16, torch.uint32: jnp.uint32, torch.uint64: jnp.uint64,
    }
    for theirs, ours in pairs.items():
        assert L.to_jax_dtype(theirs) == jnp.dtype(ours)
        assert L.to_torch_dtype(ours) == theirs
        assert L.to_torch_dtype(jnp.dtype(ours)) == theirs
    with pytest.raises(TypeError):
        L.to_jax_dtype(torch.complex32)
    assert jnp.ones(2, jnp.int64).dtype == jnp.int64  # x64 is on


def test_decomposition_table():
    table = L.decompositions()
    core = set(L.compat.core_aten_decompositions())
    for name in L._LOWERED_INSTEAD:
        op = L._resolve(name)
        assert op is not None and op in core, f"{name} is not (any more) in torch's core decompositions"
        implicit = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        assert op not in table and (L.lowering(op) is not None or implicit), name
    registry = L.compat.registered_decompositions()
    for name in L._DECOMPOSED:
        op = L._resolve(name)
        assert op is not None and op in registry, f"torch has no decomposition of {name}"
        assert op in table and L.lowering(op) is None, name


_GRID = torch.rand(2, 3, 3, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
_RMS_WEIGHT = torch.rand(4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", [
    ("upsample nearest", lambda x: F.interpolate(x, scale_factor=2, mode="nearest")),
    ("upsample bilinear", lambda x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=False)),
    ("grid sample", lambda x, grid=_GRID: F.grid_sample(x, grid, align_corners=False)),
    ("adaptive max pool", lambda x: F.adaptive_max_pool2d(x, (3, 3))),
    ("hardswish + mish", lambda x: F.mish(F.hardswish(x))),
    ("rms norm", lambda x, weight=_RMS_WEIGHT: F.rms_norm(x, (4,), weight)),
], ids=lambda c: c[0])
def test_decomposed_ops_reach_only_lowered_ops(case):
    """Forward and backward of ops the table leaves to decompositions, traced by
    aot_autograd with decompositions(), run through the table: torch's values."""
    from torch._functorch.aot_autograd import aot_function

    _, fn = case
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    constants = list(inspect.signature(fn).parameters.values())[1:]  # tensors as inputs, not closed over
    extra = [p.default for p in constants]
    recorder = GraphRecorder()
    compiler = jax_compiler(recorder)
    compiled = aot_function(fn, fw_compiler=compiler, bw_compiler=compiler, decompositions=L.decompositions())
    out = compiled(x, *extra)
    assert not recorder.missing, "no lowering: " + ", ".join(map(str, recorder.missing))
    g = torch.randn(out.shape)
    (grad,) = torch.autograd.grad(out, x, g)
    x_eager = x.detach().clone().requires_grad_()
    out_eager = fn(x_eager)
    (grad_eager,) = torch.autograd.grad(out_eager, x_eager, g)
    _close(out, out_eager, "forward", atol=1e-5)
    _close(grad, grad_eager, "gradient", atol=1e-5)
