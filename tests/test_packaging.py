"""What a user installs: torch alone for CUDA/CPU, torch_xla only through the xla extra."""
from __future__ import annotations

import pathlib
import sys
import tomllib

import pytest
import torch

import donate_backend
from donate_backend.backend import donate_xla

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def _project():
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_base_install_asks_for_torch_only():
    assert _project()["dependencies"] == ["torch>=2.9"]


def test_xla_extra_pins_the_torch_that_torch_xla_was_built_for():
    assert sorted(_project()["optional-dependencies"]["xla"]) == ["torch==2.9.0", "torch_xla==2.9.0"]


def _fake_xla_tensor(shape):
    """A fake tensor on an XLA device: needs no torch_xla (the graph is never run)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return FakeTensor(FakeTensorMode(), torch.empty(shape, device="meta"), torch.device("xla", 0))


def test_an_xla_tensor_without_torch_xla_gets_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # `import torch_xla` raises ImportError
    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    cpu, xla = torch.randn(3), _fake_xla_tensor((2, 3))
    with pytest.raises(donate_backend.DonateXlaError) as raised:
        donate_xla(gm, [cpu, xla])
    message = str(raised.value)
    assert "has an input on an XLA device (input 1, shape (2, 3), device xla:0)" in message
    assert "torch_xla is not installed" in message
    assert "pip install 'donate_backend[xla]'" in message
    assert message.startswith("donate_xla: graph ")
    assert isinstance(raised.value.__cause__, ImportError)


# CPU graphs compiling with torch_xla unimportable: test_native_compat.py::
# test_native_path_imports_without_torch_xla (in a subprocess: blocking the import in this
# process would leave torch's own caches of "no torch_xla" behind for the XLA tests).
