"""The lowering table from torch ATen ops to JAX.

``lowering(op)`` gives the JAX implementation of an ATen ``OpOverload`` (or None).
The JAX target interprets each functional FX graph aot_autograd produces
(forward, backward, inference and optimizer-step graphs, after ``decompositions()``)
node by node with it, under ``jax.jit``; eager ops on JAX-backed tensors run op by
op through the same table.

Calling convention. A lowering takes the op's arguments as the FX node has them
(``node.args``, ``node.kwargs``, keyword names as in the op's schema), with every
tensor replaced by a ``jax.Array`` (a list of tensors by a list of arrays; None
stays None); Python scalars, ``torch.dtype``, ``torch.device``, ``torch.layout``,
``torch.memory_format`` and lists of ints are passed as they are. It returns what
the op returns: an array for a Tensor, a tuple for several returns, a list for
``Tensor[]``; ``_local_scalar_dense`` (``Tensor.item()``) returns a 0-d array,
which the caller converts when it needs a Python number (under ``jax.jit`` it
cannot). A ``bool[]`` output mask that turns a result off gives None there.

Semantics are torch's eager CPU results: values, shapes and dtypes. Every
pointwise op applies torch's type promotion (dimensioned tensors over 0-d tensors
over Python scalars, by category; ``INT_TO_FLOAT`` ops such as ``div``/``exp``,
``ALWAYS_BOOL`` comparisons, ``sum``/``prod``/``cumsum`` of bool and ints to
int64, ``mean``/``var`` of ints refused as torch refuses them), computes half and
bfloat16 in float32 as torch's CPU kernels do, and keeps Python scalars weakly
typed so that ``float32 + 0.5`` stays float32. Matmuls and convolutions use
``lax.Precision.HIGHEST`` (full float32, as torch's CPU float32 results).

Random ops (``is_random(op)``: ``rand``, ``randn``, ``rand_like``, ``randn_like``,
``randint``, ``randint_like``, ``randperm``, ``bernoulli``, ``native_dropout``,
``normal``, ``normal_functional``, ``uniform``, ``exponential``) take a keyword-only
``key=``: a ``jax.random`` key, preferably a typed key (``jax.random.key(seed)``;
a raw ``uint32[2]`` ``jax.random.PRNGKey`` works too). One key per call: the
lowering splits it itself where it needs several draws. The values follow JAX's
generator, not torch's (a ``torch.Generator`` argument is ignored); shapes,
dtypes, ranges and distributions are torch's.

Dtypes: ``to_jax_dtype``/``to_torch_dtype`` map bool, uint8/16/32/64, int8/16/32/64,
float16, bfloat16, float32, float64, complex64, complex128 (and the float8 types
both sides have). The target turns on ``jax_enable_x64`` so that int64 and float64
stay 64-bit; without it JAX silently narrows them.

Refused (``lowering`` gives None; ``unsupported(op)`` says why and what to do):
in-place and ``out=`` variants (graphs must be functional), sparse, quantized and
nested tensors, linear algebra (``linalg_*``), FFTs, fused optimizer kernels
(``_fused_adam*``), data-dependent ops such as ``masked_select`` and ``unique``.
Lowered but raising ``NotImplementedError`` (naming the op) for arguments out of
reach: ``native_batch_norm``/``_native_batch_norm_legit`` in training with running
stats (they update those in place; functionalized graphs carry
``_native_batch_norm_legit_functional``), flash attention with ``dropout_p > 0``
(its backward has no RNG state; the op is tagged ``nondeterministic_seeded`` but
takes no key), ``as_strided`` reading past its input's elements (it assumes a
contiguous input owning its storage from offset 0, which aot_autograd's
functional graphs give it). ``nonzero`` and boolean-mask ``index``/``index_put``
work eagerly only (their shapes depend on values; a mask whose put value is
constant along the masked dimension is lowered with ``where`` and traces).
``empty*`` give zeros. Max pooling's index for a window with several NaNs is the
first NaN's (torch's CPU kernel takes the last).

Graphs: ``decompositions()`` is torch's core ATen table less the ops lowered here
directly (``_LOWERED_INSTEAD``: the norm, activation, loss, softmax and embedding
backward ops, flash attention, ...) plus torch's decompositions of a few non-core
ops (``_DECOMPOSED``: upsampling, ``grid_sampler_2d``, ...). ``operator.getitem``
nodes (multi-output ops) are the interpreter's to handle. ``prims.fma`` (which
torch 2.15's dynamo writes for ``addcmul_``/``addcdiv_`` with ``value=`` and
``add_`` with a tensor ``alpha``, e.g. in single-tensor AdamW) exists only once
``torch._inductor.inductor_prims`` is imported, so its lowering is looked up by
name when first asked for.

Families (see ``families()``): pointwise (unary, binary, ternary), activations and
their backward ops, reductions, softmax, matmul, convolution, pooling,
normalization, losses, indexing and scatter, views and shapes, creation, sorting,
attention, random, ``_foreach_*`` (functional ops, each returning a list), prims
and a few graph utilities.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from . import compat

OpOverload = torch._ops.OpOverload

__all__ = [
    "lowering", "is_random", "decompositions", "unsupported", "to_jax_dtype",
    "to_torch_dtype", "lowered_ops", "families",
]

# -- registry -------------------------------------------------------------------------------------

_TABLE: Dict[OpOverload, Callable] = {}
_RANDOM: set = set()
_FAMILY: Dict[OpOverload, str] = {}
# Lowerings of ops not registered yet when this module is imported, by name: torch 2.15's
# dynamo rewrites addcmul_/addcdiv_(value=) and add_(alpha=tensor) into prims.fma, which
# exists only once dynamo has imported torch._inductor.inductor_prims.
_PENDING: Dict[str, tuple] = {}
_family = "misc"  # the family registrations below are filed under (set by _section)


def _section(name: str) -> None:
    global _family
    _family = name


def _resolve(name) -> Optional[OpOverload]:
    """``"add.Tensor"`` (aten) or ``"prims.fma.default"`` to the OpOverload, or None
    where this torch lacks it."""
    if not isinstance(name, str):
        return name
    parts = name.split(".")
    namespace, packet, overload = ("aten", *parts) if len(parts) == 2 else parts
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return None


def register(*names, random: bool = False):
    """Decorator filing ``fn`` as the lowering of each op in ``names`` (OpOverloads or
    ``"packet.overload"`` strings; ops this torch lacks are skipped)."""
    def deco(fn):
        for name in names:
            op = _resolve(name)
            if op is None:
                if isinstance(name, str) and name.startswith("prims."):
                    _PENDING[name] = (fn, _family, random)
                continue
            _file(op, fn, _family, random)
        return fn
    return deco


def _file(op, fn, family, random):
    _TABLE[op] = fn
    _FAMILY[op] = family
    if random:
        _RANDOM.add(op)


def _resolve_pending() -> None:
    for name in list(_PENDING):
        op = _resolve(name)
        if op is not None:
            _file(op, *_PENDING.pop(name))


def lowering(op) -> Optional[Callable]:
    """The JAX implementation of ``op`` (an ``OpOverload``), or None."""
    fn = _TABLE.get(op)
    if fn is None and _PENDING:
        _resolve_pending()
        fn = _TABLE.get(op)
    return fn


def is_random(op) -> bool:
    """Whether ``lowering(op)`` takes the keyword-only ``key=`` (a jax.random key)."""
    return op in _RANDOM


def lowered_ops() -> List[OpOverload]:
    """Every op the table lowers (prims registered since import included)."""
    _resolve_pending()
    return list(_TABLE)


def families() -> Dict[str, List[OpOverload]]:
    """The lowered ops by family (pointwise, reduction, ...)."""
    _resolve_pending()
    out: Dict[str, List[OpOverload]] = {}
    for op, family in _FAMILY.items():
        out.setdefault(family, []).append(op)
    return out


# -- dtypes and torch's type promotion -------------------------------------------------------------

def _dtype_pairs():
    names = (
        "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    for name in names:
        theirs, ours = getattr(torch, name, None), getattr(jnp, name, None)
        if isinstance(theirs, torch.dtype) and ours is not None:
            yield theirs, jnp.dtype(ours)


_TO_JAX = dict(_dtype_pairs())
_TO_TORCH = {ours: theirs for theirs, ours in _TO_JAX.items()}


def to_jax_dtype(dtype: torch.dtype):
    """The JAX (numpy) dtype of a torch dtype; TypeError for one JAX lacks."""
    try:
        return _TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"torch dtype {dtype} has no JAX counterpart") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype (or scalar type such as ``jnp.float32``)."""
    try:
        return _TO_TORCH[jnp.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"JAX dtype {dtype} has no torch counterpart") from None


_LOW_FLOATS = {torch.float16, torch.bfloat16} | {
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
}


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _tdtype(x) -> torch.dtype:
    return to_torch_dtype(x.dtype)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def _is_integral(dtype, include_bool=True) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or (include_bool and jnp.dtype(dtype) == jnp.bool_)


def _default_float() -> torch.dtype:
    return torch.get_default_dtype()


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    return {torch.float64: torch.complex128}.get(dtype, torch.complex64)


