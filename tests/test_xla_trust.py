"""Ordinary training programs that once gave wrong values or XLA-internal errors.

Each program runs compiled with donate_xla on XLA and eagerly on the CPU (the
oracle) from the same initial values, for several steps; every returned value
and every piece of state is compared after each step.
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from programs import (
    checkpointed_program,
    grad_scaler_program,
    held_state_program,
    inference_mode_program,
    varying_batch_program,
)

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    from xla_models import linear_sgd_momentum

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


def test_inference_returning_aliases_of_one_result():
    def program(device, compile_):
        model = _mlp().eval().to(device)

        def f(x):
            with torch.no_grad():
                out = model(x)
            return out, out.detach(), out.sum()

        cf = compile_(f)
        return (lambda i: cf(_batch(i, device=device)[0])), (lambda: list(model.parameters()))

    run_against_eager(program)


def test_copy_between_inputs_then_update_the_source():
    """``q.copy_(p)`` in one compiled function, then ``p`` updated in place in another."""

    def program(device, compile_):
        g = torch.Generator().manual_seed(1)
        p, q, grad = (torch.randn(5, generator=g).to(device) for _ in range(3))
        cp = compile_(lambda q, p: q.copy_(p))

        def upd(p, g):
            p.sub_(0.1 * g)

        upd = compile_(upd)

        def step(i):
            cp(q, p)
            upd(p, grad)
            return q.clone() if device.type == "cpu" else q

        return step, lambda: [p, q]

    run_against_eager(program, steps=3)


@pytest.mark.parametrize("donation", ["on", "off"])
def test_a_buffer_restored_after_a_read_the_backward_needs(donation, monkeypatch):
    """A buffer updated in place, read into the loss, then copied back to its old
    value: the backward needs the value the forward read. torch_xla's functional
    ``aten.copy`` kernel also wrote into its first argument, so the saved value
    was overwritten by the restored one (a wrong gradient, donation on or off)."""
    monkeypatch.setenv("DONATE_XLA_DONATION", "1" if donation == "on" else "0")

    def program(device, compile_):
        torch.manual_seed(0)
        w = torch.nn.Parameter((torch.randn(8, 8) * 0.3).to(device))
        saved, stat = torch.randn(8).to(device), torch.randn(8).to(device)

        def step_fn(x):
            with torch.no_grad():
                saved.copy_(stat)
                stat.copy_(x.mean(0))
            h = torch.sigmoid(x @ w)
            with torch.no_grad():
                stat.lerp_(h.mean(0), 0.3)
            out = torch.tanh(h * (stat + 1))
            with torch.no_grad():
                stat.copy_(saved)
            loss = (out * out).mean()
            loss.backward()
            return loss.detach()

        step_fn = compile_(step_fn)

        def step(i):
            w.grad = None
            return step_fn(_batch(i, device=device)[0])

        return step, lambda: [w.grad, saved, stat]

    run_against_eager(program, steps=3)


def test_target_network_hard_update_while_training():
    """DQN-style: a compiled hard update copies the online net into the target every other
    step; a compiled AdamW step trains the online net reading the target under no_grad."""

    def program(device, compile_):
        online = _mlp(1).to(device)
        target = _mlp(2).to(device)
        opt = torch.optim.AdamW(online.parameters(), lr=1e-2)

        def hard_update():
            with torch.no_grad():
                for tp, p in zip(target.parameters(), online.parameters()):
                    tp.copy_(p)

        def train(x, y):
            with torch.no_grad():
                goal = target(x) + y
            loss = F.mse_loss(online(x), goal)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        hard_update, train = compile_(hard_update), compile_(train)

        def step(i):
            if i % 2 == 0:
                hard_update()
            return train(*_batch(i, device=device))

        state = lambda: list(online.parameters()) + list(target.parameters())  # noqa: E731
        return step, state

    run_against_eager(program, steps=6)


def test_gan_step_with_two_optimizers_in_one_function():
    def program(device, compile_):
        torch.manual_seed(3)
        gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).to(device)
        disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)).to(device)
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))

        def step(real, z):
            # The generator runs again for its own update: reusing ``fake`` would
            # backward twice through one compiled forward (aot_eager refuses it too).
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(z).detach())).mean()
            d_loss.backward()
            opt_d.step()
            opt_d.zero_grad()
            g_loss = F.softplus(-disc(gen(z))).mean()
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()
            disc.zero_grad()
            return d_loss.detach(), g_loss.detach()

        cstep = compile_(step)

        def run(i):
            g = torch.Generator().manual_seed(i)
            return cstep(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))

        state = lambda: list(gen.parameters()) + list(disc.parameters())  # noqa: E731
        return run, state

    run_against_eager(program)


def test_step_returning_a_detached_output_for_metrics():
    def program(device, compile_):
        model = _mlp(4).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            out = model(x)
            metrics = out.detach()
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, metrics

        cstep = compile_(step)
        return (lambda i: cstep(*_batch(i, device=device))), (lambda: list(model.parameters()))

    run_against_eager(program)


def test_step_staging_its_batch_into_a_persistent_buffer():
    def program(device, compile_):
        model = _mlp(5).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        buf_x = torch.zeros(6, 8, device=device)
        buf_y = torch.zeros(6, 4, device=device)

        def step(x, y):
            buf_x.copy_(x)
            buf_y.copy_(y)
            loss = F.mse_loss(model(buf_x), buf_y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        cstep = compile_(step)
        state = lambda: list(model.parameters()) + [buf_x, buf_y]  # noqa: E731
        return (lambda i: cstep(*_batch(i, device=device))), state

    run_against_eager(program)


def test_tensor_literal_saved_for_backward():
    """torch_xla's own DynamoTrainingBasicTest.test_simple_model shape."""

    def program(device, compile_):
        def f(x):
            return x.gather(1, torch.tensor([[1], [2], [3]]).to(x.device)).sum()

        cf = compile_(f)

        def step(i):
            x = torch.arange(12.0).reshape(3, 4).add(i).to(device).requires_grad_()
            loss = cf(x)
            loss.backward()
            return loss, x.grad

        return step, lambda: []

    run_against_eager(program, steps=3)


