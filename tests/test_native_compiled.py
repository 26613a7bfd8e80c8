"""The compiled graph (native/compiled.py): no deep copies, one build per setting, executor flips.

What these guard against: the native path deep-copied every aot graph to keep a pristine copy,
which fails on graphs holding fake or meta constants (every HF model); under
Inductor, ``retain_graph=True`` was refused with ``free_saved=False`` although
nothing was donated; and a switch flipped after capture handed Inductor graphs
it could not compile.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import donate_backend
from donate_backend import config
from donate_backend.native.compiled import CompiledGraph
from instances import instances_of
from programs import (
    checkpointed_program,
    grad_scaler_program,
    held_state_program,
    inference_mode_program,
    varying_batch_program,
)


class WithConstants(torch.nn.Module):
    """Uses tensors made in forward: aot_autograd lifts them as graph constants."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = torch.tensor([0.5, 2.0] * 4)
        mask = torch.arange(8) % 2 == 0
        return torch.where(mask, self.linear(x) * scale, x).relu()


def _grads(model, x, run=None):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    # (not `run or model`: newer torch gives a compiled module a __len__ that raises)
    (model if run is None else run)(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _assert_close(actual, expected, **tolerance):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **tolerance)


def test_no_graph_is_ever_deep_copied(monkeypatch):
    real_deepcopy = torch.fx.GraphModule.__deepcopy__

    def refuse(self, memo):
        # (aot_autograd deep-copies the backward it compiles lazily: only ours count.)
        caller = sys._getframe(1)
        while caller is not None:
            if "donate_backend" in caller.f_code.co_filename:
                raise AssertionError(f"{caller.f_code.co_filename} deep-copied a GraphModule")
            caller = caller.f_back
        return real_deepcopy(self, memo)

    torch.manual_seed(0)
    model, x = WithConstants(), torch.randn(4, 8)
    expected = _grads(copy.deepcopy(model), x)
    monkeypatch.setattr(torch.fx.GraphModule, "__deepcopy__", refuse)
    compiled = torch.compile(model, backend="donate_xla")
    _assert_close(_grads(model, x, compiled), expected)
    with config.patch(free_saved=False):  # a lazy rebuild from the kept graph
        _assert_close(_grads(model, x, compiled), expected)


def test_one_build_per_setting_reused_when_it_comes_back():
    torch.manual_seed(0)
    model, x = WithConstants(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="donate_xla")
    with instances_of(CompiledGraph) as graphs:
        for setting in (True, False, True, False):
            with config.patch(free_saved=setting):
                _grads(model, x, compiled)
    (backward,) = [g for g in graphs if g.ctx.kind == "backward"]
    assert len(backward._builds.built_keys()) == 2


@pytest.mark.parametrize("free_saved", [True, False])
def test_inductor_backward_with_retain_graph_is_correct(free_saved):
    # Once refused with free_saved=False although nothing was
    # donated. Now the donating variant never runs under retain_graph: with
    # free_saved=True a second, non-donating variant runs instead.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ours = copy.deepcopy(eager)
    x = torch.randn(8, 16)
    with config.patch(native_compiler="inductor", free_saved=free_saved):
        compiled = torch.compile(ours, backend="donate_xla")
        compiled(x).sum().backward()  # compiles; a plain backward first
        eager(x).sum().backward()
        loss_e, loss_c = eager(x).pow(2).sum(), compiled(x).pow(2).sum()
        for _ in range(2):
            loss_e.backward(retain_graph=True)
            loss_c.backward(retain_graph=True)
    _assert_close([p.grad for p in ours.parameters()], [p.grad for p in eager.parameters()],
                  rtol=1e-5, atol=1e-5)


