"""Automatic donation on XLA: who is donated, that buffers are reused, and safety."""
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON, xla_flags_with

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    import donate_backend
    from donate_backend.analysis import aliasing
    from donate_backend.xla.runtime import XlaExecutable
    from xla_models import MLP, CASES, Case, make_step, train

TOL = dict(rtol=1e-4, atol=1e-5)
XLAC = torch_xla._XLAC if HAS_TORCH_XLA else None


@pytest.fixture
def alias_per_call(monkeypatch):
    """(graph, donors, InputOutputAliasCount of the executable) for every executed graph.

    torch_xla records InputOutputAliasCount when it compiles an executable, so
    each call is matched with the count recorded for the variant it ran.
    """
    calls = []
    original = XlaExecutable.__call__

    def measured(self, args):
        out = original(self, args)
        calls.append((self.graph_name, len(self.last_call.donors), self.last_call.aliased))
        return out

    monkeypatch.setattr(XlaExecutable, "__call__", measured)
    return calls


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_single": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False, fused=False),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adamw_single": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False, fused=False),
}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_every_parameter_and_state_buffer_is_donated(opt_name, alias_per_call):
    case = Case(opt_name, MLP, OPTIMIZERS[opt_name], CASES["mlp_sgd_momentum"].make_batch)
    eager = train(case, backend=None)
    compiled = train(case, backend="donate_xla")
    for a, b in zip(eager.params, compiled.params):
        torch.testing.assert_close(b, a, **TOL)
    for (_, a), (_, b) in zip(eager.opt_state, compiled.opt_state):
        torch.testing.assert_close(b, a, **TOL)
    # every executed graph aliased exactly its donors
    assert alias_per_call and all(used == aliased for _, used, aliased in alias_per_call)
    assert any(used > 0 for _, used, _ in alias_per_call)
    steady = donate_backend.reports()[-1]
    assert steady.kind == "inference"
    roles = [d.role for d in steady.donated]
    n_params = len(compiled.params)
    device_state = [t for _, t in compiled.opt_state if t.dim() > 0]
    assert roles.count("parameter") == n_params
    assert roles.count("optimizer_state") == len(device_state)
    assert all(e.reason == aliasing.HOST_SCALAR for e in steady.excluded)


def test_batchnorm_running_stats_are_donated(alias_per_call):
    train(CASES["cnn_bn_adam"], backend="donate_xla", steps=2)
    forward = next(r for r in donate_backend.reports() if r.kind == "forward")
    assert [tuple(d.shape) for d in forward.donated] == [(8,), (8,)]  # running mean and var
    # num_batches_tracked is a 0-dim tensor: torch_xla may share its buffer with equal scalars
    (count,) = [e for e in forward.excluded if e.role == "buffer"]
    assert count.reason == aliasing.DEVICE_SCALAR
    assert all(used == aliased for _, used, aliased in alias_per_call)


def _accumulate_run(backend, preallocate_grads):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = MLP().to(device)
    if preallocate_grads:  # AccumulateGrad then adds in place into these buffers
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    extra = [torch.randn(p.shape).to(device) for p in model.parameters()]  # host RNG: same twice

    def accumulate(extra):
        with torch.no_grad():
            for p, e in zip(model.parameters(), extra):
                p.grad += e

    accumulate = torch.compile(accumulate, backend=backend) if backend else accumulate
    batch = (torch.ones(8, 16).to(device), torch.zeros(8, 4).to(device))
    for _ in range(3):
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
        accumulate(extra)
    return [p.grad.cpu() for p in model.parameters()]


@pytest.mark.parametrize("preallocate", [True, False], ids=["own_buffers", "views_of_backward"])
def test_gradients_accumulated_with_plus_equals(preallocate, alias_per_call):
    """`p.grad += g` in the compiled function overwrites every .grad.

    Preallocated gradients own their buffers and are donated. Gradients that
    aot_autograd returned as views of a backward intermediate share their base's
    buffer, so those calls run without donation, and values still match.
    """
    eager = _accumulate_run(None, preallocate)
    compiled = _accumulate_run("donate_xla", preallocate)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, **TOL)
    (record,) = donate_backend.reports()
    assert [d.role for d in record.donated] == ["gradient"] * len(eager)
    assert all(used == aliased for _, used, aliased in alias_per_call)
    donors_used = [used for _, used, _ in alias_per_call]
    if preallocate:
        assert donors_used == [len(eager)] * 3
    else:
        assert donors_used == [0] * 3


