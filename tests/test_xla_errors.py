"""Unsupported graphs fail with a clear error, never a crash or a wrong value (graphs with ops
torch_xla cannot lower run them on the CPU: test_xla_cpu_ops.py)."""
import re

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    from donate_backend.errors import UnsupportedGraphError
    from donate_backend.xla.lower import LoweringRequest, lower


def test_item_read_in_graph_is_rejected(xla_device):
    """A data-dependent read that reaches our graph (capture_scalar_outputs style)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    total = graph.call_function(torch.ops.aten.sum.default, (x,))
    scalar = graph.call_function(torch.ops.aten._local_scalar_dense.default, (total,))
    graph.output((scalar,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(UnsupportedGraphError, match=r"graph 7 inference: node '_local_scalar_dense\w*' .*\.item\(\)"):
        lower(LoweringRequest(gm, (torch.randn(4).to(xla_device),), "graph 7 inference"))


def test_item_with_dynamo_graph_break_still_matches_eager(xla_device):
    x = torch.randn(8).to(xla_device)
    f = torch.compile(lambda t: t * t.sum().item(), backend="donate_xla")
    torch.testing.assert_close(f(x).cpu(), (x * x.sum().item()).cpu())


def test_host_tensor_input_is_uploaded_with_the_inputs(xla_device):
    import donate_backend

    f = torch.compile(lambda a, b: a + b.to(a.device), backend="donate_xla")
    a, b = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(f(a.to(xla_device), b).cpu(), a + b)
    # dynamo keeps the .to() in the graph: the host tensor is an input of the XLA graph
    (record,) = donate_backend.reports()
    assert record.host_input_bytes == 16


def test_xla_compile_failure_is_reported_and_frees_placeholders(xla_device, monkeypatch):
    import torch_xla

    import donate_backend.xla.lower as lower_module

    def failing_compile(*args, **kwargs):
        raise RuntimeError("INTERNAL: something XLA did not like")

    monkeypatch.setattr(lower_module, "_compile_into_cache", failing_compile)
    f = torch.compile(lambda t: t * 3, backend="donate_xla")
    with pytest.raises(Exception) as info:
        f(torch.randn(4).to(xla_device))
    message = str(info.value)
    assert re.search(r"graph \d+ inference: XLA could not compile the graph: RuntimeError: INTERNAL", message)
    assert "DONATE_XLA_DEBUG=1" in message
    ours = _find_in_chain(info.value, UnsupportedGraphError)
    assert ours is not None and isinstance(ours.__cause__, RuntimeError)  # the original, chained
    assert "something XLA did not like" in str(ours.__cause__)
    torch_xla.sync()  # a placeholder left alive here would crash the process
    x = torch.ones(3).to(xla_device) * 2
    torch.testing.assert_close(x.cpu(), torch.full((3,), 2.0))


def _find_in_chain(exc, kind):
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def test_debug_switch_writes_the_failing_graph_to_a_file(xla_device, monkeypatch):
    import donate_backend.xla.lower as lower_module
    from donate_backend import config

    def failing_compile(*args, **kwargs):
        raise RuntimeError("INTERNAL: boom")

    monkeypatch.setattr(lower_module, "_compile_into_cache", failing_compile)
    f = torch.compile(lambda t, u: t.mul_(3) + u, backend="donate_xla")
    with config.patch(debug=True), pytest.raises(Exception) as info:
        f(torch.randn(4).to(xla_device), torch.randn(4).to(xla_device))
    match = re.search(r"The graph was written to (\S+\.txt)", str(info.value))
    assert match, str(info.value)
    with open(match.group(1)) as dump:
        text = dump.read()
    assert re.search(r"graph \d+ inference: traced on placeholders", text)
    assert "#0   float32[4] xla donor" in text  # the input signature, with the donor
    assert "torch.ops.aten.mul.Tensor" in text  # the FX code
    assert "RuntimeError: INTERNAL: boom" in text


def test_memory_mapping_verdicts():
    from donate_backend.xla import mmap_guard

    assert mmap_guard.verdict(None, 65530) == "ok"  # no /proc: nothing known
    assert mmap_guard.verdict(1000, None) == "ok"
    assert mmap_guard.verdict(39000, 65530) == "ok"
    assert mmap_guard.verdict(40000, 65530) == "warn"
    assert mmap_guard.verdict(52500, 65530) == "refuse"


def test_memory_mappings_are_read_from_proc(tmp_path):
    from donate_backend.xla import mmap_guard

    if mmap_guard.mapping_limit() is not None:  # Linux
        assert 0 < mmap_guard.mapping_count() < mmap_guard.mapping_limit()
    assert mmap_guard.mapping_count(str(tmp_path / "absent")) is None
    (tmp_path / "limit").write_text("262144\n")
    assert mmap_guard.mapping_limit(str(tmp_path / "limit")) == 262144


def test_near_the_mapping_limit_warns_once(monkeypatch, caplog):
    from donate_backend.xla import mmap_guard

    monkeypatch.setattr(mmap_guard, "_warned", False)
    with caplog.at_level("WARNING", logger="donate_xla"):
        mmap_guard.check_room("graph 3 forward", count=45000, limit=65530)
        mmap_guard.check_room("graph 4 forward", count=45100, limit=65530)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "compiling graph 3 forward: this process holds 45,000 memory mappings of the 65,530" in warning
    assert "XLA_COMPILATION_CACHE_SIZE" in warning


def test_compiling_at_the_mapping_limit_is_a_clear_error_not_a_crash(xla_device, monkeypatch):
    """Past 80 % of vm.max_map_count the next XLA:CPU compilation could segfault
    the process (each kernel is mapped); donate_xla refuses to compile instead."""
    from donate_backend.xla import mmap_guard

    count = mmap_guard.mapping_count()
    if count is None:
        pytest.skip("no /proc/self/maps on this system")
    monkeypatch.setattr(mmap_guard, "mapping_limit", lambda: count + 10)
    f = torch.compile(lambda t: t * 3 + 1, backend="donate_xla")
    with pytest.raises(Exception, match=r"graph \d+ inference is not compiled: this process holds [\d,]+ memory "
                                        r"mappings of the [\d,]+ Linux allows \(vm.max_map_count\)") as info:
        f(torch.randn(4).to(xla_device))
    # dynamo wraps a backend's error in BackendCompilerFailed
    assert isinstance(getattr(info.value, "inner_exception", info.value), mmap_guard.MappingLimitError)
    monkeypatch.undo()
    torch._dynamo.reset()
    torch.testing.assert_close(f(torch.ones(4).to(xla_device)).cpu(), torch.full((4,), 4.0))
