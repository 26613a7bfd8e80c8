"""The JAX target against eager torch on the CPU: tensors on ``donate_backend.jax_device()``,
eager ops on them, and training steps compiled with donate_xla (torch >= 2.15 with jax).

The autograd engine counts its devices at its first backward, so the JAX device is
registered when this module is imported, before any test runs one: ``make test-newest``
runs this file in a pytest process of its own with ``DONATE_XLA_TEST_JAX=1``; elsewhere
it is skipped.
"""
from __future__ import annotations

import copy
import io
import os
import re

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import donate_backend
from donate_backend import config
from donate_backend.errors import DonateXlaError

if os.environ.get("DONATE_XLA_TEST_JAX") != "1":
    pytest.skip("the JAX target's tests run in a process of their own (make test-newest: DONATE_XLA_TEST_JAX=1)",
                allow_module_level=True)
pytest.importorskip("jax")
try:
    DEV = donate_backend.jax_device()
except DonateXlaError as error:  # torch older than 2.15
    pytest.skip(str(error), allow_module_level=True)

import training_loop  # noqa: E402
import xla_fuzz  # noqa: E402
from real_models import MODELS, available  # noqa: E402


def test_a_tensor_on_the_device_behaves_as_a_torch_tensor(tmp_path):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    d = x.to(DEV)
    assert d.device.type == "jax" and str(d.device) == "jax:0"
    torch.testing.assert_close(d.cpu(), x)
    assert d.sum().item() == 66.0
    view = d[1]  # a view: an in-place write through it reaches the base
    view.mul_(10)
    x[1].mul_(10)
    torch.testing.assert_close(d.cpu(), x)
    d.t()[0].add_(1)
    x.t()[0].add_(1)
    torch.testing.assert_close(d.cpu(), x)
    assert "jax:0" in repr(d)
    big = torch.tensor([2**40 + 3, -5], dtype=torch.int64)
    assert big.to(DEV).cpu().tolist() == big.tolist()
    half = torch.randn(5).to(torch.bfloat16)
    assert torch.equal(half.to(DEV).cpu(), half)
    model = nn.Linear(4, 2).to(DEV)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(v.device.type == "jax" for v in loaded.values())
    other = nn.Linear(4, 2).to(DEV)
    other.load_state_dict(loaded)
    clone = copy.deepcopy(other)
    for a, b in zip(clone.parameters(), model.parameters()):
        torch.testing.assert_close(a.cpu(), b.cpu())
    clone.weight.data.add_(1)  # a deep copy owns its data
    assert not torch.equal(clone.weight.cpu(), model.weight.cpu())


def test_eager_ops_match_the_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    index = torch.tensor([2, 0, 1])
    cases = {
        "conv": lambda a, b, i: F.conv2d(a, b, padding=1),
        "softmax": lambda a, b, i: a.softmax(-1),
        "index": lambda a, b, i: a[:, i],
        "matmul": lambda a, b, i: a.flatten(1) @ a.flatten(1).t(),
        "masked_select": lambda a, b, i: a.masked_select(a > 0),  # a size known only from the values
    }
    for name, fn in cases.items():
        expected = fn(x, w, index)
        got = fn(x.to(DEV), w.to(DEV), index.to(DEV))
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _train_side_by_side(make, batch, optimizer, steps=4, accumulate=1, clip=None, sizes=None):
    """``steps`` steps of eager on the CPU and of the compiled step on the JAX device from the
    same weights; per step the loss, then every parameter and buffer, compared."""
    torch.manual_seed(0)
    eager = make()
    ours = copy.deepcopy(eager).to(DEV)
    opt_e, opt_o = optimizer(eager.parameters()), optimizer(ours.parameters())
    sched_e = torch.optim.lr_scheduler.StepLR(opt_e, step_size=2, gamma=0.5)
    sched_o = torch.optim.lr_scheduler.StepLR(opt_o, step_size=2, gamma=0.5)

    def step(model, opt, batches):
        total = 0.0
        for x, y in batches:
            loss = F.cross_entropy(model(x), y) / len(batches)
            loss.backward()
            total = total + loss.detach()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return total

    compiled = torch.compile(step, backend="donate_xla")
    for i in range(steps):
        n = sizes[i] if sizes else 8
        batches = [batch(n, 100 * i + j) for j in range(accumulate)]
        expected = step(eager, opt_e, batches)
        got = compiled(ours, opt_o, [(x.to(DEV), y.to(DEV)) for x, y in batches])
        sched_e.step()
        sched_o.step()
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i} loss: {m}")
        for (name, a), b in zip(ours.state_dict().items(), eager.state_dict().values()):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {i} {name}: {m}")
    return ours


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def test_adamw_with_accumulation_clipping_and_a_schedule_trains_like_eager():
    _train_side_by_side(_mlp, _tokens, lambda p: torch.optim.AdamW(p, lr=1e-2), accumulate=2, clip=0.5)
    records = donate_backend.reports()
    assert records and all(r.path == "jax" for r in records)
    step = [r for r in records if r.kind == "inference"][-1]  # the optimizer's steady step
    # every parameter and both Adam moments are written over their old buffers
    assert len(step.donated) >= 3 * 6, [d.role for d in step.donated]
    assert "tf.aliasing_output" in step.lowered.lowered.stablehlo()


