"""Each guard of donate_backend/xla/compat.py, with its binding removed."""
import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from instances import instances_of

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla
    import torch_xla.core.xla_builder as xla_builder

    import donate_backend
    from donate_backend.xla import compat
    from donate_backend.xla.lower import LoweringRequest, lower
    from xla_models import linear_sgd_momentum


def _some_xla_tensor():
    return torch.ones(3).to(torch_xla.device())


# (binding, a call that needs it)
REQUIRED = [
    ("_xla_create_placeholder_tensor", lambda: compat.make_placeholder((2,), torch.float32)),
    ("_xla_get_tensor_id", lambda: compat.tensor_id(_some_xla_tensor())),
    ("_check_tensor_need_materialization", lambda: compat.need_materialization([_some_xla_tensor()])),
    ("_get_tensors_xla_device_data_node", lambda: compat.device_data_nodes([_some_xla_tensor()])),
    ("_get_seed_info_id", compat.seed_info_id if HAS_TORCH_XLA else None),
    ("_is_placecholder", lambda: compat.is_placeholder(_some_xla_tensor())),
    ("_get_graph_hash", lambda: compat.graph_hash([_some_xla_tensor() * 2])),
    ("_xla_warm_up_cache", lambda: compat.warm_up_cache([_some_xla_tensor() * 2])),
    ("_run_cached_graph", lambda: compat.run_cached_graph(b"0" * 32, [])),
    ("_xla_sync_multi", lambda: compat.sync([_some_xla_tensor()], wait=True)),
    ("_xla_sync_live_tensors", lambda: compat.sync_live_tensors_async(torch_xla.device())),
    ("_xla_wait_device_ops", compat.wait_device_ops if HAS_TORCH_XLA else None),
    ("_get_base_seed_as_tensor", lambda: compat.base_seed_tensor(torch_xla.device())),
    ("_xla_get_rng_seed", compat.rng_seed if HAS_TORCH_XLA else None),
    ("_set_buffer_donation", lambda: compat.set_buffer_donation(_some_xla_tensor(), False)),
    ("_get_tensors_handle", lambda: compat.buffer_identities([_some_xla_tensor()])),
    ("_unique_id_for_ir_and_data", lambda: compat.value_identities([_some_xla_tensor()])),
    ("_unique_id_for_ir_and_data", lambda: compat.value_identity(_some_xla_tensor())),
    ("_xla_counter_value", compat.buffer_donation_count if HAS_TORCH_XLA else None),
]


def test_buffer_identities_of_a_tensor_without_a_buffer_fall_back_to_value_identities(xla_device):
    a = _some_xla_tensor()
    torch_xla.sync()
    b = torch.zeros(3, device=xla_device)
    b.copy_(a)  # reads a's buffer
    pending = a * 2  # no buffer yet: torch_xla cannot give its handle
    ids = compat.buffer_identities([a, b, pending])
    assert ids[0] == ids[1] and ids[2] != ids[0]


@pytest.mark.parametrize("name,call", REQUIRED, ids=[n for n, _ in REQUIRED])
def test_a_missing_required_binding_is_named(xla_device, monkeypatch, name, call):
    monkeypatch.delattr(torch_xla._XLAC, name)
    with pytest.raises(compat.MissingXlaApiError, match=rf"torch_xla\._XLAC\.{name}\b.*torch_xla==2\.9\.0"):
        call()


def test_a_missing_placeholder_builder_is_named(xla_device, monkeypatch):
    monkeypatch.delattr(xla_builder, "create_placeholder_tensor")
    with pytest.raises(compat.MissingXlaApiError, match="create_placeholder_tensor"):
        compat.make_placeholder((2,), torch.float32)


def _sgd_graph():
    graph = torch.fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (g, 2.5))
    new = graph.call_function(torch.ops.aten.sub.Tensor, (p, scaled))
    graph.call_function(torch.ops.aten.copy_.default, (p, new))
    graph.output(())
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    "name",
    [
        "_set_buffer_donation",
        "_xla_get_enable_alias_with_buffer_donor_config",
        "_xla_set_enable_alias_with_buffer_donor_config",
    ],
)
def test_without_buffer_donor_bindings_nothing_is_donated(xla_device, monkeypatch, name):
    monkeypatch.delattr(torch_xla._XLAC, name)
    assert not compat.supports_donation()
    inputs = [torch.randn(4).to(xla_device), torch.randn(4).to(xla_device)]
    lowered = lower(LoweringRequest(_sgd_graph(), tuple(inputs), "graph 0 inference", donors=(0,)))
    assert lowered.donors == ()
    assert "donated" not in lowered.as_text()


