"""Programs whose graphs hold ops torch_xla cannot lower: they run on the CPU between
XLA segments (xla/fallback.py), with eager's values and gradients.
"""
import functools

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import (
    STITCHED,
    _batch,
    _compiled_under,
    _mlp,
    assert_close_tree,
    mse_training_step,
    parameters_and_optimizer_state,
    run_against_eager,
)

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    from donate_backend.xla.ops import has_xla_lowering


RRELU_TRAINING = """
import torch, torch_xla, torch.nn.functional as F
import donate_backend
device = torch_xla.device()
lin = torch.nn.Linear(16, 16).to(device)
f = torch.compile(lambda x: F.rrelu(lin(x), 0.1, 0.3, True), backend="donate_xla")
for i in range(3):
    x = torch.randn(64, 16).to(device).requires_grad_(True)
    h = lin(x).detach().cpu()
    y = f(x)
    y.sum().backward()
    y = y.detach().cpu()
    slope = torch.where(h < 0, y / h, torch.ones_like(h))
    assert bool((((slope >= 0.1 - 1e-6) & (slope <= 0.3 + 1e-6)) | (h >= 0)).all())
    torch.testing.assert_close(x.grad.cpu(), slope @ lin.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
print(sorted({op for r in donate_backend.reports() for op in r.fallback_ops}))
"""


CPU_FALLBACK_CASES = """
import torch, torch_xla, torch.nn.functional as F
import donate_backend
device = torch_xla.device()
g = torch.Generator().manual_seed(0)
img = torch.randn(2, 3, 7, 9, generator=g)
w, b = torch.randn(5, 4, generator=g), torch.randn(4, generator=g)
idx = torch.randint(0, 6, (6, 5), generator=g)
cases = {
    "cummin": lambda x: torch.cummin(x.view(-1), 0).values,
    "median over a dim": lambda x: torch.median(x.flatten(1), 1).values,
    "nanmedian over a dim": lambda x: torch.nanmedian(x.flatten(1), 1).values,
    "frexp": lambda x: torch.frexp(x).mantissa,
    "adaptive avg pool, indivisible": lambda x: F.adaptive_avg_pool2d(x, (4, 5)),
    "adaptive avg pool, divisible": lambda x: F.adaptive_avg_pool2d(x[..., :6, :6], (3, 2)),
    "adaptive max pool, indivisible": lambda x: F.adaptive_max_pool2d(x, (4, 5)),
    "avg pool, ceil mode with padding": lambda x: F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=True),
    "avg pool, divisor override": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    "addmm with beta and alpha": lambda x: torch.addmm(b.to(x.device), x.flatten(0, 2)[:, :5], w.to(x.device), beta=0.5, alpha=2.0),
    "linspace between tensors": lambda x: torch.linspace(x.min(), x.max(), 5, device=x.device) * x.sum(),
    "scatter_reduce mean": lambda x: torch.zeros(6, 5, device=x.device).scatter_reduce(
        0, idx.to(x.device), x.flatten()[:30].view(6, 5), "mean", include_self=False),
    "inv_ex checking errors": lambda x: torch.linalg.inv_ex(x[0, 0, :5, :5] + 5 * torch.eye(5, device=x.device), check_errors=True).inverse,
    "assignment through a bool mask": lambda x: torch.ops.aten.index_put(x * 1, [x[:, 0, 0, 0].detach() > x[:, 0, 0, 0].detach().mean()], torch.tensor(0.0, device=x.device)),
    "norm with p=0": lambda x: torch.norm(x, 0, dim=1) * x.sum(),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 2),
    "huber loss": lambda x: F.huber_loss(x, torch.zeros_like(x), delta=0.5),
    "embedding bag": lambda x: F.embedding_bag(
        torch.tensor([0, 2, 1, 3], device=x.device), x.reshape(-1, 9)[:4], torch.tensor([0, 2], device=x.device), mode="mean"),
    "ihfft2 (conj_physical)": lambda x: torch.fft.ihfft2(x).abs(),
    "complex from two real tensors": lambda x: torch.complex(x, 2 * x).abs(),
    "polar": lambda x: torch.polar(x.abs() + 1, x).real,
    "roll of an empty tensor": lambda x: torch.roll(x[:0], 1, 0),
    "cholesky_solve of empty matrices": lambda x: torch.cholesky_solve(x[0, :, :0, :0], x[0, :, :0, :0]),
}

def run(fn, on):
    x = img.clone().to(on).requires_grad_(True)
    out = fn(x)
    (out**2).sum().backward()
    return out.detach().cpu(), x.grad.cpu()

for name, fn in cases.items():
    donate_backend.clear_reports()
    got, expected = run(torch.compile(fn, backend="donate_xla"), device), run(fn, "cpu")
    for what, x, y in zip(("value", "input gradient"), got, expected):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}, {what}: {m}")
    on_cpu = sorted({op for r in donate_backend.reports() for op in r.fallback_ops})
    print(f"{name}: {on_cpu}")
    torch._dynamo.reset()
"""


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