def _real_of(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def _scalar_dtype(value) -> torch.dtype:
    if isinstance(value, (bool, np.bool_)):
        return torch.bool
    if isinstance(value, (int, np.integer)):
        return torch.int64
    if isinstance(value, (float, np.floating)):
        return _default_float()
    if isinstance(value, complex):
        return _complex_of(_default_float())
    raise TypeError(f"not a tensor or a number: {value!r}")


def _combine(higher, lower):
    """c10's combine_categories: a lower-priority operand decides the dtype only
    when it is of a higher category (bool < integer < float < complex)."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:
        return _complex_of(higher) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


def _result_type(*operands) -> torch.dtype:
    """torch.result_type of ``operands`` (arrays standing for tensors, Python
    scalars, None ignored)."""
    groups = [None, None, None]  # dimensioned tensors, 0-d tensors, Python scalars
    for x in operands:
        if x is None:
            continue
        if _is_array(x):
            slot, dtype = (0 if np.ndim(x) else 1), _tdtype(x)
        else:
            slot, dtype = 2, _scalar_dtype(x)
        groups[slot] = dtype if groups[slot] is None else torch.promote_types(groups[slot], dtype)
    return _combine(groups[0], _combine(groups[1], groups[2]))


# torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND
DEFAULT, INT_TO_FLOAT, ALWAYS_BOOL, COMPLEX_TO_FLOAT, BOOL_TO_LONG, NO_OPMATH = range(6)


def _types(kind, *operands):
    """(compute dtype, result dtype) of a pointwise op, as JAX dtypes."""
    promoted = _result_type(*operands)
    if kind == INT_TO_FLOAT and not (promoted.is_floating_point or promoted.is_complex):
        promoted = _default_float()
    elif kind == BOOL_TO_LONG and promoted == torch.bool:
        promoted = torch.int64
    compute = promoted if kind == NO_OPMATH or promoted not in _LOW_FLOATS else torch.float32
    result = {ALWAYS_BOOL: torch.bool, COMPLEX_TO_FLOAT: _real_of(promoted)}.get(kind, promoted)
    return to_jax_dtype(compute), to_jax_dtype(result)


def _opmath(dtype):
    """The dtype torch's CPU kernels compute ``dtype`` in (float32 for half types)."""
    return jnp.dtype(jnp.float32) if to_torch_dtype(dtype) in _LOW_FLOATS else jnp.dtype(dtype)


def _weak(value, dtype):
    """A Python scalar made fit for ``dtype`` but left a Python scalar (weakly typed):
    ints wrap as torch's integer casts do, bools become 0/1 for numbers."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return bool(value)
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (float, np.floating)) and jnp.issubdtype(dtype, jnp.integer):
        return int(value)  # torch casts a float scalar to an integer tensor's dtype (truncating)
    if isinstance(value, (int, np.integer)) and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        value = int(value)
        if not info.min <= value <= info.max:
            value = (value - info.min) % (1 << info.bits) + info.min
        return value
    if isinstance(value, complex) and not _is_complex(dtype):
        return value.real
    return value


def _to(x, dtype):
    """``x`` (array or Python scalar) in ``dtype``; a scalar stays weakly typed."""
    if x is None:
        return None
    if not _is_array(x):
        return _weak(x, dtype)
    x = jnp.asarray(x)
    if x.dtype == dtype:
        return x
    if _is_complex(x.dtype) and not _is_complex(dtype):
        x = jnp.real(x)
    return lax.convert_element_type(x, dtype)


def _cast(y, dtype):
    """``y`` as an array of ``dtype`` (torch's result dtype)."""
    return _to(jnp.asarray(y), jnp.dtype(dtype))


def _value(value, dtype):
    """A fill value (scalar or 0-d array) as a 0-d array of ``dtype``, converted as
    torch converts (float to int truncates)."""
    if _is_array(value):
        return _to(value, dtype)
    if isinstance(value, complex) and not _is_complex(dtype):
        value = value.real
    return _cast(np.asarray(value), dtype)


def _jdtype(dtype, default=None):
    """A dtype argument (torch.dtype or None) as a JAX dtype."""
    if dtype is None:
        return default
    return to_jax_dtype(dtype) if isinstance(dtype, torch.dtype) else jnp.dtype(dtype)


def _pointwise(fn, kind=DEFAULT):
    """A lowering applying ``fn`` to all its (positional) operands after promotion."""
    def impl(*operands):
        compute, result = _types(kind, *operands)
        return _cast(fn(*(_to(x, compute) for x in operands)), result)
    impl.__name__ = getattr(fn, "__name__", "pointwise")
    return impl


# -- shape helpers --------------------------------------------------------------------------------

def _dims(dim, ndim: int, empty_means_all: bool = True):
    """A reduction's dims (int, list, None) as a sorted tuple of axes."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim)) if empty_means_all else ()
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _axis(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _listed(value, n: int) -> tuple:
    """An int-or-list argument (kernel size, stride...) as ``n`` ints."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value * n if len(value) == 1 else value


def _bshape(v, ndim: int, axis: int = 1):
    """A per-channel vector reshaped to broadcast along ``axis`` of an ndim array."""
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


HIGHEST = lax.Precision.HIGHEST


# -- pointwise ops ------------------------------------------------------------------------------

_section("pointwise")


def _floor_div_float(a, b):
    # torch's div_floor_floating: fmod-based, with its rounding fix-up and signed zero.
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    floor = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floor)
    return jnp.where(b == 0, a / b, floor)


def _divide(a, b, rounding_mode):
    compute, result = _types(DEFAULT if rounding_mode else INT_TO_FLOAT, a, b)
    a, b = _to(a, compute), _to(b, compute)
    if rounding_mode is None:
        q = a / b
    elif _is_integral(compute):
        a, b = jnp.asarray(a, compute), jnp.asarray(b, compute)
        q = lax.div(*jnp.broadcast_arrays(a, b)) if rounding_mode == "trunc" else jnp.floor_divide(a, b)
    elif rounding_mode == "trunc":
        q = jnp.trunc(a / b)
    else:
        q = _floor_div_float(a, b)
    return _cast(q, result)


@register("div.Tensor", "div.Scalar", "true_divide.Tensor", "true_divide.Scalar")
def _div(self, other):
    return _divide(self, other, None)


@register("div.Tensor_mode", "div.Scalar_mode")
def _div_mode(self, other, *, rounding_mode=None):
    return _divide(self, other, rounding_mode)


@register("floor_divide.default", "floor_divide.Scalar")
def _floor_divide(self, other):
    return _divide(self, other, "floor")


def _with_alpha(sign):
    def impl(self, other, alpha=1):  # keyword-only in .Tensor, positional in .Scalar
        compute, result = _types(DEFAULT, self, other)
        a, b = _to(self, compute), _to(other, compute)
        if alpha != 1:
            b = b * _weak(alpha, compute)
        return _cast(a + b if sign > 0 else a - b, result)
    return impl


register("add.Tensor", "add.Scalar")(_with_alpha(+1))
register("sub.Tensor", "sub.Scalar")(_with_alpha(-1))


@register("rsub.Tensor", "rsub.Scalar")
def _rsub(self, other, alpha=1):
    return _with_alpha(-1)(other, self, alpha=alpha)


def _pow_impl(base, exponent):
    if not _is_array(exponent) and not isinstance(exponent, bool) and _is_array(base):
        e = exponent
        if isinstance(e, float) and e.is_integer() and abs(e) <= 64:
            e = int(e)
        if isinstance(e, int) and (e >= 0 or not _is_integral(base.dtype)):
            return lax.integer_pow(base, e)
        if e == 0.5:
            return jnp.sqrt(base)
        if e == -0.5:
            return lax.rsqrt(base)
    return jnp.power(base, exponent)


register("pow.Tensor_Tensor", "pow.Tensor_Scalar", "pow.Scalar")(_pointwise(_pow_impl, BOOL_TO_LONG))


def _sign(x):
    return x if x.dtype == jnp.bool_ else jnp.sign(x)


def _rounding(fn):
    return lambda x: x if _is_integral(x.dtype) else fn(x)


def _digamma(x):
    # torch: digamma(+-0) = -+inf (lax gives nan)
    return jnp.where(x == 0, jnp.copysign(jnp.full_like(x, jnp.inf), -x), lax.digamma(x))


def _relu(x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


_UNARY = {
    INT_TO_FLOAT: {
        "sin": jnp.sin, "cos": jnp.cos, "tan": jnp.tan, "asin": jnp.arcsin, "acos": jnp.arccos,
        "atan": jnp.arctan, "sinh": jnp.sinh, "cosh": jnp.cosh, "tanh": jnp.tanh,
        "asinh": jnp.arcsinh, "acosh": jnp.arccosh, "atanh": jnp.arctanh, "exp": jnp.exp,
        "exp2": jnp.exp2, "expm1": jnp.expm1, "log": jnp.log, "log2": jnp.log2, "log10": jnp.log10,
        "log1p": jnp.log1p, "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "sigmoid": jax.nn.sigmoid,
        "erf": lax.erf, "erfc": lax.erfc, "erfinv": lax.erf_inv, "lgamma": lax.lgamma,
        "digamma": _digamma, "reciprocal": lambda x: 1 / x, "i0": jsp.i0,
        "special_i0e": jsp.i0e, "special_i1": jsp.i1, "special_i1e": jsp.i1e,
        "special_ndtri": jsp.ndtri, "special_erfcx": jsp.erfcx if hasattr(jsp, "erfcx") else None,
    },
    DEFAULT: {
        "neg": jnp.negative, "sign": _sign, "sgn": _sign, "ceil": _rounding(jnp.ceil),
        "floor": _rounding(jnp.floor), "round": _rounding(jnp.round), "trunc": _rounding(jnp.trunc),
        "frac": lambda x: x - jnp.trunc(x), "bitwise_not": jnp.invert, "relu": _relu,
        "positive": lambda x: x, "conj_physical": jnp.conj, "square": lambda x: x * x,
    },
    COMPLEX_TO_FLOAT: {"abs": jnp.abs, "absolute": jnp.abs},
    ALWAYS_BOOL: {
        "isnan": jnp.isnan, "isinf": jnp.isinf, "isfinite": jnp.isfinite, "isposinf": jnp.isposinf,
        "isneginf": jnp.isneginf, "signbit": jnp.signbit, "logical_not": jnp.logical_not,
    },
}
for _kind, _fns in _UNARY.items():
    for _name, _fn in _fns.items():
        if _fn is not None:
            register(f"{_name}.default")(_pointwise(_fn, BOOL_TO_LONG if _name == "square" else _kind))


@register("round.decimals")
def _round_decimals(self, *, decimals=0):
    compute, result = _types(DEFAULT, self)
    x = _to(self, compute)
    if _is_integral(compute):
        return x
    if decimals >= 0:
        scale = 10.0 ** decimals
        return _cast(jnp.round(x * scale) / scale, result)
    scale = 10.0 ** -decimals
    return _cast(jnp.round(x / scale) * scale, result)


_BINARY = {
    DEFAULT: {
        "mul": {"Tensor": jnp.multiply, "Scalar": jnp.multiply},
        "remainder": {"Tensor": jnp.remainder, "Scalar": jnp.remainder, "Scalar_Tensor": jnp.remainder},
        "fmod": {"Tensor": jnp.fmod, "Scalar": jnp.fmod},
        "maximum": {"default": jnp.maximum}, "minimum": {"default": jnp.minimum},
        "fmax": {"default": jnp.fmax}, "fmin": {"default": jnp.fmin},
        "max": {"other": jnp.maximum}, "min": {"other": jnp.minimum},
        "nextafter": {"default": jnp.nextafter}, "gcd": {"default": jnp.gcd}, "lcm": {"default": jnp.lcm},
        "bitwise_and": {"Tensor": jnp.bitwise_and, "Scalar": jnp.bitwise_and, "Scalar_Tensor": jnp.bitwise_and},
        "bitwise_or": {"Tensor": jnp.bitwise_or, "Scalar": jnp.bitwise_or, "Scalar_Tensor": jnp.bitwise_or},
        "bitwise_xor": {"Tensor": jnp.bitwise_xor, "Scalar": jnp.bitwise_xor, "Scalar_Tensor": jnp.bitwise_xor},
        "bitwise_left_shift": {"Tensor": jnp.left_shift, "Tensor_Scalar": jnp.left_shift,
                               "Scalar_Tensor": jnp.left_shift},
        "bitwise_right_shift": {"Tensor": jnp.right_shift, "Tensor_Scalar": jnp.right_shift,
                                "Scalar_Tensor": jnp.right_shift},
    },
    INT_TO_FLOAT: {
        "atan2": {"default": jnp.arctan2}, "hypot": {"default": jnp.hypot},
        "copysign": {"Tensor": jnp.copysign, "Scalar": jnp.copysign},
        "logaddexp": {"default": jnp.logaddexp}, "logaddexp2": {"default": jnp.logaddexp2},
    },
    ALWAYS_BOOL: {
        name: {"Tensor": fn, "Scalar": fn}
        for name, fn in (("eq", jnp.equal), ("ne", jnp.not_equal), ("lt", jnp.less),
                         ("le", jnp.less_equal), ("gt", jnp.greater), ("ge", jnp.greater_equal))
    },
}
for _kind, _ops in _BINARY.items():
    for _name, _overloads in _ops.items():
        for _overload, _fn in _overloads.items():
            register(f"{_name}.{_overload}")(_pointwise(_fn, _kind))


def _logical(fn):
    def impl(self, other):
        a = self if _is_array(self) else jnp.asarray(bool(self))
        b = other if _is_array(other) else jnp.asarray(bool(other))
        return fn(a != 0, b != 0)
    return impl


for _name, _fn in (("logical_and", jnp.logical_and), ("logical_or", jnp.logical_or),
                   ("logical_xor", jnp.logical_xor)):
    register(f"{_name}.default")(_logical(_fn))


@register("where.self", "where.ScalarSelf", "where.ScalarOther", "where.Scalar")
def _where(condition, self, other):
    compute, result = _types(DEFAULT, self, other)
    return _cast(jnp.where(_to(condition, jnp.bool_), _to(self, compute), _to(other, compute)), result)


@register("clamp.default", "clamp.Tensor")
def _clamp(self, min=None, max=None):
    compute, result = _types(DEFAULT, self, min, max)
    x = _to(self, compute)
    if min is not None:
        x = jnp.maximum(x, _to(min, compute))
    if max is not None:
        x = jnp.minimum(x, _to(max, compute))
    return _cast(x, result)


@register("clamp_min.default", "clamp_min.Tensor")
def _clamp_min(self, min):
    return _clamp(self, min=min)


@register("clamp_max.default", "clamp_max.Tensor")
def _clamp_max(self, max):
    return _clamp(self, max=max)


def _addc(divide: bool):
    def impl(self, tensor1, tensor2, *, value=1):
        compute, result = _types(DEFAULT, self, tensor1, tensor2)
        a, b, c = _to(self, compute), _to(tensor1, compute), _to(tensor2, compute)
        prod = b / c if divide else b * c
        v = _to(value, compute) if _is_array(value) else _weak(value, compute)
        return _cast(a + v * prod, result)
    return impl


register("addcmul.default")(_addc(False))
register("addcdiv.default")(_addc(True))


@register("lerp.Scalar", "lerp.Tensor")
def _lerp(self, end, weight):
    compute, result = _types(DEFAULT, self, end, weight)
    a, b, w = _to(self, compute), _to(end, compute), _to(weight, compute)
    diff = b - a
    # torch's CPU kernel: two formulas, picked by |weight| < 0.5, for accuracy at both ends
    low = a + w * diff
    high = b - diff * (1 - w)
    return _cast(jnp.where(jnp.abs(w) < 0.5, low, high), result)


@register("prims.fma.default")
def _fma(a, b, c):
    compute, result = _types(DEFAULT, a, b, c)
    return _cast(_to(a, compute) * _to(b, compute) + _to(c, compute), result)


@register("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(self, mask, value):
    return jnp.where(_to(mask, jnp.bool_), _value(value, self.dtype), self)


@register("threshold.default")
def _threshold(self, threshold, value):
    compute, result = _types(DEFAULT, self)
    x = _to(self, compute)
    return _cast(jnp.where(x <= _weak(threshold, compute), _value(value, compute), x), result)


@register("nan_to_num.default")
def _nan_to_num(self, nan=None, posinf=None, neginf=None):
    if _is_integral(self.dtype):
        return self
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


@register("complex.default")
def _complex(real, imag):
    return lax.complex(real, imag)


# -- activations and their backward ops -------------------------------------------------------------

_section("activation")


def _float_op(fn):
    """A float-only pointwise lowering over its tensor/scalar operands: computes in
    opmath and returns the dtype of the first operand (``grad_output``/``self``)."""
    @functools.wraps(fn)
    def impl(first, *rest, **kwargs):
        out = first.dtype
        acc = _opmath(out)
        cast = [_to(x, acc) if _is_array(x) else x for x in (first, *rest)]
        return _cast(fn(*cast, **kwargs), out)
    return impl


@register("leaky_relu.default")
@_float_op
def _leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@register("leaky_relu_backward.default")
@_float_op
def _leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    return jnp.where(self > 0, grad_output, grad_output * negative_slope)


@register("hardtanh.default")
def _hardtanh(self, min_val=-1, max_val=1):
    # no promotion: the bounds take self's dtype (an integer tensor truncates them)
    return jnp.clip(self, _value(min_val, self.dtype), _value(max_val, self.dtype))


@register("hardtanh_backward.default")
@_float_op
def _hardtanh_backward(grad_output, self, min_val, max_val):
    return jnp.where((self <= min_val) | (self >= max_val), 0, grad_output)


@register("elu.default")
@_float_op
def _elu(self, alpha=1, scale=1, input_scale=1):
    return jnp.where(self > 0, self * scale, jnp.expm1(self * input_scale) * (alpha * scale))


@register("elu_backward.default")
@_float_op
def _elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    x = self_or_result
    if is_result:
        neg = grad_output * input_scale * (x + alpha * scale)
    else:
        neg = grad_output * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, neg, grad_output * scale)


_SQRT1_2 = 0.7071067811865476
_GELU_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # sqrt(2/pi)
_GELU_KAPPA = 0.044715


@register("gelu.default")
@_float_op
def _gelu(self, *, approximate="none"):
    x = self
    if approximate == "tanh":
        inner = _GELU_BETA * (x + _GELU_KAPPA * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return x * 0.5 * (1 + lax.erf(x * _SQRT1_2))


@register("gelu_backward.default")
@_float_op
def _gelu_backward(grad_output, self, *, approximate="none"):
    x = self
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_BETA * (x + _GELU_KAPPA * x_sq * x)
        t = jnp.tanh(inner)
        left, right = 0.5 * x, 1 + t
        left_derivative = 0.5 * right
        right_derivative = (1 - t * t) * _GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)
        return grad_output * (left_derivative + left * right_derivative)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * (_SQRT1_2 * (2.0 / math.sqrt(math.pi)) * 0.5)
    return grad_output * (cdf + x * pdf)


@register("silu.default")
@_float_op
def _silu(self):
    return self * jax.nn.sigmoid(self)


@register("silu_backward.default")
@_float_op
def _silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


@register("sigmoid_backward.default")
@_float_op
def _sigmoid_backward(grad_output, output):
    return grad_output * (1 - output) * output


@register("tanh_backward.default")
@_float_op
def _tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


@register("threshold_backward.default")
def _threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, jnp.zeros((), grad_output.dtype), grad_output)


@register("softplus.default")
@_float_op
def _softplus(self, beta=1, threshold=20):
    z = self * beta
    return jnp.where(z > threshold, self, jnp.log1p(jnp.exp(z)) / beta)


@register("softplus_backward.default")
@_float_op
def _softplus_backward(grad_output, self, beta, threshold):
    z = jnp.exp(self * beta)
    return jnp.where(self * beta > threshold, grad_output, grad_output * z / (z + 1))


@register("native_dropout_backward.default")
def _native_dropout_backward(grad_output, mask, scale):
    return _pointwise(lambda g, m, s: g * m * s)(grad_output, mask, scale)


# -- reductions -----------------------------------------------------------------------------------

_section("reduction")


def _accumulating(x, dtype):
    """(compute dtype, result dtype) for sum-like reductions: bool/int to int64."""
    if dtype is not None:
        out = _jdtype(dtype)
    elif _is_integral(x.dtype):
        out = jnp.dtype(jnp.int64)
    else:
        out = x.dtype
    return _opmath(out), out


@register("sum.dim_IntList", "sum.default")
def _sum(self, dim=None, keepdim=False, *, dtype=None):
    acc, out = _accumulating(self, dtype)
    return _cast(jnp.sum(_to(self, acc), axis=_dims(dim, self.ndim), keepdims=keepdim), out)


@register("prod.default", "prod.dim_int")
def _prod(self, dim=None, keepdim=False, *, dtype=None):
    acc, out = _accumulating(self, dtype)
    return _cast(jnp.prod(_to(self, acc), axis=_dims(dim, self.ndim), keepdims=keepdim), out)


def _need_float(name, x, dtype=None):
    out = _jdtype(dtype, x.dtype)
    if not (_is_float(out) or _is_complex(out)):
        raise RuntimeError(
            f"{name}(): could not infer output dtype. Input dtype must be either a floating "
            f"point or complex dtype. Got: {to_torch_dtype(x.dtype)}")
    return out


@register("mean.dim", "mean.default")
def _mean(self, dim=None, keepdim=False, *, dtype=None):
    out = _need_float("mean", self, dtype)
    return _cast(jnp.mean(_to(self, _opmath(out)), axis=_dims(dim, self.ndim), keepdims=keepdim), out)


def _extreme(fn):
    def impl(self, dim=None, keepdim=False):
        return fn(self, axis=_dims(dim, self.ndim), keepdims=keepdim)
    return impl


register("amax.default", "max.default")(_extreme(jnp.max))
register("amin.default", "min.default")(_extreme(jnp.min))


def _extreme_with_index(fn, arg):
    def impl(self, dim, keepdim=False):
        if self.ndim == 0:
            return self, jnp.zeros((), jnp.int64)
        axis = dim % self.ndim
        return (fn(self, axis=axis, keepdims=keepdim),
                arg(self, axis=axis, keepdims=keepdim).astype(jnp.int64))
    return impl


register("max.dim")(_extreme_with_index(jnp.max, jnp.argmax))
register("min.dim")(_extreme_with_index(jnp.min, jnp.argmin))


def _arg_extreme(arg):
    def impl(self, dim=None, keepdim=False):
        if dim is None:
            index = arg(self.reshape(-1)).astype(jnp.int64)
            return index.reshape((1,) * self.ndim) if keepdim else index
        if self.ndim == 0:
            return jnp.zeros((), jnp.int64)
        return arg(self, axis=dim % self.ndim, keepdims=keepdim).astype(jnp.int64)
    return impl


register("argmax.default")(_arg_extreme(jnp.argmax))
register("argmin.default")(_arg_extreme(jnp.argmin))


def _var_mean(x, dim, correction, keepdim):
    out = _need_float("var", x)
    if not (_is_float(x.dtype) or _is_complex(x.dtype)):
        raise RuntimeError("std and var only support floating point and complex dtypes")
    acc = _opmath(out)
    xc = _to(x, acc)
    dims = _dims(dim, x.ndim)
    n = math.prod(x.shape[d] for d in dims)
    mean = jnp.mean(xc, axis=dims, keepdims=True)
    diff = xc - mean
    sq = jnp.real(diff * jnp.conj(diff)) if _is_complex(acc) else diff * diff
    c = 1 if correction is None else correction
    var = jnp.sum(sq, axis=dims, keepdims=keepdim) / max(n - c, 0)
    mean = mean if keepdim else jnp.squeeze(mean, dims)
    return _cast(var, to_jax_dtype(_real_of(to_torch_dtype(out)))), _cast(mean, out)


@register("var.correction")
def _var(self, dim=None, *, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)[0]


@register("var.dim")
def _var_dim(self, dim, unbiased=True, keepdim=False):
    return _var_mean(self, dim, 1 if unbiased else 0, keepdim)[0]


@register("var_mean.correction")
def _var_mean_lowering(self, dim=None, *, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)


@register("std.correction")
def _std(self, dim=None, *, correction=None, keepdim=False):
    return jnp.sqrt(_var_mean(self, dim, correction, keepdim)[0])


def _truth_reduction(fn):
    def impl(self, dim=None, keepdim=False):
        out = jnp.uint8 if self.dtype == jnp.uint8 else jnp.bool_
        dims = _dims(dim, self.ndim, empty_means_all=False)
        return fn(self != 0, axis=dims, keepdims=keepdim).astype(out)
    return impl


register("any.default", "any.dim", "any.dims")(_truth_reduction(jnp.any))
register("all.default", "all.dim", "all.dims")(_truth_reduction(jnp.all))


def _scan(fn):
    def impl(self, dim, *, dtype=None):
        acc, out = _accumulating(self, dtype)
        x = _to(self, acc)
        return _cast(x if x.ndim == 0 else fn(x, axis=dim % x.ndim), out)
    return impl


register("cumsum.default")(_scan(jnp.cumsum))
register("cumprod.default")(_scan(jnp.cumprod))


@register("logsumexp.default")
def _logsumexp(self, dim, keepdim=False):
    compute, result = _types(INT_TO_FLOAT, self)
    return _cast(jsp.logsumexp(_to(self, compute), axis=_dims(dim, self.ndim), keepdims=keepdim), result)


@register("count_nonzero.dim_IntList", "count_nonzero.default")
def _count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=_dims(dim, self.ndim)).astype(jnp.int64)