def test_cross_entropy_with_an_inline_target():
    def program(device, compile_):
        model = _mlp(6, out=5).to(device)

        def f(x):
            logits = model(x)
            return F.cross_entropy(logits, torch.tensor([0, 1, 2, 3, 4, 0]).to(x.device))

        cf = compile_(f)

        def step(i):
            loss = cf(_batch(i, device=device)[0])
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return loss, grads

        return step, lambda: list(model.parameters())

    run_against_eager(program, steps=3)


def test_step_returning_loss_and_its_detached_copy():
    def program(device, compile_):
        model = _mlp(7).to(device)

        def f(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss, loss.detach()

        cf = compile_(f)

        def step(i):
            out = cf(*_batch(i, device=device))
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return out, grads

        return step, lambda: list(model.parameters())

    run_against_eager(program, steps=3)


def test_returned_new_value_stays_valid_after_the_next_donating_call():
    """A value that is both returned and written into an input must not share the
    input's buffer: the next call donates that input."""

    def program(device, compile_):
        g = torch.Generator().manual_seed(8)
        p, grad = torch.randn(5, generator=g).to(device), torch.randn(5, generator=g).to(device)

        def upd(p, g):
            new = p - 0.5 * g
            p.copy_(new)
            return new

        cupd = compile_(upd)
        kept = []

        def step(i):
            kept.append(cupd(p, grad))
            return list(kept)  # every earlier result must still read its own value

        return step, lambda: [p]

    run_against_eager(program, steps=4)


def test_reductions_over_every_dimension_by_an_empty_dim_list():
    """``x.amax()`` is ``amax(x, [])``, and an empty dim list means every dimension.
    torch_xla 2.9 reduced over none (eager torch_xla and openxla return x unchanged);
    donate_xla gives torch's answer. A max-abs loss scale, a normalised logit and
    variance statistics, trained for a few steps against the CPU."""
    aten = torch.ops.aten

    def program(device, compile_):
        model = _mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def f(x, y):
            out = model(x)
            scaled = out / out.detach().abs().amax()
            loss = F.mse_loss(scaled, y) + 0.1 * out.amin(keepdim=True).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = (aten.var.correction(out.detach(), []), aten.sum.dim_IntList(out.detach(), []),
                     aten.mean.dim(out.detach(), [], True), torch.amax(out.detach(), dim=()))
            return loss.detach(), stats

        cf = compile_(f)
        return (lambda i: cf(*_batch(i, device=device))), (lambda: list(model.parameters()))

    run_against_eager(program)


def test_a_lowering_that_changes_an_outputs_shape_is_refused(monkeypatch):
    """Should another torch_xla lowering compute the wrong shape, the graph is refused
    with a message naming the output, not run: here the empty-dim fix is undone."""
    from donate_backend.xla import ops

    monkeypatch.setattr(ops, "with_every_dim", lambda target, args, kwargs: (args, kwargs))
    f = torch.compile(lambda x: x.amax() * 2, backend="donate_xla")
    with pytest.raises(Exception, match=r"computed output 'mul' with shape \[3, 4\], but torch says \[\]"):
        f(torch.randn(3, 4).to(torch_xla.device()))


def test_eval_mode_batch_norm_with_trainable_weights():
    """Fine-tuning with frozen BatchNorm statistics (``model.eval()``, weights still
    trained): aot_autograd saves BatchNorm's mean and inverse std as ``[C]`` values
    for the backward (torch's definition off the CPU), and torch_xla 2.9 returns
    empty ones. donate_xla refused the graph (resnet18 in eval mode without
    ``no_grad`` failed to compile); it now saves what torch defines. Trained
    against the CPU, the running statistics untouched."""

    def program(device, compile_):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 4),
        )
        with torch.no_grad():  # running statistics that are not the defaults
            model[1].running_mean.uniform_(-0.5, 0.5)
            model[1].running_var.uniform_(0.5, 2.0)
        model = model.eval().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        cf = compile_(mse_training_step(model, opt))

        def step(i):
            g = torch.Generator().manual_seed(200 + i)
            x, y = torch.randn(5, 3, 8, 8, generator=g), torch.randn(5, 4, generator=g)
            return cf(x.to(device), y.to(device))

        return step, lambda: list(model.parameters()) + list(model.buffers())

    run_against_eager(program)


def test_resnet18_in_eval_mode_without_no_grad():
    """torch_xla's own test_dynamo.py compiles resnet18 in eval mode without
    ``no_grad``; the forward graph then saves BatchNorm statistics for a backward."""
    torchvision = pytest.importorskip("torchvision")

    def program(device, compile_):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).eval().to(device)
        cf = compile_(model)

        def step(i):
            g = torch.Generator().manual_seed(300 + i)
            return cf(torch.randn(2, 3, 32, 32, generator=g).to(device))

        return step, lambda: list(model.buffers())

    run_against_eager(program, steps=2)


