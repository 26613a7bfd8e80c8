"""donate_xla trains like eager on the XLA device, and compiles without transfers."""
import pytest
import torch

from conftest import XLA_SKIP_REASON

# The test names come from xla_models.CASES, so without torch_xla the module is skipped whole.
pytest.importorskip("torch_xla", reason=XLA_SKIP_REASON)

import donate_backend
from donate_backend.xla import metrics as xla_metrics
from xla_models import CASES, train

TOL = dict(rtol=1e-4, atol=1e-5)  # XLA fuses the compiled step; eager rounds per op


def assert_runs_equal(eager, compiled, buffers_oracle=None):
    """``buffers_oracle``: a run whose buffers are the reference (the CPU's: eager
    torch_xla updates BatchNorm's running variance with the biased batch variance,
    donate_xla with torch's unbiased one)."""
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5, abs=1e-5)
    assert len(compiled.params) == len(eager.params)
    for a, b in zip(eager.params, compiled.params):
        torch.testing.assert_close(b, a, **TOL)
    assert [k for k, _ in compiled.opt_state] == [k for k, _ in eager.opt_state]
    for (_, a), (_, b) in zip(eager.opt_state, compiled.opt_state):
        torch.testing.assert_close(b, a, **TOL)
    for a, b in zip((buffers_oracle or eager).buffers, compiled.buffers):
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_matches_eager_on_xla(name):
    eager = train(CASES[name], backend=None)
    compiled = train(CASES[name], backend="donate_xla")
    assert_runs_equal(eager, compiled, buffers_oracle=train(CASES[name], backend=None, device="cpu"))
    assert compiled.losses[0] != compiled.losses[-1]  # it really trained
    kinds = {r.kind for r in donate_backend.reports()}
    assert {"forward", "backward", "inference"} <= kinds


class BufferUpdater(torch.nn.Module):
    """An inference module that keeps a running mean of what it has seen."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 3))
        self.register_buffer("running", torch.zeros(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.running.mul_(0.9).add_(x.mean(0), alpha=0.1)
        self.calls.add_(1)
        return x @ self.weight


def test_inference_graph_updates_buffer_in_place(xla_device):
    torch.manual_seed(0)
    eager = BufferUpdater().to(xla_device)
    compiled_mod = BufferUpdater().to(xla_device)
    compiled_mod.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_mod, backend="donate_xla")
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 6).to(xla_device) + i
            torch.testing.assert_close(compiled(x).cpu(), eager(x).cpu(), **TOL)
    torch.testing.assert_close(compiled_mod.running.cpu(), eager.running.cpu(), **TOL)
    assert int(compiled_mod.calls.cpu()) == 5
    (record,) = [r for r in donate_backend.reports() if r.kind == "inference"]
    assert [(d.role, d.shape) for d in record.donated] == [("buffer", (6,))]
    assert [e.role for e in record.excluded] == ["buffer"]  # the 0-dim counter is never donated


def test_dropout_draws_fresh_masks(xla_device):
    torch.manual_seed(0)
    drop = torch.nn.Dropout(0.5).to(xla_device)
    f = torch.compile(lambda x: drop(x), backend="donate_xla")
    x = torch.ones(256).to(xla_device)
    masks = [(f(x).cpu() != 0) for _ in range(3)]
    assert not torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[1], masks[2])
    for m in masks:  # still dropout with p=0.5, scaled by 2
        assert 0.3 < m.float().mean().item() < 0.7
    out = f(x).cpu()
    assert set(out.unique().tolist()) <= {0.0, 2.0}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiling_transfers_nothing(name):
    train(CASES[name], backend="donate_xla", steps=2)
    records = donate_backend.reports()
    assert {r.kind for r in records} >= {"forward", "backward", "inference"}
    for record in records:  # measured around each graph's whole compile
        assert (record.transfers_count, record.transfers_bytes) == (0, 0), record.name
        if not record.backward_segments:  # a split backward's segments have their own records
            assert record.lowered.transfers.ir_value_to_data == 0, record.name


def test_inference_compile_transfers_nothing(xla_device):
    mod = torch.compile(BufferUpdater().to(xla_device), backend="donate_xla")
    with torch.no_grad():
        mod(torch.randn(4, 6).to(xla_device))
    records = donate_backend.reports()
    assert records and all((r.transfers_count, r.transfers_bytes) == (0, 0) for r in records)


def test_transfer_metric_sees_real_uploads(xla_device):
    """Guards the zero-transfer tests: the snapshot does move when data is uploaded."""
    before = xla_metrics.transfer_snapshot()
    torch.randn(64).to(xla_device)
    delta = xla_metrics.transfer_snapshot().minus(before)
    assert delta.transfer_count >= 1 and delta.outbound_bytes >= 256


def test_forward_saves_weights_not_copies_of_their_transposes(xla_device):
    """Every XLA output is a buffer of its own, so a saved ``t(weight)`` would be a
    full copy of the weight held until backward; the backward must get the weight."""
    from xla_capture import compiled_graphs

    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 24)).to(xla_device)
    step = torch.compile(lambda x: model(x).square().sum(), backend="donate_xla")
    step(torch.randn(8, 32).to(xla_device)).backward()
    forward, _ = compiled_graphs()["forward"]
    output_node = next(n for n in forward.graph.nodes if n.op == "output")
    saved_shapes = {tuple(n.meta["val"].shape) for n in output_node.args[0][1:] if isinstance(n, torch.fx.Node)}
    transposed = {(32, 48), (48, 24)}
    assert saved_shapes and not saved_shapes & transposed, saved_shapes
    assert {(48, 32), (24, 48)} & saved_shapes  # what the backward reads instead
