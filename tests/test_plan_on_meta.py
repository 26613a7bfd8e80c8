"""Planning a GPU step on a machine without one: the step traced on the meta device.

A model and batch on ``torch.device("meta")`` have shapes and no data. The native
path compiles and "runs" them (meta kernels compute shapes only), so the memory
plan of the step, a memory limit's choice or its refusal, come out on any
machine, counted in CUDA's allocator blocks.
"""
from __future__ import annotations

import pytest
import torch

import donate_backend
from donate_backend.analysis.aliasing import storage_address
from donate_backend.budget import MemoryLimitError
from donate_backend.native import compat
from test_memory_plan import _six_layers, _whole_step

MIB = 2**20
HAS_OFFLOADING = compat.activation_offloading(on_cuda=False) is not None


def _train(model, x, steps, options=None):
    """Compile a whole Adam step on ``model(x).square().mean()`` and run it ``steps``
    times; returns the last loss (on the model's device)."""
    torch._dynamo.reset()
    donate_backend.clear_reports()
    step = _whole_step(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    run = torch.compile(step, backend="donate_xla", options=options or {})
    for _ in range(steps):
        loss = run(x)
    return loss


def test_meta_storages_are_told_apart_by_identity_and_views_share_theirs():
    a, b = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert storage_address(a) != storage_address(b)
    assert storage_address(a[2:]) == storage_address(a)
    real = torch.empty(8)
    assert storage_address(real) == ("cpu", real.untyped_storage().data_ptr())


def test_a_step_traced_on_the_meta_device_is_planned_as_on_the_cpu():
    """The same Adam step on the CPU and on meta tensors: the same graphs, the same
    resident bytes, peak and parts at the peak, up to CUDA's 512-byte blocks (Adam's
    twelve 4-byte step counters take a block each on meta). The meta step allocates
    nothing, and the plan says what it cannot see."""
    x = torch.randn(2048, 512)
    _train(_six_layers(), x, 3)
    on_cpu = donate_backend.memory_plan(workspaces=False)

    model = _six_layers().to("meta")
    loss = _train(model, x.to("meta"), 3)
    on_meta = donate_backend.memory_plan()
    print(f"\n{on_cpu.as_text()}\n{on_meta.as_text()}")
    assert loss.is_meta and all(p.is_meta for p in model.parameters())
    kinds = lambda plan: [g.name.split()[-1] for g in plan.graphs]  # noqa: E731 (graph ids go on counting)
    assert kinds(on_meta) == kinds(on_cpu) == ["forward", "backward", "inference", "inference"]
    rounding = 12 * 512
    assert on_meta.resident_bytes == pytest.approx(on_cpu.resident_bytes, abs=rounding)
    assert on_meta.peak_bytes == pytest.approx(on_cpu.peak_bytes, abs=rounding)
    for category, nbytes in on_cpu.breakdown.items():
        assert on_meta.breakdown[category] == pytest.approx(nbytes, abs=rounding), category
    assert on_meta.breakdown["optimizer state"] == pytest.approx(12 * MIB, rel=0.01)  # moments and step counters
    (note,) = [n for n in on_meta.notes if "meta device" in n]
    assert "512-byte blocks" in note and "workspaces" in note
    assert not any("meta device" in n for n in on_cpu.notes)


def test_a_memory_limit_on_the_meta_device_is_fitted_or_refused_before_a_gpu_is_needed():
    """A limit below the default step is met on meta tensors by planning the graph again
    with Adam's state counted (the choice says so); one no plan meets is refused at the
    third call with the bytes the step needs, as it would be on the device. Offloading is
    kept out (``offload_saved`` 0): it would meet both limits (next test)."""
    x = torch.randn(2048, 512, device="meta")
    _train(_six_layers().to("meta"), x, 3)
    default = donate_backend.memory_plan()
    limit = default.peak_bytes - 6 * MIB

    _train(_six_layers().to("meta"), x, 3, {"memory_limit": limit, "offload_saved": False})
    fitted = donate_backend.memory_plan()
    print(f"\nlimit {limit / MIB:.1f} MiB\n{fitted.as_text()}")
    assert fitted.peak_bytes <= limit < default.peak_bytes
    (choice,) = [c for c in fitted.choices if "chosen under memory_limit" in c]
    assert "planned again after 2 steps" in choice

    with pytest.raises(MemoryLimitError) as refused:
        _train(_six_layers().to("meta"), x, 3, {"memory_limit": "50MiB", "offload_saved": False})
    assert refused.value.least_bytes > 50 * MIB
    assert "memory_limit is 50.0 MiB" in str(refused.value)



@pytest.mark.skipif(not HAS_OFFLOADING, reason=f"torch {torch.__version__} has no activation offloading")
def test_on_the_meta_device_a_memory_limit_offloads_as_on_a_gpu():
    """Planning for a GPU on meta tensors, a limit that recomputation alone cannot meet but
    offloading the saved activations can is met as it would be on CUDA: the activations go to
    host memory (the copies run as meta tensors there), the step's plan is within the limit,
    and with ``offload_saved`` 0 the same limit is refused or recomputes."""
    x = torch.randn(2048, 512, device="meta")
    _train(_six_layers().to("meta"), x, 3, {"offload_saved": False})
    default = donate_backend.memory_plan()
    _train(_six_layers().to("meta"), x, 3, {"offload_saved": True})
    offloaded = donate_backend.memory_plan()
    print(f"\ndefault {default.peak_bytes / MIB:.1f} MiB, every activation offloaded {offloaded.peak_bytes / MIB:.1f} MiB")
    assert offloaded.peak_bytes < default.peak_bytes
    limit = (offloaded.peak_bytes + default.peak_bytes) // 2

    _train(_six_layers().to("meta"), x, 3, {"memory_limit": limit})
    fitted = donate_backend.memory_plan()
    (choice,) = [c for c in fitted.choices if "chosen under memory_limit" in c]
    print(f"limit {limit / MIB:.1f} MiB: {choice}")
    assert fitted.peak_bytes <= limit
    assert "offloaded to host memory" in choice

    try:
        _train(_six_layers().to("meta"), x, 3, {"memory_limit": limit, "offload_saved": False})
    except MemoryLimitError as refused:
        assert refused.least_bytes > limit
    else:
        recomputed = donate_backend.memory_plan()
        (choice,) = [c for c in recomputed.choices if "chosen under memory_limit" in c]
        assert "offloaded" not in choice and recomputed.peak_bytes <= limit