def test_eval_mode_batch_norm_backward_without_torchs_decomposition_is_refused(monkeypatch):
    """Without torch's decomposition (a private table) torch_xla's wrong gradient is
    not used: the graph is refused with a message that says what to do."""
    from donate_backend.xla import compat

    monkeypatch.setattr(compat, "decomposition", lambda op: None)
    device = torch_xla.device()
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval().to(device)

    @torch.compile(backend="donate_xla")
    def f(x):
        model(x).sum().backward()

    with pytest.raises(Exception, match="eval-mode BatchNorm's backward needs torch's decomposition"):
        f(torch.randn(2, 3, 6, 6).to(device))


def test_batch_norm_running_variance_uses_the_unbiased_batch_variance():
    """torch updates BatchNorm's running variance with the batch's unbiased variance;
    torch_xla 2.9 uses the biased one (eager torch_xla and openxla too: 0.024 off
    after one update of 7 samples). BatchNorm1d/2d and InstanceNorm with running
    statistics, trained against the CPU, every buffer compared."""

    def program(device, compile_):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({
            "bn1d": torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5)),
            "bn2d": torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3, momentum=0.3)),
            "in2d": torch.nn.InstanceNorm2d(2, affine=True, track_running_stats=True),
        }).train().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def f(x, img):
            loss = model["bn1d"](x).square().mean() + model["bn2d"](img).square().mean() + model["in2d"](img).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        cf = compile_(f)

        def step(i):
            g = torch.Generator().manual_seed(400 + i)
            return cf(torch.randn(7, 6, generator=g).to(device), torch.randn(3, 2, 6, 6, generator=g).to(device))

        return step, lambda: list(model.parameters()) + list(model.buffers())

    run_against_eager(program)


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