# -- softmax --------------------------------------------------------------------------------------

_section("softmax")


def _softmax_like(fn):
    def impl(self, dim, half_to_float):
        out = jnp.dtype(jnp.float32) if half_to_float else self.dtype
        x = _to(self, _opmath(self.dtype))
        if x.ndim == 0:
            return _cast(fn(x.reshape(1), axis=0).reshape(()), out)
        return _cast(fn(x, axis=dim % x.ndim), out)
    return impl


register("_softmax.default")(_softmax_like(jax.nn.softmax))
register("_log_softmax.default")(_softmax_like(jax.nn.log_softmax))


@register("_softmax_backward_data.default")
def _softmax_backward(grad_output, output, dim, input_dtype):
    acc = _opmath(grad_output.dtype)
    g, y = _to(grad_output, acc), _to(output, acc)
    axis = _axis(dim, g.ndim)
    gi = y * (g - jnp.sum(g * y, axis=axis, keepdims=True)) if g.ndim else jnp.zeros_like(g)
    return _cast(gi, to_jax_dtype(input_dtype))


@register("_log_softmax_backward_data.default")
def _log_softmax_backward(grad_output, output, dim, input_dtype):
    acc = _opmath(grad_output.dtype)
    g, y = _to(grad_output, acc), _to(output, acc)
    axis = _axis(dim, g.ndim)
    gi = g - jnp.exp(y) * jnp.sum(g, axis=axis, keepdims=True) if g.ndim else jnp.zeros_like(g)
    return _cast(gi, to_jax_dtype(input_dtype))


# -- matmul ---------------------------------------------------------------------------------------

_section("matmul")


def _matmul_core(a, b):
    out = jnp.result_type(a.dtype, b.dtype)
    if to_torch_dtype(out) in _LOW_FLOATS:
        return jnp.matmul(a, b, precision=HIGHEST, preferred_element_type=jnp.float32), out
    return jnp.matmul(a, b, precision=HIGHEST), out


@register("mm.default", "bmm.default", "matmul.default", "dot.default", "mv.default")
def _matmul(self, other):
    prod, out = _matmul_core(self, other)
    return _cast(prod, out)


def _add_matmul(self, prod, out, beta, alpha):
    alpha, beta = _weak(alpha, prod.dtype), _weak(beta, prod.dtype)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:  # self is ignored, NaN included
        return _cast(jnp.broadcast_to(prod, jnp.broadcast_shapes(self.shape, prod.shape)), out)
    base = _to(self, prod.dtype)
    return _cast((base * beta if beta != 1 else base) + prod, out)


@register("addmm.default", "addmv.default", "baddbmm.default")
def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    prod, out = _matmul_core(mat1, mat2)
    return _add_matmul(self, prod, out, beta, alpha)


