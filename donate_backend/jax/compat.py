"""Private torch API the JAX target uses, each looked up here once.

The rule (CONTRIBUTING.md, checked by ``tests/test_fence.py``): a private torch
name (``torch._...``) is used only in a compat module. The JAX lowering table
(``lowerings.py``) needs torch's decomposition tables; the JAX device
(``device.py``, ``eager.py``) needs torch's Python backend registration
(``torch._C._acc``, torch 2.15), storages with no memory behind them, and kernels
run by their meta or CPU implementation. Each function says what it does when the
API is missing, or the device refuses to start (``python_backend_supported``).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator

import torch


def core_aten_decompositions() -> Dict:
    """A copy of ``torch._decomp.core_aten_decompositions()``: the table that lowers
    ATen to torch's core ATen op set (keys are ``OpOverload``s, values Python
    decompositions). An empty dict when this torch has no such table."""
    try:
        from torch._decomp import core_aten_decompositions as table
    except ImportError:
        return {}
    return dict(table())


def get_decompositions(ops: Iterable) -> Dict:
    """``torch._decomp.get_decompositions(ops)``: torch's registered decompositions
    of ``ops`` (``OpOverload``s); ops without one are left out. An empty dict when
    this torch has no decomposition registry."""
    try:
        from torch._decomp import get_decompositions as lookup
    except ImportError:
        return {}
    return dict(lookup(list(ops)))


def registered_decompositions() -> Dict:
    """torch's whole registry of decompositions, ``torch._decomp.decomposition_table``
    (for telling a refused op that has one); an empty dict when missing."""
    try:
        from torch._decomp import decomposition_table
    except ImportError:
        return {}
    return decomposition_table


# -- the JAX device: a PrivateUse1 backend written in Python ------------------------------

def python_backend_supported() -> bool:
    """Whether this torch lets a Python module be a device backend: a device guard and
    hooks registered from Python (``torch._C._acc``, torch 2.15; torch 2.9 has none)."""
    acc = getattr(torch._C, "_acc", None)
    return acc is not None and hasattr(acc, "register_python_privateuseone_device_guard") and hasattr(
        torch._C, "_construct_storage_from_data_pointer")


def backend_name() -> str:
    """The name torch's PrivateUse1 device goes by now (``privateuseone`` until renamed)."""
    return torch._C._get_privateuse1_backend_name()


def register_python_backend(name: str, device_module) -> None:
    """Make PrivateUse1 a device named ``name`` served from Python: renamed, its tensor and
    storage methods generated (``.jax()``), ``device_module`` as ``torch.<name>``, and the
    device guard and hooks torch asks a backend for (``torch._C._acc``)."""
    acc = torch._C._acc

    class _Guard(acc.DeviceGuard):
        def type_(self):
            return torch._C._autograd.DeviceType.PrivateUse1

    class _Hooks(acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def is_built(self) -> bool:
            return True

        def has_primary_context(self, index) -> bool:
            return True

    if backend_name() != name:
        torch.utils.rename_privateuse1_backend(name)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    torch._register_device_module(name, device_module)
    acc.register_python_privateuseone_hook(_Hooks())
    acc.register_python_privateuseone_device_guard(_Guard())


# Storages of the JAX device get addresses no process maps (above x86-64's and AArch64's
# user space, 2^47 and 2^48), one range each: torch tells storages apart by address
# (``torch.save`` dedups them so), and a null address is refused there.
_ADDRESS_BASE = 1 << 52
_next_address = [_ADDRESS_BASE]


def device_storage(nbytes: int, device: torch.device):
    """A storage of ``nbytes`` on ``device`` with no memory behind it (its data lives in a
    JAX array the device keeps beside it): torch's view, bounds and serialization code
    sees its true size and an address of its own that nothing dereferences (only the
    device's kernels read its data)."""
    address = _next_address[0]
    _next_address[0] += (max(int(nbytes), 1) + 4095) // 4096 * 4096
    return torch._C._construct_storage_from_data_pointer(address, device, nbytes)


def tensor_on(storage, dtype: torch.dtype, shape, stride, offset: int = 0) -> torch.Tensor:
    """A tensor on ``storage``'s device viewing it (``set_`` through the CPU kernel, which
    only sets metadata and checks the bounds)."""
    tensor = torch._C._acc.create_empty_tensor((0,), dtype)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(keys, tensor, storage, offset, list(shape), list(stride))
    return tensor


def meta_kernel(op, *args, **kwargs):
    """``op`` run by its meta kernel on the device's tensors: a view op computes its result's
    sizes and strides over the same storage, which is what a view on the device is."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
    return op.redispatch(keys, *args, **kwargs)


def cpu_kernel(op, *args, **kwargs):
    """``op`` run by its CPU kernel on the device's tensors (metadata ops: ``set_``)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    return op.redispatch(keys, *args, **kwargs)


@contextlib.contextmanager
def outside_fake_mode() -> Iterator[None]:
    """Real tensors inside the block although a fake mode is active (aot_autograd calls the
    compiler under its FakeTensorMode; a graph's constants are real CPU tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def outside_dynamo(fn):
    """``fn`` that dynamo never traces (``torch._disable_dynamo``): the device's kernels run
    under eager code between graph breaks, where dynamo's frame hook is set."""
    disable = getattr(torch, "_disable_dynamo", None)
    return disable(fn) if disable is not None else fn


def clone_storages_with(clone_on_device) -> None:
    """``UntypedStorage.clone`` (what ``copy.deepcopy`` of a tensor calls) through
    ``clone_on_device(storage)`` for the device's storages: torch's own allocates the copy
    through the device's allocator, which a device served from Python has none of. Other
    storages clone as before."""
    original = torch.UntypedStorage.clone
    if getattr(original, "_donate_jax", False):
        return

    def clone(self):
        if self.device.type == backend_name():
            return clone_on_device(self)
        return original(self)

    clone._donate_jax = True
    torch.UntypedStorage.clone = clone