@pytest.mark.parametrize(
    "name",
    [
        "_get_xla_all_numbers_special_scalars", "_set_xla_all_numbers_special_scalars",
        "_get_xla_handle_special_scalars", "_set_xla_handle_special_scalars",
    ],
)
def test_the_special_scalar_switch_is_required(xla_device, monkeypatch, name):
    """Without it the graph fingerprint would be uploaded data, not an HLO constant."""
    monkeypatch.delattr(torch_xla._XLAC, name)
    with pytest.raises(compat.MissingXlaApiError, match=name):
        with compat.tracing_settings(donate=False):
            pass


@pytest.mark.parametrize("handled", [True, False], ids=["default", "XLA_NO_SPECIAL_SCALARS"])
def test_tracing_settings_are_restored(xla_device, handled):
    XLAC = torch_xla._XLAC
    saved = XLAC._get_xla_handle_special_scalars()
    XLAC._set_xla_handle_special_scalars(handled)  # what XLA_NO_SPECIAL_SCALARS=1 sets at start-up
    try:

        def settings():
            return (
                XLAC._get_xla_all_numbers_special_scalars(), XLAC._get_xla_handle_special_scalars(),
                XLAC._xla_get_enable_alias_with_buffer_donor_config(),
            )

        before = settings()
        with compat.tracing_settings(donate=True):
            assert settings() == (True, True, True)
        assert settings() == before
    finally:
        XLAC._set_xla_handle_special_scalars(saved)


SGD_STEPS = """
import torch, torch_xla
from donate_backend import config
from xla_models import linear_sgd_momentum
device = torch_xla.device()
params, opt, step, x = linear_sgd_momentum(torch.device("cpu"))
expected = [float(step(x)) for _ in range(3)], [p.detach().clone() for p in params]
for stitch in (False, True):
    torch._dynamo.reset()
    with config.patch(stitch=stitch):
        params, opt, step, x = linear_sgd_momentum(device, lambda f: torch.compile(f, backend="donate_xla"))
        losses = [float(step(x)) for _ in range(3)]
    torch.testing.assert_close(losses, expected[0])
    for p, e in zip(params, expected[1]):
        torch.testing.assert_close(p.detach().cpu(), e)
print("ok")
"""


@pytest.mark.parametrize(
    "variable",
    [
        # scalars (the graph fingerprint among them) became uploaded data: "Execution
        # supplied 4 buffers but compiled program expected 3"
        "XLA_NO_SPECIAL_SCALARS",
        # every op traced on a placeholder ran at once: a segmentation fault
        "XLA_USE_EAGER_DEBUG_MODE",
    ],
)
def test_torch_xla_debug_switches_leave_values_right(variable):
    """A torch_xla switch set to 1 for the whole process (read at start-up, so in a
    fresh one): stitched and not, three SGD steps equal eager."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    env = {**os.environ, "PJRT_DEVICE": "CPU", variable: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", SGD_STEPS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


FUNCTIONALIZATION_OFF = """
import torch, torch_xla
import donate_backend
x = torch.ones(3).to(torch_xla.device())
try:
    torch.compile(lambda t: t * 2, backend="donate_xla")(x)
except Exception as exc:  # dynamo wraps the backend's error
    print(exc)
