"""What openxla runs, donate_xla runs too: dynamic shapes, compiled autograd, CPU
fallback, host index tensors, explicit donation requests. Values against eager CPU."""
import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla

    import donate_backend

TOL = dict(rtol=1e-4, atol=1e-5)


def _pair(seed=0):
    """The same small model on the CPU (eager oracle) and on XLA, with SGD-momentum."""
    torch.manual_seed(seed)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    xla = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    xla.load_state_dict(cpu.state_dict())
    xla.to(torch_xla.device())
    return cpu, xla


def _step_fn(model, opt, pointwise=None):
    def step(x, y):
        out = model(x)
        if pointwise is not None:
            out = pointwise(out)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _train_both(batches, compile_kwargs=None, pointwise=None, before_call=None):
    cpu, xla = _pair()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    eager = _step_fn(cpu, sgd(cpu), pointwise)
    compiled = torch.compile(_step_fn(xla, sgd(xla), pointwise), backend="donate_xla", **(compile_kwargs or {}))
    device = torch_xla.device()
    for x, y in batches:
        xd, yd = x.to(device), y.to(device)
        if before_call is not None:
            before_call(xd)
        torch.testing.assert_close(compiled(xd, yd).cpu(), eager(x, y), **TOL)
    for a, b in zip(xla.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.cpu(), b, **TOL)


def _batches(sizes):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 8, generator=g), torch.randn(b, 4, generator=g)) for b in sizes]


def test_dynamic_true_compiles_one_static_executable_per_batch_size():
    sizes = [32, 32, 17, 9, 32]
    _train_both(_batches(sizes), compile_kwargs=dict(dynamic=True))
    forwards = [r for r in donate_backend.reports() if r.kind == "forward"]
    assert sorted({r.input_shapes[2][0] for r in forwards}) == [9, 17, 32]  # one each, 32 reused
    assert len(forwards) == 3
    assert all((r.transfers_count, r.transfers_bytes) == (0, 0) for r in donate_backend.reports())
    optimizer = [r for r in donate_backend.reports() if r.kind == "inference"]
    assert optimizer and len(optimizer[-1].donated) == 8  # 4 weights + 4 momenta (once they exist)


def test_mark_dynamic_with_dynamic_false():
    device = torch_xla.device()
    weight = torch.randn(8, 3)
    f = torch.compile(lambda x, w: torch.relu(x @ w) * 2, backend="donate_xla", dynamic=False)
    wd = weight.to(device)
    for rows in (6, 7, 6):
        x = torch.randn(rows, 8)
        xd = x.to(device)
        torch._dynamo.mark_dynamic(xd, 0)
        torch.testing.assert_close(f(xd, wd).cpu(), torch.relu(x @ weight) * 2, **TOL)
    assert sorted(r.input_shapes[0][0] for r in donate_backend.reports()) == [6, 7]


def test_automatic_dynamic_after_a_shape_change():
    _train_both(_batches([5, 9, 11, 9]))  # dynamo recompiles dynamically at the second shape
    shapes = [r.input_shapes for r in donate_backend.reports() if r.kind == "forward"]
    assert len(shapes) == 3  # the static graph for 5, then one executable each for 9 and 11


def test_compiled_autograd_graph_goes_to_the_xla_path():
    """With compiled autograd the backward is a dynamo graph of its own; its tensors are
    XLA tensors (in a list), so it is lowered and donates like any other."""
    cpu, xla = _pair(3)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    eager = _step_fn(cpu, sgd(cpu))
    device = torch_xla.device()
    saved = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = True
    try:
        compiled = torch.compile(_step_fn(xla, sgd(xla)), backend="donate_xla")
        for x, y in _batches([4, 4, 4]):
            torch.testing.assert_close(compiled(x.to(device), y.to(device)).cpu(), eager(x, y), **TOL)
    finally:
        torch._dynamo.config.compiled_autograd = saved
    for a, b in zip(xla.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.cpu(), b, **TOL)
    records = donate_backend.reports()
    assert records and all(r.path == "xla" for r in records)
    assert not [r for r in records if r.kind == "backward"]  # the backward ran as compiled autograd's graph
    assert len({r.graph_id for r in records}) >= 3  # forward, compiled-autograd graph, optimizer


def test_training_through_ops_without_xla_lowering():
    """lgamma has no XLA kernel in torch_xla 2.9, nor its derivative digamma: both run on
    the CPU between XLA segments, forward and backward."""
    _train_both(_batches([4, 4, 4]), pointwise=lambda out: torch.lgamma(torch.sigmoid(out) + 2))
    fallen = {op for r in donate_backend.reports() for op in r.fallback_ops}
    assert fallen == {"aten.lgamma.default", "aten.digamma.default"}
    optimizer = [r for r in donate_backend.reports() if r.kind == "inference"]
    assert optimizer and len(optimizer[-1].donated) == 8


def test_indexing_with_a_cpu_index_tensor():
    device = torch_xla.device()
    table, index = torch.randn(10, 4), torch.tensor([1, 3, 5])
    f = torch.compile(lambda t, i: t[i] * 2, backend="donate_xla")
    torch.testing.assert_close(f(table.to(device), index).cpu(), table[index] * 2)
    (record,) = donate_backend.reports()
    assert record.host_input_bytes == 3 * 8


def _requested(x):
    torch.ops.xla.dynamo_set_buffer_donor_(x, True)
    return x * 1.1


def test_a_requested_donation_is_honoured():
    device = torch_xla.device()
    x = torch.randn(5, 5)
    xd = x.to(device)
    out = torch.compile(_requested, backend="donate_xla")(xd)
    torch.testing.assert_close(out.cpu(), x * 1.1)
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()
    assert "Data Handle: Deleted" in torch_xla._XLAC._get_xla_tensor_debug_info(xd)
    (record,) = donate_backend.reports()
    assert [(d.index, d.requested) for d in record.donated] == [(0, True)]


def test_a_requested_donation_of_a_tensor_the_graph_keeps_is_excluded():
    """A view of the input is returned: donating would delete what the view reads."""
    device = torch_xla.device()

    def keeps(x):
        torch.ops.xla.dynamo_set_buffer_donor_(x, True)
        return x * 1.1, x.t()

    x = torch.randn(5, 5)
    xd = x.to(device)
    scaled, transposed = torch.compile(keeps, backend="donate_xla")(xd)
    torch.testing.assert_close(transposed.cpu(), x.t())
    torch.testing.assert_close(xd.cpu(), x)  # still readable
    (record,) = donate_backend.reports()
    assert not record.donated
    assert [e.index for e in record.excluded] == [0]


def test_a_buffer_flagged_for_donation_before_the_call_is_donated():
    """torch_xla's per-buffer flag (``_set_buffer_donation``), set eagerly, as openxla honours it."""
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    f = torch.compile(lambda t: t + 1, backend="donate_xla")
    kept = torch.randn(5, 5)
    torch.testing.assert_close(f(kept.to(device)).cpu(), kept + 1)  # compiled; nothing flagged
    x = torch.randn(5, 5)
    xd = x.to(device)
    assert torch_xla._XLAC._set_buffer_donation(xd, True)
    torch.testing.assert_close(f(xd).cpu(), x + 1)
    xm.wait_device_ops()
    assert "Data Handle: Deleted" in torch_xla._XLAC._get_xla_tensor_debug_info(xd)
    y = torch.randn(5, 5)
    yd = y.to(device)
    torch.testing.assert_close(f(yd).cpu(), y + 1)
    torch.testing.assert_close(yd.cpu(), y)  # not flagged: still readable