@STITCHED
@pytest.mark.parametrize("source", ["parameters", "momentum"])
@pytest.mark.parametrize("swap", [False, True], ids=["backup", "backup_swap_restore"])
@pytest.mark.parametrize("made", ["before_training", "after_warm_up"])
@pytest.mark.parametrize("sync", [False, True], ids=["no_sync", "torch_xla_sync"])
def test_copy_out_of_a_donated_tensor_stays_valid(source, swap, made, sync, stitched):
    """``backup.copy_(p)`` makes torch_xla's ``backup`` read ``p``'s buffer; a later
    donating step must not hand that buffer to XLA. Before the fix the next read of
    ``backup`` failed with "Check failed: handle->HasValue()" (torch_xla's own tags
    name only the last tensor synced to a buffer). Patterns: keep a copy of the
    weights or of optimizer state, or swap other values in and restore the copy
    (EMA evaluation), with or without a ``torch_xla.sync()`` in between. Stitched,
    the copies read the step's pending values (nothing has run yet)."""

    def run(device, compile_fn):
        early = [torch.zeros(3, 4, device=device), torch.zeros(3, device=device)]
        params, opt, step, x = linear_sgd_momentum(device, compile_fn)
        losses = [step(x) for _ in range(2)]
        sources = params if source == "parameters" else [opt.state[p]["momentum_buffer"] for p in params]
        backup = early if made == "before_training" else [torch.zeros_like(s) for s in sources]
        with torch.no_grad():
            for b, s in zip(backup, sources):
                b.copy_(s)
            if swap:
                for s in sources:
                    s.copy_(torch.full_like(s, 0.5))
                for s, b in zip(sources, backup):
                    s.copy_(b)
        if sync and device.type == "xla":
            torch_xla.sync()
        losses += [step(x) for _ in range(2)]
        return losses, backup, params

    got = run(torch_xla.device(), _compiled_under(stitched))
    expected = run(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, copies, parameters")


@STITCHED
def test_two_data_copies_into_a_donated_parameter_keep_the_source_valid(stitched):
    """``p.data.copy_(a)`` frees ``p``'s buffer without moving ``p``'s version; the next
    upload can get a device data object at the freed address, and ``p.data.copy_(b)``
    then makes ``p`` hold ``b``'s buffer at the address donate_xla recorded. Without
    the record's pin on the old buffer the next step donated ``b``'s buffer (the read
    of ``b`` failed: "Buffer has been deleted or donated"). Stitched, torch_xla's sync
    donated it through its buffer tags (the same failure) until stitched steps donated
    only what they record."""

    def run(device, compile_fn):
        params, _, step, x = linear_sgd_momentum(device, compile_fn)
        losses = [step(x) for _ in range(3)]
        kept = []
        with torch.no_grad():
            for p in params:
                p.data.copy_(torch.full_like(p, 0.25))
                b = (torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 10).to(device)
                kept.append(b)
                p.data.copy_(b)
        losses += [step(x) for _ in range(2)]
        return losses, kept, params

    got = run(torch_xla.device(), _compiled_under(stitched))
    expected = run(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, sources, parameters")


@pytest.mark.parametrize(
    "between", ["data_copy", "backup_copy", "clone", "detach", "data_copy_of_detached"]
)
@pytest.mark.parametrize("sync", [False, True], ids=["no_sync", "torch_xla_sync"])
def test_eager_code_before_a_stitched_step_has_run_keeps_its_values(between, sync):
    """A stitched step runs later (at the sync or the next step). Eager code in between
    sees lazy parameters: ``p.data.copy_(u)`` makes the sync hand ``p`` the buffer of
    ``u`` without moving ``p``'s version or XLA tensor, so the next step must not donate
    it; a backup ``copy_`` or a ``clone`` of the pending value gets a buffer of its
    own; a ``detach`` shares the parameter's storage and follows it. Values equal
    eager, and the steps after donate again (the parameters keep their buffers)."""

    def run(device, compile_fn):
        params, opt, step, x = linear_sgd_momentum(device, compile_fn)
        losses = [step(x) for _ in range(2)]
        kept = []
        with torch.no_grad():
            for p in params:
                if between == "data_copy":
                    u = (torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 7).to(device)
                    p.data.copy_(u)
                    kept.append(u)
                elif between == "backup_copy":
                    kept.append(torch.zeros_like(p).copy_(p))
                elif between == "clone":
                    kept.append(p.clone())
                elif between == "detach":
                    kept.append(p.detach())
                else:
                    u = torch.full_like(p, 0.125)
                    p.detach().data.copy_(u)
                    kept.append(u)
        if sync and device.type == "xla":
            torch_xla.sync()
        losses += [step(x) for _ in range(3)]
        return losses, kept, params, [opt.state[p]["momentum_buffer"] for p in params]

    got = run(torch_xla.device(), _compiled_under(True))
    expected = run(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, kept tensors, parameters, momentum")


@pytest.mark.parametrize("stitch", [False, True])
def test_a_clone_read_on_the_host_survives_an_eager_update_and_a_compiled_call(stitch):
    """Reading a clone of a device tensor on the host leaves the clone and the original
    on one buffer. An eager in-place update of the original, then a torch_xla sync,
    donates that buffer and loses the clone (torch_xla 2.9; an openxla call does the
    same; see docs/xla.md). A donate_xla call whose inputs have no pending eager work
    runs none of it, so the clone keeps its value and the update lands."""
    from donate_backend import config
    from donate_backend.xla import ownership

    device = torch_xla.device()
    b = torch.randn(6).to(device)
    w = torch.randn(6).to(device)
    torch_xla.sync()
    ownership.stitched_pending.settle(device)  # a stitched step of an earlier test: run it now
    b_host = b.cpu()
    kept = b.clone()
    assert torch.equal(kept.cpu(), b_host)
    b.mul_(0.5)  # eager, pending

    @torch.compile(backend="donate_xla")
    def bump(w):
        w.add_(1)

    with config.patch(stitch=stitch):
        bump(w)  # openxla syncs the pending update here and loses the clone
    assert torch.equal(kept.cpu(), b_host)
    assert torch.equal(b.cpu(), b_host * 0.5)


def test_a_stitched_step_donates_again_after_a_copy_suspended_it():
    """A ``copy_`` between a stitched step and its run suspends donation for one step
    (``_Pending``); the steps after give every parameter and state tensor its own
    buffer back."""
    import torch_xla.core.xla_model as xm

    from donate_backend import config

    device = torch_xla.device()
    params, opt, step, x = linear_sgd_momentum(device, lambda f: torch.compile(f, backend="donate_xla"))
    with config.patch(stitch=True):
        for _ in range(2):
            step(x)
        scratch = torch.zeros(3, device=device)
        scratch.copy_(params[1])  # any copy_ into an XLA tensor
        for _ in range(3):
            step(x)
        torch_xla.sync()
        xm.wait_device_ops()
        state = params + [opt.state[p]["momentum_buffer"] for p in params]
        before = [torch_xla._XLAC._unsafe_buffer_pointer(t) for t in state]
        step(x)
        torch_xla.sync()
        xm.wait_device_ops()
    assert [torch_xla._XLAC._unsafe_buffer_pointer(t) for t in state] == before
    assert scratch.cpu().shape == (3,)


def test_parameters_read_eagerly_between_steps_are_copied_then_donated_again(caplog):
    """An eager read (an EMA update, a logged norm) gives a parameter an IR node another
    tensor may share; the next step donates a copy of it, and the step after donates the
    buffer it wrote itself again. Values equal eager throughout."""
    import logging

    caplog.set_level(logging.INFO, logger="donate_xla")

    def run(device, compile_fn):
        params, _, step, x = linear_sgd_momentum(device, compile_fn)
        ema = [p.detach().clone() for p in params]
        out = []
        for i in range(5):
            out.append(step(x))
            if i % 2 == 0:
                with torch.no_grad():
                    for e, p in zip(ema, params):
                        e.mul_(0.9).add_(p, alpha=0.1)
                out.append(sum(p.norm() for p in params))
        return out, ema, params

    got = run(torch_xla.device(), lambda f: torch.compile(f, backend="donate_xla"))
    expected = run(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses and norms, EMA, parameters")
    assert any("donated copies" in m for m in caplog.messages)


@pytest.mark.parametrize(
    "stitched_part", ["forward_backward", "optimizer"], ids=["stitched_forward", "stitched_optimizer"]
)
def test_stitched_and_unstitched_graphs_in_one_program_keep_their_values(stitched_part):
    """A program can mix stitched graphs with executables (the switch changed between
    calls; dynamic-shape graphs are never stitched). A stitched forward reads recorded
    parameters through their pins, so the parameters show no sign of the pending read;
    the optimizer executable then donated their buffers before the stitched graph had
    run, and the next read of the loss failed ("buffer ... is deleted"). Executables
    that donate start pending stitched graphs first."""
    import contextlib

    from donate_backend import config

    def run(device, compile_fn, switched):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(8, 4).to(device)

        def forward_backward(x):
            loss = model(x).square().mean()
            loss.backward()
            return loss

        def optimizer():
            opt.step()
            opt.zero_grad()

        fb, o = compile_fn(forward_backward), compile_fn(optimizer)
        losses = []
        for _ in range(4):
            with switched(stitched_part == "forward_backward"):
                losses.append(fb(x))
            with switched(stitched_part == "optimizer"):
                o()
        return losses, list(model.parameters()), [opt.state[p]["momentum_buffer"] for p in model.parameters()]

    got = run(torch_xla.device(), lambda f: torch.compile(f, backend="donate_xla"), lambda on: config.patch(stitch=on))
    expected = run(torch.device("cpu"), lambda f: f, lambda on: contextlib.nullcontext())
    assert_close_tree(got, expected, "losses, parameters, momentum")


@pytest.mark.parametrize("recorded_by", ["write_back", "output"])
def test_stitched_graph_that_leaves_a_recorded_input_unchanged_keeps_it(recorded_by):
    """``a.copy_(b); b.copy_(a)`` updates ``b`` with its own value. An executable call
    writes ``b`` back (or hands it to the program as an output) and records it as
    holding its buffer alone; a stitched call of a graph that leaves ``b`` unchanged
    has no write-back for it, yet flagged ``b``'s buffer for donation, so the sync
    donated it and the next read of ``b`` failed with "Check failed:
    handle->HasValue()" (fuzz seed 92043, ``--mixed``). A stitched graph now donates
    only inputs it writes back."""
    import contextlib

    from donate_backend import config

    def run(device, compile_fn, switched, sync):
        torch.manual_seed(0)
        a = torch.randn(6).to(device)

        def make(x):
            return x * 2

        def swap(x, a, b):
            with torch.no_grad():
                a.copy_(b)
                b.copy_(a)
                a.mul_(x.sum())
            return x + 1

        make, swap = compile_fn(make), compile_fn(swap)
        if recorded_by == "write_back":
            b = torch.randn(6).to(device)
            with switched(False):
                swap(torch.ones(4).to(device), a, b)
        else:
            with switched(False):
                b = make(torch.randn(6).to(device))
        seen = []
        for step in range(3):
            with switched(True):
                out = swap(torch.full((4,), 0.5 + step).to(device), a, b)
            sync()
            seen += [t.to("cpu", copy=True) for t in (out, a, b)]  # a copy on the CPU too
        return seen

    got = run(
        torch_xla.device(), lambda f: torch.compile(f, backend="donate_xla"),
        lambda on: config.patch(stitch=on), torch_xla.sync,
    )
    expected = run(torch.device("cpu"), lambda f: f, lambda on: contextlib.nullcontext(), lambda: None)
    assert_close_tree(got, expected, "outputs, a and b after every call")


@STITCHED
def test_mixed_precision_training_with_layer_and_batch_norm(stitched):
    """``torch.autocast`` to bfloat16 around a model with BatchNorm and LayerNorm (which
    torch_xla computes as a batch norm): the forward saves the statistics in float32,
    as torch declares them, and the backward got a bf16 input with float32 statistics,
    which XLA's HLO verifier refused ("Seen floating point types of different
    precisions"; eager torch_xla and openxla compiled it, their statistics being bf16).
    Now every traced value has torch's dtype and that backward runs in float32.
    Trained against CPU autocast, to bf16's precision."""

    def program(device, compile_):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * 6 * 6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4),
        ).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def f(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach(), out.dtype

        cf = compile_(f)

        def step(i):
            g = torch.Generator().manual_seed(500 + i)
            x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            return cf(x.to(device), y.to(device))

        return step, lambda: list(model.parameters()) + list(model.buffers())[:2]

    run_against_eager(program, compile_fn=_compiled_under(stitched), tol=dict(rtol=3e-2, atol=3e-3))


def test_traced_values_take_the_dtype_torch_declares():
    """The two helpers behind it: a traced result in another dtype than the node's
    fake value is cast to it (tuples element by element, the rest untouched), and a
    BatchNorm backward with mixed floating dtypes runs in float32."""
    from donate_backend.xla.ops import batch_norm_backward_args, conform_dtypes

    graph = torch.fx.Graph()
    single, pair = graph.placeholder("a"), graph.placeholder("b")
    single.meta["val"] = torch.empty(2, dtype=torch.float32)
    pair.meta["val"] = (torch.empty(2, dtype=torch.bfloat16), torch.empty(3, dtype=torch.float32))
    assert conform_dtypes(single, torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    same = torch.ones(2)
    assert conform_dtypes(single, same) is same
    out = conform_dtypes(pair, (torch.ones(2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)))
    assert [t.dtype for t in out] == [torch.bfloat16, torch.float32]
    untouched = (torch.ones(2, dtype=torch.bfloat16), torch.ones(3))
    assert conform_dtypes(pair, untouched) is untouched

    bnb = torch.ops.aten.native_batch_norm_backward.default
    half, full = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3)
    args = (half, half, None, None, None, full, full, True, 1e-5, [True, False, False])
    assert [a.dtype for a in batch_norm_backward_args(bnb, args)[:2]] == [torch.float32] * 2
    assert batch_norm_backward_args(bnb, args)[5] is full
    same_dtype = (full, full, None, None, None, full, full, True, 1e-5, [True, True, True])
    assert batch_norm_backward_args(bnb, same_dtype) is same_dtype
    assert batch_norm_backward_args(torch.ops.aten.add.Tensor, args) is args


@pytest.mark.parametrize("optimizer", ["adamw", "adagrad", "rmsprop"])
@pytest.mark.parametrize("start", ["fresh", "one_eager_step"])
def test_parameter_groups_keep_their_step_counters_across_a_recompile(optimizer, start):
    """Two parameter groups and a learning-rate scheduler: dynamo replaced the first
    group's step counters by XLA copies while tracing the second group's
    initialisation, so ``state_dict()`` said step 0 for it, and after the
    scheduler's new ``lr`` recompiled the step the counting restarted (other
    parameters than eager; openxla too). Trained against the CPU with every
    optimizer state tensor compared, the counters included; also when one eager
    step made the state before compiling."""
    make_optimizer = {
        "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-3),
        "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, lr_decay=0.1),
        "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, centered=True),
    }[optimizer]

    def program(device, compile_):
        model = _mlp(seed=3).to(device)
        opt = make_optimizer([
            {"params": model[0].parameters(), "lr": 2e-2},
            {"params": model[2].parameters(), "lr": 5e-3},
        ])
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        f = mse_training_step(model, opt)
        if start == "one_eager_step":
            g = torch.Generator().manual_seed(599)
            f(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))
        cf = compile_(f)

        def step(i):
            g = torch.Generator().manual_seed(600 + i)
            loss = cf(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))
            sched.step()
            return loss

        return step, lambda: parameters_and_optimizer_state(model, opt)

    run_against_eager(program)


@pytest.mark.parametrize("optimizer", ["sgd_momentum_weight_decay", "adamw"])
def test_compiled_model_with_an_eager_optimizer_and_no_sync(optimizer):
    """``torch.compile(model)`` with the optimizer step left eager and no
    ``torch_xla.sync()`` between steps: the next forward found the parameters'
    updates pending, synced only those, and torch_xla gave each parameter's old
    buffer to its new value while a momentum buffer's pending IR (the weight
    decay) still read it ("buffer ... is deleted"; openxla too). The forward now
    runs all pending IR at once, as a step marker would. Against the CPU."""

    def program(device, compile_):
        model = _mlp(seed=5).to(device)
        opt = {
            "sgd_momentum_weight_decay": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        }[optimizer](model.parameters())
        compiled = compile_(model)

        def step(i):
            g = torch.Generator().manual_seed(700 + i)
            x, y = torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)
            loss = F.mse_loss(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step, lambda: parameters_and_optimizer_state(model, opt)

    run_against_eager(program, state_every_step=False)


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


def test_dropout_mask_saved_for_backward_is_a_bool_buffer():
    """Dropout in training with a gradient saves its mask for the backward.
    torch_xla's ``native_dropout`` mask says bool but is float32 underneath, so
    the forward's executable returned a float32 buffer where a bool one was
    planned and every call failed ("result 2 came back as float32[...], planned
    bool[...]"). Traced values that say bool are now XLA ``pred`` values (and
    dropout itself runs torch's decomposition, whose mask is a comparison; see
    below). The RNG differs from the CPU's, so the check is what dropout means:
    the input's gradient is the scale times the kept positions, and each call
    draws anew."""
    drop = torch.nn.Dropout(0.5)
    f = torch.compile(lambda x: drop(x * 3), backend="donate_xla")
    kept = []
    for i in range(3):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(i)).to(torch_xla.device()).requires_grad_(True)
        out = f(x)
        out.sum().backward()
        out, grad = out.detach().cpu(), x.grad.cpu()
        torch.testing.assert_close(grad, 6.0 * (out != 0), rtol=0, atol=0)
        assert 0.4 < (out != 0).float().mean().item() < 0.6
        kept.append(out != 0)
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])


