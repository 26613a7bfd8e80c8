"""Run a program compiled with donate_xla on XLA and eagerly on the CPU, and compare.

``run_against_eager(make_program)`` builds the program twice from the same initial
values and compares every returned value and every piece of state after each step.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA

if HAS_TORCH_XLA:
    import torch_xla

TOL = dict(rtol=1e-4, atol=1e-5)


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def assert_close_tree(got, expected, what="", tol=None):
    got, expected = _cpu(got), _cpu(expected)
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        assert got.shape == expected.shape, (what, got.shape, expected.shape)
        torch.testing.assert_close(got, expected, **(tol or TOL), msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), what
        for k, (g, e) in enumerate(zip(got, expected)):
            assert_close_tree(g, e, f"{what}[{k}]", tol)
    else:
        assert got == expected, what


def run_against_eager(make_program, steps=4, compile_fn=None, tol=None, state_every_step=True):
    """``make_program(device, compile)`` -> (step(i) -> outputs, state() -> tensors).

    ``state_every_step=False`` compares the state after the last step only:
    reading it syncs the tensors, which would hide what pending IR does."""
    compile_fn = compile_fn or (lambda f: torch.compile(f, backend="donate_xla"))
    xla_step, xla_state = make_program(torch_xla.device(), compile_fn)
    cpu_step, cpu_state = make_program(torch.device("cpu"), lambda f: f)
    for i in range(steps):
        got = xla_step(i)
        expected = cpu_step(i)
        assert_close_tree(got, expected, f"step {i} outputs", tol)
        if state_every_step or i == steps - 1:
            assert_close_tree(xla_state(), cpu_state(), f"step {i} state", tol)


def mse_training_step(model, opt):
    """``f(x, y)``: an MSE loss, its backward, the optimizer's step and zero_grad; the loss."""

    def f(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return f


def parameters_and_optimizer_state(model, opt) -> list:
    """The model's parameters, then each one's optimizer state tensors (sorted by key)."""
    tensors = list(model.parameters())
    for p in model.parameters():
        tensors += [v for _, v in sorted(opt.state[p].items())]
    return tensors


def _mlp(seed=0, width=16, out=4):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, out))


def _batch(i, n=6, device="cpu"):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(n, 4, generator=g).to(device)


STITCHED = pytest.mark.parametrize("stitched", [False, True], ids=["executables", "stitched"])


def _compiled_under(stitched: bool):
    """The XLA run's ``compile_fn``: ``torch.compile`` with donate_xla, the step's calls
    made with ``DONATE_XLA_STITCH`` on or off (the switch is read per call)."""
    from donate_backend import config

    def compile_fn(f):
        compiled = torch.compile(f, backend="donate_xla")

        def call(*args):
            with config.patch(stitch=stitched):
                return compiled(*args)

        return call

    return compile_fn
