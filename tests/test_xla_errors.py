"""Unsupported graphs fail with a clear error, never a crash or a wrong value."""
import re

import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    from donate_backend.errors import UnsupportedGraphError
    from donate_backend.xla.lower import LoweringRequest, lower
    from donate_backend.xla.ops import has_xla_lowering


def test_op_without_xla_lowering_runs_on_the_cpu_between_xla_segments(xla_device):
    import donate_backend

    f = torch.compile(lambda t: torch.special.zeta(t * 2, t) + 1, backend="donate_xla")
    x = torch.rand(8) + 1
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), torch.special.zeta(x * 2, x) + 1)
    (split,) = [r for r in donate_backend.reports() if r.fallback_ops]
    assert split.fallback_ops == ("aten.special_zeta.default",)
    assert "around ops run on the CPU: aten.special_zeta.default" in donate_backend.format_record(split)


RRELU_TRAINING = """
import torch, torch_xla, torch.nn.functional as F
import donate_backend
device = torch_xla.device()
lin = torch.nn.Linear(16, 16).to(device)
f = torch.compile(lambda x: F.rrelu(lin(x), 0.1, 0.3, True), backend="donate_xla")
for i in range(3):
    x = torch.randn(64, 16).to(device).requires_grad_(True)
    h = lin(x).detach().cpu()
    y = f(x)
    y.sum().backward()
    y = y.detach().cpu()
    slope = torch.where(h < 0, y / h, torch.ones_like(h))
    assert bool((((slope >= 0.1 - 1e-6) & (slope <= 0.3 + 1e-6)) | (h >= 0)).all())
    torch.testing.assert_close(x.grad.cpu(), slope @ lin.weight.detach().cpu(), rtol=1e-4, atol=1e-5)
print(sorted({op for r in donate_backend.reports() for op in r.fallback_ops}))
"""


def test_rrelu_in_training_runs_on_the_cpu_instead_of_crashing():
    """torch_xla 2.9 has a kernel for ``rrelu_with_noise``, but tracing it on a
    placeholder killed the process with a segmentation fault; it now runs on the
    CPU between XLA segments. Each element's slope is in [lower, upper] and the
    input's gradient goes through the slopes the forward drew. In a fresh
    process, so that a crash fails this test only."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", RRELU_TRAINING], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "aten.rrelu_with_noise_functional.default" in out.stdout


CPU_FALLBACK_CASES = """
import torch, torch_xla, torch.nn.functional as F
import donate_backend
device = torch_xla.device()
g = torch.Generator().manual_seed(0)
img = torch.randn(2, 3, 7, 9, generator=g)
w, b = torch.randn(5, 4, generator=g), torch.randn(4, generator=g)
idx = torch.randint(0, 6, (6, 5), generator=g)
cases = {
    "cummin": lambda x: torch.cummin(x.view(-1), 0).values,
    "median over a dim": lambda x: torch.median(x.flatten(1), 1).values,
    "nanmedian over a dim": lambda x: torch.nanmedian(x.flatten(1), 1).values,
    "frexp": lambda x: torch.frexp(x).mantissa,
    "adaptive avg pool, indivisible": lambda x: F.adaptive_avg_pool2d(x, (4, 5)),
    "adaptive avg pool, divisible": lambda x: F.adaptive_avg_pool2d(x[..., :6, :6], (3, 2)),
    "adaptive max pool, indivisible": lambda x: F.adaptive_max_pool2d(x, (4, 5)),
    "avg pool, ceil mode with padding": lambda x: F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=True),
    "avg pool, divisor override": lambda x: F.avg_pool2d(x, 2, divisor_override=3),
    "addmm with beta and alpha": lambda x: torch.addmm(b.to(x.device), x.flatten(0, 2)[:, :5], w.to(x.device), beta=0.5, alpha=2.0),
    "linspace between tensors": lambda x: torch.linspace(x.min(), x.max(), 5, device=x.device) * x.sum(),
    "scatter_reduce mean": lambda x: torch.zeros(6, 5, device=x.device).scatter_reduce(
        0, idx.to(x.device), x.flatten()[:30].view(6, 5), "mean", include_self=False),
    "inv_ex checking errors": lambda x: torch.linalg.inv_ex(x[0, 0, :5, :5] + 5 * torch.eye(5, device=x.device), check_errors=True).inverse,
    "assignment through a bool mask": lambda x: torch.ops.aten.index_put(x * 1, [x[:, 0, 0, 0].detach() > x[:, 0, 0, 0].detach().mean()], torch.tensor(0.0, device=x.device)),
    "norm with p=0": lambda x: torch.norm(x, 0, dim=1) * x.sum(),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, 2),
    "huber loss": lambda x: F.huber_loss(x, torch.zeros_like(x), delta=0.5),
    "embedding bag": lambda x: F.embedding_bag(
        torch.tensor([0, 2, 1, 3], device=x.device), x.reshape(-1, 9)[:4], torch.tensor([0, 2], device=x.device), mode="mean"),
    "ihfft2 (conj_physical)": lambda x: torch.fft.ihfft2(x).abs(),
    "complex from two real tensors": lambda x: torch.complex(x, 2 * x).abs(),
    "polar": lambda x: torch.polar(x.abs() + 1, x).real,
    "roll of an empty tensor": lambda x: torch.roll(x[:0], 1, 0),
    "cholesky_solve of empty matrices": lambda x: torch.cholesky_solve(x[0, :, :0, :0], x[0, :, :0, :0]),
}