@pytest.mark.parametrize("p", [0.1, 0.3, 0.9])
def test_dropout_scales_kept_values_by_one_over_one_minus_p(p):
    """torch_xla 2.9's ``native_dropout`` lowering keeps a value with probability
    ``1 - p`` and divides it by ``p``: with ``p=0.1`` every kept value came out
    times 10 instead of 1.11 (openxla too; eager torch_xla takes another route).
    donate_xla now runs torch's decomposition of it."""
    f = torch.compile(lambda x: F.dropout(x, p, True), backend="donate_xla")
    out = f(torch.ones(20_000).to(torch_xla.device())).cpu()
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    assert abs(kept.numel() / out.numel() - (1 - p)) < 0.02


@pytest.mark.parametrize("dims", [2, 3])
def test_global_average_pool_of_a_channels_last_input_trains_like_eager(dims):
    """``adaptive_avg_pool2d(x, 1)`` of a channels-last-strided input (ConvNeXt and Swin
    pool a permuted tensor) failed to compile, openxla too: aot_autograd re-ran ATen's
    ``as_strided_`` restride on the fake XLA tensor ("Expected XLA tensor").
    ``xla/rewrite.py`` replaces it by the mean ATen computes; other output sizes and
    keyword arguments go through as written."""
    pool = F.adaptive_avg_pool2d if dims == 2 else F.adaptive_avg_pool3d
    to_last = (0, 2, 3, 1) if dims == 2 else (0, 2, 3, 4, 1)
    back = (0, 3, 1, 2) if dims == 2 else (0, 4, 1, 2, 3)

    def program(device, compile_fn):
        torch.manual_seed(0)
        w = torch.randn(5, 3).to(device).requires_grad_(True)

        def f(x):
            h = (x.permute(*to_last) @ w).permute(*back)  # channels-last strides
            return pool(h, 1).sum() + pool(h, output_size=(1,) * dims).mean() + pool(h, 2).sum()

        step = compile_fn(f)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(2, 5, *(4,) * dims, generator=g) for _ in range(2)]

        def run(i):
            loss = step(xs[i].to(device))
            loss.backward()
            return loss.detach()

        return run, (lambda: [w, w.grad])

    run_against_eager(program, steps=2)


