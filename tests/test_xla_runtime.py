"""Runtime behaviour: cache eviction, switches, host scalars, logging."""
import dataclasses
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import donate_backend
    from donate_backend import config
    from donate_backend.analysis import aliasing
    from donate_backend.xla import metrics as xla_metrics
    from xla_models import CASES, train


def test_evicted_graph_is_recompiled_not_crashed():
    script = textwrap.dedent(
        """
        import torch, torch_xla, donate_backend
        dev = torch_xla.device()
        f = torch.compile(lambda t: t * 2 + 1, backend="donate_xla")
        g = torch.compile(lambda t: t * 3 - 1, backend="donate_xla")
        x = torch.randn(4).to(dev)
        for _ in range(3):  # each call evicts the other graph from a 1-entry cache
            assert torch.allclose(f(x).cpu(), x.cpu() * 2 + 1)
            assert torch.allclose(g(x).cpu(), x.cpu() * 3 - 1)
        assert torch_xla._XLAC._xla_get_num_cached_compilation_graph() == 1
        print("OK", len(donate_backend.reports()))
        """
    )
    env = dict(os.environ, XLA_COMPILATION_CACHE_SIZE="1", PJRT_DEVICE="CPU")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK 2" in out.stdout  # two graphs compiled once each, recompiled silently


def _update_graph():
    """p -= 2.5 * g, written back into p; returns g * 2."""
    graph = torch.fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    new = graph.call_function(torch.ops.aten.sub.Tensor, (p, graph.call_function(torch.ops.aten.mul.Tensor, (g, 2.5))))
    graph.call_function(torch.ops.aten.copy_.default, (p, new))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (g, 2.0)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("variant", ["plain", "flagged"])
def test_an_evicted_variant_is_lowered_again_from_its_own_request(xla_device, monkeypatch, variant):
    """Each variant of an executable is its request with fields replaced; a variant the
    cache evicted is lowered again from its own request and stays in its own slot (a
    variant donating user-flagged buffers must not come back as the plain one)."""
    from donate_backend.xla import compat as xla_compat
    from donate_backend.xla.lower import LoweringRequest, lower
    from donate_backend.xla.runtime import XlaExecutable

    inputs = [torch.randn(4).to(xla_device), torch.randn(4).to(xla_device)]
    request = LoweringRequest(_update_graph(), tuple(inputs), "graph 0 inference", donors=(0,))
    executable = XlaExecutable("graph 0 inference", lower(request), requestable=(1,))
    assert executable.lowered.request is request
    flagged = frozenset({1})
    if variant == "plain":
        chosen = executable._plain_variant(inputs)
        assert chosen.request == request.without_donation() and chosen.donors == ()
    else:
        chosen = executable._variant_with_flagged(flagged, inputs)
        assert chosen.request == request.with_requested(flagged) and chosen.donors == (0, 1)

    real_run, misses = xla_compat.run_cached_graph, []

    def evicted_once(graph_hash, values):
        if not misses:
            misses.append(graph_hash)
            raise RuntimeError("Failed to get computation by hash (evicted)")
        return real_run(graph_hash, values)

    monkeypatch.setattr(xla_compat, "run_cached_graph", evicted_once)
    monkeypatch.setattr(xla_compat, "cache_may_have_evicted", lambda: True)
    p0, g0 = inputs[0].cpu(), inputs[1].cpu()
    ran, results = executable._run(chosen, inputs)
    assert misses and ran is not chosen and ran.request == chosen.request and ran.donors == chosen.donors
    assert executable.lowered.request is request  # the donating graph was not the one evicted
    if variant == "plain":
        assert executable._without_donation is ran and not executable._with_flagged
    else:
        assert executable._with_flagged[flagged] is ran and executable._without_donation is None
    (slot,) = ran.outputs
    assert slot.kind == "result" and torch.allclose(results[slot.index].cpu(), g0 * 2)
    executable._write_back(inputs, ran, results)
    assert torch.allclose(inputs[0].cpu(), p0 - 2.5 * g0)


def test_a_sharded_request_is_lowered_with_the_calls_inputs_and_only_it(xla_device):
    """Under SPMD a request is traced on the call's device tensors; lowering one without
    them (or an unsharded one with them) is refused, naming the graph."""
    from donate_backend.xla.lower import LoweringRequest, lower

    inputs = (torch.randn(4).to(xla_device), torch.randn(4).to(xla_device))
    request = LoweringRequest(_update_graph(), inputs, "graph 5 inference", donors=(0,))
    message = r"graph 5 inference: lower\(\) takes the call's inputs \(real_inputs\) for a sharded request"
    with pytest.raises(ValueError, match=message):
        lower(dataclasses.replace(request, sharded=True))
    with pytest.raises(ValueError, match=message):
        lower(request, list(inputs))


