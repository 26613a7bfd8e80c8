"""Gradients of the native path equal eager: MLP, CNN, transformer block, retain/create graph."""
from __future__ import annotations

import copy

import pytest
import torch

import donate_backend
from donate_backend import config



def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 48), torch.nn.ReLU(),
        torch.nn.Linear(48, 8), torch.nn.Tanh(),
    )


def cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.SiLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 7 * 7, 10),
    )


class TransformerBlock(torch.nn.Module):
    def __init__(self, width=32, heads=4):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.ff = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


CASES = {
    "mlp": (mlp, (16, 32)),
    "cnn": (cnn, (4, 3, 16, 16)),
    "transformer": (TransformerBlock, (2, 6, 32)),
}


def eager_and_compiled(name):
    make, shape = CASES[name]
    torch.manual_seed(0)
    eager = make()
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(*shape)
    return eager, compiled_model, x


def grads(model, x):
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def assert_close_lists(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def run_both(name, steps=2):
    eager, compiled_model, x = eager_and_compiled(name)
    compiled = torch.compile(compiled_model, backend="donate_xla")
    for _ in range(steps):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager.zero_grad(set_to_none=True)
        compiled_model.zero_grad(set_to_none=True)
        out_e, out_c = eager(xe), compiled(xc)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
        (out_e * out_e).sum().backward()
        (out_c * out_c).sum().backward()
        assert_close_lists(grads(compiled_model, xc), grads(eager, xe))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_equal_eager(name):
    run_both(name)
    backward = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert backward and all(r.path == "native" for r in backward)
    assert all(r.saved_freed_early > 0 for r in backward)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_gradients_equal_eager_with_switch_off(name):
    with config.patch(free_saved=False):
        run_both(name, steps=1)


def test_retain_graph_twice_accumulates_like_eager():
    eager, compiled_model, x = eager_and_compiled("mlp")
    compiled = torch.compile(compiled_model, backend="donate_xla")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_e, loss_c = eager(xe).pow(2).sum(), compiled(xc).pow(2).sum()
    for _ in range(2):
        loss_e.backward(retain_graph=True)
        loss_c.backward(retain_graph=True)
    assert_close_lists(grads(compiled_model, xc), grads(eager, xe))
    (backward,) = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert backward.buffers_reused >= 1  # the reusing code exists, but must not run here


def test_create_graph_gives_second_order_gradients_like_eager():
    eager, compiled_model, x = eager_and_compiled("mlp")
    compiled = torch.compile(compiled_model, backend="donate_xla")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ge,) = torch.autograd.grad(eager(xe).pow(2).sum(), xe, create_graph=True)
    (gc,) = torch.autograd.grad(compiled(xc).pow(2).sum(), xc, create_graph=True)
    torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
    assert gc.requires_grad
    # Differentiating the compiled backward itself is refused by aot_autograd
    # (for every aot_autograd backend); it must be that clear error, not a
    # wrong number.
    with pytest.raises(RuntimeError, match="double backward"):
        gc.sum().backward()


def test_retain_graph_after_a_reusing_backward_is_correct():
    eager, compiled_model, x = eager_and_compiled("mlp")
    compiled = torch.compile(compiled_model, backend="donate_xla")
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(xe).pow(2).sum().backward()
    compiled(xc).pow(2).sum().backward()  # compiled and run with reuse on
    loss_e, loss_c = eager(xe).pow(2).sum(), compiled(xc).pow(2).sum()
    for _ in range(2):
        loss_e.backward(retain_graph=True)
        loss_c.backward(retain_graph=True)
    assert_close_lists(grads(compiled_model, xc), grads(eager, xe))


def test_flipping_the_switch_rebuilds_instead_of_reusing_code():
    eager, compiled_model, x = eager_and_compiled("mlp")
    compiled = torch.compile(compiled_model, backend="donate_xla")
    compiled(x.clone().requires_grad_()).sum().backward()
    (backward,) = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert backward.buffers_reused >= 1
    with config.patch(free_saved=False):
        compiled_model.zero_grad(set_to_none=True)
        xc = x.clone().requires_grad_()
        compiled(xc).sum().backward()
        assert backward.saved_freed_early == 0 and backward.buffers_reused == 0
    eager.zero_grad(set_to_none=True)
    xe = x.clone().requires_grad_()
    eager(xe).sum().backward()
    assert_close_lists(grads(compiled_model, xc), grads(eager, xe))
    compiled(x.clone().requires_grad_()).sum().backward()
    assert backward.buffers_reused >= 1  # back to the first build


def test_inductor_executor_matches_eager():
    with config.patch(native_compiler="inductor"):
        run_both("mlp", steps=1)
    backward = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert backward and backward[0].saved_freed_early > 0


def test_inference_graph_with_input_mutation_matches_eager():
    def update(buffer, x):
        buffer.add_(x)  # kept in the graph as a copy_ (keep_inference_input_mutations)
        return (buffer * 2).sum()

    buffer_e, buffer_c, x = torch.zeros(4), torch.zeros(4), torch.randn(4)
    with torch.no_grad():
        expected = update(buffer_e, x)
        got = torch.compile(update, backend="donate_xla")(buffer_c, x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(buffer_c, buffer_e)
    assert [r.kind for r in donate_backend.reports()] == ["inference"]
