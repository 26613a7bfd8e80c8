"""A CI-sized run of the differential fuzzer on donate_xla's native path (the CPU).

The scenarios are those of tests/xla_fuzz.py (tied weights, copies between inputs,
``backward(inputs=)``, gradient accumulation, BatchNorm in train and eval mode...),
compiled with donate_xla on CPU tensors, so the backward frees saved tensors at their
last use and reuses dying buffers; each is compared with eager PyTorch after every
call. Needs no torch_xla: it runs on the newest torch too. ``make fuzz-native`` runs
2,000.
"""
import pytest
import torch

import xla_fuzz

CI_SEEDS = range(20_000, 20_016)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_training_program_matches_eager_on_the_native_path(seed):
    outcome = xla_fuzz.check(seed, path="native")
    assert outcome.status != "failed", f"seed {seed}: {outcome.detail}\n{outcome.source}"


def test_the_native_path_compiles_on_the_cpu_and_excuses_no_difference(monkeypatch):
    """donate_xla runs on the CPU tensors; a difference that aot_eager does not share
    is a failure (there is no "numerics" class: same device, same arithmetic)."""
    scenario = xla_fuzz.generate(CI_SEEDS[0])
    right = xla_fuzz.Run([], [([torch.zeros(2)], {})])
    shifted = xla_fuzz.Run([], [([torch.ones(2)], {})])
    devices = []

    def fake_run(scenario, device, compiled, backend="donate_xla"):
        devices.append((device.type, compiled, backend))
        return shifted if compiled and backend == "donate_xla" else right

    monkeypatch.setattr(xla_fuzz, "generate", lambda seed: scenario)
    monkeypatch.setattr(xla_fuzz, "run", fake_run)
    outcome = xla_fuzz.check(scenario.seed, path="native")
    assert outcome.status == "failed"
    assert ("cpu", True, "donate_xla") in devices
    assert all(device == "cpu" for device, _, _ in devices)


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path must be one of"):
        xla_fuzz.check(CI_SEEDS[0], path="tpu")


@pytest.mark.parametrize("executor", ["aten", "inductor"])
def test_a_deviation_inductor_shares_is_upstream_only_with_the_inductor_executor(monkeypatch, executor):
    """With DONATE_XLA_NATIVE_COMPILER=inductor, a difference plain Inductor shares (its
    own arithmetic, e.g. fused AdamW) is upstream; with the ATen executor it fails."""
    from donate_backend import config

    scenario = xla_fuzz.generate(CI_SEEDS[0])
    right = xla_fuzz.Run([], [([torch.zeros(2)], {})])
    shifted = xla_fuzz.Run([], [([torch.ones(2)], {})])

    def fake_run(scenario, device, compiled, backend="donate_xla"):
        return shifted if compiled and backend in ("donate_xla", "inductor") else right

    monkeypatch.setattr(xla_fuzz, "generate", lambda seed: scenario)
    monkeypatch.setattr(xla_fuzz, "run", fake_run)
    with config.patch(native_compiler=executor):
        outcome = xla_fuzz.check(scenario.seed, path="native")
    assert outcome.status == ("upstream" if executor == "inductor" else "failed")


def test_the_mesh_path_needs_a_process_started_for_it(monkeypatch):
    monkeypatch.delenv(xla_fuzz.MESH_ENV, raising=False)
    with pytest.raises(RuntimeError, match="DONATE_XLA_FUZZ_MESH=1"):
        xla_fuzz.check(CI_SEEDS[0], path="mesh")


def test_the_cuda_path_compares_with_eager_on_cuda_and_aot_eager_decides_upstream(monkeypatch):
    """``--path cuda``: eager and donate_xla both on the CUDA device; a difference aot_eager
    on CUDA does not share is a failure, one it shares is upstream. (``run`` is faked, so
    this runs without a GPU; tests/test_native_cuda.py runs real seeds where there is one.)"""
    scenario = xla_fuzz.generate(CI_SEEDS[0])
    right = xla_fuzz.Run([], [([torch.zeros(2)], {})])
    shifted = xla_fuzz.Run([], [([torch.ones(2)], {})])
    for reference_shares, expected in ((False, "failed"), (True, "upstream")):
        devices = []

        def fake_run(scenario, device, compiled, backend="donate_xla"):
            devices.append((device.type, compiled, backend))
            deviates = compiled and (backend == "donate_xla" or reference_shares)
            return shifted if deviates else right

        monkeypatch.setattr(xla_fuzz, "generate", lambda seed: scenario)
        monkeypatch.setattr(xla_fuzz, "run", fake_run)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        outcome = xla_fuzz.check(scenario.seed, path="cuda")
        assert outcome.status == expected
        assert devices == [("cuda", False, "donate_xla"), ("cuda", True, "donate_xla"), ("cuda", True, "aot_eager")]


def test_the_cuda_path_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="path 'cuda' needs a CUDA device"):
        xla_fuzz.check(CI_SEEDS[0], path="cuda")
