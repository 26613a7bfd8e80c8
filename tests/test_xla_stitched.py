"""Stitched steps (DONATE_XLA_STITCH): graphs run later, inside the lazy whole-step
computation, and share state with eager code and with executables.
"""
import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import _compiled_under, assert_close_tree

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    from xla_models import linear_sgd_momentum


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