def test_rewrite_replaces_only_global_average_pools():
    from donate_backend.xla.rewrite import global_avg_pool2d, rewrite_for_xla

    gm = torch.fx.symbolic_trace(
        lambda x: F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, output_size=(2, 2)).sum() + F.relu(x)
    )
    assert rewrite_for_xla(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(global_avg_pool2d) == 2 and F.relu in targets
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    torch.testing.assert_close(
        gm(x), F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, (2, 2)).sum() + F.relu(x)
    )


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


def test_dropout_without_torchs_decomposition_is_refused(monkeypatch):
    """Without torch's decomposition of ``native_dropout`` (a private table)
    torch_xla's lowering, which scales kept values by 1/p, is not used: the graph
    is refused with a message that says what to do."""
    from donate_backend.xla import compat

    monkeypatch.setattr(compat, "decomposition", lambda op: None)
    f = torch.compile(lambda x: F.dropout(x, 0.1, True), backend="donate_xla")
    with pytest.raises(Exception, match="dropout needs torch's decomposition of native_dropout"):
        f(torch.ones(64).to(torch_xla.device()))


@pytest.mark.parametrize("budget,stitch", [(1.0, False), (0.5, False), (0.1, False), (1.0, True)])
def test_dropout_gradients_use_the_forwards_masks(budget, stitch):
    """Two dropouts (p 0.5 and 0.3) in a small network; each compiled call
    returns the dropped activations, whose zeros are its masks, and the CPU
    recomputes loss and gradients with those masks. Under an activation budget
    aot_autograd's partitioner recomputed a dropout in the backward, which on
    XLA draws another mask: wrong gradients at budgets 0.5 and 0.1. Random ops
    are now always saved (``xla.keep_random_values_saved``)."""
    from donate_backend import config

    torch.manual_seed(0)
    ref = torch.nn.ModuleDict(dict(a=torch.nn.Linear(16, 64), b=torch.nn.Linear(64, 64), c=torch.nn.Linear(64, 4)))
    model = copy.deepcopy(ref).to(torch_xla.device())

    def f(m, x):
        y = F.dropout(torch.tanh(m["a"](x)), 0.5, True)
        z = F.dropout(F.gelu(m["b"](y)), 0.3, True)
        return m["c"](z).square().mean() + y.square().mean(), y, z

    with config.patch(activation_budget=budget, stitch=stitch):
        compiled = torch.compile(lambda x: f(model, x), backend="donate_xla")
        for i in range(3):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i))
            loss, y, z = compiled(x.to(torch_xla.device()))
            loss.backward()
            y_mask, z_mask = y.detach().cpu() != 0, z.detach().cpu() != 0
            y_ref = torch.tanh(ref["a"](x)) * y_mask * 2
            z_ref = F.gelu(ref["b"](y_ref)) * z_mask / 0.7
            loss_ref = ref["c"](z_ref).square().mean() + y_ref.square().mean()
            loss_ref.backward()
            assert_close_tree([loss, y, z], [loss_ref, y_ref, z_ref], f"call {i} values")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_tree(p.grad, q.grad, f"call {i} {name}.grad")
                p.grad = q.grad = None