def test_sgd_momentum_and_batch_norm_train_like_eager():
    ours = _train_side_by_side(SmallCNN, _images, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    assert ours.bn.num_batches_tracked.item() == 4


def test_batch_sizes_that_change_are_compiled_once_each():
    _train_side_by_side(_mlp, _tokens, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=6,
                        sizes=[8, 5, 8, 3, 5, 8])
    assert all(r.path == "jax" for r in donate_backend.reports())


def test_without_donation_nothing_is_donated_and_values_stay_equal():
    with config.patch(donation=False):
        _train_side_by_side(_mlp, _tokens, lambda p: torch.optim.AdamW(p, lr=1e-2), steps=2)
    records = donate_backend.reports()
    assert records and not any(r.donated for r in records)
    assert "tf.aliasing_output" not in records[-1].lowered.lowered.stablehlo()


def test_the_lowered_update_shows_which_input_is_written_over():
    p, g = torch.zeros(4).to(DEV), torch.ones(4).to(DEV)

    @torch.compile(backend="donate_xla")
    def update(p, g):
        p.sub_(0.5 * g)

    update(p, g)
    torch.testing.assert_close(p.cpu(), torch.full((4,), -0.5))
    text = donate_backend.reports()[-1].lowered.lowered.stablehlo()
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    arguments = [re.sub(r"\s+", " ", a).strip() for a in re.split(r",\s*(?=%arg)", main)]
    normalised = "\n".join(re.sub(r"\{.*?(tf\.aliasing_output = \d+).*\}", r"{\1}", a) for a in arguments)
    # the parameter (argument 0) is donated: XLA writes the update, output 0, over it
    expecttest.assert_expected_inline(normalised, """\
%arg0: tensor<4xf32> {tf.aliasing_output = 0}
%arg1: tensor<4xf32>""")


def test_an_input_the_forward_saves_as_it_is_is_not_copied_by_its_executable():
    """A forward saves its weight and its input for the backward as they are: its executable
    returns neither (XLA would copy each into a buffer of its own), the runtime hands the
    inputs themselves to the backward, and the gradients are eager's."""
    torch.manual_seed(0)
    eager = nn.Linear(256, 128, bias=False)
    ours = copy.deepcopy(eager).to(DEV)
    x = torch.randn(4, 256)
    f = torch.compile(lambda model, x: model(x).square().sum(), backend="donate_xla")
    f(ours, x.to(DEV)).backward()
    eager(x).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad.cpu(), eager.weight.grad, rtol=1e-5, atol=1e-5)
    forward = next(r for r in donate_backend.reports() if r.kind == "forward")
    # what it returns: the loss and the matmul's output (4 x 128; XLA adds a few bytes of its
    # output tuple's table), not the weight (128 KiB) or the input (4 KiB)
    assert 4 + 4 * 128 * 4 <= forward.lowered.memory.output_bytes < 4 * 256 * 4, forward.lowered.memory


