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
from programs import retained_graph_program

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
    return _device_puts_of(graph._graph)


def _device_puts_of(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == torch.ops.prims.device_put.default]


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
    assert config.settings_from_env({"DONATE_XLA_OFFLOAD_SAVED": "0"}).offload_saved is False
    assert config.settings_from_env({}).offload_saved is None  # unset: a memory limit on CUDA may choose it
    donate_backend.clear_reports()


def _fake_graph(device: str) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        return make_fx(lambda x: torch.tanh(x) * 2)(torch.empty(8, 8, device=device))


def test_a_memory_limit_may_offload_only_on_cuda_with_the_switch_unset():
    """The lever exists where host memory is not the device's (a graph on CUDA; fake tensors,
    no GPU needed), on a torch that offloads, and only while ``offload_saved`` is unset:
    0 forbids it, 1 offloads every graph anyway."""
    from donate_backend.native import offload

    on_cuda, on_cpu = _fake_graph("cuda"), _fake_graph("cpu")
    assert offload.lever(on_cpu) is None
    assert offload.lever(on_cuda) is (offload.partition_offloading if HAS_OFFLOADING else None)
    for forced in (False, True):
        with config.patch(offload_saved=forced):
            assert offload.lever(on_cuda) is None


def _as_on_a_device(monkeypatch):
    """Plan as on a GPU, where a saved activation's copy in host memory takes no device memory
    (what ``native.memory`` does for a graph on CUDA), for the CPU graphs here: torch's
    offloaded copies (``cpu_offload_*``) count no bytes, in each candidate's prediction and in
    the step's plan. Returns the candidates predicted, as (label, peak) pairs."""
    from donate_backend import budget, graph_meta
    from donate_backend.native import memory

    predicted = []
    predict, keys = memory.predict_step, memory._keys

    def predict_step(fw_module, bw_module, forward_returns=None):
        peak, parts = predict(fw_module, bw_module, forward_returns)
        share = bw_module.meta[graph_meta.BUDGET_SHARE]
        predicted.append((f"{share:g}{budget.OFFLOADED if _device_puts_of(fw_module) else ''}", peak))
        return peak, parts

    monkeypatch.setattr(memory, "_keys", lambda node: [] if node.name.startswith("cpu_offload_") else keys(node))
    monkeypatch.setattr(memory, "predict_step", predict_step)
    return predicted


@needs_offloading
def test_under_a_memory_limit_offloading_comes_before_recomputation(monkeypatch):
    """With host memory apart from the device's (as on CUDA: ``offload.lever`` made to answer as
    there, copies counted as there), a limit between the step's peak with its activations
    offloaded and without is met by offloading at the full activation budget, before any
    smaller budget; the offloaded graphs run with values equal to eager over 3 steps. With
    ``offload_saved`` 0 the same limit recomputes instead."""
    from donate_backend import budget
    from donate_backend.budget import MemoryLimitError
    from donate_backend.native import offload

    unset = lambda joint: config.current().offload_saved is None  # noqa: E731 (as ``lever`` on CUDA)
    monkeypatch.setattr(type(offload.lever), "__call__",
                        lambda self, joint: offload.partition_offloading if unset(joint) else None)
    predicted = _as_on_a_device(monkeypatch)
    eager_model = _mlp()
    expected = _train(eager_model, eager_model)

    torch._dynamo.reset()  # every candidate, predicted: none fits 1 byte
    model = _mlp()
    with pytest.raises(Exception) as caught:
        _train(model, torch.compile(model, backend="donate_xla", options={"memory_limit": 1}))
    refused = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(refused, MemoryLimitError)
    # the refusal names every candidate tried, offloaded ones included, and the limit
    assert "(+offload: saved activations offloaded to host memory)" in str(refused), str(refused)
    assert "1+offload: " in str(refused) and "memory_limit is " in str(refused), str(refused)
    peaks = dict(predicted)
    assert list(peaks)[:3] == ["1", "1+offload", "0.7"], peaks
    assert peaks["1+offload"] < peaks["1"], peaks
    limit = (peaks["1+offload"] + peaks["1"]) // 2

    def train(switch):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        model = _mlp()
        run = torch.compile(model, backend="donate_xla", options={"memory_limit": limit, "offload_saved": switch})
        (losses, params), built = _graphs_built(lambda: _train(model, run))
        assert losses == pytest.approx(expected[0], rel=1e-6, abs=1e-7)
        for got, want in zip(params, expected[1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        (record,) = [r for r in donate_backend.reports() if r.budget_choice]
        forward = next(g for g in built if g.ctx.kind == "forward")
        return record.budget_choice, _device_puts(forward)

    choice, copies = train(None)
    print(f"\nMLP 64-256-256-8, batch 32, host copies counted as on a GPU: {choice}")
    assert choice.startswith("activation budget 1 with ") and "offloaded to host memory" in choice, choice
    assert copies
    # offloading forbidden: the first smaller budget that fits, or a refusal before the step runs
    recomputing = [label for label, peak in peaks.items() if not label.endswith(budget.OFFLOADED) and peak <= limit]
    if recomputing:
        choice, copies = train(False)
        assert choice.startswith(f"activation budget {recomputing[0]} chosen"), choice
        assert not copies
    else:
        with pytest.raises(Exception) as caught:
            train(False)
        assert isinstance(getattr(caught.value, "inner_exception", caught.value), MemoryLimitError)


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


@needs_offloading
@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_offloaded_graphs_under_retain_graph_hooks_inputs_and_autograd_grad_match_eager(executor):
    """With the saved activations offloaded, the backward reads the reloaded copies: two
    backwards through one retained graph (the second reloads them again), a gradient hook,
    ``backward(inputs=)`` that leaves the other gradients as they were, and
    ``torch.autograd.grad``, which writes no ``.grad`` at all, equal eager."""

    def program(model, run):
        torch.manual_seed(2)
        return retained_graph_program(model, run, torch.randn(16, 64, requires_grad=True))

    eager = _mlp()
    expected = program(eager, eager)
    torch._dynamo.reset()
    ours = _mlp()
    with config.patch(native_compiler=executor, offload_saved=True):
        got, built = _graphs_built(lambda: program(ours, torch.compile(ours, backend="donate_xla")))
    assert any(_device_puts(g) for g in built if g.ctx.kind == "forward")  # it did offload
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