def test_a_budget_graph_with_nothing_but_dropout_to_recompute():
    """Left with only the dropout it must save, torch's budget partitioner
    returns the dropout's (output, mask) pair as one saved value, which
    aot_autograd cannot take ("'tuple' object has no attribute
    'untyped_storage'"); such a graph is partitioned as at the full budget."""
    from donate_backend import config

    def f(x):
        y = F.dropout(torch.tanh(x) * 3, 0.5, True)
        return (y**2).sum(), y

    with config.patch(activation_budget=0.5):
        compiled = torch.compile(f, backend="donate_xla")
        x = torch.randn(64, 32).to(torch_xla.device()).requires_grad_(True)
        loss, y = compiled(x)
        loss.backward()
    # y = mask * 2 * 3 tanh(x), so d(sum y^2)/dx = 2 y * mask * 6 (1 - tanh^2); y != 0 where kept
    x_cpu, y, grad = x.detach().cpu(), y.detach().cpu(), x.grad.cpu()
    kept = y != 0
    torch.testing.assert_close(y, kept * 6 * torch.tanh(x_cpu), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, 2 * y * kept * 6 * (1 - torch.tanh(x_cpu) ** 2), rtol=1e-4, atol=1e-5)
    assert 0.4 < kept.float().mean().item() < 0.6


@STITCHED
def test_compiled_calls_under_inference_mode_match_eager(stitched):
    """Under ``torch.inference_mode()`` every compiled call failed after running, in
    donate_xla's own bookkeeping ("Inference tensors do not track version counter"):
    it recorded each new output's version. Such tensors are not recorded now (a
    donated one is copied first), and the values equal eager on the CPU."""
    got = inference_mode_program(torch_xla.device(), _compiled_under(stitched))
    expected = inference_mode_program(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "outputs, accumulator, parameters, buffers", tol=dict(rtol=2e-5, atol=1e-5))