"""


def test_without_torch_xla_functionalization_graphs_are_refused():
    """XLA_DISABLE_FUNCTIONALIZATION=1: views taken before a call did not follow
    their base, a lazy clone lost its value and reads failed with "Check failed:
    handle->HasValue()" (openxla computes wrong values). Refused, with what to do."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_DISABLE_FUNCTIONALIZATION": "1"}
    out = subprocess.run([sys.executable, "-c", FUNCTIONALIZATION_OFF], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "UnsupportedGraphError: graph 0: donate_xla needs torch_xla's functionalization" in out.stdout
    assert "XLA_DISABLE_FUNCTIONALIZATION=1" in out.stdout and "Unset XLA_DISABLE_FUNCTIONALIZATION" in out.stdout


@pytest.mark.parametrize("raw,off", [(None, False), ("0", False), ("false", False), ("1", True), ("true", True)])
def test_functionalization_switch_is_read_as_torch_xla_reads_it(monkeypatch, raw, off):
    if raw is None:
        monkeypatch.delenv("XLA_DISABLE_FUNCTIONALIZATION", raising=False)
    else:
        monkeypatch.setenv("XLA_DISABLE_FUNCTIONALIZATION", raw)
    assert (compat.functionalization_disabled() is not None) == off


def test_without_the_eager_mode_binding_lazy_mode_does_nothing(xla_device, monkeypatch):
    """Without the binding that reads torch_xla's eager mode, ``lazy_mode`` sets nothing
    (no eager mode to turn off) and runs its block; with it, eager mode is off inside and
    back on after."""
    calls = []
    monkeypatch.setattr(torch_xla._XLAC, "_set_use_eager_mode", lambda on: calls.append(on), raising=False)
    monkeypatch.setattr(torch_xla._XLAC, "_get_use_eager_mode", lambda: True, raising=False)
    with compat.lazy_mode():
        assert calls == [False]
    assert calls == [False, True]
    calls.clear()
    monkeypatch.delattr(torch_xla._XLAC, "_get_use_eager_mode")
    ran = []
    with compat.lazy_mode():
        ran.append(True)
    assert ran == [True] and calls == []


@pytest.mark.parametrize("stitch", [False, True])
def test_in_torch_xla_eager_mode_a_backup_between_steps_keeps_its_value(xla_device, stitch):
    """In eager mode a clone runs at once and shares its source's buffer. The copies
    donate_xla donates in place of a shared parameter are made lazily, so they get
    buffers of their own: the backup keeps the parameters' values of its time and the
    steps equal eager."""
    import torch_xla.experimental

    from donate_backend import config

    def run(device, compile_fn):
        params, opt, step, x = linear_sgd_momentum(device, compile_fn)
        losses = [float(step(x))]
        with torch.no_grad():
            backups = [torch.zeros_like(p).copy_(p) for p in params]
        seen = [b.cpu() for b in backups]
        losses += [float(step(x)) for _ in range(3)]
        return losses, [b.cpu() for b in backups], seen, [p.detach().cpu() for p in params]

    expected = run(torch.device("cpu"), lambda f: f)
    torch_xla.experimental.eager_mode(True)
    try:
        with config.patch(stitch=stitch):
            got = run(xla_device, lambda f: torch.compile(f, backend="donate_xla"))
    finally:
        torch_xla.experimental.eager_mode(False)
    torch.testing.assert_close(got, expected)


def test_without_the_hlo_printer_there_is_no_hlo_text(xla_device, monkeypatch):
    monkeypatch.delattr(torch_xla._XLAC, "_get_xla_tensors_hlo")
    inputs = [torch.randn(4).to(xla_device), torch.randn(4).to(xla_device)]
    lowered = lower(LoweringRequest(_sgd_graph(), tuple(inputs), "graph 0 inference", donors=(0,), keep_hlo_text=True))
    assert lowered.hlo_text is None and "hlo:" not in lowered.as_text()


def test_without_the_cache_count_eviction_is_assumed_possible(xla_device, monkeypatch):
    assert compat.cached_graph_count() is not None
    assert not compat.cache_may_have_evicted()  # a fresh test process is far from 2048 graphs
    monkeypatch.setenv("XLA_COMPILATION_CACHE_SIZE", str(compat.cached_graph_count()))
    assert compat.cache_may_have_evicted()
    monkeypatch.delenv("XLA_COMPILATION_CACHE_SIZE")
    monkeypatch.delattr(torch_xla._XLAC, "_xla_get_num_cached_compilation_graph")
    assert compat.cached_graph_count() is None and compat.cache_may_have_evicted()


def test_a_failed_run_is_not_taken_for_an_eviction_while_the_cache_was_never_full(xla_device, monkeypatch):
    """Without a full cache the runtime reports the failure instead of recompiling."""
    f = torch.compile(lambda t: t * 2 + 1, backend="donate_xla")
    x = torch.randn(4).to(xla_device)
    f(x)

    def evicted(hash_, inputs):
        raise RuntimeError("Failed to get computation by hash 123. Maybe the entry get kicked out of the LRU cache")

    monkeypatch.setattr(torch_xla._XLAC, "_run_cached_graph", evicted)
    with pytest.raises(donate_backend.DonateXlaError, match=r"graph \d+ inference: running the compiled graph failed"):
        f(x)


def test_a_missing_computation_builder_is_named(xla_device, monkeypatch):
    a = _some_xla_tensor()
    inner = xla_builder.create_computation("sub", lambda x, y: x - y, [xla_builder.tensor_shape(a)] * 2)
    monkeypatch.delattr(xla_builder, "create_computation")
    with pytest.raises(compat.MissingXlaApiError, match="create_computation"):
        compat.reordered_computation(inner, [a, a], (1, 0), "sub")


def test_a_reordered_computation_takes_its_operands_in_the_new_order(xla_device):
    a = torch.tensor([5.0, 7.0]).to(xla_device)
    b = torch.tensor([1.0, 2.0]).to(xla_device)
    shape = xla_builder.tensor_shape(a)
    inner = xla_builder.create_computation("sub", lambda x, y: x - y, [shape, shape])
    reordered = compat.reordered_computation(inner, [a, b], (1, 0), "sub_reordered")
    (result,) = compat.user_computation("test::sub_reordered", [b, a], reordered)
    assert result.cpu().tolist() == [4.0, 5.0]  # a - b, not b - a


def _sgd_executables(xla_device, kind, steps: int, stitch: bool = False) -> list:
    """Run a compiled SGD-momentum step ``steps`` times on XLA (``stitch``: stitched),
    then eagerly on the CPU; assert equal losses and weights; return the ``kind``
    objects (``XlaExecutable`` or ``StitchedExecutable``) the XLA run made."""
    from donate_backend import config

    results, made = [], []
    for device, backend in ((xla_device, "donate_xla"), (torch.device("cpu"), None)):
        torch._dynamo.reset()
        compile_fn = (lambda f: torch.compile(f, backend=backend)) if backend else (lambda f: f)
        with instances_of(kind) as recorded:
            params, _, step, x = linear_sgd_momentum(device, compile_fn)
            with config.patch(stitch=stitch):
                losses = [step(x) for _ in range(steps)]
        if backend:
            made = recorded
        results.append(([loss.cpu() for loss in losses], [p.cpu() for p in params]))
    torch.testing.assert_close(results[0], results[1])
    return made


def _sgd_steps(xla_device, steps=4):
    """The optimizer executables' (calls copying donors, calls without donation)."""
    from donate_backend.xla.runtime import XlaExecutable

    made = _sgd_executables(xla_device, XlaExecutable, steps)
    return [(o.calls_copying_donors, o.calls_without_donation) for o in made if o.lowered.donors]


def test_with_every_exclusivity_api_steady_steps_donate_their_own_buffers(xla_device):
    counts = _sgd_steps(xla_device)
    # the first step's graph copies the parameters once (not yet written by donate_xla);
    # the steady graph donates the buffers it wrote itself
    assert sorted(counts) == [(0, 0), (1, 0)]


@pytest.mark.parametrize(
    "owner, name",
    [
        ("torch", "_from_functional_tensor"),
        ("torch", "_functionalize_replace"),
        ("torch.autograd.graph", "increment_version"),
        ("TracingContext", "try_get"),
    ],
)
def test_without_an_exclusivity_api_values_stay_right(xla_device, monkeypatch, owner, name):
    """Without a way to tell that a donor holds its buffer alone, every call donates
    copies (or nothing): values equal eager. (torch itself keeps the function: only
    donate_xla's lookup fails.)"""
    if owner == "TracingContext":  # looked up once, in torch_compat, for both paths
        from donate_backend import torch_compat

        monkeypatch.setattr(torch_compat, "current_tracing_context", lambda: None)
    else:
        real = compat._torch_api
        monkeypatch.setattr(compat, "_torch_api", lambda o, n: None if n == name else real(o, n))
    counts = _sgd_steps(xla_device)
    assert counts and all(copying + plain >= 1 for copying, plain in counts)


def test_without_view_metas_only_tensors_that_are_not_views_are_donatable(xla_device, monkeypatch):
    from donate_backend.xla.ownership import identity_storages

    base = torch.randn(4, 3).to(xla_device)
    assert identity_storages([base]) and not identity_storages([base.t()])
    monkeypatch.delattr(torch._C._functionalization, "get_view_meta_sequence")
    assert identity_storages([base]) and not identity_storages([base, base.t()])


def _stitched_sgd_steps(xla_device, steps=5):
    """Stitched: each stitched graph with donors gives (calls that flagged buffers for
    donation, calls that flagged none)."""
    from donate_backend.xla.stitched import StitchedExecutable

    made = _sgd_executables(xla_device, StitchedExecutable, steps, stitch=True)
    return [(s.calls_donating, s.calls_without_donation) for s in made if s._donors]


def test_stitched_steady_steps_donate_what_they_recorded(xla_device):
    counts = _stitched_sgd_steps(xla_device)
    # the first step's graph (momentum created) donates nothing: its parameters were
    # not written by donate_xla; it writes them, so the steady graph flags its buffers
    # at each of its calls
    assert sorted(counts) == [(0, 1), (4, 0)]


def test_without_torch_xla_copy_counter_stitched_steps_donate_nothing(xla_device, monkeypatch):
    """Without the counter a pending write-back is never confirmed: values stay right."""
    real = compat._optional
    monkeypatch.setattr(compat, "_optional", lambda n: None if n == "_xla_counter_value" else real(n))
    assert compat.copies_between_tensors() is None
    counts = _stitched_sgd_steps(xla_device)
    assert counts and all(donating == 0 for donating, _ in counts)


@pytest.mark.parametrize("name", ["_functionalize_replace", "_from_functional_tensor"])
def test_without_functionalization_apis_stitched_values_stay_right(xla_device, monkeypatch, name):
    """Without them stitched write-backs fall back to ``copy_`` and nothing is recorded."""
    real = compat._torch_api
    monkeypatch.setattr(compat, "_torch_api", lambda o, n: None if n == name else real(o, n))
    counts = _stitched_sgd_steps(xla_device)
    assert counts and all(donating == 0 for donating, _ in counts)


def test_the_xla_element_type_of_a_bool_tensor(xla_device, monkeypatch):
    _, mask = torch.ops.aten.native_dropout(torch.randn(4, 4).to(xla_device), 0.5, True)
    assert mask.dtype == torch.bool and compat.stores_as_pred(mask) is False  # f32 underneath
    assert compat.stores_as_pred(mask != 0) is True
    assert compat.stores_as_pred(torch.ones(2, dtype=torch.bool).to(xla_device)) is True
    monkeypatch.delattr(torch_xla._XLAC, "_get_xla_tensor_shape_type")
    assert compat.stores_as_pred(mask) is None  # then such a mask stays as it is


@pytest.mark.parametrize(
    "raw,off",
    [(None, False), ("1", False), ("true", False), ("7", False), ("0", True), ("false", True), ("00", True),
     ("no", True), (" -2x", False)],
)
def test_param_aliasing_switch_is_read_as_torch_xla_reads_it(monkeypatch, raw, off):
    """``GetEnvBool``: "true"/"false", else C's atoi (so "no" is 0: off)."""
    if raw is None:
        monkeypatch.delenv("XLA_ENABLE_PARAM_ALIASING", raising=False)
    else:
        monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", raw)
    reason = compat.donation_turned_off()
    assert (reason is not None) == off
    if off:
        assert f"XLA_ENABLE_PARAM_ALIASING={raw}" in reason


def test_auto_sharding_turns_donation_off(monkeypatch):
    monkeypatch.delenv("XLA_ENABLE_PARAM_ALIASING", raising=False)
    monkeypatch.setattr(torch_xla._XLAC, "_xla_get_auto_sharding", lambda: True, raising=False)
    assert "auto-sharding" in compat.donation_turned_off()
    monkeypatch.delattr(torch_xla._XLAC, "_xla_get_auto_sharding")  # an older torch_xla: no such mode
    assert compat.donation_turned_off() is None


PARAM_ALIASING_OFF = """
import warnings, torch, torch_xla
import donate_backend
from xla_models import linear_sgd_momentum
device = torch_xla.device()
params, opt, step, x = linear_sgd_momentum(torch.device("cpu"))
expected = [float(step(x)) for _ in range(3)], [p.detach().clone() for p in params]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params, opt, step, x = linear_sgd_momentum(device, lambda f: torch.compile(f, backend="donate_xla"))
    losses = [float(step(x)) for _ in range(3)]
torch.testing.assert_close(losses, expected[0])
for p, e in zip(params, expected[1]):
    torch.testing.assert_close(p.detach().cpu(), e)
records = [r for r in donate_backend.reports() if r.path == "xla"]
assert records and not any(r.donated for r in records) and not any(r.donation_enabled for r in records)
said = [str(w.message) for w in caught if "XLA_ENABLE_PARAM_ALIASING=0" in str(w.message)]
assert len(said) == 1, said
print("ok")
"""


def test_with_torch_xla_param_aliasing_off_graphs_run_without_donating():
    """XLA_ENABLE_PARAM_ALIASING=0 (read once per process by torch_xla) made every
    donating graph fail with "Failed to get computation by hash": torch_xla's graph
    hash counted the donors its compile then left out. Now the graphs compile without
    donors, values equal eager, and one warning says why nothing is donated."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(__file__)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_ENABLE_PARAM_ALIASING": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", PARAM_ALIASING_OFF], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def _leaves_seen_in_a_backward(graph_id: int):
    """``spmd.gradient_leaves`` asked from inside the backward of a function of
    (parameter, int, non-leaf) whose forward inputs were remembered for ``graph_id``."""
    from donate_backend.xla import spmd

    device = torch_xla.device()
    p = torch.nn.Parameter(torch.ones(2, 3).to(device))
    x = torch.ones(2, 3, device=device, requires_grad=True) * 2
    spmd.remember_forward_inputs(graph_id, [p, 3, x], {})
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, n, b):
            return a * n + b

        @staticmethod
        def backward(ctx, g):
            seen["leaves"] = spmd.gradient_leaves(graph_id, 3)
            seen["wrong_count"] = spmd.gradient_leaves(graph_id, 2)
            return g, None, g

    Probe.apply(p, 3, x).sum().backward()
    return p, seen


def test_gradient_leaves_name_the_parameter_of_this_backward_call():
    p, seen = _leaves_seen_in_a_backward(-101)
    assert seen["leaves"][0] is p and seen["leaves"][1:] == (None, None)
    assert seen["wrong_count"] is None  # not the remembered forward: unknown


def test_gradient_leaves_without_the_autograd_node_api_are_unknown(monkeypatch):
    """Without ``torch._C._current_autograd_node`` the backward's gradients keep the
    shardings of the forward variant lowered last (the behaviour before leaves)."""
    from donate_backend.xla import spmd

    monkeypatch.delattr(torch._C, "_current_autograd_node")
    _, seen = _leaves_seen_in_a_backward(-102)
    assert seen["leaves"] is None
    assert spmd.gradient_leaves(-103, 1) is None  # nothing remembered


def test_traced_call_tells_fake_and_placeholder_arguments_from_real_ones(monkeypatch):
    """``compat.traced_call``: fake tensors (torch's ``is_fake``, or, where that helper is
    gone, the class name) are traced calls anywhere; placeholders and IR computed from
    them only inside torch_xla's scan (elsewhere a result still being computed looks like
    a placeholder); real device tensors never."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(3)
    real = torch.ones(3, device=torch_xla.device())
    torch_xla.sync()
    compat.wait_device_ops()
    placeholder = xla_builder.create_placeholder_tensor((3,), torch.float32)
    assert compat.traced_call([real, fake])
    assert not compat.traced_call([real, real + 1, placeholder, 2])  # not inside scan
    monkeypatch.setattr(compat, "_inside_torch_xla_scan", lambda: True)
    assert compat.traced_call([real, placeholder])
    assert compat.traced_call([real, placeholder * 2])
    assert not compat.traced_call([real, real])
    monkeypatch.setitem(sys.modules, "torch._subclasses.fake_tensor", None)  # the helper moved
    assert compat.traced_call([real, fake])