def test_donation_switch_recompiles_and_turns_aliasing_off():
    case = CASES["mlp_sgd_momentum"]
    on = train(case, backend="donate_xla", steps=3)
    records_on = donate_backend.reports()
    torch._dynamo.reset()
    donate_backend.clear_reports()
    before = xla_metrics.alias_count_total()
    with config.patch(donation=False):
        off = train(case, backend="donate_xla", steps=3)
    after = xla_metrics.alias_count_total()
    assert after[1] - before[1] == 0  # no buffer aliased while the switch is off
    assert off.losses == on.losses
    for a, b in zip(on.params, off.params):
        assert torch.equal(a, b)
    assert any(r.donated for r in records_on)
    assert all(not r.donated and not r.donation_enabled for r in donate_backend.reports())


def test_flipping_the_switch_on_a_compiled_function(xla_device):
    p = torch.zeros(4).to(xla_device)

    @torch.compile(backend="donate_xla")
    def bump(t):
        with torch.no_grad():
            t.add_(1)

    bump(p)
    with config.patch(donation=False):
        bump(p)  # same dynamo entry, other setting: a second lowering, no donors
    bump(p)
    assert torch.equal(p.cpu(), torch.full((4,), 3.0))
    kinds = [(r.kind, len(r.donated), r.donation_enabled) for r in donate_backend.reports()]
    assert kinds == [("inference", 1, True), ("inference", 0, False)]


def test_host_scalar_step_counters_are_updated_and_not_donated(xla_device):
    model = torch.nn.Linear(3, 2).to(xla_device)
    opt = torch.optim.Adam(model.parameters())

    @torch.compile(backend="donate_xla")
    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step(torch.randn(5, 3).to(xla_device))
    steps = [s["step"] for s in opt.state.values()]
    assert all(t.device.type == "cpu" and float(t) == 3.0 for t in steps)
    (opt_record,) = [r for r in donate_backend.reports() if r.kind == "inference"]
    host = [e for e in opt_record.excluded if e.reason == aliasing.HOST_SCALAR]
    assert len(host) == 2 and {e.role for e in host} == {"optimizer_state"}


def test_debug_switch_logs_each_report(xla_device, caplog):
    with config.patch(debug=True), caplog.at_level(logging.WARNING, logger="donate_xla"):
        f = torch.compile(lambda t: t.sin(), backend="donate_xla")
        f(torch.randn(3).to(xla_device))
    assert any("donate_xla compiled graph" in m and "donation on" in m for m in caplog.messages)


def test_an_xla_record_splits_its_compile_time_by_stage(xla_device):
    f = torch.compile(lambda t: t.sin() * 2, backend="donate_xla")
    f(torch.randn(3).to(xla_device))
    (record,) = donate_backend.reports()
    assert [name for name, _ in record.phases] == ["donors", "trace", "plan", "xla compile", "memory prediction"]
    assert record.compile_seconds == pytest.approx(sum(s for _, s in record.phases))
    assert dict(record.phases)["xla compile"] > 0


def test_tensor_constants_are_uploaded_once_and_reported(xla_device):
    def f(x):
        scale = torch.tensor([1.0, 2.0, 3.0], device=x.device)  # a lifted constant
        shift = torch.tensor([5.0, 6.0, 7.0]).to(x.device)  # a host constant
        return x * scale + shift

    compiled = torch.compile(f, backend="donate_xla")
    x = torch.ones(3).to(xla_device)
    torch.testing.assert_close(compiled(x).cpu(), torch.tensor([6.0, 8.0, 10.0]))
    (record,) = donate_backend.reports()
    assert record.constants_uploaded == 2
    assert record.transfers_count == 2 and record.transfers_bytes == 24
    before = xla_metrics.transfer_snapshot()
    for _ in range(3):
        torch.testing.assert_close(compiled(x).cpu(), torch.tensor([6.0, 8.0, 10.0]))
    delta = xla_metrics.transfer_snapshot().minus(before)
    assert (delta.transfer_count, delta.outbound_bytes) == (0, 0)  # never uploaded again


