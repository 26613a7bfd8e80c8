"""Eager ops on the JAX device: every ATen op that reaches PrivateUse1, run op by op.

What runs outside compiled graphs (creating optimizer state, printing a loss, preparing
a batch, in-place and view ops, the autograd engine's accumulation, ``state_dict()``)
reaches the device here, below autograd, as on any backend. ``install`` registers one
boxed fallback for the whole PrivateUse1 key:

- views (``op.is_view``: ``view``, ``transpose``, ``slice``, ``as_strided``, ``detach``...)
  run their meta kernel on the device's tensor: a new tensor on the same storage with
  the view's sizes and strides, as a view is on any device;
- copies between the host and the device (``_copy_from``, ``_to_copy``, ``copy_``), the
  allocators (``empty``, ``empty_strided``), ``resize_``, ``set_`` and ``.item()`` are the
  device's own (``_SPECIAL``);
- every other op runs its lowering (``lowerings.lowering``) on the JAX arrays of its
  tensor arguments (``device.read``), and its results become new tensors; an in-place or
  ``out=`` op runs its functional variant and writes the result through its target
  (``device.write``: the target's views see it); a random op takes a key from the
  device's generator;
- an op whose output's shape depends on its input's values (``torch.Tag.dynamic_output_shape``:
  ``nonzero``, ``masked_select``, which ``print`` uses) runs on the host, where those values
  have to be anyway;
- an op with no lowering runs torch's decomposition of it where there is one (its parts
  come back here), else it is refused with a ``DonateXlaError`` that names it.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from ..errors import UnsupportedGraphError
from . import compat, device, lowerings

aten = torch.ops.aten
_library = None


def install() -> None:
    """Register the device's own ops as its kernels and the fallback for every other op (once).
    The allocators and copies are kernels of their own, not only the fallback's: under a
    fake mode ``torch.tensor(data, device=...)`` finds its copy by kernel."""
    global _library
    if _library is None:
        _library = (torch.library.Library("_", "IMPL"), torch.library.Library("aten", "IMPL"))
        _library[0].fallback(compat.outside_dynamo(_dispatch), "PrivateUse1")
        for op, kernel in _SPECIAL.items():
            _library[1].impl(_qualified_name(op), compat.outside_dynamo(kernel), "PrivateUse1")


def _qualified_name(op) -> str:
    name = op._schema.name.split("::")[1]
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _dispatch(op, *args, **kwargs):
    special = _SPECIAL.get(op)
    if special is not None:
        return special(*args, **kwargs)
    if op.is_view:
        return compat.meta_kernel(op, *args, **kwargs)
    written = _written_arguments(op)
    if written:
        return _mutating(op, written, args, kwargs)
    return _functional(op, args, kwargs)


# -- ops with a lowering ---------------------------------------------------------------------

def _is_device_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == device.NAME


def _arrays(value):
    """A lowering's argument: every tensor as a JAX array (a host tensor, such as a 0-d
    scalar beside device tensors, moved to the device)."""
    def to_array(v):
        if isinstance(v, torch.Tensor):
            return device.read(v) if _is_device_tensor(v) else device.from_host(v)
        return v

    return tree_map(to_array, value)


def _device_of(args, kwargs) -> torch.device:
    found = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if _is_device_tensor(v)]
    if found:
        return found[0].device
    requested = kwargs.get("device")
    return requested if isinstance(requested, torch.device) and requested.type == device.NAME else torch.device(device.NAME, 0)


def _wrapped(result, where: torch.device):
    import jax

    def to_tensor(v):
        return device.wrap(v, where) if isinstance(v, jax.Array) else v

    return tree_map(to_tensor, result)


def _run(op, args, kwargs):
    """``op``'s lowering on the arrays of ``args``/``kwargs``, or None where it has none."""
    lowered = lowerings.lowering(op)
    if lowered is None:
        return None
    extra = {"key": device.device_module().next_key()} if lowerings.is_random(op) else {}
    return (lowered(*_arrays(args), **_arrays(kwargs), **extra),)