def test_flipping_the_executor_both_ways_recompiles_correctly():
    # Graphs captured for one executor are built for the other: the ATen
    # executor runs Inductor's decomposed graphs, Inductor gets the ATen
    # executor's graphs retraced with its decompositions and passes.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Dropout(0.0), torch.nn.GELU(), torch.nn.Linear(16, 4)
    )
    x = torch.randn(8, 16)
    expected = _grads(copy.deepcopy(model), x)
    for first, second in (("aten", "inductor"), ("inductor", "aten")):
        torch._dynamo.reset()
        ours = copy.deepcopy(model)
        with config.patch(native_compiler=first):
            compiled = torch.compile(ours, backend="donate_xla")
            _assert_close(_grads(ours, x, compiled), expected, rtol=1e-5, atol=1e-5)
        with config.patch(native_compiler=second):
            _assert_close(_grads(ours, x, compiled), expected, rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_dropout_trains_under_inductor_after_a_flip():
    # Random ops need Inductor's replace_random pass, which its partitioner
    # runs; graphs captured for the ATen executor get it when flipped.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="donate_xla")
    x = torch.randn(64, 16)
    compiled(x).sum().backward()
    with config.patch(native_compiler="inductor"):
        outputs = [compiled(x) for _ in range(2)]
        outputs[0].sum().backward()
    with torch.no_grad():
        kept = model.eval()(x)
    assert all(torch.isfinite(o).all() for o in outputs)
    assert not torch.equal(outputs[0], outputs[1])  # fresh randomness on every call
    assert not torch.allclose(outputs[0], kept)  # dropout did drop
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_optimizer_in_backward_hooks_fire_as_in_eager(executor):
    """SGD in post-accumulate-grad hooks: same firings, gradients and parameters as eager."""

    def attach(model, seen):
        for index, param in enumerate(model.parameters()):
            def hook(p, index=index):
                seen.append((index, p.grad.clone()))
                with torch.no_grad():
                    p.add_(p.grad, alpha=-0.1)
                p.grad = None

            param.register_post_accumulate_grad_hook(hook)

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ours = copy.deepcopy(eager)
    seen_eager, seen_ours = [], []
    attach(eager, seen_eager)
    attach(ours, seen_ours)
    with config.patch(native_compiler=executor):
        compiled = torch.compile(ours, backend="donate_xla")
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            eager(x).pow(2).sum().backward()
            compiled(x).pow(2).sum().backward()
    assert sorted(i for i, _ in seen_ours) == sorted(i for i, _ in seen_eager)
    by_index_e = sorted(seen_eager, key=lambda item: item[0])
    by_index_o = sorted(seen_ours, key=lambda item: item[0])
    for (_, e), (_, o) in zip(by_index_e, by_index_o):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)
    _assert_close(list(ours.parameters()), list(eager.parameters()), rtol=1e-5, atol=1e-6)
    assert any(r.kind == "backward" for r in donate_backend.reports())


def _assert_program_matches_eager(program, executor: str, *args, tol=None) -> None:
    """``program(device, compile_fn, *args)`` compiled with ``executor`` equals eager."""
    expected = program(torch.device("cpu"), lambda f: f, *args)
    torch._dynamo.reset()
    with config.patch(native_compiler=executor):
        got = program(torch.device("cpu"), lambda f: torch.compile(f, backend="donate_xla"), *args)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **(tol or dict(rtol=2e-5, atol=1e-5)))


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_compiled_calls_under_inference_mode_match_eager(executor):
    """The program tests/test_xla_training_programs.py runs on XLA (evaluation under
    ``torch.inference_mode()``, an inference tensor accumulated into inside a compiled
    call, then used to train), on the native path: equal to eager."""
    _assert_program_matches_eager(inference_mode_program, executor, tol=dict(rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_grad_scaler_training_matches_eager(executor, whole_step):
    """``torch.amp.GradScaler`` with the model or the whole step compiled: the
    overflowing step is skipped and the scale halved, as in eager."""
    _, _, scale = grad_scaler_program(torch.device("cpu"), lambda f: f, whole_step)
    assert scale.item() == 2.0**15  # the overflow was seen: 65536 halved once
    _assert_program_matches_eager(grad_scaler_program, executor, whole_step)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_step_recompiled_for_a_changing_batch_size_matches_eager(executor):
    """A whole training step called with changing batch sizes (dynamo compiles it again
    after a change): equal to eager."""
    _assert_program_matches_eager(varying_batch_program, executor)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_trains_like_eager(executor, use_reentrant):
    """``torch.utils.checkpoint`` around two of three blocks, the model compiled:
    losses, input gradients and parameters equal eager."""
    _assert_program_matches_eager(checkpointed_program, executor, False, use_reentrant)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_state_dicts_and_averaged_model_held_during_training_match_eager(executor):
    """State dicts and an SWA ``AveragedModel`` held while the compiled step trains, and a
    restore by ``load_state_dict``: every held tensor equals eager's."""
    _assert_program_matches_eager(held_state_program, executor, True)
