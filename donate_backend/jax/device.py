"""The JAX device: torch tensors whose data is a JAX array.

``jax_device()`` names torch's PrivateUse1 device ``jax`` and serves it from Python
(torch 2.15's Python backends, ``compat.register_python_backend``). A tensor on it is
an ordinary ``torch.Tensor``: dynamo, aot_autograd and autograd treat it as they treat
a CUDA tensor, and ``tensor.device`` says ``jax:0``. Its storage has the right size but
no memory behind it; the data is a ``jax.Array`` on JAX's default device kept beside
the storage (``Buffer``). Views share the storage, as on any device, so an in-place
write through a view reaches its base.

Reading a tensor (``read``) gives the JAX array of its elements: the buffer itself
where the tensor covers its storage from the start in order (the common case, free),
else the elements its sizes, strides and offset pick (a gather). Writing (``write``)
replaces the buffer where the tensor covers the storage, else scatters into it. A
tensor whose dtype differs from its buffer's (``view(dtype)``, the bytes ``torch.save``
reads) sees the buffer's bytes reinterpreted.

Random numbers come from the device's own generator (``DeviceModule``): a JAX key
from ``torch.manual_seed``'s seed, folded with a counter per draw.
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from ..errors import DonateXlaError
from . import compat

NAME = "jax"
_lock = threading.Lock()
_started = False
_refusal: Optional[str] = None  # why the device cannot serve this process (``_check_autograd_serves_it``)


def jax_device(index: int = 0) -> torch.device:
    """The torch device whose tensors hold JAX arrays (on JAX's default backend: CPU here,
    a GPU or TPU where JAX has one). Models and batches move to it as to any device:
    ``model.to(donate_backend.jax_device())``."""
    start()
    count = len(_jax().devices())
    if not 0 <= index < count:
        raise DonateXlaError(
            f"donate_xla: jax_device({index}): JAX has {count} device(s) on its default backend "
            f"({_jax().default_backend()}); use an index below {count}.",
            help_section="The JAX target",
        )
    return torch.device(NAME, index)


def start() -> None:
    """Register the device (once per process): refused where this torch cannot serve a
    device from Python, JAX is missing, or another backend took PrivateUse1."""
    global _started
    with _lock:
        if _started:
            return
        try:
            import jax
        except ImportError as error:
            raise DonateXlaError(
                "donate_xla: the JAX target needs jax: pip install 'donate_backend[jax]' "
                "(jax 0.10.2 on Python 3.11).", help_section="The JAX target") from error
        if not compat.python_backend_supported():
            raise DonateXlaError(
                f"donate_xla: torch {torch.version.__version__} cannot serve a device from Python (it has no "
                "torch._C._acc device guard); the JAX target needs torch 2.15 or newer.",
                help_section="The JAX target")
        taken = compat.backend_name()
        if taken not in ("privateuseone", NAME):
            raise DonateXlaError(
                f"donate_xla: torch's PrivateUse1 device is already the {taken!r} backend in this process; "
                "the JAX target needs it as 'jax'. Use one of them per process.",
                help_section="The JAX target")
        # int64 indices and float64 stay 64-bit (JAX narrows them by default)
        jax.config.update("jax_enable_x64", True)
        from . import cache

        cache.configure()
        compat.register_python_backend(NAME, DeviceModule())
        compat.clone_storages_with(_clone_storage)
        from . import eager, serialization

        eager.install()
        serialization.install()
        _started = True
        _check_autograd_serves_it()
    if _refusal is not None:
        raise DonateXlaError(_refusal, help_section="The JAX target")


def _check_autograd_serves_it() -> None:
    """The autograd engine sizes its device queues when it first runs a backward: a device
    registered after that has no queue, and its backward fails inside the engine. Probed
    once, with a one-element backward, and refused with what to do."""
    global _refusal
    probe = torch.zeros(1, device=torch.device(NAME, 0), requires_grad=True)
    try:
        probe.sum().backward()
    except RuntimeError as error:
        if "device_ready_queues_" not in str(error):
            raise
        _refusal = (
            "donate_xla: the JAX device was registered after this process ran its first backward: the "
            "autograd engine counts each device's queues when it starts, so it cannot run a backward on "
            "it. Call donate_backend.jax_device() before the first backward (at the start of the program).")


def started() -> bool:
    return _started


def _jax():
    import jax

    return jax


def jax_device_of(device: torch.device):
    """The JAX device behind a torch ``jax:N`` device."""
    return _jax().devices()[device.index or 0]


# -- buffers --------------------------------------------------------------------------------

class Buffer:
    """The data of one storage: a JAX array whose elements, in order, are the storage's
    (its shape is the tensor's that last wrote all of it). No two buffers hold one array
    (``_claimed``): a compiled call donates an input's array, which must then be nobody
    else's."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array) -> None:
        self.array = _claimed(array, self)

    @property
    def dtype(self) -> torch.dtype:
        from .lowerings import to_torch_dtype

        return to_torch_dtype(self.array.dtype)


_ATTR = "_donate_jax_buffer"
# id(array) -> the buffer that holds it (a weak reference): JAX hands back the same array
# object for an identity (an ``astype`` to its own dtype, a ``broadcast_to`` its own shape)
_holders: dict = {}


def _claimed(array, buffer: "Buffer"):
    """``array``, or a copy of it where another live buffer holds that very array."""
    key = id(array)
    holder = _holders.get(key)
    other = holder() if holder is not None else None
    if other is not None and other is not buffer and other.array is array:
        array = _jax().numpy.array(array, copy=True)
        key = id(array)
    if len(_holders) > 4 * 4096:  # forget buffers that are gone
        for k in [k for k, ref in _holders.items() if ref() is None]:
            del _holders[k]
    _holders[key] = weakref.ref(buffer)
    return array


def buffer_of(tensor: torch.Tensor) -> Buffer:
    storage = tensor.untyped_storage()
    found = getattr(storage, _ATTR, None)
    if found is None:
        # a storage made without data (an ``empty`` whose elements are not read before
        # they are written): zeros of its bytes
        jnp = _jax().numpy
        found = Buffer(jnp.zeros(storage.nbytes(), dtype=jnp.uint8))
        setattr(storage, _ATTR, found)
    return found


def _set_buffer(storage, buffer: Buffer) -> None:
    setattr(storage, _ATTR, buffer)


def _contiguous_strides(shape) -> list:
    strides, step = [], 1
    for size in reversed(list(shape)):
        strides.append(step)
        step *= max(int(size), 1)
    return list(reversed(strides))


def covers_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all of its storage's elements, in order, from the start."""
    if tensor.storage_offset() != 0 or not tensor.is_contiguous():
        return False
    return tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()


def wrap(array, device: Optional[torch.device] = None) -> torch.Tensor:
    """A new tensor on the JAX device holding ``array`` (a storage of its own)."""
    from .lowerings import to_torch_dtype

    device = device or torch.device(NAME, 0)
    array = _jax().numpy.asarray(array)
    dtype = to_torch_dtype(array.dtype)
    shape = tuple(int(s) for s in array.shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    storage = compat.device_storage(nbytes, device)
    _set_buffer(storage, Buffer(array))
    return compat.tensor_on(storage, dtype, shape, _contiguous_strides(shape))


def _clone_storage(storage):
    """A copy of a storage of the device (``copy.deepcopy`` of its tensors): the same bytes
    in a storage of their own."""
    copy = compat.device_storage(storage.nbytes(), storage.device)
    found = getattr(storage, _ATTR, None)
    if found is not None:
        _set_buffer(copy, Buffer(_jax().numpy.array(found.array, copy=True)))
    return copy


def new_storage_for(tensor: torch.Tensor, shape) -> None:
    """Give ``tensor`` a fresh storage of ``shape`` (``resize_`` past its storage)."""
    from .lowerings import to_jax_dtype

    shape = [int(s) for s in shape]
    nbytes = math.prod(shape) * tensor.element_size()
    storage = compat.device_storage(nbytes, tensor.device)
    _set_buffer(storage, Buffer(_jax().numpy.zeros(shape, dtype=to_jax_dtype(tensor.dtype))))
    compat.cpu_kernel(torch.ops.aten.set_.source_Storage_storage_offset, tensor, storage, 0, shape,
                      _contiguous_strides(shape))


def _as_bytes(array):
    """The array's elements as a flat ``uint8`` array of their bytes."""
    jnp, lax = _jax().numpy, _jax().lax
    if array.dtype == jnp.uint8:
        return array.reshape(-1)
    if array.dtype == jnp.bool_:
        return array.reshape(-1).astype(jnp.uint8)
    return lax.bitcast_convert_type(array.reshape(-1), jnp.uint8).reshape(-1)


def _from_bytes(data, dtype: torch.dtype):
    """Flat ``uint8`` bytes as a flat array of ``dtype``."""
    from .lowerings import to_jax_dtype

    jnp, lax = _jax().numpy, _jax().lax
    target = to_jax_dtype(dtype)
    if target == jnp.uint8:
        return data
    if target == jnp.bool_:
        return data != 0
    size = jnp.dtype(target).itemsize
    return lax.bitcast_convert_type(data.reshape(-1, size), target)


def _flat_elements(tensor: torch.Tensor):
    """The storage's elements as a flat array of the tensor's dtype."""
    buffer = buffer_of(tensor)
    array = buffer.array
    if buffer.dtype == tensor.dtype:
        return array.reshape(-1)
    return _from_bytes(_as_bytes(array), tensor.dtype)


def _indices(tensor: torch.Tensor) -> np.ndarray:
    """The flat indices into its storage of each of ``tensor``'s elements."""
    index = np.full([int(s) for s in tensor.shape], int(tensor.storage_offset()), dtype=np.int64)
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        shape = [1] * tensor.dim()
        shape[dim] = int(size)
        index = index + np.arange(int(size), dtype=np.int64).reshape(shape) * int(stride)
    return index


def read(tensor: torch.Tensor):
    """The JAX array of ``tensor``'s elements (module docstring)."""
    buffer = buffer_of(tensor)
    if covers_storage(tensor) and buffer.dtype == tensor.dtype:
        array = buffer.array
        return array if tuple(array.shape) == tuple(tensor.shape) else array.reshape(tuple(tensor.shape))
    flat = _flat_elements(tensor)
    if tensor.numel() == 0:
        return flat[:0].reshape(tuple(tensor.shape))
    return flat[_indices(tensor)]


def write(tensor: torch.Tensor, value) -> None:
    """Make ``tensor``'s elements ``value`` (an array broadcast to its shape, cast to its
    dtype), through its storage: its views see it."""
    from .lowerings import to_jax_dtype

    jnp = _jax().numpy
    value = jnp.broadcast_to(jnp.asarray(value).astype(to_jax_dtype(tensor.dtype)), tuple(tensor.shape))
    storage = tensor.untyped_storage()
    if covers_storage(tensor):
        _set_buffer(storage, Buffer(value if isinstance(value, _jax().Array) else jnp.asarray(value)))
        return
    if tensor.numel() == 0:
        return
    # part of the storage: scatter into its elements, seen as the tensor's dtype (a storage
    # made without data, or last written through another dtype, is read as its bytes)
    flat = _flat_elements(tensor).at[_indices(tensor).reshape(-1)].set(value.reshape(-1))
    _set_buffer(storage, Buffer(flat))


def holds(tensor: torch.Tensor, array) -> None:
    """Install ``array`` as ``tensor``'s whole data (a compiled graph's new value of an input
    it covers): no copy, no gather."""
    _set_buffer(tensor.untyped_storage(), Buffer(array))


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` (waits for the device)."""
    return array_to_host(read(tensor), tensor.dtype)


def array_to_host(array, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` with a JAX array's elements (waits for the device)."""
    array = np.asarray(array)
    if dtype == torch.bfloat16:  # numpy's bfloat16 (ml_dtypes) is not torch's
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True)).to(dtype)