def test_op_without_xla_lowering_runs_on_the_cpu_between_xla_segments(xla_device):
    import donate_backend

    f = torch.compile(lambda t: torch.special.zeta(t * 2, t) + 1, backend="donate_xla")
    x = torch.rand(8) + 1
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), torch.special.zeta(x * 2, x) + 1)
    (split,) = [r for r in donate_backend.reports() if r.fallback_ops]
    assert split.fallback_ops == ("aten.special_zeta.default",)
    assert "around ops run on the CPU: aten.special_zeta.default" in donate_backend.format_record(split)


def test_rrelu_in_training_runs_on_the_cpu_instead_of_crashing():
    """torch_xla 2.9 has a kernel for ``rrelu_with_noise``, but tracing it on a
    placeholder killed the process with a segmentation fault; it now runs on the
    CPU between XLA segments. Each element's slope is in [lower, upper] and the
    input's gradient goes through the slopes the forward drew. In a fresh
    process, so that a crash fails this test only."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", RRELU_TRAINING], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "aten.rrelu_with_noise_functional.default" in out.stdout


def test_kernels_that_would_hand_placeholders_to_the_cpu_run_on_the_cpu():
    """torch_xla 2.9 has kernels for these ops, but for these arguments (or
    always) they read their input's data or pass it to torch_xla's CPU fallback,
    which aborted the process when traced on a placeholder ("PjRt buffer is null
    in TransferFromDevice") or crashed it. They now run on the CPU between XLA
    segments; each value and input gradient equals the CPU's. The divisible
    adaptive pool stays on XLA. In a fresh process, so that a crash fails this
    test only."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", CPU_FALLBACK_CASES], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ran = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert len(ran) == 23, out.stdout
    assert ran["adaptive avg pool, divisible"] == "[]"
    assert "aten._adaptive_avg_pool2d_backward.default" in ran["adaptive avg pool, indivisible"]
    assert all(ops != "[]" for name, ops in ran.items() if name != "adaptive avg pool, divisible"), ran


def test_lowering_check_knows_composites():
    assert has_xla_lowering(torch.ops.aten.addmm.default)
    assert has_xla_lowering(torch.ops.aten.linear.default)  # decomposes
    assert has_xla_lowering(torch.ops.aten._native_batch_norm_legit_functional.default)
    assert not has_xla_lowering(torch.ops.aten.histc.default)
    assert not has_xla_lowering(torch.ops.aten.special_zeta.default)


def test_host_copy_inside_graph_runs_on_the_cpu(xla_device):
    import donate_backend

    f = torch.compile(lambda t: (t * 2).sum().cpu() + 1, backend="donate_xla")
    x = torch.randn(8)
    out = f(x.to(xla_device))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, (x * 2).sum() + 1)
    assert any(r.fallback_ops == ("aten._to_copy.default",) for r in donate_backend.reports())


def test_custom_op_without_an_xla_kernel_falls_back_to_the_cpu(xla_device):
    """A CPU-only custom op never runs on a placeholder (torch_xla's fallback would crash)."""
    import donate_backend

    @torch.library.custom_op("donate_xla_test::cpu_only", mutates_args=(), device_types="cpu")
    def cpu_only(t: torch.Tensor) -> torch.Tensor:
        assert t.device.type == "cpu"
        return t * 2

    @cpu_only.register_fake
    def _(t):
        return torch.empty_like(t)

    assert not has_xla_lowering(torch.ops.donate_xla_test.cpu_only.default)
    f = torch.compile(lambda t: torch.ops.donate_xla_test.cpu_only(t + 1) * 3, backend="donate_xla")
    x = torch.randn(4)
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), (x + 1) * 2 * 3)
    assert any(r.fallback_ops == ("donate_xla_test.cpu_only.default",) for r in donate_backend.reports())


def test_custom_op_with_a_composite_kernel_is_traced(xla_device):
    @torch.library.custom_op("donate_xla_test::composite", mutates_args=())
    def composite(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    @composite.register_fake
    def _(t):
        return torch.empty_like(t)

    x = torch.randn(4)
    f = torch.compile(lambda t: torch.ops.donate_xla_test.composite(t), backend="donate_xla")
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), x * 2 + 1)


def _roll_node(shape):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(shape, device="meta")
    node = graph.call_function(torch.ops.aten.roll.default, (x, [1]))
    return node


def test_an_op_goes_to_the_cpu_only_for_the_arguments_its_kernel_hands_over(monkeypatch):
    """``lowerable_node`` asks an op's fallback predicate about the node's arguments
    (their fake values); a predicate that raises (an argument layout nobody foresaw)
    sends the op to the CPU, the safe side."""
    from donate_backend.xla import ops

    assert ops.lowerable_node(_roll_node((3, 4)))
    assert not ops.lowerable_node(_roll_node((0, 4)))  # torch_xla's kernel: SIGFPE

    def surprised(args, kwargs):
        raise IndexError("an argument layout nobody foresaw")

    monkeypatch.setitem(ops._FALLS_BACK_WITH, torch.ops.aten.roll.default, surprised)
    assert not ops.lowerable_node(_roll_node((3, 4)))