@STITCHED
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_grad_scaler_training_matches_eager(stitched, whole_step):
    """``torch.amp.GradScaler`` on XLA with the model or the whole step compiled: the
    overflowing step is skipped and the scale halved, as in eager on the CPU."""
    got = grad_scaler_program(torch_xla.device(), _compiled_under(stitched), whole_step)
    expected = grad_scaler_program(torch.device("cpu"), lambda f: f, whole_step)
    assert expected[2].item() == 2.0**15  # the overflow was seen: 65536 halved once
    assert_close_tree(got, expected, "losses, parameters, scale", tol=dict(rtol=2e-5, atol=1e-5))


@STITCHED
def test_step_recompiled_for_a_changing_batch_size_matches_eager(stitched):
    """The batch size changes between calls (a smaller last batch does it), so dynamo
    compiles the whole step again for each new size (on XLA, with this LayerNorm, it
    keeps the sizes static). Values equal eager on the CPU. (openxla stops at the third
    call of this program with "Check failed: cachedComputation"; with ``dynamic=True``
    torch_xla 2.9's LayerNorm cannot be traced under any backend.)"""
    import donate_backend

    got = varying_batch_program(torch_xla.device(), _compiled_under(stitched))
    expected = varying_batch_program(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, parameters, optimizer state", tol=dict(rtol=2e-5, atol=1e-5))
    assert sum(r.kind == "forward" for r in donate_backend.reports()) >= 2  # it did recompile


@STITCHED
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_activation_checkpointing_trains_like_eager_and_saves_less(stitched, use_reentrant, whole_step):
    """``torch.utils.checkpoint`` around two of three blocks, the model or the whole step
    compiled: losses, input gradients and parameters equal eager on the CPU (eager
    torch_xla 2.9 cannot run the checkpointed model: ``torch.utils.checkpoint`` looks
    for a ``torch.xla`` module). The checkpointed blocks are recomputed in the backward,
    so the forward saves less than the same model without checkpointing."""
    import donate_backend

    def saved(program_args):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        got = checkpointed_program(torch_xla.device(), _compiled_under(stitched), *program_args)
        return got, sum(r.saved_bytes or 0 for r in donate_backend.reports() if r.kind == "forward")

    got, checkpointed_bytes = saved((whole_step, use_reentrant))
    expected = checkpointed_program(torch.device("cpu"), lambda f: f, whole_step, use_reentrant)
    assert_close_tree(got, expected, "losses, input gradients, parameters", tol=dict(rtol=2e-5, atol=1e-5))
    _, plain_bytes = saved((whole_step, None))
    assert 0 < checkpointed_bytes <= 0.8 * plain_bytes, (checkpointed_bytes, plain_bytes)  # 17 against 24 kB


@STITCHED
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_state_dicts_and_averaged_model_held_during_training_match_eager(stitched, whole_step):
    """Tensors the program holds share the donated state's buffers: a state dict taken
    before training (aliases of the parameters and statistics), the optimizer's state
    dict (its moment tensors), an SWA ``AveragedModel``, and a restore by
    ``load_state_dict`` mid-training. Every held tensor equals eager's after training."""
    got = held_state_program(torch_xla.device(), _compiled_under(stitched), whole_step)
    expected = held_state_program(torch.device("cpu"), lambda f: f, whole_step)
    assert_close_tree(got, expected, "losses, held state dict, held moments, averaged model")


def _hooked_training(device, compile_fn, hooks: str):
    """4 SGD steps of a compiled model with hooks: tensor hooks that rescale and clamp
    gradients, an optimizer per parameter run from post-accumulate-grad hooks (the
    optimizer in backward), or module forward, forward-pre and full backward hooks.
    Per step: the loss and (but for the optimizer in backward) every gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hooks == "tensor":
        model[0].weight.register_hook(lambda g: g * 0.5)
        model[2].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    elif hooks == "optimizer_in_backward":
        per_param = {p: torch.optim.SGD([p], lr=0.05, momentum=0.5) for p in model.parameters()}

        def step_one(p):
            per_param[p].step()
            per_param[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_one)
    elif hooks == "module":
        model[0].register_forward_hook(lambda module, args, out: out * 1.5)
        model[2].register_forward_pre_hook(lambda module, args: (args[0] + 0.1,))
        model[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 2,))
    forward = compile_fn(model)
    kept = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g).to(device), torch.randn(5, 3, generator=g).to(device)
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        if hooks != "optimizer_in_backward":
            kept += [p.grad.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        kept.append(loss.detach())
        if device.type == "xla":
            torch_xla.sync()
    return [t.cpu() for t in kept + list(model.parameters())]


@STITCHED
@pytest.mark.parametrize("hooks", ["tensor", "optimizer_in_backward", "module"])
def test_hooks_see_and_change_what_they_do_in_eager(hooks, stitched):
    """Gradient hooks, the optimizer run from post-accumulate-grad hooks, and module
    hooks around a compiled model on XLA: gradients, losses and parameters equal eager
    on the CPU over 4 steps (the hooks change each of them, so a skipped or doubled
    hook shows)."""
    got = _hooked_training(torch_xla.device(), _compiled_under(stitched), hooks)
    expected = _hooked_training(torch.device("cpu"), lambda f: f, hooks)
    unhooked = _hooked_training(torch.device("cpu"), lambda f: f, "none")
    assert_close_tree(got, expected, f"{hooks} hooks: gradients, losses, parameters")
    assert not torch.allclose(expected[-1], unhooked[-1])


class _Gated(torch.nn.Module):
    """A layer that takes one of two branches by a value computed on the device."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.cond(
            x.sum() > 0, lambda h: self.lin(h).relu(), lambda h: self.lin(h).tanh() * 2, (x,)
        )


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
