"""The native path on a CUDA device, against eager on the same device.

Skipped where there is no GPU (CI and the developers' machines have none). On a
machine with one, ``tools/gpu_check.sh`` runs this file, the fuzzer's ``cuda`` path
and ``bench/backward_memory.py --device cuda``.

What only a GPU shows: the caching allocator (a freed saved tensor goes back to a
stream-ordered pool while kernels that read it may still be queued), cuDNN and
cuBLAS kernels in the reused buffers, ``torch.amp.GradScaler`` on CUDA, and peaks
measured by ``torch.cuda.max_memory_allocated`` (the CPU tests use profiler events).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import donate_backend
import xla_fuzz
from donate_backend import config
from memtrack import cuda_peak_bytes
from programs import (
    checkpointed_program,
    grad_scaler_program,
    held_state_program,
    retained_graph_program,
    varying_batch_program,
)
from real_models import MODELS, available
from test_native_real_models import (
    STEPS, TOLERANCE, assert_history_close, backward_peak, max_differences, train_side_by_side,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
MIB = 2**20
FUZZ_SEEDS = range(21_000, 21_048)
# cuBLAS is deterministic only with a fixed workspace; read when cuBLAS starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def same_arithmetic_every_run():
    """Deterministic kernels and no TF32 in cuDNN, so that eager and compiled runs of the
    same ops give the same numbers: by default cuDNN convolutions run in TF32 with
    algorithms chosen per call, and CUDA's index_add and scatter accumulate with atomics."""
    saved = (
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved[:3]
    torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])


class OnCuda:
    """A ``real_models.RealModel`` whose model and batches live on the GPU."""

    def __init__(self, spec):
        self.spec = spec

    def build(self) -> torch.nn.Module:
        return self.spec.build().to(CUDA)

    def batch(self, seed: int) -> dict:
        return {k: v.to(CUDA) for k, v in self.spec.batch(seed).items()}

    def loss(self, model, batch) -> torch.Tensor:
        return self.spec.loss(model, batch)