def test_a_write_into_one_of_two_overlapping_views_is_refused_by_name():
    base = torch.zeros(4, 4).to(DEV)

    @torch.compile(backend="donate_xla")
    def f(a, b):
        a.add_(1)
        return b.sum()

    with pytest.raises(Exception, match=r"inputs #\d+ and #\d+ are views of one tensor on the JAX device"):
        f(base[:3], base[1:])


def test_a_device_registered_after_the_first_backward_is_refused_with_what_to_do():
    import subprocess
    import sys

    code = ("import torch, donate_backend\n"
            "torch.ones(1, requires_grad=True).sum().backward()\n"
            "donate_backend.jax_device()\n")
    environ = {k: v for k, v in os.environ.items() if k != "DONATE_XLA_TEST_JAX"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environ)
    assert proc.returncode != 0
    assert "DonateXlaError" in proc.stderr and "before the first backward" in proc.stderr, proc.stderr[-2000:]


def test_an_op_without_a_lowering_is_refused_by_name():
    x = torch.randn(4, 4).to(DEV)

    @torch.compile(backend="donate_xla", dynamic=False)
    def f(x):
        return torch.linalg.svd(x).S

    with pytest.raises(Exception, match=r"graph \d+.*svd"):
        f(x)


def test_a_device_index_jax_does_not_have_is_refused():
    with pytest.raises(DonateXlaError, match="JAX has 1 device"):
        donate_backend.jax_device(7)


def test_dropout_draws_a_new_mask_each_call_at_its_rate():
    x = torch.ones(4000).to(DEV)
    f = torch.compile(lambda x: F.dropout(x, 0.25, training=True), backend="donate_xla")
    first, second = f(x).cpu(), f(x).cpu()
    for out in (first, second):
        assert set(out.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
        assert abs((out == 0).float().mean().item() - 0.25) < 0.03
    assert not torch.equal(first, second)


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
}
# every HF model of tests/real_models.py (torchvision has no release for the newest torch yet);
# make test runs the first four, make test-slow the rest (SLOW_JAX_REAL in the Makefile)
REAL_CASES = ["gpt2", "gpt2-sgd", "llama", "bert", "t5", "mixtral", "bart", "albert", "whisper", "clip"]


@pytest.mark.parametrize("case", REAL_CASES)
def test_a_real_model_trains_like_eager(case):
    name, _, optimizer = case.partition("-")
    if not available(name):
        pytest.skip(f"{MODELS[name].package} is not installed")
    spec = MODELS[name]
    eager, ours = spec.build(), spec.build_on(DEV)
    make = OPTIMIZERS[optimizer or "adamw"]
    opt_e, opt_o = make(eager.parameters()), make(ours.parameters())

    def step(model, opt, batch):
        loss = spec.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = torch.compile(step, backend="donate_xla")
    for i in range(3):
        batch = spec.batch(i)
        expected = step(eager, opt_e, batch)
        got = compiled(ours, opt_o, {k: v.to(DEV) for k, v in batch.items()})
        torch.testing.assert_close(got.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
        for (n, a), b in zip(ours.named_parameters(), eager.parameters()):
            # AdamW moves a parameter whose gradient is 0 in exact arithmetic (an attention
            # key's bias) by about lr either way from rounding noise: compared in lr
            torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=2.5e-3, msg=lambda m: f"{n}: {m}")
    assert all(r.path == "jax" for r in donate_backend.reports())