# -- convolution ----------------------------------------------------------------------------------

_section("convolution")


def _conv(x, weight, stride, padding, dilation, transposed, output_padding, groups):
    """aten.convolution without its bias, any number of spatial dims."""
    n = x.ndim - 2
    stride, padding, dilation = _listed(stride, n), _listed(padding, n), _listed(dilation, n)
    layout = tuple(range(n + 2))
    numbers = lax.ConvDimensionNumbers(layout, layout, layout)
    low = to_torch_dtype(x.dtype) in _LOW_FLOATS
    extra = {"preferred_element_type": jnp.float32} if low else {}
    if not transposed:
        return lax.conv_general_dilated(
            x, weight, window_strides=stride, padding=[(p, p) for p in padding],
            rhs_dilation=dilation, dimension_numbers=numbers, feature_group_count=groups,
            precision=HIGHEST, **extra)
    # A transposed convolution is the input-gradient of a convolution: dilate the
    # input by the stride, pad by dilation * (k - 1) - padding (plus output_padding
    # on the high side) and convolve with the flipped kernel, in and out swapped per group.
    output_padding = _listed(output_padding, n)
    cin, cout_per_group, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    w = weight.reshape((groups, cin // groups, cout_per_group) + kernel)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_per_group, cin // groups) + kernel)
    w = jnp.flip(w, axis=tuple(range(2, n + 2)))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op)
            for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
    return lax.conv_general_dilated(
        x, w, window_strides=(1,) * n, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=numbers, feature_group_count=groups, precision=HIGHEST, **extra)


@register("convolution.default")
def _convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    out = _conv(input, weight, stride, padding, dilation, transposed, output_padding, groups)
    if bias is not None:
        out = out + _bshape(_to(bias, out.dtype), out.ndim)
    return _cast(out, input.dtype)


@register("convolution_backward.default")
def _convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
                          transposed, output_padding, groups, output_mask):
    acc = _opmath(input.dtype)

    def forward(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    grad_input = grad_weight = grad_bias = None
    if output_mask[0] or output_mask[1]:
        _, pullback = jax.vjp(forward, _to(input, acc), _to(weight, acc))
        gi, gw = pullback(_to(grad_output, acc))
        grad_input = _cast(gi, input.dtype) if output_mask[0] else None
        grad_weight = _cast(gw, weight.dtype) if output_mask[1] else None
    if output_mask[2]:
        axes = (0,) + tuple(range(2, grad_output.ndim))
        grad_bias = _cast(jnp.sum(_to(grad_output, acc), axis=axes), grad_output.dtype)
    return grad_input, grad_weight, grad_bias


# -- pooling --------------------------------------------------------------------------------------

_section("pooling")


def _pool_geometry(sizes, kernel, stride, padding, dilation, ceil_mode):
    """Per spatial dim (kernel, stride, pad, dilation, output size, high pad) as
    torch's pooling_output_shape computes them."""
    out = []
    for size, k, s, p, d in zip(sizes, kernel, stride, padding, dilation):
        span = d * (k - 1) + 1
        num = size + 2 * p - span + ((s - 1) if ceil_mode else 0)
        o = num // s + 1
        if ceil_mode and (o - 1) * s >= size + p:
            o -= 1
        high = (o - 1) * s + span - size - p
        out.append((k, s, p, d, o, high))
    return out


def _pool_args(x, n, kernel_size, stride, padding, dilation=1):
    kernel = _listed(kernel_size, n)
    stride = _listed(stride, n) if stride else kernel
    return kernel, stride, _listed(padding, n), _listed(dilation, n)


def _lowest(dtype):
    return -jnp.inf if _is_float(dtype) else jnp.iinfo(dtype).min


def _max_pool_with_indices(n):
    def impl(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        sizes = self.shape[-n:]
        lead = self.ndim - n
        geometry = _pool_geometry(sizes, *_pool_args(self, n, kernel_size, stride, padding, dilation),
                                  ceil_mode)
        xp = lax.pad(self, jnp.array(_lowest(self.dtype), self.dtype),
                     [(0, 0, 0)] * lead + [(p, h, 0) for _, _, p, _, _, h in geometry])
        windows, flat = [], []
        plane_strides = _plane_strides(sizes)
        for offsets in itertools.product(*[range(g[0]) for g in geometry]):
            start = [0] * lead + [o * d for o, (_, _, _, d, _, _) in zip(offsets, geometry)]
            limit = list(self.shape[:lead]) + [b + (o - 1) * s + 1
                                                for b, (_, s, _, _, o, _) in zip(start[lead:], geometry)]
            windows.append(lax.slice(xp, start, limit, [1] * lead + [g[1] for g in geometry]))
            # the flat in-plane index (torch's indices) of this window element
            coords = np.zeros([g[4] for g in geometry], np.int64)
            for axis, (off, (_, s, p, d, o, _)) in enumerate(zip(offsets, geometry)):
                shape = [1] * n
                shape[axis] = o
                coords = coords + (np.arange(o) * s - p + off * d).reshape(shape) * plane_strides[axis]
            flat.append(coords)
        stacked = jnp.stack(windows, axis=-1)
        which = jnp.argmax(stacked, axis=-1)[..., None]
        values = jnp.take_along_axis(stacked, which, axis=-1)[..., 0]
        table = jnp.broadcast_to(jnp.asarray(np.stack(flat, axis=-1)), stacked.shape)
        return values, jnp.take_along_axis(table, which, axis=-1)[..., 0]
    return impl


register("max_pool2d_with_indices.default")(_max_pool_with_indices(2))
register("max_pool3d_with_indices.default")(_max_pool_with_indices(3))


def _max_pool_backward(n):
    def impl(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
        planes = math.prod(self.shape[:-n])
        plane = math.prod(self.shape[-n:])
        acc = _opmath(grad_output.dtype)
        g = _to(grad_output, acc).reshape(planes, -1)
        rows = jnp.arange(planes)[:, None]
        grad = jnp.zeros((planes, plane), acc).at[rows, indices.reshape(planes, -1)].add(g)
        return _cast(grad.reshape(self.shape), self.dtype)
    return impl


register("max_pool2d_with_indices_backward.default")(_max_pool_backward(2))
register("max_pool3d_with_indices_backward.default")(_max_pool_backward(3))


def _avg_divisor(geometry, sizes, count_include_pad):
    """The divisor of each output position (numpy), as torch's avg_pool kernels."""
    divisor = np.ones([g[4] for g in geometry])
    for axis, ((k, s, p, _, o, _), size) in enumerate(zip(geometry, sizes)):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, size + p)
        count = end - start if count_include_pad else np.minimum(end, size) - np.maximum(start, 0)
        shape = [1] * len(geometry)
        shape[axis] = o
        divisor = divisor * count.reshape(shape)
    return divisor


def _avg_pool_forward(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad,
                      divisor_override):
    sizes = x.shape[-n:]
    lead = x.ndim - n
    geometry = _pool_geometry(sizes, *_pool_args(x, n, kernel_size, stride, padding), ceil_mode)
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * lead + [(p, h, 0) for _, _, p, _, _, h in geometry])
    summed = lax.reduce_window(xp, 0.0, lax.add, (1,) * lead + tuple(g[0] for g in geometry),
                               (1,) * lead + tuple(g[1] for g in geometry), "VALID")
    divisor = divisor_override or _avg_divisor(geometry, sizes, count_include_pad)
    return summed / jnp.asarray(divisor, x.dtype)


def _avg_pool(n):
    def impl(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
        x = _to(self, _opmath(self.dtype))
        out = _avg_pool_forward(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                divisor_override)
        return _cast(out, self.dtype)
    return impl


def _avg_pool_backward(n):
    def impl(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad,
             divisor_override):
        acc = _opmath(self.dtype)
        _, pullback = jax.vjp(
            lambda x: _avg_pool_forward(x, n, kernel_size, stride, padding, ceil_mode,
                                        count_include_pad, divisor_override), _to(self, acc))
        return _cast(pullback(_to(grad_output, acc))[0], self.dtype)
    return impl


register("avg_pool2d.default")(_avg_pool(2))
register("avg_pool3d.default")(_avg_pool(3))
register("avg_pool2d_backward.default")(_avg_pool_backward(2))
register("avg_pool3d_backward.default")(_avg_pool_backward(3))


def _adaptive_matrix(size: int, out: int) -> np.ndarray:
    """Averaging weights (out x size) of torch's adaptive pooling along one dim:
    window i spans [floor(i*size/out), ceil((i+1)*size/out))."""
    m = np.zeros((out, size))
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def _adaptive_apply(x, matrices, transpose):
    n = len(matrices)
    for i, m in enumerate(matrices):
        axis = x.ndim - n + i
        m = jnp.asarray(m.T if not transpose else m, x.dtype)
        x = jnp.moveaxis(jnp.tensordot(x, m, axes=([axis], [0]), precision=HIGHEST), -1, axis)
    return x


def _adaptive_avg_pool(n):
    def impl(self, output_size):
        sizes = self.shape[-n:]
        outs = _listed(output_size, n)
        mats = [_adaptive_matrix(s, o) for s, o in zip(sizes, outs)]
        return _cast(_adaptive_apply(_to(self, _opmath(self.dtype)), mats, False), self.dtype)
    return impl


def _adaptive_avg_pool_backward(n):
    def impl(grad_output, self):
        sizes, outs = self.shape[-n:], grad_output.shape[-n:]
        mats = [_adaptive_matrix(s, o) for s, o in zip(sizes, outs)]
        return _cast(_adaptive_apply(_to(grad_output, _opmath(self.dtype)), mats, True), self.dtype)
    return impl


def _adaptive_windows(size: int, out: int):
    """(index [out, k], valid [out, k]) of torch's adaptive windows along one dim, padded
    to the longest window k."""
    bounds = [((i * size) // out, -((-(i + 1) * size) // out)) for i in range(out)]
    k = max(end - start for start, end in bounds)
    index = np.array([[min(start + j, end - 1) for j in range(k)] for start, end in bounds])
    valid = np.array([[start + j < end for j in range(k)] for start, end in bounds])
    return index, valid


def _plane_strides(sizes) -> np.ndarray:
    """Row-major strides of a pooling plane (torch's flat indices count within it)."""
    return np.cumprod((1,) + tuple(sizes[::-1]))[:-1][::-1]


def _adaptive_table(windows, sizes):
    """(flat in-plane index, valid) per output position and window element, shaped
    outputs + (window elements,)."""
    flat, valid = np.zeros((), np.int64), np.ones((), bool)
    for (index, ok), stride in zip(windows, _plane_strides(sizes)):
        flat = flat[..., None, None] + index * stride  # [o1, k1, o2, k2, ...]
        valid = valid[..., None, None] & ok
    n = len(windows)
    order = [2 * a for a in range(n)] + [2 * a + 1 for a in range(n)]  # o1, o2, ..., k1, k2, ...
    outs = tuple(index.shape[0] for index, _ in windows)
    return flat.transpose(order).reshape(outs + (-1,)), valid.transpose(order).reshape(outs + (-1,))


def _adaptive_max_pool(n):
    def impl(self, output_size):
        sizes, lead = self.shape[-n:], self.ndim - n
        windows = [_adaptive_windows(s, o) for s, o in zip(sizes, _listed(output_size, n))]
        x = self
        for axis, (index, _) in enumerate(windows):  # x becomes [..., o1, k1, o2, k2, ...]
            x = jnp.take(x, jnp.asarray(index), axis=lead + 2 * axis)
        order = [lead + 2 * a for a in range(n)] + [lead + 2 * a + 1 for a in range(n)]
        flat, valid = _adaptive_table(windows, sizes)
        x = jnp.transpose(x, list(range(lead)) + order).reshape(self.shape[:lead] + flat.shape)
        x = jnp.where(valid, x, jnp.array(_lowest(self.dtype), self.dtype))
        which = jnp.argmax(x, axis=-1)[..., None]
        values = jnp.take_along_axis(x, which, axis=-1)[..., 0]
        indices = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), x.shape), which, axis=-1)[..., 0]
        return values, indices
    return impl


def _adaptive_max_pool_backward(n):
    backward = _max_pool_backward(n)

    def impl(grad_output, self, indices):
        return backward(grad_output, self, None, None, None, None, None, indices)
    return impl


register("adaptive_max_pool2d.default")(_adaptive_max_pool(2))
register("adaptive_max_pool3d.default")(_adaptive_max_pool(3))
register("adaptive_max_pool2d_backward.default")(_adaptive_max_pool_backward(2))
register("adaptive_max_pool3d_backward.default")(_adaptive_max_pool_backward(3))
register("_adaptive_avg_pool2d.default")(_adaptive_avg_pool(2))
register("_adaptive_avg_pool3d.default")(_adaptive_avg_pool(3))
register("_adaptive_avg_pool2d_backward.default")(_adaptive_avg_pool_backward(2))
register("_adaptive_avg_pool3d_backward.default")(_adaptive_avg_pool_backward(3))


# -- normalization --------------------------------------------------------------------------------

_section("normalization")


def _stats_dtype(x, *params):
    """torch's CPU dtype for mean/rstd: a parameter's dtype where it differs from the
    input's (mixed bfloat16 input, float32 parameters), else the input's."""
    for p in params:
        if p is not None and p.dtype != x.dtype:
            return p.dtype
    return x.dtype


@register("native_layer_norm.default")
def _native_layer_norm(input, normalized_shape, weight, bias, eps):
    axis = input.ndim - len(normalized_shape)
    dims = tuple(range(axis, input.ndim))
    acc = _opmath(input.dtype)
    x = _to(input, acc)
    mean = jnp.mean(x, axis=dims, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=dims, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _to(weight, acc)
    if bias is not None:
        out = out + _to(bias, acc)
    stats = _stats_dtype(input, weight, bias)
    return _cast(out, input.dtype), _cast(mean, stats), _cast(rstd, stats)


@register("native_layer_norm_backward.default")
def _native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias,
                                output_mask):
    axis = input.ndim - len(normalized_shape)
    dims, lead = tuple(range(axis, input.ndim)), tuple(range(axis))
    acc = _opmath(input.dtype)
    g, x = _to(grad_out, acc), _to(input, acc)
    mean, rstd = _to(mean, acc), _to(rstd, acc)
    xhat = (x - mean) * rstd
    gw = g * _to(weight, acc) if weight is not None else g
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        a = jnp.mean(gw * xhat, axis=dims, keepdims=True)
        b = jnp.mean(gw, axis=dims, keepdims=True)
        grad_input = _cast(rstd * (gw - b - xhat * a), input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = _cast(jnp.sum(g * xhat, axis=lead), weight.dtype)
    if output_mask[2] and bias is not None:
        grad_bias = _cast(jnp.sum(g, axis=lead), bias.dtype)
    return grad_input, grad_weight, grad_bias


def _weight_norm(v, g, dim):
    """``w = v * g / |v|``, the norm over every dimension but ``dim``, and the norm."""
    acc = _opmath(v.dtype)
    axes = tuple(i for i in range(v.ndim) if i != dim % max(v.ndim, 1))
    vv = _to(v, acc)
    norm = jnp.sqrt(jnp.sum(vv * vv, axis=axes, keepdims=True))
    return _cast(vv * (_to(g, acc) / norm), v.dtype), _cast(norm, v.dtype)


@register("_weight_norm_interface.default")
def _weight_norm_interface(v, g, dim=0):
    w, norm = _weight_norm(v, g, dim)
    return w, norm.reshape(g.shape)


@register("_weight_norm_interface_backward.default")
def _weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    _, pullback = jax.vjp(lambda v, g: _weight_norm(v, g, dim)[0], saved_v, saved_g)
    grad_v, grad_g = pullback(grad_w)
    return grad_v, grad_g


def _bn_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _bn_normalize(x, mean, invstd, weight, bias, acc):
    out = (x - _bshape(mean, x.ndim)) * _bshape(invstd, x.ndim)
    if weight is not None:
        out = out * _bshape(_to(weight, acc), x.ndim)
    if bias is not None:
        out = out + _bshape(_to(bias, acc), x.ndim)
    return out


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var)."""
    acc = _opmath(input.dtype)
    stats = _stats_dtype(input, weight, bias, running_mean, running_var)
    x = _to(input, acc)
    if training:
        axes = _bn_axes(x)
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - _bshape(mean, x.ndim)), axis=axes)
        invstd = lax.rsqrt(var + eps)
        out = _bn_normalize(x, mean, invstd, weight, bias, acc)
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = _cast(_to(running_mean, acc) * (1 - momentum) + mean * momentum, running_mean.dtype)
        if running_var is not None:
            n = x.size // x.shape[1]
            unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.inf
            new_var = _cast(_to(running_var, acc) * (1 - momentum) + unbiased * momentum, running_var.dtype)
        return (_cast(out, input.dtype), _cast(mean, stats), _cast(invstd, stats), new_mean, new_var)
    mean, var = _to(running_mean, acc), _to(running_var, acc)
    out = _bn_normalize(x, mean, lax.rsqrt(var + eps), weight, bias, acc)
    empty = jnp.zeros((0,), stats)
    return _cast(out, input.dtype), empty, empty, running_mean, running_var


def _refuse_in_place_stats(name, training, running_mean):
    if training and running_mean is not None:
        raise NotImplementedError(
            f"aten.{name} in training updates running_mean/running_var in place, which a JAX "
            "lowering cannot do; functionalized graphs carry "
            "aten._native_batch_norm_legit_functional instead (trace with aot_autograd)")


@register("native_batch_norm.default", "_native_batch_norm_legit.default")
def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    _refuse_in_place_stats("native_batch_norm", training, running_mean)
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]


@register("_native_batch_norm_legit.no_stats")
def _native_batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, True, momentum, eps)[:3]


@register("_native_batch_norm_legit_functional.default")
def _native_batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum,
                                  eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@register("_native_batch_norm_legit_no_training.default")
def _native_batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@register("native_batch_norm_backward.default")
def _native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                                save_invstd, train, eps, output_mask):
    acc = _opmath(input.dtype)
    g, x = _to(grad_out, acc), _to(input, acc)
    if train:
        mean, invstd = _to(save_mean, acc), _to(save_invstd, acc)
    else:
        mean, invstd = _to(running_mean, acc), lax.rsqrt(_to(running_var, acc) + eps)
    axes = _bn_axes(x)
    xhat = (x - _bshape(mean, x.ndim)) * _bshape(invstd, x.ndim)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    w = _to(weight, acc) if weight is not None else jnp.ones((), acc)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        scale = _bshape(w * invstd, x.ndim) if weight is not None else _bshape(invstd, x.ndim)
        if train:
            n = x.size // x.shape[1]
            gi = scale * (g - _bshape(sum_g / n, x.ndim) - xhat * _bshape(sum_gx / n, x.ndim))
        else:
            gi = g * scale
        grad_input = _cast(gi, input.dtype)
    param = weight.dtype if weight is not None else _stats_dtype(input, running_mean)
    if output_mask[1]:
        grad_weight = _cast(sum_gx, param)
    if output_mask[2]:
        grad_bias = _cast(sum_g, param)
    return grad_input, grad_weight, grad_bias


def _group_norm(x, weight, bias, N, C, group, eps):
    xg = x.reshape(N, group, -1)
    mean = jnp.mean(xg, axis=-1)
    var = jnp.mean(jnp.square(xg - mean[..., None]), axis=-1)
    rstd = lax.rsqrt(var + eps)
    out = ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    if weight is not None:
        out = out * _bshape(weight, x.ndim)
    if bias is not None:
        out = out + _bshape(bias, x.ndim)
    return out, mean, rstd


@register("native_group_norm.default")
def _native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    acc = _opmath(input.dtype)
    out, mean, rstd = _group_norm(_to(input, acc), _to(weight, acc), _to(bias, acc), N, C, group, eps)
    stats = _stats_dtype(input, weight, bias)
    return _cast(out, input.dtype), _cast(mean, stats), _cast(rstd, stats)


@register("native_group_norm_backward.default")
def _native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    acc = _opmath(input.dtype)
    x, g = _to(input, acc), _to(grad_out, acc)
    m, r = _to(mean, acc)[..., None], _to(rstd, acc)[..., None]
    xhat = (x.reshape(N, group, -1) - m) * r
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        # the layer-norm formula within each group, on the gradient through the affine weight
        gw = (g * _bshape(_to(weight, acc), g.ndim) if weight is not None else g).reshape(N, group, -1)
        a = jnp.mean(gw * xhat, axis=-1, keepdims=True)
        b = jnp.mean(gw, axis=-1, keepdims=True)
        grad_input = _cast((r * (gw - b - xhat * a)).reshape(x.shape), input.dtype)
    axes = _bn_axes(x)
    param = weight.dtype if weight is not None else input.dtype
    if output_mask[1] and weight is not None:
        grad_weight = _cast(jnp.sum(g * xhat.reshape(x.shape), axis=axes), param)
    if output_mask[2]:
        grad_bias = _cast(jnp.sum(g, axis=axes), param)
    return grad_input, grad_weight, grad_bias


# -- losses ---------------------------------------------------------------------------------------

_section("loss")


def _nll_parts(self, target, weight, ignore_index):
    class_axis = 0 if self.ndim == 1 else 1
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    w = jnp.ones((), self.dtype) if weight is None else _to(weight, self.dtype)[t]
    w = jnp.where(valid, w, jnp.zeros((), self.dtype))
    return class_axis, valid, t, w


@register("nll_loss_forward.default", "nll_loss2d_forward.default")
def _nll_loss_forward(self, target, weight, reduction, ignore_index):
    class_axis, valid, t, w = _nll_parts(self, target, weight, ignore_index)
    picked = jnp.take_along_axis(self, jnp.expand_dims(t, class_axis), axis=class_axis)
    loss = -jnp.squeeze(picked, class_axis) * w
    if reduction == 0:
        return loss, jnp.zeros((), self.dtype)
    total = jnp.sum(w)
    return (jnp.sum(loss) / total if reduction == 1 else jnp.sum(loss)), total


@register("nll_loss_backward.default", "nll_loss2d_backward.default")
def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    class_axis, valid, t, w = _nll_parts(self, target, weight, ignore_index)
    g = grad_output / total_weight if reduction == 1 else grad_output
    contribution = jnp.where(valid, -w * g, jnp.zeros((), self.dtype))
    classes = lax.broadcasted_iota(jnp.int64, self.shape, class_axis)
    hit = classes == jnp.expand_dims(t, class_axis)
    return jnp.where(hit, jnp.expand_dims(contribution, class_axis), jnp.zeros((), self.dtype)).astype(self.dtype)


# -- embedding, indexing and scatter --------------------------------------------------------------

_section("indexing")


@register("embedding.default")
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0, mode="clip")


@register("embedding_dense_backward.default")
def _embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    acc = _opmath(grad_output.dtype)
    flat = indices.reshape(-1)
    g = _to(grad_output, acc).reshape(flat.shape[0], -1)
    if padding_idx >= 0:
        g = jnp.where((flat == padding_idx)[:, None], jnp.zeros((), acc), g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), acc).at[flat].add(1)
        g = g / counts[flat][:, None]
    grad = jnp.zeros((num_weights, g.shape[1]), acc).at[flat].add(g)
    return _cast(grad.reshape((num_weights,) + grad_output.shape[indices.ndim:]), grad_output.dtype)


def _index_key(indices):
    key = []
    for index in indices:
        if index is None:
            key.append(slice(None))
        elif index.dtype in (jnp.bool_, jnp.uint8):
            key.append(index.astype(jnp.bool_))
        else:
            key.append(index)
    return tuple(key)


@register("index.Tensor", "_unsafe_index.Tensor")
def _index(self, indices):
    """Advanced indexing (numpy's rules are torch's); a boolean mask needs concrete
    values (eager only: its result's shape depends on them)."""
    return self[_index_key(indices)]


def _masked_put(self, position, mask, values, accumulate):
    """``self[:, ..., mask] = values`` (mask at ``position``) without the mask's
    nonzero count, for values constant along the masked dimension."""
    pre, rest = self.shape[:position], self.shape[position + mask.ndim:]
    rank = len(pre) + 1 + len(rest)
    if values.ndim > rank:
        return None
    full = values.reshape((1,) * (rank - values.ndim) + values.shape)
    if full.shape[len(pre)] != 1:
        return None
    full = full.reshape(full.shape[:len(pre)] + (1,) * mask.ndim + full.shape[len(pre) + 1:])
    where = mask.reshape((1,) * len(pre) + mask.shape + (1,) * len(rest))
    if accumulate:
        return self + jnp.where(where, full, jnp.zeros((), self.dtype))
    return jnp.where(where, full, self)


@register("index_put.default", "_unsafe_index_put.default", "_index_put_impl.default")
def _index_put(self, indices, values, accumulate=False, unsafe=False):
    values = _to(values, self.dtype)
    key = _index_key(indices)
    masks = [i for i, k in enumerate(key) if _is_array(k) and k.dtype == jnp.bool_]
    if masks:
        position = masks[0]
        if len(masks) == 1 and all(k == slice(None) for k in key[:position]) and position == len(key) - 1:
            out = _masked_put(self, position, key[position], values, accumulate)
            if out is not None:
                return out
    ref = self.at[key]
    return ref.add(values) if accumulate else ref.set(values)


@register("index_select.default")
def _index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=dim % self.ndim, mode="clip")


@register("gather.default")
def _gather(self, dim, index, *, sparse_grad=False):
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    axis = dim % self.ndim
    if index.ndim == 0:
        index = index.reshape((1,) * self.ndim)
    src = self[tuple(slice(None) if d == axis else slice(0, index.shape[d]) for d in range(self.ndim))]
    return jnp.take_along_axis(src, index, axis=axis, mode="clip")


def _scatter_coords(index, axis):
    coords = [lax.broadcasted_iota(index.dtype, index.shape, d) for d in range(index.ndim)]
    coords[axis] = index
    return tuple(coords)


def _scatter_prepare(self, dim, index, src):
    """(self, coords, src values) for torch's scatter family, 0-d made 1-d."""
    if self.ndim == 0:
        self, index = self.reshape(1), index.reshape(1)
        src = src.reshape(1) if _is_array(src) and np.ndim(src) == 0 else src
    if index.ndim == 0:
        index = index.reshape((1,) * self.ndim)
    axis = dim % self.ndim
    if _is_array(src) and np.ndim(src):
        values = _to(src, self.dtype)[tuple(slice(0, n) for n in index.shape)]
    else:
        values = jnp.broadcast_to(_value(src, self.dtype), index.shape)
    return self, _scatter_coords(index, axis), values


_SCATTER_IDENTITY = {"sum": 0, "add": 0, "prod": 1, "multiply": 1, "mean": 0}


def _reduce_identity(reduce, dtype):
    if reduce == "amax":
        return _lowest(dtype)
    if reduce == "amin":
        return jnp.inf if _is_float(dtype) else jnp.iinfo(dtype).max
    return _SCATTER_IDENTITY[reduce]


def _scatter_impl(self, dim, index, src, reduce=None, include_self=True):
    shape = self.shape
    x, coords, values = _scatter_prepare(self, dim, index, src)
    if reduce is None:
        out = x.at[coords].set(values)
        return out.reshape(shape)
    if not include_self:
        hit = jnp.zeros(x.shape, jnp.bool_).at[coords].set(True)
        x = jnp.where(hit, jnp.asarray(_reduce_identity(reduce, x.dtype), x.dtype), x)
    ref = x.at[coords]
    if x.dtype == jnp.bool_ and reduce in ("sum", "add", "prod", "multiply"):
        out = ref.max(values) if reduce in ("sum", "add") else ref.min(values)  # or / and
    elif reduce in ("sum", "add", "mean"):
        out = ref.add(values)
    elif reduce in ("prod", "multiply"):
        out = ref.multiply(values)
    elif reduce == "amax":
        out = ref.max(values)
    elif reduce == "amin":
        out = ref.min(values)
    else:
        raise NotImplementedError(f"scatter reduce={reduce!r}")
    if reduce == "mean":
        count = jnp.zeros(x.shape, x.dtype).at[coords].add(jnp.ones((), x.dtype))
        count = count + (1 if include_self else 0)
        count = jnp.where(count == 0, jnp.ones((), x.dtype), count)
        out = jnp.floor_divide(out, count) if _is_integral(x.dtype) else out / count
    return out.reshape(shape)


@register("scatter.src", "scatter.value")
def _scatter(self, dim, index, src=None, value=None):
    return _scatter_impl(self, dim, index, src if value is None else value)


@register("scatter.reduce", "scatter.value_reduce")
def _scatter_reduce_legacy(self, dim, index, src=None, value=None, *, reduce):
    return _scatter_impl(self, dim, index, src if value is None else value, reduce=reduce)


@register("scatter_add.default")
def _scatter_add(self, dim, index, src):
    return _scatter_impl(self, dim, index, src, reduce="sum")


@register("scatter_reduce.two")
def _scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    return _scatter_impl(self, dim, index, src, reduce=reduce, include_self=include_self)


@register("masked_scatter.default")
def _masked_scatter(self, mask, source):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    flat_mask = jnp.broadcast_to(mask, shape).reshape(-1)
    flat = jnp.broadcast_to(self, shape).reshape(-1)
    position = jnp.cumsum(flat_mask.astype(jnp.int64)) - 1
    src = _to(source, self.dtype).reshape(-1)
    picked = src[jnp.clip(position, 0, max(src.shape[0] - 1, 0))]
    return jnp.where(flat_mask, picked, flat).reshape(shape)


@register("index_add.default")
def _index_add(self, dim, index, source, *, alpha=1):
    shape = self.shape
    x = self.reshape(1) if self.ndim == 0 else self
    src = _to(source, self.dtype)
    src = src.reshape(1) if src.ndim == 0 else src
    if alpha != 1:
        src = src * _weak(alpha, self.dtype)
    key = (slice(None),) * _axis(dim, x.ndim) + (index.reshape(-1),)
    return x.at[key].add(src).reshape(shape)


@register("nonzero.default")
def _nonzero(self):
    """Eager only (the count depends on the values)."""
    if self.ndim == 0:
        return jnp.zeros((int(self != 0), 0), jnp.int64)
    return jnp.stack(jnp.nonzero(self), axis=-1).astype(jnp.int64)


@register("bucketize.Tensor")
def _bucketize(self, boundaries, *, out_int32=False, right=False):
    out = jnp.searchsorted(boundaries, self, side="right" if right else "left")
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


# -- views and shape ops --------------------------------------------------------------------------

_section("shape")


@register("view.default", "_unsafe_view.default", "reshape.default", "view_copy.default",
          "_reshape_alias.default")
def _view(self, size, stride=None):
    return jnp.reshape(self, tuple(size))


@register("view.dtype")
def _view_dtype(self, dtype):
    new = to_jax_dtype(dtype)
    old = self.dtype
    if new.itemsize == old.itemsize:
        return lax.bitcast_convert_type(self, new)
    if new.itemsize < old.itemsize:
        out = lax.bitcast_convert_type(self, new)  # adds a trailing dim of the ratio
        return out.reshape(self.shape[:-1] + (-1,)) if self.ndim else out.reshape(-1)
    ratio = new.itemsize // old.itemsize
    return lax.bitcast_convert_type(self.reshape(self.shape[:-1] + (-1, ratio)), new)


@register("expand.default", "expand_copy.default")
def _expand(self, size, *, implicit=False):
    lead = len(size) - self.ndim
    shape = [self.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(self, tuple(shape))


@register("permute.default", "permute_copy.default")
def _permute(self, dims):
    return jnp.transpose(self, [d % self.ndim for d in dims]) if self.ndim else self


@register("t.default")
def _t(self):
    return self if self.ndim < 2 else self.T


@register("transpose.int")
def _transpose(self, dim0, dim1):
    return self if self.ndim < 2 else jnp.swapaxes(self, dim0, dim1)


@register("squeeze.default", "squeeze.dim", "squeeze.dims")
def _squeeze(self, dim=None):
    if self.ndim == 0:
        return self
    dims = range(self.ndim) if dim is None else _dims(dim, self.ndim, empty_means_all=False)
    return jnp.squeeze(self, tuple(d for d in dims if self.shape[d] == 1))


@register("unsqueeze.default")
def _unsqueeze(self, dim):
    return jnp.expand_dims(self, dim % (self.ndim + 1))


@register("alias.default", "lift_fresh_copy.default", "lift_fresh.default", "detach.default",
          "prims.view_of.default", "alias_copy.default")
def _identity(self):
    return self


@register("clone.default")
def _clone(self, *, memory_format=None):
    return self


@register("_to_copy.default")
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    return self if dtype is None else _to(self, to_jax_dtype(dtype))


@register("prims.convert_element_type.default")
def _convert_element_type(a, dtype):
    return _to(a, to_jax_dtype(dtype))


@register("copy.default")
def _copy(self, src, non_blocking=False):
    return jnp.broadcast_to(_to(src, self.dtype), self.shape)


def _strided_index(size, stride, storage_offset, numel, name):
    index = np.full(tuple(size), storage_offset or 0, np.int64)
    for axis, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = n
        index = index + (np.arange(n) * st).reshape(shape)
    if index.size and (index.max() >= numel or index.min() < 0):
        raise NotImplementedError(
            f"aten.{name} reads past its input's {numel} elements: only views of a contiguous "
            "tensor's own elements (what aot_autograd produces) are lowered")
    return index


@register("as_strided.default", "as_strided_copy.default")
def _as_strided(self, size, stride, storage_offset=None):
    """As if on a contiguous input that owns its storage from offset 0."""
    index = _strided_index(size, stride, storage_offset, self.size, "as_strided")
    return self.reshape(-1)[jnp.asarray(index)]


@register("as_strided_scatter.default")
def _as_strided_scatter(self, src, size, stride, storage_offset=None):
    index = _strided_index(size, stride, storage_offset, self.size, "as_strided_scatter")
    flat = self.reshape(-1).at[jnp.asarray(index.reshape(-1))].set(_to(src, self.dtype).reshape(-1))
    return flat.reshape(self.shape)


@register("select.int")
def _select(self, dim, index):
    axis = dim % self.ndim
    return lax.index_in_dim(self, index % self.shape[axis], axis, keepdims=False)


def _slice_bounds(n, start, end, step):
    start, end, step = slice(start, end, step).indices(n)
    return start, max(end, start), step


@register("slice.Tensor")
def _slice(self, dim=0, start=None, end=None, step=1):
    axis = dim % self.ndim
    start, end, step = _slice_bounds(self.shape[axis], start, end, step)
    return lax.slice_in_dim(self, start, end, step, axis=axis)


@register("narrow.default", "narrow_copy.default")
def _narrow(self, dim, start, length):
    axis = dim % self.ndim
    start = start % self.shape[axis] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, 1, axis=axis)


@register("slice_scatter.default")
def _slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    axis = dim % self.ndim
    start, end, step = _slice_bounds(self.shape[axis], start, end, step)
    key = (slice(None),) * axis + (slice(start, end, step),)
    return self.at[key].set(_to(src, self.dtype))


@register("select_scatter.default")
def _select_scatter(self, src, dim, index):
    axis = dim % self.ndim
    key = (slice(None),) * axis + (index % self.shape[axis],)
    return self.at[key].set(_to(src, self.dtype))


@register("diagonal.default", "diagonal_copy.default")
def _diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, dim1 % self.ndim, dim2 % self.ndim)


