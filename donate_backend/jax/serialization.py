"""``torch.save`` and ``torch.load`` of tensors on the JAX device.

Saving needs nothing of its own: ``torch.save`` copies each storage to the host through
its bytes, which the device gives (``eager``: a byte view of a storage reads its buffer's
bytes). Loading restores a storage saved from ``jax:N`` onto that device: a storage with
no memory behind it whose buffer is the saved bytes (``install`` registers the location
with ``torch.serialization``); ``map_location="cpu"`` loads it on the host as usual.
"""
from __future__ import annotations

import torch

from . import compat, device

_installed = False


def _tag(storage):
    if storage.device.type == device.NAME:
        return f"{device.NAME}:{storage.device.index or 0}"
    return None


def _restore(storage, location: str):
    if not location.startswith(device.NAME):
        return None
    index = int(location.split(":")[1]) if ":" in location else 0
    where = torch.device(device.NAME, index)
    host = storage if storage.device.type == "cpu" else storage.cpu()
    restored = compat.device_storage(host.nbytes(), where)
    data = torch.empty(0, dtype=torch.uint8).set_(host)
    device._set_buffer(restored, device.Buffer(device.from_host(data)))
    return restored


def install() -> None:
    global _installed
    if not _installed:
        torch.serialization.register_package(9, _tag, _restore)
        _installed = True