@pytest.mark.parametrize("mode", ["step", "model"])
def test_a_training_loop_with_accumulation_clipping_a_schedule_eval_and_a_checkpoint(mode):
    """tests/training_loop.py on the JAX device against the same loop run eagerly on the CPU:
    the whole step compiled, at the full activation budget and at 0.5 (its forwards then save
    less for the backward), and only the model compiled (the optimizer and clipping then run
    op by op on the device)."""
    if not available(training_loop.MODEL):
        pytest.skip(f"{MODELS[training_loop.MODEL].package} is not installed")
    eager = training_loop.run(None, torch.device("cpu"))
    saved = {}
    for budget in (1.0, 0.5) if mode == "step" else (1.0,):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        with config.patch(activation_budget=budget):
            got = training_loop.run(mode, DEV)
        records = donate_backend.reports()
        assert records and all(r.path == "jax" for r in records)
        if mode == "step":
            assert any(r.donated for r in records), "the compiled step donated nothing"
        saved[budget] = sum(r.saved_bytes for r in records if r.kind == "forward")
        training_loop.compare(got, eager)
    if mode == "step":
        assert saved[0.5] < saved[1.0], saved


@pytest.mark.parametrize("seed", range(40_000, 40_012))
def test_random_training_program_matches_eager_on_the_jax_target(seed):
    outcome = xla_fuzz.check(seed, path="jax")
    assert outcome.status != "failed", f"seed {seed}: {outcome.detail}\n{outcome.source}"


def test_the_fake_mode_is_left_for_a_graph_constant():
    from donate_backend.jax import compat, device

    constant = torch.tensor([1.5, 2.0])  # real, as a graph's lifted constant is
    with torch._subclasses.fake_tensor.FakeTensorMode():
        array = device.from_host(constant)
        with compat.outside_fake_mode():
            assert not isinstance(torch.ones(1), torch._subclasses.fake_tensor.FakeTensor)
    assert array.tolist() == [1.5, 2.0]


def _probe(tmp_path, batch=8, **env):
    """tests/jax_cache_probe.py in a fresh process, its cache in ``tmp_path`` unless ``env`` says."""
    import json
    import subprocess
    import sys

    environ = dict(os.environ, DONATE_XLA_CACHE_DIR=str(tmp_path), **env)
    environ.pop("DONATE_XLA_TEST_JAX", None)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "jax_cache_probe.py"), str(batch)],
                          capture_output=True, text=True, timeout=600, env=environ, cwd=here)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for got, expected in zip(result["losses"], result["expected"]):
        assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected)), result
    return result


CACHED = "loaded from JAX's compilation cache"


def test_a_second_process_loads_every_executable_from_the_compilation_cache(tmp_path):
    first = _probe(tmp_path)
    assert first["directory"] == str(tmp_path)
    kinds = sorted(kind for kind, *_ in first["graphs"])
    assert kinds == ["backward", "forward", "inference"], first  # the optimizer's step: an inference graph
    assert all(phases == ["xla compile"] for _, *phases in first["graphs"]), first
    assert any(tmp_path.iterdir())
    second = _probe(tmp_path)
    assert sorted(kind for kind, *_ in second["graphs"]) == kinds
    assert all(phases == [CACHED] for _, *phases in second["graphs"]), second
    assert second["losses"] == first["losses"]
    # another batch size: the forward and the backward are other executables (the optimizer's
    # step, which reads no batch, is the same one)
    other = dict((kind, phases) for kind, *phases in _probe(tmp_path, batch=5)["graphs"])
    assert other == {"forward": ["xla compile"], "backward": ["xla compile"], "inference": [CACHED]}, other


def test_a_corrupt_cache_entry_is_compiled_again_with_a_warning(tmp_path):
    _probe(tmp_path)
    for entry in tmp_path.rglob("*"):
        if entry.is_file():
            entry.write_bytes(b"not an executable")
    again = _probe(tmp_path)
    assert again["graphs"] and not any(CACHED in phases for _, *phases in again["graphs"]), again
    assert again["warnings"], again


def test_the_compilation_cache_is_off_with_its_switch(tmp_path):
    off = _probe(tmp_path, DONATE_XLA_CACHE="0")
    assert off["directory"] is None
    assert not any(tmp_path.iterdir())