@register("diagonal_scatter.default")
def _diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = dim1 % self.ndim, dim2 % self.ndim
    moved = jnp.moveaxis(self, (d1, d2), (-2, -1))
    length = src.shape[-1]
    rows = np.arange(length) + max(-offset, 0)
    cols = np.arange(length) + max(offset, 0)
    moved = moved.at[..., rows, cols].set(_to(src, self.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@register("unfold.default")
def _unfold(self, dimension, size, step):
    if self.ndim == 0:
        return self.reshape(1)
    axis = dimension % self.ndim
    count = (self.shape[axis] - size) // step + 1
    index = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    taken = jnp.take(self, jnp.asarray(index), axis=axis)  # [..., count, size, ...]
    return jnp.moveaxis(taken, axis + 1, -1)


def _split_sizes(n, split_size):
    if split_size == 0:
        return [0] if n == 0 else None
    count = max(-(-n // split_size), 1)
    return [min(split_size, n - i * split_size) for i in range(count)]


def _split_at(self, sizes, dim):
    axis = _axis(dim, self.ndim)
    out, start = [], 0
    for size in sizes:
        out.append(lax.slice_in_dim(self, start, start + size, axis=axis))
        start += size
    return out


@register("split.Tensor", "unsafe_split.Tensor")
def _split(self, split_size, dim=0):
    return _split_at(self, _split_sizes(self.shape[_axis(dim, self.ndim)], split_size), dim)


@register("split_with_sizes.default", "unsafe_split_with_sizes.default", "split_with_sizes_copy.default")
def _split_with_sizes(self, split_sizes, dim=0):
    return _split_at(self, split_sizes, dim)


@register("chunk.default")
def _chunk(self, chunks, dim=0):
    n = self.shape[_axis(dim, self.ndim)]
    return _split(self, max(-(-n // chunks), 1), dim)


@register("unbind.int", "unbind_copy.int")
def _unbind(self, dim=0):
    axis = dim % self.ndim
    return [lax.index_in_dim(self, i, axis, keepdims=False) for i in range(self.shape[axis])]


def _promoted(tensors):
    """``tensors`` in their common dtype (cat and stack promote; their inputs are all
    of one priority group)."""
    out = to_jax_dtype(functools.reduce(torch.promote_types, [_tdtype(t) for t in tensors]))
    return [_to(t, out) for t in tensors], out


@register("cat.default", "concat.default", "concatenate.default")
def _cat(tensors, dim=0):
    tensors, out = _promoted(list(tensors))
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]  # torch skips legacy empties
    if not kept:
        return jnp.zeros((0,), out)
    return jnp.concatenate(kept, axis=_axis(dim, kept[0].ndim))


@register("stack.default")
def _stack(tensors, dim=0):
    tensors, _ = _promoted(list(tensors))
    return jnp.stack(tensors, axis=dim % (tensors[0].ndim + 1))


@register("constant_pad_nd.default")
def _constant_pad_nd(self, pad, value=0):
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        config[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, _value(value, self.dtype), config)


@register("flip.default")
def _flip(self, dims):
    return jnp.flip(self, axis=_dims(dims, self.ndim, empty_means_all=False)) if self.ndim else self


@register("roll.default")
def _roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(d % self.ndim for d in dims))


@register("repeat.default")
def _repeat(self, repeats):
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    return jnp.tile(x, tuple(repeats))


@register("tril.default")
def _tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@register("triu.default")
def _triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


@register("view_as_real.default")
def _view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@register("view_as_complex.default")
def _view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@register("prims.broadcast_in_dim.default")
def _broadcast_in_dim(a, shape, broadcast_dimensions):
    return lax.broadcast_in_dim(a, tuple(shape), tuple(broadcast_dimensions))


@register("prims.squeeze.default")
def _prims_squeeze(a, dimensions):
    return jnp.squeeze(a, tuple(dimensions)) if dimensions else a


# -- creation -------------------------------------------------------------------------------------

_section("creation")


def _fill_dtype(value, dtype):
    if dtype is not None:
        return to_jax_dtype(dtype)
    return to_jax_dtype(_tdtype(value) if _is_array(value) else _scalar_dtype(value))


@register("full.default")
def _full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = _fill_dtype(fill_value, dtype)
    return jnp.full(tuple(size), _value(fill_value, out), out)


@register("full_like.default")
def _full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    out = _jdtype(dtype, self.dtype)
    return jnp.full(self.shape, _value(fill_value, out), out)


def _constant_factory(value):
    def impl(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        out = _jdtype(dtype, to_jax_dtype(_default_float()))
        return jnp.full(tuple(size), _value(value, out), out)
    return impl


def _constant_like(value):
    def impl(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        out = _jdtype(dtype, self.dtype)
        return jnp.full(self.shape, _value(value, out), out)
    return impl


def _constant_new(value):
    def impl(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
        out = _jdtype(dtype, self.dtype)
        return jnp.full(tuple(size), _value(value, out), out)
    return impl


register("zeros.default", "empty.memory_format")(_constant_factory(0))
register("ones.default")(_constant_factory(1))
register("zeros_like.default", "empty_like.default")(_constant_like(0))
register("ones_like.default")(_constant_like(1))
register("new_zeros.default", "new_empty.default")(_constant_new(0))
register("new_ones.default")(_constant_new(1))


@register("empty_strided.default")
def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _constant_factory(0)(size, dtype=dtype)


@register("empty_permuted.default")
def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _constant_factory(0)(size, dtype=dtype)


@register("new_empty_strided.default")
def _new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _constant_new(0)(self, size, dtype=dtype)


@register("new_full.default")
def _new_full(self, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = _jdtype(dtype, self.dtype)
    return jnp.full(tuple(size), _value(fill_value, out), out)


@register("scalar_tensor.default")
def _scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = _jdtype(dtype, to_jax_dtype(_default_float()))
    return _value(s, out)


@register("fill.Scalar", "fill.Tensor")
def _fill(self, value):
    return jnp.full(self.shape, _value(value, self.dtype), self.dtype)


@register("zero.default")
def _zero(self):
    return jnp.zeros_like(self)


def _arange_impl(start, end, step, dtype):
    if dtype is None:
        numbers = (start, end, step)
        dtype = _default_float() if any(isinstance(v, float) for v in numbers) else torch.int64
    out = to_jax_dtype(dtype)
    count = max(math.ceil((end - start) / step), 0)
    if _is_integral(out) and all(isinstance(v, int) for v in (start, end, step)):
        return (start + jnp.arange(count, dtype=jnp.int64) * step).astype(out)
    # torch's CPU kernel computes start + i * step in double, then rounds
    return (start + jnp.arange(count, dtype=jnp.float64) * step).astype(out)


@register("arange.default")
def _arange_end(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange_impl(0, end, 1, dtype)


@register("arange.start")
def _arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange_impl(start, end, 1, dtype)


@register("arange.start_step")
def _arange(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange_impl(start, end, step, dtype)


@register("prims.iota.default")
def _iota(length, *, start, step, dtype, device, requires_grad):
    out = to_jax_dtype(dtype)
    return (start + jnp.arange(length, dtype=out) * step).astype(out)


# -- sorting --------------------------------------------------------------------------------------

_section("sorting")


def _sort_impl(x, dim, descending):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    axis = dim % x.ndim
    keys = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    index = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    if descending:
        # a stable descending sort: stable ascending sort of the reversed array, reversed
        keys, index = jnp.flip(keys, axis), jnp.flip(index, axis)
        keys, index = lax.sort((keys, index), dimension=axis, num_keys=1, is_stable=True)
        keys, index = jnp.flip(keys, axis), jnp.flip(index, axis)
    else:
        keys, index = lax.sort((keys, index), dimension=axis, num_keys=1, is_stable=True)
    return keys.astype(x.dtype), index


@register("sort.default")
def _sort(self, dim=-1, descending=False):
    return _sort_impl(self, dim, descending)


@register("sort.stable")
def _sort_stable(self, *, stable=None, dim=-1, descending=False):
    return _sort_impl(self, dim, descending)


@register("topk.default")
def _topk(self, k, dim=-1, largest=True, sorted=True):
    values, index = _sort_impl(self, dim, largest)
    if self.ndim == 0:
        return values, index
    axis = dim % self.ndim
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(index, 0, k, axis=axis)


# -- attention ------------------------------------------------------------------------------------

_section("attention")


def _attention(q, k, v, is_causal, attn_mask, scale):
    """(out, logsumexp) of scaled dot-product attention, math form."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("...le,...se->...ls", q, k, precision=HIGHEST) * scale
    if is_causal:
        causal = np.tril(np.ones((q.shape[-2], k.shape[-2]), bool))
        scores = jnp.where(causal, scores, -jnp.inf)
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            scores = jnp.where(attn_mask, scores, -jnp.inf)
        else:
            scores = scores + _to(attn_mask, scores.dtype)
    lse = jsp.logsumexp(scores, axis=-1)
    probs = jnp.exp(scores - lse[..., None])
    return jnp.einsum("...ls,...sv->...lv", probs, v, precision=HIGHEST), lse


def _no_attention_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError(
            "aten._scaled_dot_product_flash_attention_for_cpu with dropout_p > 0 is not lowered "
            "(its backward has no RNG state to replay); use dropout_p=0 or the math path")


@register("_scaled_dot_product_flash_attention_for_cpu.default")
def _flash_attention_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                         scale=None):
    _no_attention_dropout(dropout_p)
    acc = _opmath(query.dtype)
    out, lse = _attention(_to(query, acc), _to(key, acc), _to(value, acc), is_causal, attn_mask, scale)
    return _cast(out, query.dtype), _cast(lse, acc)


@register("_scaled_dot_product_flash_attention_for_cpu_backward.default")
def _flash_attention_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                  attn_mask=None, scale=None):
    _no_attention_dropout(dropout_p)
    acc = _opmath(query.dtype)
    _, pullback = jax.vjp(lambda q, k, v: _attention(q, k, v, is_causal, attn_mask, scale)[0],
                          _to(query, acc), _to(key, acc), _to(value, acc))
    gq, gk, gv = pullback(_to(grad_out, acc))
    return _cast(gq, query.dtype), _cast(gk, key.dtype), _cast(gv, value.dtype)


# -- random ops (keyword-only key=) ---------------------------------------------------------------

_section("random")


def _float_out(dtype, default=None):
    out = _jdtype(dtype, default if default is not None else to_jax_dtype(_default_float()))
    return out


def _uniform_draw(key, shape, dtype, low=0.0, high=1.0):
    # drawn in the target dtype itself, so that rounding cannot reach ``high``
    return jax.random.uniform(key, tuple(shape), jnp.dtype(dtype), low, high)


def _normal_draw(key, shape, dtype):
    dtype = jnp.dtype(dtype)
    return _cast(jax.random.normal(key, tuple(shape), _opmath(dtype)), dtype)


@register("rand.default", "rand.generator", random=True)
def _rand(size, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return _uniform_draw(key, size, _float_out(dtype))


@register("randn.default", "randn.generator", random=True)
def _randn(size, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return _normal_draw(key, size, _float_out(dtype))


@register("rand_like.default", "rand_like.generator", random=True)
def _rand_like(self, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    return _uniform_draw(key, self.shape, _jdtype(dtype, self.dtype))


@register("randn_like.default", "randn_like.generator", random=True)
def _randn_like(self, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
                memory_format=None):
    return _normal_draw(key, self.shape, _jdtype(dtype, self.dtype))


def _randint_draw(key, low, high, shape, dtype):
    out = _jdtype(dtype, jnp.dtype(jnp.int64))
    draw = jax.random.randint(key, tuple(shape), low, high, jnp.int64)
    return draw.astype(out)


@register("randint.default", "randint.generator", random=True)
def _randint(high, size, *, key, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return _randint_draw(key, 0, high, size, dtype)


@register("randint.low", "randint.low_generator", random=True)
def _randint_low(low, high, size, *, key, generator=None, dtype=None, layout=None, device=None,
                 pin_memory=None):
    return _randint_draw(key, low, high, size, dtype)


@register("randint_like.default", "randint_like.generator", "randint_like.Tensor",
          "randint_like.Tensor_generator", random=True)
def _randint_like(self, high, *, key, generator=None, dtype=None, layout=None, device=None,
                  pin_memory=None, memory_format=None):
    return _randint_draw(key, 0, high, self.shape, _jdtype(dtype, self.dtype))


@register("randint_like.low_dtype", "randint_like.low_generator_dtype", random=True)
def _randint_like_low(self, low, high, *, key, generator=None, dtype=None, layout=None, device=None,
                      pin_memory=None, memory_format=None):
    return _randint_draw(key, low, high, self.shape, _jdtype(dtype, self.dtype))


@register("randperm.default", "randperm.generator", random=True)
def _randperm(n, *, key, generator=None, dtype=torch.int64, layout=None, device=None, pin_memory=None):
    return jax.random.permutation(key, n).astype(_jdtype(dtype, jnp.dtype(jnp.int64)))


def _bernoulli_draw(key, p, shape, dtype):
    acc = _opmath(dtype) if _is_float(dtype) else jnp.dtype(jnp.float32)
    u = jax.random.uniform(key, tuple(shape), acc)
    return (u < (_to(p, acc) if _is_array(p) else p)).astype(dtype)


@register("bernoulli.default", random=True)
def _bernoulli(self, *, key, generator=None):
    return _bernoulli_draw(key, self, self.shape, self.dtype)


@register("bernoulli.p", random=True)
def _bernoulli_p(self, p=0.5, *, key, generator=None):
    return _bernoulli_draw(key, p, self.shape, self.dtype)


@register("bernoulli.Tensor", random=True)
def _bernoulli_tensor(self, p, *, key, generator=None):
    return _bernoulli_draw(key, jnp.broadcast_to(p, self.shape), self.shape, self.dtype)


@register("native_dropout.default", random=True)
def _native_dropout(input, p, train, *, key):
    """(output, mask): torch's ``input * mask * 1/(1-p)`` (scale 0 for p == 1)."""
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, input.shape)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    acc = _opmath(input.dtype)
    out = _to(input, acc) * keep.astype(acc) * scale
    return _cast(out, input.dtype), keep


def _normal_impl(key, mean, std, shape, dtype):
    z = _normal_draw(key, shape, _opmath(dtype))
    return _cast(_to(mean, z.dtype) + _to(std, z.dtype) * z, dtype)


@register("normal.Tensor_Tensor", random=True)
def _normal_tt(mean, std, *, key, generator=None):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return _normal_impl(key, mean, std, shape, to_jax_dtype(_result_type(mean, std)))


@register("normal.Tensor_float", random=True)
def _normal_tf(mean, std=1.0, *, key, generator=None):
    return _normal_impl(key, mean, std, mean.shape, mean.dtype)


@register("normal.float_Tensor", random=True)
def _normal_ft(mean, std, *, key, generator=None):
    return _normal_impl(key, mean, std, std.shape, std.dtype)


@register("normal.float_float", random=True)
def _normal_ff(mean, std, size, *, key, generator=None, dtype=None, layout=None, device=None,
               pin_memory=None):
    return _normal_impl(key, mean, std, size, _float_out(dtype))


@register("normal_functional.default", random=True)
def _normal_functional(self, mean=0.0, std=1.0, *, key, generator=None):
    return _normal_impl(key, mean, std, self.shape, self.dtype)


@register("uniform.default", random=True)
def _uniform(self, *bounds, key, generator=None, **named):
    """``uniform(self, from=0, to=1)``: ``from`` is a Python keyword, so the bounds come
    positionally or as ``**{"from": ..., "to": ...}``."""
    low = bounds[0] if len(bounds) > 0 else named.get("from", 0.0)
    high = bounds[1] if len(bounds) > 1 else named.get("to", 1.0)
    return _uniform_draw(key, self.shape, self.dtype, low, high)


@register("exponential.default", random=True)
def _exponential(self, lambd=1.0, *, key, generator=None):
    acc = _opmath(self.dtype)
    return _cast(jax.random.exponential(key, self.shape, acc) / lambd, self.dtype)


# -- _foreach_* (functional variants; each returns a list) ----------------------------------------

_section("foreach")


def _pointwise_lowering(name):
    return _TABLE[_resolve(name)]


_FOREACH_BINARY = {
    # name: (lowering of one element, overloads, whether List/Tensor take alpha)
    "add": ("add.Tensor", ("List", "Scalar", "ScalarList", "Tensor"), True),
    "sub": ("sub.Tensor", ("List", "Scalar", "ScalarList"), True),
    "mul": ("mul.Tensor", ("List", "Scalar", "ScalarList", "Tensor"), False),
    "div": ("div.Tensor", ("List", "Scalar", "ScalarList", "Tensor"), False),
    "maximum": ("maximum.default", ("List", "Scalar", "ScalarList"), False),
    "minimum": ("minimum.default", ("List", "Scalar", "ScalarList"), False),
    "clamp_min": ("clamp_min.default", ("List", "Scalar", "ScalarList"), False),
    "clamp_max": ("clamp_max.default", ("List", "Scalar", "ScalarList"), False),
    "pow": ("pow.Tensor_Tensor", ("List", "Scalar", "ScalarList"), False),
}


def _foreach_binary(fn, overload, alpha):
    if overload in ("List", "ScalarList"):
        def impl(self, other, *, alpha=1):
            kw = {"alpha": alpha} if alpha != 1 else {}
            return [fn(a, b, **kw) for a, b in zip(self, other)]
    else:  # Scalar / Tensor: one operand for every element
        def impl(self, other, *, alpha=1):
            kw = {"alpha": alpha} if alpha != 1 else {}
            return [fn(a, other, **kw) for a in self]
    return impl


for _name, (_element, _overloads, _alpha) in _FOREACH_BINARY.items():
    for _overload in _overloads:
        register(f"_foreach_{_name}.{_overload}")(
            _foreach_binary(_pointwise_lowering(_element), _overload, _alpha))


@register("_foreach_pow.ScalarAndTensor")
def _foreach_pow_scalar_base(self, exponent):
    return [_pointwise_lowering("pow.Scalar")(self, e) for e in exponent]


_FOREACH_UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor",
    "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "sigmoid",
    "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "rsqrt",
)


def _foreach_unary(fn):
    return lambda self: [fn(a) for a in self]


for _name in _FOREACH_UNARY:
    register(f"_foreach_{_name}.default")(_foreach_unary(_pointwise_lowering(f"{_name}.default")))


@register("_foreach_zero.default")
def _foreach_zero(self):
    return [jnp.zeros_like(a) for a in self]


@register("_foreach_copy.default")
def _foreach_copy(self, src, non_blocking=False):
    return [_copy(a, b) for a, b in zip(self, src)]


def _foreach_addc(divide):
    element = _addc(divide)

    def scalar(self, tensor1, tensor2, value=1):
        return [element(a, b, c, value=value) for a, b, c in zip(self, tensor1, tensor2)]

    def scalar_list(self, tensor1, tensor2, scalars):
        return [element(a, b, c, value=s) for a, b, c, s in zip(self, tensor1, tensor2, scalars)]

    def tensor(self, tensor1, tensor2, scalars):
        # one value per element, read as Python scalars are (torch's slow path calls .item())
        return [element(a, b, c, value=_to(scalars[i], _opmath(a.dtype)))
                for i, (a, b, c) in enumerate(zip(self, tensor1, tensor2))]
    return scalar, scalar_list, tensor


for _name, _divides in (("addcmul", False), ("addcdiv", True)):
    _scalar, _scalar_list, _tensor = _foreach_addc(_divides)
    register(f"_foreach_{_name}.Scalar")(_scalar)
    register(f"_foreach_{_name}.ScalarList")(_scalar_list)
    register(f"_foreach_{_name}.Tensor")(_tensor)


@register("_foreach_lerp.List", "_foreach_lerp.Scalar", "_foreach_lerp.ScalarList")
def _foreach_lerp(self, tensors1, weights=None, weight=None):
    w = weights if weights is not None else weight
    if isinstance(w, (list, tuple)):
        return [_lerp(a, b, c) for a, b, c in zip(self, tensors1, w)]
    return [_lerp(a, b, w) for a, b in zip(self, tensors1)]


def _vector_norm(a, ord, dtype, root):
    result = _jdtype(dtype, jnp.dtype(to_jax_dtype(_real_of(_tdtype(a)))))
    x = jnp.abs(_to(a, _opmath(a.dtype)))
    if ord == math.inf:
        return _cast(jnp.max(x), result)
    power = jnp.sum(x * x) if ord == 2 else jnp.sum(x) if ord == 1 else jnp.sum(x ** ord)
    if root and ord != 1:
        power = jnp.sqrt(power) if ord == 2 else power ** (1.0 / ord)
    return _cast(power, result)


@register("_foreach_norm.Scalar")
def _foreach_norm(self, ord=2, dtype=None):
    return [_vector_norm(a, ord, dtype, root=True) for a in self]


@register("_foreach_powsum.Scalar")
def _foreach_powsum(self, ord=2, dtype=None):
    return [_vector_norm(a, ord, dtype, root=False) for a in self]


@register("_foreach_clone.default")
def _foreach_clone(self, *, memory_format=None):
    return list(self)


@register("_foreach_mm.default")
def _foreach_mm(self, mat2):
    return [_matmul(a, b) for a, b in zip(self, mat2)]


@register("_foreach_max.default")
def _foreach_max(self):
    return [jnp.max(a) for a in self]


# -- graph utilities ------------------------------------------------------------------------------

_section("misc")


@register("_local_scalar_dense.default")
def _local_scalar_dense(self):
    """A 0-d array (the caller makes a Python number of it where it can)."""
    return jnp.reshape(self, ())


@register("_assert_tensor_metadata.default")
def _assert_tensor_metadata(a, size=None, stride=None, dtype=None, *, device=None, layout=None):
    return None


@register("_assert_async.default", "_assert_async.msg")
def _assert_async(self, assert_msg=None):
    return None


# -- refusals -------------------------------------------------------------------------------------

_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                   "unique_consecutive", "repeat_interleave", "argwhere", "nonzero_static"}
_HINTS = {
    "_fused_adam": "the fused optimizer kernels are not lowered: use the optimizer with "
                   "foreach=True or foreach=False (its _foreach_* or per-tensor ops are)",
    "_fused_adamw": "the fused optimizer kernels are not lowered: use the optimizer with "
                    "foreach=True or foreach=False (its _foreach_* or per-tensor ops are)",
    "_fused_sgd": "the fused optimizer kernels are not lowered: use foreach=True or foreach=False",
}


def unsupported(op) -> str:
    """The text of a refusal of ``op``: its name and, where known, what to do."""
    name = str(op)
    schema = getattr(op, "_schema", None)
    packet = name.split(".")[1] if name.count(".") >= 2 else name
    base = packet.rstrip("_")
    message = f"{name} has no JAX lowering"
    if base in _HINTS or packet in _HINTS:
        return f"{message}: {_HINTS.get(base) or _HINTS[packet]}"
    if schema is not None and (schema.is_mutable or packet.endswith("_")
                               or any(a.is_out for a in schema.arguments)):
        return (f"{message}: it is an in-place or out= variant; the JAX target runs functional "
                "graphs (aot_autograd functionalizes them) - use the functional op")
    if base in _DATA_DEPENDENT:
        return (f"{message} under jax.jit: its output's shape depends on the input's values; "
                "move it out of the compiled region (e.g. torch._dynamo.graph_break()) or "
                "make the shape static")
    namespace = name.split(".")[0]
    if namespace in ("quantized", "sparse") or "sparse" in packet or "quantize" in packet:
        return f"{message}: sparse and quantized tensors are not supported by the JAX target"
    if packet.startswith("linalg_") or packet.startswith("_linalg") or packet.startswith("fft_") \
            or packet.startswith("_fft"):
        return f"{message}: linear algebra and FFT ops are not lowered yet"
    if schema is not None and torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return f"{message}: a random op the table does not cover (random lowerings take key=)"
    if op in compat.registered_decompositions():
        return (f"{message}: torch has a decomposition of it; add it to decompositions() in "
                "donate_backend/jax/lowerings.py (_DECOMPOSED) or lower it there")
    return (f"{message}: add a lowering to donate_backend/jax/lowerings.py, or a decomposition "
            "of it to decompositions()")


# -- decompositions -------------------------------------------------------------------------------

# In torch's core decompositions, but lowered directly here: one fused JAX expression
# (or one vjp) instead of a chain of ATen ops, and exactly torch's formula.
_LOWERED_INSTEAD = (
    "_softmax_backward_data.default", "_log_softmax_backward_data.default",
    "native_layer_norm_backward.default", "native_batch_norm_backward.default",
    "native_group_norm_backward.default", "gelu_backward.default", "silu.default",
    "silu_backward.default", "sigmoid_backward.default", "tanh_backward.default",
    "threshold_backward.default", "leaky_relu_backward.default", "hardtanh_backward.default",
    "elu_backward.default", "softplus.default", "softplus_backward.default",
    "nll_loss_forward.default", "nll_loss_backward.default", "nll_loss2d_forward.default",
    "nll_loss2d_backward.default", "embedding_dense_backward.default", "logsumexp.default",
    "roll.default", "tril.default", "triu.default", "masked_fill.Scalar", "masked_fill.Tensor",
    "_scaled_dot_product_flash_attention_for_cpu.default", "native_dropout_backward.default",
    "adaptive_avg_pool2d.default", "adaptive_avg_pool3d.default",
)

# Not in the core decompositions, not lowered here, and found in training graphs of
# common models: torch's own decompositions bring them to ops the table lowers.
_DECOMPOSED = (
    "upsample_nearest2d.vec", "upsample_nearest2d.default", "upsample_bilinear2d.vec",
    "upsample_bilinear2d.default", "upsample_bicubic2d.default", "upsample_trilinear3d.default",
    "grid_sampler_2d.default", "_addmm_activation.default",
    "_batch_norm_with_update_functional.default",
    "_batch_norm_no_update.default", "batch_norm_backward.default", "dist.default",
    "cauchy.default", "geometric.default", "log_normal.default", "tril_indices.default",
    "triu_indices.default", "special_zeta.default", "frexp.Tensor", "ldexp.Tensor",
    "rrelu_with_noise_backward.default", "polar.default", "alpha_dropout.default",
)


def decompositions() -> dict:
    """The decomposition table the JAX target hands aot_autograd: torch's core ATen
    decompositions, less those ops lowered directly (``_LOWERED_INSTEAD``), plus
    torch's decompositions of the non-core ops in ``_DECOMPOSED``."""
    table = compat.core_aten_decompositions()
    for name in _LOWERED_INSTEAD:
        op = _resolve(name)
        if op is not None:
            table.pop(op, None)
    extra = [op for op in map(_resolve, _DECOMPOSED) if op is not None and op not in _TABLE]
    table.update(compat.get_decompositions(extra))
    return table
