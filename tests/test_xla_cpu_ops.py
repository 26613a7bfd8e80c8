"""Programs whose graphs hold ops torch_xla cannot lower: they run on the CPU between
XLA segments (xla/fallback.py), with eager's values and gradients.

Each program runs compiled with donate_xla on XLA and eagerly on the CPU (the oracle)
from the same initial values, for several steps; every returned value and every piece
of state is compared (``eager_oracle.run_against_eager``).
"""
import functools

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import STITCHED, _batch, _compiled_under, _mlp, assert_close_tree, mse_training_step, parameters_and_optimizer_state, run_against_eager

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla


def test_weight_norm_training_runs_its_cpu_ops_between_xla_segments():
    """``parametrizations.weight_norm``: torch_xla has no kernel for
    ``_weight_norm_interface`` (nor its backward), so the graphs run in XLA
    segments around those ops on the CPU. The op returns two tensors, and the
    next XLA segment was handed them as one tuple input, which failed to lower
    ("Trying to access XLA data ... while an async operation is in flight").
    Its results are now unpacked in its own segment. Adam, against the CPU."""
    import donate_backend

    def program(device, compile_):
        model = _mlp(seed=6)
        torch.nn.utils.parametrizations.weight_norm(model[0])
        model = model.to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = compile_(mse_training_step(model, opt))
        return (lambda i: step(*_batch(i, device=device))), (lambda: parameters_and_optimizer_state(model, opt))

    run_against_eager(program)
    fallback = {op for r in donate_backend.reports() for op in r.fallback_ops}
    assert "aten._weight_norm_interface.default" in fallback


class _SpectralConv1d(torch.nn.Module):
    """A Fourier neural operator's layer: rfft, a complex product on the lowest
    modes, irfft. Complex weights as a complex parameter, or built from two real
    ones with ``torch.complex``."""

    def __init__(self, channels, modes, complex_parameter):
        super().__init__()
        self.modes = modes
        shape = (channels, channels, modes)
        if complex_parameter:
            self.w = torch.nn.Parameter(0.1 * torch.randn(shape, dtype=torch.cfloat))
        else:
            self.w_re, self.w_im = (torch.nn.Parameter(0.1 * torch.randn(shape)) for _ in range(2))

    def forward(self, x):
        w = self.w if hasattr(self, "w") else torch.complex(self.w_re, self.w_im)
        spectrum = torch.fft.rfft(x)
        out = torch.zeros(*x.shape[:2], x.shape[-1] // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[..., : self.modes] = torch.einsum("bix,iox->box", spectrum[..., : self.modes], w)
        return torch.fft.irfft(out, n=x.shape[-1])


@pytest.mark.parametrize("complex_parameter", [False, True])
def test_fourier_neural_operator_trains_like_eager(complex_parameter):
    """``torch.complex`` (and ``polar``, ``conj_physical``) killed the process when
    traced on a placeholder (segmentation fault); they now run on the CPU. Four
    Adam steps of a two-layer spectral network, losses and every parameter and
    moment (complex ones too) equal to the CPU's."""

    def program(device, compile_fn):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv1d(2, 8, 1), _SpectralConv1d(8, 6, complex_parameter), torch.nn.GELU(),
            _SpectralConv1d(8, 6, complex_parameter), torch.nn.Conv1d(8, 1, 1),
        ).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        step = compile_fn(mse_training_step(model, opt))
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 2, 32, generator=g), torch.randn(4, 1, 32, generator=g)) for _ in range(4)]
        return (lambda i: step(*(t.to(device) for t in batches[i]))), (
            lambda: parameters_and_optimizer_state(model, opt)
        )

    run_against_eager(program, steps=4)


def _cond_training(device, compile_fn):
    torch.manual_seed(0)
    model = _Gated().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):
        loss = (model(x) * torch.arange(1.0, 4.0, device=x.device)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = compile_fn(step)
    losses = [step(torch.full((2, 4), sign).to(device)) for sign in (1.0, -1.0, 0.5, -0.5)]
    return [t.cpu() for t in losses + list(model.parameters())]


def _control_flow(kind: str, x, w):
    from torch._higher_order_ops.scan import scan
    from torch._higher_order_ops.while_loop import while_loop
    from functorch.experimental.control_flow import map as control_map

    if kind == "while_loop":  # (its body cannot differentiate: on x @ w's value only)
        h = (x @ w).detach()
        return while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2 + 1), (torch.tensor(0, device=x.device), h))[1]
    if kind == "scan":  # an RNN over the leading dimension

        def cell(carry, xi):
            new = torch.tanh(carry @ w + xi)
            return new, new.clone()

        return scan(cell, torch.zeros(x.shape[1], w.shape[0], device=x.device), x)[1]
    return control_map(lambda xi, w: xi @ w, x, w)


class _Gated(torch.nn.Module):
    """A layer that takes one of two branches by a value computed on the device."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.cond(
            x.sum() > 0, lambda h: self.lin(h).relu(), lambda h: self.lin(h).tanh() * 2, (x,)
        )


@STITCHED
def test_torch_cond_runs_its_branch_on_the_cpu_and_trains_like_eager(stitched):
    """``torch.cond`` branches on a value on the device. torch_xla runs it by reading
    that value, which a placeholder lacks: donate_xla refused every graph with it
    ("Check failed: handle->HasValue()" while lowering). It now runs on the CPU between
    XLA segments, forward and backward, taking each branch as eager does."""
    import donate_backend

    got = _cond_training(torch_xla.device(), _compiled_under(stitched))
    expected = _cond_training(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, parameters")
    split = {r.kind for r in donate_backend.reports() if "cond" in r.fallback_ops}
    assert split == {"forward", "backward"}


@pytest.mark.parametrize("kind", ["while_loop", "scan", "map"])
def test_loops_run_on_the_cpu_with_eagers_values_and_gradients(kind):
    """``while_loop``, ``scan`` and ``control_flow.map`` were refused like ``torch.cond``
    (torch_xla iterates on values a placeholder lacks); they run on the CPU between XLA
    segments now, with eager's values and, for scan and map, gradients."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 2, 3, generator=g), torch.randn(3, 3, generator=g)
    expected_w = w.clone().requires_grad_()
    expected = _control_flow(kind, x, expected_w)
    device = torch_xla.device()
    got_w = w.to(device).requires_grad_()
    got = torch.compile(functools.partial(_control_flow, kind), backend="donate_xla")(x.to(device), got_w)
    assert_close_tree(got, expected, f"{kind} values")
    if kind != "while_loop":
        weights = torch.arange(got.numel(), dtype=torch.float32).reshape(got.shape) / got.numel()
        (expected_grad,) = torch.autograd.grad((expected * weights).sum(), expected_w)
        (got_grad,) = torch.autograd.grad((got * weights.to(device)).sum(), got_w)
        assert_close_tree(got_grad, expected_grad, f"{kind} gradient")