def cuda_backward_peak(spec, model, run) -> int:
    return backward_peak(spec, model, run, measure=cuda_peak_bytes)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_model_trains_like_eager_on_cuda(name, executor):
    """Each step from eager's state (as the CPU tests do under Inductor): on CUDA, aot_autograd's
    graphs do not compute exactly what eager does even with deterministic kernels (resnet18's
    first gradients 6e-6 apart in norm, then BatchNorm at batch 4 and AdamW amplify that
    over steps), so eager is matched to the Inductor tolerance. The ATen executor runs the
    same graphs and kernels as aot_eager, and must equal it to the CPU tests' tolerance."""
    if not available(name):
        pytest.skip(f"{MODELS[name].package} is not installed")
    spec = OnCuda(MODELS[name])
    eager = spec.build()
    ours = copy.deepcopy(eager)
    with config.patch(native_compiler=executor):
        compiled = torch.compile(ours, backend="donate_xla")
        expected, actual = train_side_by_side(spec, eager, ours, compiled, resync=True)
        peak_ours = cuda_backward_peak(spec, ours, compiled)
    records = donate_backend.reports()
    peaks = {"eager": cuda_backward_peak(spec, eager, eager)}
    if executor == "aten":  # the same graphs with aot_autograd's plain backward
        torch._dynamo.reset()
        eager_again = spec.build()
        reference = copy.deepcopy(eager_again)
        run_reference = torch.compile(reference, backend="aot_eager")
        _, by_aot_eager = train_side_by_side(spec, eager_again, reference, run_reference, resync=True)
        peaks["aot_eager"] = cuda_backward_peak(spec, reference, run_reference)
    print(
        f"\n{name} [{executor}, cuda] max |diff| vs eager, each of {STEPS} AdamW steps from eager's state: "
        + ", ".join(f"{k} {v:.2e}" for k, v in max_differences(expected, actual).items())
        + "; forward+backward peak: "
        + ", ".join(f"{k} {v / MIB:.3f} MiB" for k, v in peaks.items())
        + f", donate_xla {peak_ours / MIB:.3f} MiB ({peak_ours / peaks['eager']:.2f}x eager)"
    )
    assert_history_close(expected, actual, TOLERANCE["inductor"])
    assert records and all(r.path == "native" for r in records)
    assert any(r.kind == "backward" for r in records)
    if executor == "aten":
        assert_history_close(by_aot_eager, actual, TOLERANCE["aten"])
        assert peak_ours <= peaks["aot_eager"]  # freeing never holds more than the plain backward


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _peak_and_grads(model, run, x):
    model.zero_grad(set_to_none=True)
    run(x).square().mean().backward()  # compiles
    model.zero_grad(set_to_none=True)
    peak = cuda_peak_bytes(lambda: run(x).square().mean().backward())
    return peak, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_freeing_backward_peaks_no_higher_than_the_same_graphs_on_cuda(executor):
    """bench/backward_memory.py's model 1 at a quarter of its batch: the freeing backward
    peaks no higher than the same graphs run by the stock backend (aot_eager for the ATen
    executor, Inductor for Inductor), measured by the CUDA allocator, and equals eager."""
    torch.manual_seed(0)
    eager = _mlp(2048, 8).to(CUDA)
    x = torch.randn(128, 2048, device=CUDA)
    peaks = {"eager": _peak_and_grads(eager, eager, x)[0]}
    reference = "aot_eager" if executor == "aten" else "inductor"
    torch._dynamo.reset()
    stock = copy.deepcopy(eager)
    peaks[reference] = _peak_and_grads(stock, torch.compile(stock, backend=reference), x)[0]
    torch._dynamo.reset()
    ours = copy.deepcopy(eager)
    with config.patch(native_compiler=executor):
        peaks["donate_xla"], got = _peak_and_grads(ours, torch.compile(ours, backend="donate_xla"), x)
    print(f"\nMLP 8 x 2048, batch 128 [{executor}, cuda]: "
          + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in peaks.items()))
    _, expected = _peak_and_grads(eager, eager, x)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    assert peaks["donate_xla"] <= peaks[reference]


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_offloaded_activations_leave_the_device_between_forward_and_backward_on_cuda(executor):
    """``offload_saved`` (torch's activation offloading): after the forward, the device holds
    at most half of what it holds without offloading (the saved activations are in host
    memory), the whole step peaks no higher, and the gradients equal eager's."""
    from donate_backend.native import compat

    if compat.activation_offloading(on_cuda=True) is None:
        pytest.skip(f"torch {torch.__version__} has no activation offloading")
    torch.manual_seed(0)
    eager = _mlp(2048, 8).to(CUDA)
    x = torch.randn(512, 2048, device=CUDA)
    _, expected = _peak_and_grads(eager, eager, x)
    held, peaks = {}, {}
    for offload in (False, True):
        torch._dynamo.reset()
        ours = copy.deepcopy(eager)
        with config.patch(native_compiler=executor, offload_saved=offload):
            run = torch.compile(ours, backend="donate_xla")
            peaks[offload], got = _peak_and_grads(ours, run, x)
            ours.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = run(x).square().mean()
            torch.cuda.synchronize()
            held[offload] = torch.cuda.memory_allocated() - before
            loss.backward()
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    print(f"\nMLP 8 x 2048, batch 512 [{executor}, cuda]: after the forward "
          f"{held[False] / MIB:.1f} -> {held[True] / MIB:.1f} MiB with offloading; step peak "
          f"{peaks[False] / MIB:.1f} -> {peaks[True] / MIB:.1f} MiB")
    assert held[True] <= 0.5 * held[False]
    assert peaks[True] <= peaks[False]


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_a_memory_limit_offloads_before_it_recomputes_on_cuda(executor, monkeypatch):
    """A ``memory_limit`` between the step's predicted peak with its saved activations offloaded
    and without: the limit offloads at the full activation budget (nothing recomputed), the
    step peaks (``max_memory_allocated``) within 10% of its plan and below the same step
    without the limit, and the gradients equal eager's."""
    from donate_backend.native import compat, memory

    if compat.activation_offloading(on_cuda=True) is None:
        pytest.skip(f"torch {torch.__version__} has no activation offloading")
    predicted, predict = {}, memory.predict_step

    def recording(fw_module, bw_module, forward_returns=None):
        peak, parts = predict(fw_module, bw_module, forward_returns)
        offloaded = any(n.name.startswith("cpu_offload_") for n in fw_module.graph.nodes)
        predicted.setdefault(offloaded, peak)  # the first candidate of each kind: budget 1
        return peak, parts

    monkeypatch.setattr(memory, "predict_step", recording)
    torch.manual_seed(0)
    eager = _mlp(2048, 8).to(CUDA)
    x = torch.randn(512, 2048, device=CUDA)
    _, expected = _peak_and_grads(eager, eager, x)
    peaks = {}
    for limit in (1, None):  # 1 byte: every candidate predicted, then refused
        torch._dynamo.reset()
        ours = copy.deepcopy(eager)
        run = torch.compile(ours, backend="donate_xla", options={"native_compiler": executor, "memory_limit": limit})
        if limit == 1:
            with pytest.raises(Exception, match="memory_limit"):
                run(x)
            continue
        peaks["no limit"] = _peak_and_grads(ours, run, x)[0]
    assert predicted[True] < predicted[False], predicted
    limit = (predicted[True] + predicted[False]) // 2
    torch._dynamo.reset()
    donate_backend.clear_reports()
    ours = copy.deepcopy(eager)
    run = torch.compile(ours, backend="donate_xla", options={"native_compiler": executor, "memory_limit": limit})
    for _ in range(3):
        ours.zero_grad(set_to_none=True)
        run(x).square().mean().backward()
    ours.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    growth = cuda_peak_bytes(lambda: run(x).square().mean().backward())
    got = [p.grad.clone() for p in ours.parameters()]
    (record,) = [r for r in donate_backend.reports() if r.budget_choice]
    plan = donate_backend.memory_plan(workspaces=False)
    print(f"\nMLP 8 x 2048, batch 512 [{executor}, cuda]: limit {limit / MIB:.1f} MiB; {record.budget_choice}; "
          f"plan {plan.peak_bytes / MIB:.1f} MiB; measured {(resident + growth) / MIB:.1f} MiB "
          f"(no limit: {(resident + peaks['no limit']) / MIB:.1f} MiB)")
    assert record.budget_choice.startswith("activation budget 1 with "), record.budget_choice
    assert abs(resident + growth - plan.peak_bytes) <= 0.1 * plan.peak_bytes
    assert growth < peaks["no limit"]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_retain_graph_inputs_and_hooks_match_eager_on_cuda(executor):
    """Two backwards through one retained graph (gradients accumulate; the reusing backward
    must not run while the graph is kept), a gradient hook, ``backward(inputs=)`` that
    leaves the other gradients as they were, and ``torch.autograd.grad``."""
    torch.manual_seed(0)
    eager = _mlp(64, 3).to(CUDA)
    ours = copy.deepcopy(eager)
    x = torch.randn(16, 64, device=CUDA)

    def program(model, run):
        return retained_graph_program(model, run, x.clone().requires_grad_())

    expected = program(eager, eager)
    with config.patch(native_compiler=executor):
        got = program(ours, torch.compile(ours, backend="donate_xla"))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def _assert_cuda_program_matches_eager(program, executor: str, *args) -> None:
    expected = program(CUDA, lambda f: f, *args)
    torch._dynamo.reset()
    with config.patch(native_compiler=executor):
        got = program(CUDA, lambda f: torch.compile(f, backend="donate_xla"), *args)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_grad_scaler_training_matches_eager_on_cuda(executor, whole_step):
    """``torch.amp.GradScaler("cuda")``: the overflowing step skipped, the scale halved."""
    _, _, scale = grad_scaler_program(CUDA, lambda f: f, whole_step)
    assert scale.item() == 2.0**15
    _assert_cuda_program_matches_eager(grad_scaler_program, executor, whole_step)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_trains_like_eager_on_cuda(executor, use_reentrant):
    _assert_cuda_program_matches_eager(checkpointed_program, executor, False, use_reentrant)


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_held_state_and_changing_batch_match_eager_on_cuda(executor):
    _assert_cuda_program_matches_eager(held_state_program, executor, True)
    torch._dynamo.reset()
    _assert_cuda_program_matches_eager(varying_batch_program, executor)


@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_random_training_program_matches_eager_on_cuda(seed):
    """The fuzzer's scenarios (tied weights, copies between inputs, ``backward(inputs=)``,
    accumulation, aliased outputs, BatchNorm...) on CUDA against eager CUDA."""
    outcome = xla_fuzz.check(seed, path="cuda")
    assert outcome.status != "failed", f"seed {seed}: {outcome.detail}\n{outcome.source}"