def test_graphs_differing_only_in_which_input_is_read_do_not_share_code(xla_device):
    """torch_xla's graph hash cannot tell `b + a` from `b + c` for same-shaped inputs;
    without the fingerprint the second graph ran the first one's executable."""

    def reads_a(a, b, c):
        with torch.no_grad():
            b.add_(a, alpha=0.5)
        return a + b * c

    def reads_c(a, b, c):
        with torch.no_grad():
            b.add_(c, alpha=0.5)
        return a + b * c

    for fn in (reads_a, reads_c):
        host = [torch.arange(4.0) + k for k in range(3)]
        expected_out = fn(*[t.clone() for t in host])
        expected_b = host[1].clone()
        fn(host[0].clone(), expected_b, host[2].clone())
        args = [t.to(xla_device) for t in host]
        out = torch.compile(fn, backend="donate_xla")(*args)
        torch.testing.assert_close(out.cpu(), expected_out)
        torch.testing.assert_close(args[1].cpu(), expected_b)


def test_without_the_min_cut_partitioner_the_default_one_is_used(monkeypatch, caplog):
    """Guard of a private torch API: if it is gone, the default partitioner is used, with a warning."""
    import builtins

    import donate_backend.xla as xla_path

    real_import = builtins.__import__

    def no_partitioners(name, *args, **kwargs):
        if name == "torch._functorch.partitioners":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    assert "partition_fn" in xla_path.aot_options()
    monkeypatch.setattr(builtins, "__import__", no_partitioners)
    with caplog.at_level(logging.WARNING, logger="donate_xla"):
        assert xla_path.aot_options() == {}
    assert "min-cut partitioner" in caplog.text


def test_a_compiled_call_returns_before_the_device_finishes(xla_device):
    """The host runs ahead: a donating step returns once its executions are queued.
    Compared with the same step's completed time, not with absolute numbers."""
    import time

    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]
    model = torch.nn.Sequential(*layers).to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(1024, 1024).to(xla_device)

    @torch.compile(backend="donate_xla")
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):
        step(x)
        xm.wait_device_ops()
    fractions = []
    for _ in range(3):
        start = time.perf_counter()
        step(x)
        returned = time.perf_counter() - start
        torch_xla.sync()
        xm.wait_device_ops()
        fractions.append(returned / (time.perf_counter() - start))
    assert min(fractions) < 0.5, fractions
    assert any(r.donated for r in donate_backend.reports())


def test_host_step_counters_are_computed_on_the_host(xla_device):
    """Adam's step counters live on the CPU: their increment runs there, not on the
    device and back (a wait per call); the executable does not return them."""
    model = torch.nn.Linear(3, 2).to(xla_device)
    opt = torch.optim.Adam(model.parameters())

    @torch.compile(backend="donate_xla")
    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step(torch.randn(5, 3).to(xla_device))
    assert [float(s["step"]) for s in opt.state.values()] == [3.0, 3.0]
    (opt_record,) = [r for r in donate_backend.reports() if r.kind == "inference"]
    lowered = opt_record.lowered
    host_inputs = {e.index for e in opt_record.excluded if e.reason == aliasing.HOST_SCALAR}
    assert host_inputs and not host_inputs & {i for i, _ in lowered.writebacks}


def test_a_stitched_result_two_inputs_receive_gives_each_its_own_tensor(xla_device):
    """Stitched write-backs hand each input its result's XLA tensor; one result taken by
    two write-backs is cloned, so the two inputs hold the value in tensors of their own
    (an update of one never touches the other, and the sync gives each a buffer)."""
    import types

    from donate_backend.xla import compat, stitched

    a, b, c = (torch.zeros(3).to(xla_device) for _ in range(3))
    result = torch.arange(3.0).to(xla_device) * 2  # lazy, like a stitched graph's result
    lowered = types.SimpleNamespace(writebacks=((0, 0), (1, 0), (2, 1)))
    other = torch.ones(3).to(xla_device) + 1
    installed = stitched._install_lazy([a, b, c], lowered, [result, other], exclusive=frozenset({1}))
    assert [k for _, k in installed] == [0, 0, 1]
    ids = compat.tensor_ids([a, b, c])
    assert len(set(ids)) == 3 and ids[2] == compat.tensor_id(other)
    assert a.cpu().tolist() == b.cpu().tolist() == [0.0, 2.0, 4.0] and c.cpu().tolist() == [2.0] * 3
    assert a._version == b._version == c._version == 1