def _compiled_sgd_mlp():
    device = torch_xla.device()
    torch.manual_seed(0)
    model = MLP().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = torch.compile(make_step(model, opt, CASES["mlp_sgd_momentum"]), backend="donate_xla")
    return model, opt, step, (torch.randn(8, 16).to(device), torch.randn(8, 4).to(device))


def test_donated_device_addresses_are_reused():
    model, opt, step, batch = _compiled_sgd_mlp()
    for _ in range(2):  # reach the steady-state graph (momentum buffers exist)
        step(*batch)
    torch_xla.sync()
    state = list(model.parameters()) + [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    before = [XLAC._unsafe_buffer_pointer(t) for t in state]
    step(*batch)
    torch_xla.sync()
    after = [XLAC._unsafe_buffer_pointer(t) for t in state]
    # every new value was written over an old buffer; XLA may give a parameter the
    # old buffer of a momentum of the same shape (buffer-donor semantics)
    assert sorted(after) == sorted(before)


def _optimized_hlo_modules(script: str, tmp_path) -> list:
    flags = xla_flags_with(f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text")
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=flags)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [p.read_text() for p in sorted(pathlib.Path(tmp_path).glob("*after_optimizations.txt"))]


def _aliases_and_copied_parameters(text: str) -> tuple:
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
    entry = text[text.index("ENTRY"):]
    parameters = set(re.findall(r"(%[\w.-]+) = \S+ parameter\(", entry))
    copied = set(re.findall(r"copy\([^)]*?(%[\w.-]+)\)", entry))
    return len(re.findall(r"may-alias", alias)), parameters, parameters & copied


def test_optimized_hlo_aliases_donors_and_copies_nothing(tmp_path):
    modules = _optimized_hlo_modules(
        """
        import torch, torch_xla, donate_backend
        dev = torch_xla.device()
        p, m, g = (torch.randn(64, 32).to(dev) for _ in range(3))
        @torch.compile(backend="donate_xla")
        def sgd(p, m, g):
            with torch.no_grad():
                m.mul_(0.9).add_(g)
                p.add_(m, alpha=-0.1)
        sgd(p, m, g)
        torch_xla.sync()
        print(float(p.sum().cpu()))
        """,
        tmp_path,
    )
    (text,) = [t for t in modules if "input_output_alias" in t]
    aliases, parameters, copied = _aliases_and_copied_parameters(text)
    assert aliases == 2  # p and m
    assert len(parameters) == 3 and not copied


def test_each_parameter_gets_its_own_buffer_back_so_xla_copies_none(tmp_path):
    """XLA pairs donors with outputs of equal size in order; a weight paired
    with its momentum's buffer (and the other way round) made XLA copy both:
    21 copies in this step before the outputs were ordered to match."""
    modules = _optimized_hlo_modules(
        """
        import torch, torch_xla, donate_backend
        dev = torch_xla.device()
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(8, 32).to(dev)
        @torch.compile(backend="donate_xla")
        def step(x):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for _ in range(3):
            step(x)
            torch_xla.sync()
        print(float(model[0].weight.sum().cpu()))
        """,
        tmp_path,
    )
    # the steady-state step donates 6 parameters and 6 momentum buffers
    (text,) = [t for t in modules if "input_output_alias" in t and _aliases_and_copied_parameters(t)[0] == 12]
    _, parameters, copied = _aliases_and_copied_parameters(text)
    assert len(parameters) == 18 and not copied  # 6 gradients are read, nothing is copied


def test_donor_order_is_refined_until_it_settles():
    from donate_backend.xla.plan import settle_donor_order

    assert settle_donor_order(lambda order: [2, 0], 4) == ([2, 0, 1, 3], True)
    assert settle_donor_order(lambda order: [], 3) == ([0, 1, 2], True)  # no donors: order kept
    # a parameter order that flips with every result order never settles: reported, not looped on
    flipping = lambda order: [1, 0] if order[0] == 0 else [0, 1]  # noqa: E731
    order, settled = settle_donor_order(flipping, 3)
    assert not settled and sorted(order) == [0, 1, 2]


# ---- safety: values, not just that it runs ------------------------------------


def test_tied_weights_train_like_eager():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(8, 8, bias=False)
            self.head = torch.nn.Linear(8, 8, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(torch.tanh(self.embed(x)))

    case = Case("tied", Tied, OPTIMIZERS["sgd_momentum"], lambda g: (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)))
    eager, compiled = train(case, None), train(case, "donate_xla")
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    torch.testing.assert_close(compiled.params[0], eager.params[0], **TOL)


def test_writing_overlapping_views_is_refused_not_wrong(xla_device):
    """aot_autograd computes wrong values here on XLA (aot_eager too), so it is an error."""

    def f(a, b):
        with torch.no_grad():
            a.add_(1)
            b.mul_(2)

    base = torch.arange(8.0).to(xla_device)
    with pytest.raises(Exception, match=r"inputs #0 and #1 are views of one XLA tensor") as info:
        torch.compile(f, backend="donate_xla")(base[0:5], base[3:8])
    assert "Pass the base tensor" in str(info.value)
    torch.testing.assert_close(base.cpu(), torch.arange(8.0))  # nothing was written


def test_reading_two_views_of_one_base_is_fine(xla_device):
    base = torch.arange(8.0).to(xla_device)
    out = torch.compile(lambda a, b: a * 2 + b, backend="donate_xla")(base[0:4], base[4:8])
    torch.testing.assert_close(out.cpu(), torch.tensor([4.0, 7.0, 10.0, 13.0]))


def test_same_tensor_passed_twice(xla_device):
    def f(a, b):
        with torch.no_grad():
            a.add_(b)
            b.mul_(3)

    x_e, x_c = torch.ones(4).to(xla_device), torch.ones(4).to(xla_device)
    g = torch.compile(f, backend="donate_xla")
    for _ in range(3):
        f(x_e, x_e)
        g(x_c, x_c)
    torch.testing.assert_close(x_c.cpu(), x_e.cpu())


def test_mutated_input_that_backward_needs_raises_like_eager(xla_device):
    """`scale` is saved for backward, then changed in place: eager raises, and so do we."""

    def f(w, scale, x):
        y = (w * scale * x).sum()
        with torch.no_grad():
            scale.add_(1)
        return y

    def run(fn):
        w = torch.ones(4).to(xla_device).requires_grad_()
        scale = torch.full((4,), 2.0).to(xla_device)
        fn(w, scale, torch.arange(4.0).to(xla_device)).backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(f)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(torch.compile(f, backend="donate_xla"))


def test_input_mutated_in_forward_and_returned_is_not_donated(xla_device):
    """An input whose old value an output still aliases keeps its buffer."""

    def f(w, buf):
        out = (w * 2).sum()
        old = buf.view(-1)  # returned alias of buf
        with torch.no_grad():
            buf.mul_(3)
        return out, old

    w = torch.ones(4).to(xla_device).requires_grad_()
    buf_e, buf_c = torch.arange(4.0).to(xla_device), torch.arange(4.0).to(xla_device)
    out_e, old_e = f(w, buf_e)
    out_c, old_c = torch.compile(f, backend="donate_xla")(w, buf_c)
    torch.testing.assert_close(old_c.cpu(), old_e.cpu())  # both see the mutated values
    torch.testing.assert_close(buf_c.cpu(), buf_e.cpu())
    out_c.backward()
    torch.testing.assert_close(w.grad.cpu(), torch.full((4,), 2.0))


def test_lazy_clone_taken_before_the_step_keeps_its_value():
    model, opt, step, batch = _compiled_sgd_mlp()
    step(*batch)
    torch_xla.sync()
    expected = [p.detach().cpu().clone() for p in model.parameters()]
    snapshots = [p.detach().clone() for p in model.parameters()]  # lazy, share the buffers
    views = [p.detach()[0] for p in model.parameters()]
    step(*batch)
    for snap, view, old, p in zip(snapshots, views, expected, model.parameters()):
        torch.testing.assert_close(snap.cpu(), old)  # not the deleted buffer, not the new value
        torch.testing.assert_close(view.cpu(), p.detach()[0].cpu())  # a view follows its base


def test_buffer_copied_from_another_tensor_is_not_clobbered(xla_device, caplog):
    """`q.copy_(p)` shares one device buffer; donating either must not break the other."""
    caplog.set_level(logging.INFO, logger="donate_xla")
    p = torch.randn(6).to(xla_device)
    torch_xla.sync()
    p_value = p.cpu()
    q = torch.zeros(6).to(xla_device)
    q.copy_(p)  # q now reads p's buffer

    @torch.compile(backend="donate_xla")
    def bump(t):
        with torch.no_grad():
            t.add_(1)

    bump(q)  # q is the donor
    torch.testing.assert_close(p.cpu(), p_value)
    torch.testing.assert_close(q.cpu(), p_value + 1)
    r = torch.zeros(6).to(xla_device)
    r.copy_(p)
    bump(p)  # now p is the donor and r reads its buffer
    torch.testing.assert_close(r.cpu(), p_value)
    torch.testing.assert_close(p.cpu(), p_value + 1)
    copies = [m for m in caplog.messages if "donated copies" in m]
    assert len(copies) == 1 and "may hold their buffers" in copies[0]  # logged once per graph


# backward(retain_graph=True) twice in a donating step, against eager: test_xla_memory.py::
# test_retain_graph_and_create_graph_stay_right (stitched and not).


def test_backward_after_a_donating_step_raises_like_eager(xla_device):
    """Saved parameters changed in place: autograd must notice, as in eager."""
    errors = []
    for backend in (None, "donate_xla"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4).to(xla_device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_step = torch.compile(opt.step, backend=backend) if backend else opt.step
        x = torch.randn(2, 4).to(xla_device).requires_grad_()  # so the weight is saved
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        opt_step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            loss.backward()
        errors.append(str(info.value))
    assert len(errors) == 2


def test_unusable_donors_warn_once_per_graph():
    from donate_backend import report
    from donate_backend.xla import compiler

    exclusions = [report.InputExclusion(3, "other", aliasing.NO_MATCHING_OUTPUT)]
    with pytest.warns(UserWarning, match=r"graph 77 inference: some overwritten inputs could not be donated .*\[3\]"):
        compiler._warn_unusable("graph 77 inference", exclusions)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiler._warn_unusable("graph 77 inference", exclusions)  # not again


def test_no_matching_output_is_detected():
    metas = [torch.empty(3), torch.empty(2, 2)]
    inputs = [torch.empty(3), torch.empty(3), torch.empty(2, 2, dtype=torch.float16)]
    assert aliasing.outputs_without_slot([0, 1, 2], inputs, metas) == [1, 2]


def test_report_snapshot_of_a_small_sgd_step(xla_device):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).to(xla_device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)

    @torch.compile(backend="donate_xla")
    def step(x):
        layer(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step(torch.randn(4, 3).to(xla_device))
    text = "\n".join(donate_backend.format_record(r) for r in donate_backend.reports())
    text = re.sub(r"graph \d+", "graph N", re.sub(r"compile=[\d.]+s", "compile=Ts", text))
    assert text == textwrap.dedent(
        """\
        graph N forward [xla, xla] inputs=3 compile=Ts transfers=0 (0 B)
          saved for backward: 48 B
          donation on: 0 inputs, 0.00 MiB
        graph N backward [xla, xla] inputs=2 compile=Ts transfers=0 (0 B)
          donation on: 0 inputs, 0.00 MiB
        graph N inference [xla, xla] inputs=4 compile=Ts transfers=0 (0 B)
          donation on: 2 inputs, 0.00 MiB
            donated  #0   parameter       float32[2, 3] 24 B
            donated  #1   parameter       float32[2] 8 B
        graph N inference [xla, xla] inputs=6 compile=Ts transfers=0 (0 B)
          donation on: 4 inputs, 0.00 MiB
            donated  #0   parameter       float32[2, 3] 24 B
            donated  #1   parameter       float32[2] 8 B
            donated  #2   optimizer_state float32[2] 8 B
            donated  #3   optimizer_state float32[2, 3] 24 B"""
    )


def test_alias_count_is_known_when_the_graph_was_compiled_before(xla_device, alias_per_call):
    """torch_xla records the count only when it compiles; after a dynamo reset the
    same graph is found in its cache, and the count must still be reported."""

    def sgd(p, m, g):
        with torch.no_grad():
            m.mul_(0.9).add_(g)
            p.add_(m, alpha=-0.1)

    for _ in range(2):
        torch._dynamo.reset()
        p, m, g = (torch.randn(16, 8).to(xla_device) for _ in range(3))
        torch.compile(sgd, backend="donate_xla")(p, m, g)
    assert [(donors, aliased) for _, donors, aliased in alias_per_call] == [(2, 2), (2, 2)]
