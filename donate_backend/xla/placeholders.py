"""torch_xla placeholder tensors and the trace-time settings around them.

Everything here touches torch_xla's private ``_XLAC`` bindings; the rest of the
XLA path goes through these few functions.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch_xla
import torch_xla.core.xla_builder as xla_builder

XLAC = torch_xla._XLAC


def make_placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """An XLA tensor with no device buffer: tracing it builds lazy IR only."""
    return xla_builder.create_placeholder_tensor(tuple(shape), dtype)


def tensor_id(t: torch.Tensor) -> int:
    return XLAC._xla_get_tensor_id(t)


@contextlib.contextmanager
def tracing_settings(donate: bool) -> Iterator[None]:
    """Scalars become HLO constants; build in the buffer-donor configuration."""
    saved_scalars = XLAC._get_xla_all_numbers_special_scalars()
    saved_donor = XLAC._xla_get_enable_alias_with_buffer_donor_config()
    XLAC._set_xla_all_numbers_special_scalars(True)
    XLAC._xla_set_enable_alias_with_buffer_donor_config(donate)
    try:
        yield
    finally:
        XLAC._set_xla_all_numbers_special_scalars(saved_scalars)
        XLAC._xla_set_enable_alias_with_buffer_donor_config(saved_donor)


@contextlib.contextmanager
def outside_fake_tracing() -> Iterator[None]:
    """aot_autograd calls compilers under its FakeTensorMode and the python
    dispatcher; placeholder ops must run on the real XLA backend instead."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch._C._DisablePythonDispatcher():
        yield


def seed_info_id() -> int:
    return XLAC._get_seed_info_id()
