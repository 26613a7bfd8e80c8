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


_STITCHED_GELU_MLP = """
import re, sys
import torch, torch_xla, donate_backend
from donate_backend.xla import update_order
if sys.argv[1] == "unordered":
    update_order.gates = lambda gm: {}
dev = torch_xla.device()
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = torch.randn(16, 64).to(dev), torch.randn(16, 64).to(dev)
@torch.compile(backend="donate_xla", options={"stitch": True})
def step(x, y):
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
losses = [float(step(x, y).cpu()) for _ in range(4)]
ordered = sum(r.updates_ordered for r in donate_backend.reports() if r.kind == "backward")
text = "\\n".join(donate_backend.format_record(r) for r in donate_backend.reports())
print(repr(losses), ordered, "read before updated" in text)
"""


def test_a_stitched_step_reads_each_weight_before_its_update_and_copies_none(tmp_path):
    """In one XLA computation, a linear layer's backward reads its weight for the input's
    gradient while the weight's update waits only for the weight's own gradient: XLA
    copies each such weight at the start of the step to update it in place. Ordered
    (``xla/update_order.py``), the step's optimized HLO copies no weight, and the values
    are bit for bit those of the unordered step, which copies the two weights whose
    input gradient the backward computes."""
    import os
    import re
    import subprocess
    import sys

    from conftest import xla_flags_with
    from test_donation import _aliases_and_copied_parameters

    script = tmp_path / "stitched.py"
    script.write_text(_STITCHED_GELU_MLP)
    results = {}
    for run in ("ordered", "unordered"):
        dump = tmp_path / run
        env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=xla_flags_with(f"--xla_dump_to={dump} --xla_dump_hlo_as_text"))
        out = subprocess.run([sys.executable, str(script), run], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        losses, ordered, reported = out.stdout.strip().splitlines()[-1].rsplit(" ", 2)
        modules = [p.read_text() for p in sorted(dump.glob("*after_optimizations.txt"))]
        step = max((t for t in modules if "input_output_alias" in t), key=lambda t: _aliases_and_copied_parameters(t)[0])
        aliases, _, copied = _aliases_and_copied_parameters(step)
        weights = {p for p in copied if re.search(rf"{re.escape(p)} = f32\[64,64\]", step)}
        results[run] = (losses, int(ordered), reported == "True", aliases, weights)
    ordered, unordered = results["ordered"], results["unordered"]
    assert ordered[3] == unordered[3] == 12, results  # 6 parameters and 6 momentum buffers donated
    assert ordered[1] == 2 and ordered[2] and not ordered[4], results  # two gradients wait; nothing copied
    assert unordered[1] == 0 and len(unordered[4]) == 2, results
    assert ordered[0] == unordered[0]  # the same values, bit for bit


def test_each_weights_gradient_waits_for_the_backward_ops_that_read_the_weight():
    """``update_order.gates`` on a two-layer MLP's backward, partitioned as the XLA path
    partitions it (here the forward saves the second weight's transpose ``t_2``, a view
    of input 3): the input gradient's ``mm`` reads it, and the weight's own gradient
    (``mm_1``) does not depend on that ``mm``, so it waits for it. The first weight's
    input gradient is not computed (the batch needs none), and no backward op reads a
    bias: nothing else waits. The batch (input 2) has no gradient."""
    import expecttest
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    from donate_backend import graph_meta
    from donate_backend.xla import update_order

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    backwards = []

    def partition(joint, *args, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, *args, **kwargs)
        update_order.record_input_grads(fw, bw)
        backwards.append(bw)
        return fw, bw

    def forward(w0, b0, x, w1, b1):
        return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w0, b0)), w1, b1)

    # on the meta device: gates are computed from device tensors (a host tensor is not gated)
    params = [p.detach().to("meta").requires_grad_() for p in model.parameters()]
    compiled = aot_function(forward, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm,
                            partition_fn=partition)
    compiled(params[0], params[1], torch.randn(4, 8, device="meta"), params[2], params[3]).sum().backward()
    (bw,) = backwards
    gates = update_order.gates(bw)
    def op(n):
        return f"{n.name} = {n.target.__name__}({', '.join(str(a) for a in n.args)})"

    expecttest.assert_expected_inline(
        f"input gradients: {bw.meta[graph_meta.INPUT_GRADS]}\n"
        + "\n".join(f"{op(producer)} waits for {', '.join(op(r) for r in readers)}" for producer, readers in gates.items()),
        """\
input gradients: {'t_2': 3}
mm_1 = mm.default(t_3, gelu) waits for mm = mm.default(tangents_1, t_2)""",
    )
