"""``offload_saved``: torch's own activation offloading on the native path.

On the CPU the copies to host memory are plain copies (host and device memory
are one), so these tests check that the forward copies its saved activations out
and the backward copies them back before reading them, with values equal to
eager over several steps under both executors and under DDP; the memory it saves
and the overlap of the copies are CUDA's to show (tests/test_native_cuda.py).
"""
from __future__ import annotations

import pytest
import torch

import donate_backend
from donate_backend import config
from donate_backend.errors import DonateXlaError
from donate_backend.native import compat
from donate_backend.native.compiled import CompiledGraph
from instances import instances_of

HAS_OFFLOADING = compat.activation_offloading(on_cuda=False) is not None
needs_offloading = pytest.mark.skipif(not HAS_OFFLOADING, reason=f"torch {torch.__version__} has no activation offloading")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)
    )


def _train(model, run, steps: int = 3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64)
        loss = run(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _graphs_built(fn):
    with instances_of(CompiledGraph) as built:
        result = fn()
    return result, built


def _device_puts(graph: CompiledGraph) -> list:
    return [n for n in graph._graph.graph.nodes if n.target == torch.ops.prims.device_put.default]


@needs_offloading
@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_offloaded_activations_go_out_after_the_forward_and_back_before_the_backward(executor):
    eager_model = _mlp()
    expected = _train(eager_model, eager_model)
    model = _mlp()
    with config.patch(native_compiler=executor, offload_saved=True):
        run = torch.compile(model, backend="donate_xla")
        (losses, params), built = _graphs_built(lambda: _train(model, run))
    assert losses == pytest.approx(expected[0], rel=1e-6, abs=1e-7)
    for got, want in zip(params, expected[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    forward = next(g for g in built if g.ctx.kind == "forward")
    backward = next(g for g in built if g.ctx.kind == "backward")
    out = _device_puts(forward)
    back = _device_puts(backward)
    assert out and len(back) == len(out)  # each activation sent out comes back once
    assert all(n.args[1] == torch.device("cpu") for n in out)
    # the forward returns the host copies in the saved activations' places
    returned = forward._graph.graph.output_node().args[0]
    assert set(out) <= set(returned)
    # and each reload comes before the first op that reads it
    order = {n: i for i, n in enumerate(backward._graph.graph.nodes)}
    for reload in back:
        assert all(order[user] > order[reload] for user in reload.users)


@needs_offloading
def test_offloading_can_be_set_per_compiled_function():
    eager_model = _mlp()
    expected, _ = _train(eager_model, eager_model)
    model = _mlp()
    run = torch.compile(model, backend="donate_xla", options={"offload_saved": True})
    (losses, _), built = _graphs_built(lambda: _train(model, run))
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert any(_device_puts(g) for g in built if g.ctx.kind == "forward")


@pytest.mark.skipif(HAS_OFFLOADING, reason="this torch has activation offloading")
def test_offloading_on_a_torch_without_it_is_refused_with_what_to_do():
    model = _mlp()
    run = torch.compile(model, backend="donate_xla", options={"offload_saved": True})
    with pytest.raises(Exception) as caught:
        run(torch.randn(4, 64))
    error = getattr(caught.value, "inner_exception", caught.value)  # dynamo wraps a backend's error
    assert isinstance(error, DonateXlaError), repr(caught.value)
    assert "offload_saved needs torch's activation offloading" in str(error)
    assert "DONATE_XLA_OFFLOAD_SAVED=0" in str(error)


def test_offload_guard(monkeypatch):
    """Without the module or its config switch, the guard says so (None)."""
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "enable_activation_offloading"):
        monkeypatch.delattr(functorch_config, "enable_activation_offloading")
    assert compat.activation_offloading(on_cuda=False) is None


def test_offload_switch_from_the_environment():
    assert config.settings_from_env({"DONATE_XLA_OFFLOAD_SAVED": "1"}).offload_saved is True
    assert config.settings_from_env({}).offload_saved is False
    donate_backend.clear_reports()


def test_the_replay_of_a_graph_on_a_device_counts_no_bytes_for_its_host_copies():
    """A saved activation offloaded to the host takes no device memory from the offload on:
    the replay of a graph on CUDA (fake tensors: no GPU needed) counts its host copy as 0
    bytes, and the same graph on the CPU counts it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from donate_backend.native import memory

    def forward(x):
        saved = torch.tanh(x)
        return saved * 2, torch.ops.prims.device_put.default(saved, torch.device("cpu"))

    width = 1024 * 256 * 4
    peaks = {}
    for device in ("cuda", "cpu"):
        with FakeTensorMode():
            graph = make_fx(forward)(torch.empty(1024, 256, device=device)).graph
        replayed = memory.replay(graph, "g", "forward", saved_outputs_from=1)
        peaks[device] = (replayed.peak_bytes, replayed.end_bytes)
    # on CUDA: tanh, then the product (the host copy is free); the tanh dies, the product stays
    assert peaks["cuda"] == (2 * memory.cuda_block_bytes(width), memory.cuda_block_bytes(width))
    # on the CPU the copy is one more buffer, and it is returned
    assert peaks["cpu"] == (3 * width, 2 * width)
