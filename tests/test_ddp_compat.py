"""Each guard of donate_backend/ddp/compat.py, with its private API removed by monkeypatching.

For every guard: what it returns without the API, and that the code using it
then takes DDP's normal path (no rewrite, no hook, no write into a bucket).
The end-to-end cases train a 1-rank gloo DDP (in this process) compiled with
donate_xla next to eager DDP and require equal gradients.
"""
from __future__ import annotations

import copy
import logging
import types

import pytest
import torch
import torch.distributed as dist

import donate_backend
from donate_backend import config
from donate_backend.ddp import compat, eligibility, integration, writer
from donate_backend.ddp.state import WriteCounts
from donate_backend.errors import DonateXlaError

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)


# ---- guards on plain objects ----------------------------------------------------


def test_active_ddp_module_without_the_getter(monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.delattr(DistributedDataParallel, "_get_active_ddp_module")
    assert compat.active_ddp_module() is None


def test_module_parameters_unknown():
    assert compat.module_parameters(types.SimpleNamespace()) is None
    p = torch.nn.Parameter(torch.zeros(1))
    assert compat.module_parameters(types.SimpleNamespace(_module_parameters=[p])) == [p]


def test_reducer_cannot_be_rebuilt_without_its_builders():
    ddp = types.SimpleNamespace(gradient_as_bucket_view=False, _build_params_for_reducer=lambda: None)
    assert compat.can_rebuild_reducer(ddp) is False
    assert compat.rebuild_reducer(ddp, bucket_view=True) is False
    assert ddp.gradient_as_bucket_view is False  # nothing changed


class _FakeDDP:
    """Just what DDPBucketState reads from a DDP module."""

    process_group = types.SimpleNamespace(size=lambda: 1)


class _FakeBucket:
    def __init__(self, params, buffer):
        self._params, self._buffer = params, buffer

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return [self._buffer.view(p.shape) for p in self._params]


def test_rebuilt_buckets_flag_unknown_means_slots_are_never_trusted():
    from donate_backend.ddp.state import DDPBucketState

    assert compat.has_rebuilt_buckets(types.SimpleNamespace()) is None
    param = torch.nn.Parameter(torch.zeros(4))
    ddp = _FakeDDP()
    ddp._has_rebuilt_buckets = True
    state = DDPBucketState(ddp, [param], WriteCounts())
    state.learn(_FakeBucket([param], torch.zeros(4)))
    assert state.slot(0) is not None
    del ddp._has_rebuilt_buckets  # this torch no longer says when buckets are rebuilt
    assert state.slot(0) is None


def test_comm_hook_registration_missing(monkeypatch):
    monkeypatch.delattr(dist, "_register_comm_hook")
    assert compat.register_comm_hook(object(), object(), lambda s, b: None) is False


def test_user_comm_hook_unreadable_counts_as_a_hook():
    assert compat.user_comm_hook_name(types.SimpleNamespace()) == "unknown"
    assert compat.user_comm_hook_name(types.SimpleNamespace(_comm_hooks=[])) is None

    def my_hook(state, bucket):
        pass

    assert compat.user_comm_hook_name(types.SimpleNamespace(_comm_hooks=[(my_hook, None)])).endswith("my_hook")


def test_join_state_unknown_means_falling_back():
    assert compat.join_divides_by_live_ranks(types.SimpleNamespace()) is True
    enabled = types.SimpleNamespace(enable=True)
    disabled = types.SimpleNamespace(enable=False)
    assert compat.join_divides_by_live_ranks(types.SimpleNamespace(_join_config=disabled)) is False
    assert compat.join_divides_by_live_ranks(types.SimpleNamespace(_join_config=enabled)) is True
    assert (
        compat.join_divides_by_live_ranks(
            types.SimpleNamespace(_join_config=enabled, _divide_by_initial_world_size=True)
        )
        is False
    )


def test_reducer_modes_read_from_private_flags():
    assert compat.reducer_mode_reason(types.SimpleNamespace()) is None
    assert "delay_all_reduce" in compat.reducer_mode_reason(
        types.SimpleNamespace(_delay_all_reduce_params=[1])
    )
    assert "python_reducer" in compat.reducer_mode_reason(types.SimpleNamespace(_use_python_reducer=True))


def test_tensor_hooks_unknown_counts_as_a_hook():
    assert compat.tensor_hooks(types.SimpleNamespace()) is True
    p = torch.nn.Parameter(torch.zeros(1))
    assert compat.tensor_hooks(p) is False
    p.register_hook(lambda g: g)
    assert compat.tensor_hooks(p) is True
    assert eligibility.param_fallback_reason(types.SimpleNamespace(requires_grad=True)) is not None


def test_engine_query_outside_a_backward_or_without_the_api(monkeypatch):
    p = torch.nn.Parameter(torch.zeros(2))
    node = torch.autograd.graph.get_gradient_edge(p).node
    assert compat.accumulated_variable(node) is p
    assert compat.accumulated_variable((p * 2).grad_fn) is None  # not an AccumulateGrad
    assert compat.accumulated_variable(None) is None
    assert compat.engine_will_execute(node) is None  # no backward is running
    assert compat.running_node_inputs() is None
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    assert compat.engine_will_execute(node) is None


def _probe_during_backward(loss_fn, probe=None):
    """What the engine says from inside a backward: whether it will accumulate into
    w1 and w2, and (``probe``) anything else asked there."""
    w1, w2 = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            for name, w in (("w1", w1), ("w2", w2)):
                seen[name] = compat.engine_will_execute(torch.autograd.graph.get_gradient_edge(w).node)
            if probe is not None:
                seen["probe"] = probe()
            return g

    loss_fn(lambda: Probe.apply(x @ w1 @ w2).sum(), x, w1, w2)
    return seen


def test_engine_says_which_gradients_this_backward_accumulates():
    assert _probe_during_backward(lambda loss, x, w1, w2: loss().backward()) == {"w1": True, "w2": True}
    assert _probe_during_backward(lambda loss, x, w1, w2: loss().backward(inputs=[w2])) == {
        "w1": False, "w2": True,
    }
    assert _probe_during_backward(lambda loss, x, w1, w2: torch.autograd.grad(loss(), x)) == {
        "w1": False, "w2": False,
    }
    # autograd.grad of a leaf: the engine refuses to answer for it -> unknown.
    assert _probe_during_backward(lambda loss, x, w1, w2: torch.autograd.grad(loss(), w1)) == {
        "w1": None, "w2": False,
    }


class _Pair(torch.autograd.Function):
    """``a * n + b``: two tensor inputs around an int; backward reports what the writer sees."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, a, n, b):
        ctx.n = n
        return a * n + b

    @staticmethod
    def backward(ctx, g):
        _Pair.seen["inputs"] = compat.running_node_inputs()
        _Pair.seen["call"] = writer.begin(_Pair.seen["graph"])
        return g * ctx.n, None, g


def _run_pair(graph):
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    _Pair.seen = {"graph": graph}
    _Pair.apply(a, 3, b * 2).sum().backward()
    return a, b, _Pair.seen


def test_the_running_node_names_each_tensor_inputs_gradient_node():
    a, b, seen = _run_pair(writer.GraphWrites("g", 2))
    assert len(seen["inputs"]) == 2  # the int has no edge
    assert compat.accumulated_variable(seen["inputs"][0]) is a
    assert compat.accumulated_variable(seen["inputs"][1]) is None  # b * 2 is not a leaf
    assert seen["call"].inputs == seen["inputs"]


def test_begin_writes_nothing_when_the_node_does_not_match_the_graph(caplog):
    with caplog.at_level(logging.WARNING, logger="donate_xla"):
        _, _, seen = _run_pair(writer.GraphWrites("bw_graph_7", 3))
    assert seen["call"].inputs is None
    assert "bw_graph_7" in caplog.text and "normal path" in caplog.text


def test_no_current_node_api_means_no_slot_write(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_autograd_node")
    _, _, seen = _run_pair(writer.GraphWrites("g", 2))
    assert seen["inputs"] is None and seen["call"].inputs is None


class _FakeState:
    def __init__(self, param, slot):
        self.params = [param]
        self._slot = slot
        self.counts = WriteCounts()

    def index_of(self, tensor):
        return 0 if tensor is self.params[0] else None

    def slot(self, index):
        return self._slot


def _call_for(param):
    """A ``BackwardCall`` whose only input edge is ``param``'s AccumulateGrad node."""
    return writer.BackwardCall((torch.autograd.graph.get_gradient_edge(param).node,))


def test_writer_takes_the_plain_path_unless_the_engine_says_yes(monkeypatch):
    param = torch.nn.Parameter(torch.zeros(2, 2))
    slot = torch.zeros(2, 2)
    w = writer.GradWriter(types.SimpleNamespace(state=_FakeState(param, slot)), 0)
    grad = torch.ones(2, 2)
    for answer in (None, False):
        monkeypatch.setattr(compat, "engine_will_execute", lambda node, a=answer: a)
        with torch.no_grad():
            assert w.write(_call_for(param), grad) is grad
        assert param.grad is None and slot.sum() == 0
    monkeypatch.setattr(compat, "engine_will_execute", lambda node: True)
    with torch.no_grad():
        other = torch.nn.Parameter(torch.zeros(2, 2))  # not a parameter of the module
        assert w.write(_call_for(other), grad) is grad
        assert w.write(writer.BackwardCall(None), grad) is grad  # no node known
        assert param.grad is None and slot.sum() == 0
        assert w.write(_call_for(param), grad) is None
    assert param.grad is slot and slot.sum() == 4


def test_writer_refuses_a_gradient_that_is_not_the_slot_it_computed(monkeypatch):
    """``mm_into_slot`` computes a gradient into its slot; the rewrite only routes a
    product that reaches the output as that slot. Anything else at the output is an
    internal error, named with the graph and the parameter, never a silent write."""
    param = torch.nn.Parameter(torch.zeros(2, 2))
    slot = torch.zeros(2, 2)
    w = writer.GradWriter(types.SimpleNamespace(state=_FakeState(param, slot)), 0)
    monkeypatch.setattr(compat, "engine_will_execute", lambda node: True)
    call = writer.BackwardCall(_call_for(param).inputs, "graph 3 backward")
    with torch.no_grad():
        computed = writer.mm_into_slot(w, call, torch.ones(2, 3), torch.ones(3, 2))
        assert computed is slot and param.grad is slot and slot.sum() == 12
        with pytest.raises(DonateXlaError, match=r"graph 3 backward.*parameter #0.*DONATE_XLA_BUCKET_VIEW=0"):
            w.write(call, torch.ones(2, 2))
        assert w.write(call, torch.ones(2, 2)) is None  # a later gradient is added into the slot
    assert slot.sum() == 16


def test_writer_takes_the_plain_path_outside_bucket_mode():
    grad = torch.ones(2)
    param = torch.nn.Parameter(torch.zeros(2))
    w = writer.GradWriter(types.SimpleNamespace(state=None), 0)
    with torch.no_grad():
        assert w.write(_call_for(param), grad) is grad
        assert writer.mm_into_slot(w, _call_for(param), torch.ones(2, 3), torch.ones(3, 2)).sum() == 12


# ---- end to end, 1-rank DDP in this process --------------------------------------


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("ddp") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train_pair(steps=4, after_construction=None):
    """Eager DDP and compiled DDP, 4 SGD steps; returns (max grad diff, binding)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    eager_net = Net()
    ours_net = copy.deepcopy(eager_net)
    eager, ours = DDP(eager_net), DDP(ours_net)
    if after_construction is not None:
        after_construction()
    compiled = torch.compile(ours, backend="donate_xla")
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (eager_net, ours_net)]
    worst = 0.0
    for step in range(steps):
        x = torch.randn(4, 16)
        eager(x).sum().backward()
        compiled(x).sum().backward()
        for pe, po in zip(eager_net.parameters(), ours_net.parameters()):
            worst = max(worst, (pe.grad - po.grad).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return worst, integration.binding_of(ours)


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def logs():
    handler = _Logs()
    logger = logging.getLogger("donate_xla")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_end_to_end_buckets_are_used_with_every_api_present(one_rank_group):
    worst, binding = _train_pair()
    assert worst == 0.0
    assert binding.state is not None and binding.counts.slot_writes > 0


def test_end_to_end_without_the_engine_query_nothing_is_written(one_rank_group, monkeypatch):
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    worst, binding = _train_pair()
    assert worst == 0.0
    assert binding.state is not None and binding.counts.slot_writes == 0


def test_end_to_end_without_comm_hook_registration_falls_back(one_rank_group, monkeypatch, logs):
    monkeypatch.delattr(dist, "_register_comm_hook")
    worst, binding = _train_pair()
    assert worst == 0.0
    assert binding.state is None and binding.counts.slot_writes == 0
    assert any("cannot register a comm hook" in line for line in logs)


def test_end_to_end_without_reducer_builders_falls_back(one_rank_group, monkeypatch, logs):
    from torch.nn.parallel import DistributedDataParallel

    # (DDP's own constructor needs it: remove it once both modules exist.)
    worst, binding = _train_pair(
        after_construction=lambda: monkeypatch.delattr(DistributedDataParallel, "_ddp_init_helper")
    )
    assert worst == 0.0
    assert binding.state is None
    assert any("cannot rebuild DDP's reducer" in line for line in logs)


def test_end_to_end_without_the_active_module_no_rewrite(one_rank_group, monkeypatch):
    # (Dynamo itself calls the getter, so it cannot be removed for a whole run:
    # the guard's answer without it is tested above.)
    monkeypatch.setattr(compat, "active_ddp_module", lambda: None)
    worst, binding = _train_pair()
    assert worst == 0.0
    assert binding is None
    assert all(r.bucket_grads is None for r in donate_backend.reports())


def test_end_to_end_without_module_parameters_no_rewrite(one_rank_group, monkeypatch, logs):
    monkeypatch.setattr(compat, "module_parameters", lambda ddp: None)
    worst, binding = _train_pair()
    assert worst == 0.0
    assert binding is None
    assert any("does not list DDP's parameters" in line for line in logs)


def test_settings_without_buckets_are_honoured_in_process(one_rank_group):
    with config.patch(bucket_view=False):
        worst, binding = _train_pair()
    assert worst == 0.0 and binding.state is None