def from_host(tensor: torch.Tensor):
    """A JAX array of a CPU tensor's elements, on JAX's default device (also under a fake
    mode: a graph's constants are real tensors)."""
    jnp = _jax().numpy
    with compat.outside_fake_mode():
        tensor = tensor.detach().contiguous()
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return jnp.asarray(tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16))
        return jnp.asarray(tensor.numpy())


# -- the device module: torch.jax --------------------------------------------------------------

class DeviceModule:
    """``torch.jax``: what torch asks of a device's module, and its random generator."""

    def __init__(self) -> None:
        self._seed = 0
        self._draws = 0

    # torch's device-module protocol
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return len(_jax().devices())

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        _jax().effects_barrier()

    def get_amp_supported_dtype(self) -> list:
        """What ``torch.autocast(device_type="jax")`` may cast to (HF models enter autocast
        to turn it off around their rotary embeddings)."""
        return [torch.float16, torch.bfloat16]

    # random numbers
    def manual_seed(self, seed: int) -> None:
        self._seed, self._draws = int(seed) % (2**63), 0

    manual_seed_all = manual_seed

    def seed(self) -> None:
        self.manual_seed(torch.initial_seed())

    seed_all = seed

    def initial_seed(self) -> int:
        return self._seed

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.tensor([self._seed, self._draws], dtype=torch.int64)

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        self._seed, self._draws = (int(v) for v in state.tolist())

    def next_key(self):
        """A fresh JAX key for one draw (eager op or compiled call)."""
        jax = _jax()
        self._draws += 1
        return jax.random.fold_in(jax.random.key(self._seed), self._draws)


def device_module() -> DeviceModule:
    return getattr(torch, NAME)