def run(fn, on):
    x = img.clone().to(on).requires_grad_(True)
    out = fn(x)
    (out**2).sum().backward()
    return out.detach().cpu(), x.grad.cpu()

for name, fn in cases.items():
    donate_backend.clear_reports()
    got, expected = run(torch.compile(fn, backend="donate_xla"), device), run(fn, "cpu")
    for what, x, y in zip(("value", "input gradient"), got, expected):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}, {what}: {m}")
    on_cpu = sorted({op for r in donate_backend.reports() for op in r.fallback_ops})
    print(f"{name}: {on_cpu}")
    torch._dynamo.reset()
"""


def test_kernels_that_would_hand_placeholders_to_the_cpu_run_on_the_cpu():
    """torch_xla 2.9 has kernels for these ops, but for these arguments (or
    always) they read their input's data or pass it to torch_xla's CPU fallback,
    which aborted the process when traced on a placeholder ("PjRt buffer is null
    in TransferFromDevice") or crashed it. They now run on the CPU between XLA
    segments; each value and input gradient equals the CPU's. The divisible
    adaptive pool stays on XLA. In a fresh process, so that a crash fails this
    test only."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    out = subprocess.run([sys.executable, "-c", CPU_FALLBACK_CASES], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ran = dict(line.split(": ", 1) for line in out.stdout.strip().splitlines())
    assert len(ran) == 23, out.stdout
    assert ran["adaptive avg pool, divisible"] == "[]"
    assert "aten._adaptive_avg_pool2d_backward.default" in ran["adaptive avg pool, indivisible"]
    assert all(ops != "[]" for name, ops in ran.items() if name != "adaptive avg pool, divisible"), ran


def test_lowering_check_knows_composites():
    assert has_xla_lowering(torch.ops.aten.addmm.default)
    assert has_xla_lowering(torch.ops.aten.linear.default)  # decomposes
    assert has_xla_lowering(torch.ops.aten._native_batch_norm_legit_functional.default)
    assert not has_xla_lowering(torch.ops.aten.histc.default)
    assert not has_xla_lowering(torch.ops.aten.special_zeta.default)


def test_host_copy_inside_graph_runs_on_the_cpu(xla_device):
    import donate_backend

    f = torch.compile(lambda t: (t * 2).sum().cpu() + 1, backend="donate_xla")
    x = torch.randn(8)
    out = f(x.to(xla_device))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, (x * 2).sum() + 1)
    assert any(r.fallback_ops == ("aten._to_copy.default",) for r in donate_backend.reports())


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


def test_custom_op_without_an_xla_kernel_falls_back_to_the_cpu(xla_device):
    """A CPU-only custom op never runs on a placeholder (torch_xla's fallback would crash)."""
    import donate_backend

    @torch.library.custom_op("donate_xla_test::cpu_only", mutates_args=(), device_types="cpu")
    def cpu_only(t: torch.Tensor) -> torch.Tensor:
        assert t.device.type == "cpu"
        return t * 2

    @cpu_only.register_fake
    def _(t):
        return torch.empty_like(t)

    assert not has_xla_lowering(torch.ops.donate_xla_test.cpu_only.default)
    f = torch.compile(lambda t: torch.ops.donate_xla_test.cpu_only(t + 1) * 3, backend="donate_xla")
    x = torch.randn(4)
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), (x + 1) * 2 * 3)
    assert any(r.fallback_ops == ("donate_xla_test.cpu_only.default",) for r in donate_backend.reports())


def test_custom_op_with_a_composite_kernel_is_traced(xla_device):
    @torch.library.custom_op("donate_xla_test::composite", mutates_args=())
    def composite(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    @composite.register_fake
    def _(t):
        return torch.empty_like(t)

    x = torch.randn(4)
    f = torch.compile(lambda t: torch.ops.donate_xla_test.composite(t), backend="donate_xla")
    torch.testing.assert_close(f(x.to(xla_device)).cpu(), x * 2 + 1)


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


def _roll_node(shape):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(shape, device="meta")
    node = graph.call_function(torch.ops.aten.roll.default, (x, [1]))
    return node


def test_an_op_goes_to_the_cpu_only_for_the_arguments_its_kernel_hands_over(monkeypatch):
    """``lowerable_node`` asks an op's fallback predicate about the node's arguments
    (their fake values); a predicate that raises (an argument layout nobody foresaw)
    sends the op to the CPU, the safe side."""
    from donate_backend.xla import ops

    assert ops.lowerable_node(_roll_node((3, 4)))
    assert not ops.lowerable_node(_roll_node((0, 4)))  # torch_xla's kernel: SIGFPE

    def surprised(args, kwargs):
        raise IndexError("an argument layout nobody foresaw")

    monkeypatch.setitem(ops._FALLS_BACK_WITH, torch.ops.aten.roll.default, surprised)
    assert not ops.lowerable_node(_roll_node((3, 4)))