def test_dispatch_key_look_up_tells_lowered_ops_and_refuses_a_torch_without_it(monkeypatch):
    assert compat.has_kernel_for_dispatch_key("aten::add.Tensor", "XLA")
    assert not compat.has_kernel_for_dispatch_key("aten::add.Tensor", "MPS")
    monkeypatch.delattr(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    with pytest.raises(compat.MissingXlaApiError, match="_dispatch_has_kernel_for_dispatch_key"):
        compat.has_kernel_for_dispatch_key("aten::add.Tensor", "XLA")


def test_view_meta_sequence_function_reads_a_functional_view():
    get_sequence = compat.view_meta_sequence_function()
    assert get_sequence is not None
    base = torch._to_functional_tensor(torch.randn(2, 3))
    assert list(get_sequence(base)) == []  # not a view


def test_step_closures_run_after_the_sync_and_their_absence_is_reported(xla_device, monkeypatch):
    """``compat.add_step_closure``: a closure runs at the next sync; without torch_xla's
    step closures it says so (the gradients are then never seen dropped, and no step
    is stitched by default)."""
    import torch_xla.core.xla_model as xm

    ran = []
    assert compat.add_step_closure(lambda: ran.append(1))
    assert ran == []
    torch_xla.sync()
    assert ran == [1]
    monkeypatch.delattr(xm, "add_step_closure")
    assert not compat.add_step_closure(lambda: ran.append(2))
    torch_xla.sync()
    assert ran == [1]
