"""Donated buffers against everything else that may still read them: copies, clones,
backups, aliases and values read on the host between compiled calls.
"""
import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import STITCHED, _batch, _compiled_under, _mlp, assert_close_tree, run_against_eager

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    from xla_models import linear_sgd_momentum


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