def _functional(op, args, kwargs):
    where = _device_of(args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")} if "device" in kwargs else kwargs
    if torch.Tag.dynamic_output_shape in op.tags:
        return _on_host(op, args, kwargs, where)
    ran = _run(op, args, kwargs)
    if ran is not None:
        return _wrapped(ran[0], where)
    return _decomposed(op, args, kwargs)


def _on_host(op, args, kwargs, where):
    """An op whose output's shape depends on its input's values (``masked_select``,
    ``nonzero``: ``print`` uses them) on the host, its result back on the device: its
    shape is only known once its input's values are, so it waits for them anyway."""
    def to_host(v):
        return device.to_host(v) if _is_device_tensor(v) else v

    def to_device(v):
        return device.wrap(device.from_host(v), where) if isinstance(v, torch.Tensor) else v

    return tree_map(to_device, op(*tree_map(to_host, args), **tree_map(to_host, kwargs)))


def _decomposed(op, args, kwargs):
    table = compat.registered_decompositions()
    decomposition = table.get(op)
    if decomposition is None:
        raise UnsupportedGraphError(
            f"donate_xla: {lowerings.unsupported(op)}; it ran eagerly on a tensor on the JAX device. "
            "Compute it inside the compiled function (where aot_autograd may decompose it), or "
            "on the CPU: x.cpu().",
            help_section="The JAX target",
        )
    try:
        return decomposition(*args, **kwargs)
    except RecursionError:  # a decomposition that calls the op again
        raise UnsupportedGraphError(
            f"donate_xla: {lowerings.unsupported(op)}, and torch's decomposition of it calls it again; "
            "it ran eagerly on a tensor on the JAX device. Compute it on the CPU: x.cpu().",
            help_section="The JAX target",
        ) from None


# -- in-place and out= ops --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _written_arguments(op) -> tuple:
    """The names of the arguments ``op`` writes into (``self`` of an in-place op, ``out``)."""
    return tuple(a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


@functools.lru_cache(maxsize=None)
def _functional_variant(op) -> Optional[torch._ops.OpOverload]:
    """The out-of-place op an in-place or ``out=`` op computes: ``add_.Tensor`` ->
    ``add.Tensor``; ``add.out`` -> the overload of ``add`` that takes its other arguments."""
    schema = op._schema
    packet_name = schema.name.split("::")[1]
    written = set(_written_arguments(op))
    inputs = [a.name for a in schema.arguments if a.name not in written or not a.kwarg_only]
    base_name = packet_name[:-1] if packet_name.endswith("_") else packet_name
    packet = getattr(aten, base_name, None)
    if packet is None:
        return None
    if packet_name.endswith("_"):
        overload = getattr(packet, schema.overload_name or "default", None)
        return overload if overload is not None else getattr(packet, "default", None)
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if not candidate._schema.is_mutable and [a.name for a in candidate._schema.arguments] == inputs:
            return candidate
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    for name in packet.overloads():  # ``arange.start_out`` -> ``arange.start_step``: kwarg-only extras
        candidate = getattr(packet, name)
        if not candidate._schema.is_mutable and [
                a.name for a in candidate._schema.arguments if not a.kwarg_only] == positional:
            return candidate
    return None


def _mutating(op, written: tuple, args, kwargs):
    functional = _functional_variant(op)
    if functional is None:
        return _decomposed(op, args, kwargs)
    bound = _bind(op, args, kwargs)
    targets = [bound[name] for name in written]
    inputs = {k: v for k, v in bound.items() if not (k in written and op._schema.arguments[_index(op, k)].kwarg_only)}
    ordered = [inputs[a.name] for a in functional._schema.arguments if not a.kwarg_only and a.name in inputs]
    keywords = {a.name: inputs[a.name] for a in functional._schema.arguments if a.kwarg_only and a.name in inputs}
    ran = _run(functional, ordered, keywords)
    if ran is None:
        return _decomposed(op, args, kwargs)
    result = ran[0]
    values = result if isinstance(result, (tuple, list)) and not _is_list_target(targets) else (result,)
    for target, value in zip(targets, values):
        _write_into(target, value)
    if len(targets) == 1:
        return targets[0] if not _is_list_target(targets) else None
    return tuple(targets)


def _is_list_target(targets) -> bool:
    return len(targets) == 1 and isinstance(targets[0], (list, tuple))


def _write_into(target, value) -> None:
    if isinstance(target, (list, tuple)):  # a _foreach_ op's list of tensors
        for t, v in zip(target, value):
            _write_into(t, v)
        return
    if tuple(target.shape) != tuple(value.shape) and target.numel() != _numel(value.shape):
        _resize(target, value.shape)  # an out= tensor of another size (as torch resizes it)
    device.write(target, value)


def _numel(shape) -> int:
    count = 1
    for s in shape:
        count *= int(s)
    return count


def _index(op, name: str) -> int:
    return [a.name for a in op._schema.arguments].index(name)


def _bind(op, args, kwargs) -> dict:
    bound = {}
    for argument, value in zip(op._schema.arguments, args):
        bound[argument.name] = value
    bound.update(kwargs)
    return bound


# -- the device's own ops -----------------------------------------------------------------------

def _empty_strided(size, stride, *, dtype=None, device=None, **_):
    """A tensor whose storage has no data yet (it reads as zeros until written)."""
    dtype = dtype or torch.get_default_dtype()
    size = [int(s) for s in size]
    extent = 1 + sum((s - 1) * int(st) for s, st in zip(size, stride)) if all(size) else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    where = device if isinstance(device, torch.device) and device.type == _JAX else torch.device(_JAX, 0)
    storage = compat.device_storage(extent * itemsize, where)
    return compat.tensor_on(storage, dtype, size, [int(st) for st in stride])


def _copy_from(src, dst, non_blocking=False):
    if _is_device_tensor(dst):
        device.write(dst, device.read(src) if _is_device_tensor(src) else device.from_host(src))
    else:
        dst.copy_(device.to_host(src))
    return dst


def _copy_from_and_resize(src, dst):
    if tuple(dst.shape) != tuple(src.shape):
        dst.resize_(src.shape)
    return _copy_from(src, dst)


def _copy_(dst, src, non_blocking=False):
    return _copy_from(src, dst)


def _to_copy(src, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    dtype = dtype or src.dtype
    if device is not None and device.type != _JAX:
        host = _host_copy(src)
        return host.to(device=device, dtype=dtype)
    from .lowerings import to_jax_dtype

    if _is_device_tensor(src):
        return _wrap_new(device_mod.read(src).astype(to_jax_dtype(dtype)), src.device)
    return _wrap_new(device_mod.from_host(src).astype(to_jax_dtype(dtype)), device or torch.device(_JAX, 0))


def _host_copy(src):
    return device_mod.to_host(src) if _is_device_tensor(src) else src


def _wrap_new(array, where):
    return device_mod.wrap(array, where)


def _resize(tensor, size, memory_format=None):
    size = [int(s) for s in size]
    needed = _numel(size) * tensor.element_size()
    if needed <= tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size():
        compat.cpu_kernel(aten.set_.source_Storage_storage_offset, tensor, tensor.untyped_storage(),
                          tensor.storage_offset(), size, device_mod._contiguous_strides(size))
    else:
        device_mod.new_storage_for(tensor, size)
    return tensor


def _set_storage(tensor, source, storage_offset=0, size=(), stride=()):
    return compat.cpu_kernel(aten.set_.source_Storage_storage_offset, tensor, source, storage_offset, list(size),
                             list(stride))


def _set_from_storage(tensor, source):
    nbytes = source.nbytes()
    count = nbytes // tensor.element_size()
    return _set_storage(tensor, source, 0, [count], [1])


def _set_from_tensor(tensor, source):
    return _set_storage(tensor, source.untyped_storage(), source.storage_offset(), source.shape, source.stride())


def _set_empty(tensor):
    storage = compat.device_storage(0, tensor.device)
    return _set_storage(tensor, storage, 0, [0], [1])


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """A batch norm that updates its running statistics in place (``native_batch_norm``'s
    schema does not say so): its functional form, then the new statistics written into them."""
    if not (training and running_mean is not None and running_var is not None):
        return _functional(aten.native_batch_norm.default,
                           (input, weight, bias, running_mean, running_var, training, momentum, eps), {})
    functional = aten._native_batch_norm_legit_functional.default
    ran = _run(functional, (input, weight, bias, running_mean, running_var, training, momentum, eps), {})
    out, mean, invstd, new_mean, new_var = ran[0]
    device_mod.write(running_mean, new_mean)
    device_mod.write(running_var, new_var)
    return tuple(device_mod.wrap(v, input.device) for v in (out, mean, invstd))


def _local_scalar_dense(tensor):
    return device_mod.read(tensor).item()


def _by_lowering(op, *args, **kwargs):
    return _functional(op, args, kwargs)


_JAX = device.NAME
device_mod = device  # the module, under a name the keyword ``device=`` does not shadow

_SPECIAL = {
    aten.empty.memory_format: lambda size, **kw: _empty_strided(size, device._contiguous_strides(size), **kw),
    aten.empty_strided.default: _empty_strided,
    aten._copy_from.default: _copy_from,
    aten._copy_from_and_resize.default: _copy_from_and_resize,
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten.resize_.default: _resize,
    aten.set_.source_Storage_storage_offset: _set_storage,
    aten.set_.source_Storage: _set_from_storage,
    aten.set_.source_Tensor: _set_from_tensor,
    aten.set_.default: _set_empty,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.native_batch_norm.default: _batch_norm,
    aten._native_batch_norm_legit.default: _batch_norm,
    # composite kernels that would route a device other than CPU and CUDA to the
    # ``convolution_overrideable`` ops: the lowering of the op itself instead
    aten.convolution.default: functools.partial(_by_lowering, aten.convolution.default),
    aten.convolution_backward.default: functools.partial(_by_lowering, aten.convolution_backward.default),
}
