"""Which dying buffers a pointwise op may write into, and when the reusing code runs."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from donate_backend.native import free_saved, reuse

aten = torch.ops.aten



def trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(*s) for s in shapes])


def placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def planned(gm, donated=()):
    return [(p.node.name, p.buffer.name) for p in reuse.plan_reuse(gm.graph, set(donated))]


def test_out_variant_found_for_pointwise_ops():
    assert reuse.out_variant(aten.mul.Tensor) == (aten.mul.out, "out")
    assert reuse.out_variant(aten.gelu_backward.default) == (aten.gelu_backward.grad_input, "grad_input")


def test_donated_input_dying_at_a_pointwise_op_is_reused():
    gm = trace(lambda a, b: (a * b).sum(), (4, 4), (4, 4))
    a, b = placeholders(gm)
    assert planned(gm) == []  # inputs are not ours unless donated
    assert planned(gm, [a]) == [("mul", a.name)]


def test_intermediate_dying_at_a_pointwise_op_is_reused():
    gm = trace(lambda a: (a.exp() * 2).sum(), (4, 4))
    assert planned(gm) == [("mul", "exp")]


def test_not_reused_while_a_view_of_it_is_read_later():
    def f(a):
        t = a.exp()
        v = t.view(-1)
        return (t * 2).sum() + v.sum()

    assert ("mul", "exp") not in planned(trace(f, (4, 4)))


def test_not_reused_when_returned_or_shape_differs():
    def returns_exp(a):
        t = a.exp()
        return t * 2, t

    assert planned(trace(returns_exp, (4, 4))) == []
    gm = trace(lambda a, b: a.exp() + b, (4, 1), (4, 4))
    assert planned(gm) == []  # exp is [4, 1], the sum [4, 4]


def test_not_reused_when_an_opaque_call_reads_it():
    gm = trace(lambda a: (a.exp() * 2).sum(), (4, 4))
    exp = next(n for n in gm.graph.nodes if n.name == "exp")
    with gm.graph.inserting_after(exp):
        gm.graph.call_function(print, (exp,))  # e.g. a DDP hook keeping a reference
    assert planned(gm) == []


def test_rewrite_gives_the_same_numbers():
    gm = trace(lambda a, b: ((a.exp() * b).sin() + 1).sum(), (8, 8), (8, 8))
    program = free_saved.build_freeing(gm, "g", reuse_buffers=True)
    # exp -> mul -> sin -> add: each writes into the one before it.
    assert program.buffers_reused == 3
    assert "aten.mul.out(exp, b_1, out=exp)" in program.reusing_source
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    assert torch.equal(program.reusing([a, b]), gm(a, b))


def _mlp_and_input():
    torch.manual_seed(0)
    # Ends in GELU: its backward's only dying buffer is the saved pre-activation.
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4), torch.nn.GELU()
    )
    return model, torch.randn(8, 16)


def _retain_twice(model, x):
    model(x).pow(2).sum().backward()  # the backward is built by a normal call
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    return [p.grad.clone() for p in model.parameters()]


def test_reusing_code_does_not_run_while_the_graph_is_kept(monkeypatch):
    model, x = _mlp_and_input()
    expected = _retain_twice(copy.deepcopy(model), x)
    calls = []
    real = free_saved.may_reuse_saved_buffers
    monkeypatch.setattr(
        free_saved, "may_reuse_saved_buffers", lambda: calls.append(real()) or calls[-1]
    )
    got = _retain_twice(torch.compile(model, backend="donate_xla"), x)
    assert calls == [True, False, False]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_reusing_under_retain_graph_would_corrupt_gradients(monkeypatch):
    """The runtime check is what keeps retain_graph correct: forcing reuse breaks it."""
    model, x = _mlp_and_input()
    expected = _retain_twice(copy.deepcopy(model), x)
    compiled = torch.compile(copy.deepcopy(model), backend="donate_xla")
    assert all(torch.allclose(g, e) for g, e in zip(_retain_twice(compiled, x), expected))
    monkeypatch.setattr(free_saved, "may_reuse_saved_buffers", lambda: True)
    # The overwritten saved tensor is caught by autograd's version counter.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _retain_twice(torch.compile(model, backend="donate_xla"), x)
