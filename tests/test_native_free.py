"""The compiled backward frees saved activations at their last use, before it returns."""
from __future__ import annotations

import torch

import donate_backend
from donate_backend import config
from memtrack import StorageTracker, profiler_peak_bytes



def mlp(width=64, depth=3):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def gelu_liveness_during_backward(model, x):
    """Run forward+backward under the tracker; for each backward op, which forward
    ``gelu`` outputs (saved activations) are still alive after it."""
    compiled = torch.compile(model, backend="donate_xla")
    tracker = StorageTracker()
    with tracker:
        loss = compiled(x).sum()
        saved = tracker.made_by("aten.gelu.default")
        timeline = []
        tracker.probe(lambda t, op: timeline.append((op, [not r.expired() for r in saved])))
        loss.backward()
    return saved, timeline


def test_saved_activation_is_freed_before_backward_returns():
    saved, timeline = gelu_liveness_during_backward(mlp(), torch.randn(32, 64))
    assert len(saved) == 3
    first_gelu = 0  # input of the second Linear: read by its weight gradient only
    dead_at = next(i for i, (_, alive) in enumerate(timeline) if not alive[first_gelu])
    later_ops = [op for op, _ in timeline[dead_at + 1 :]]
    # The first layer's gradients are still to be computed when it dies.
    assert "aten.mm.default" in later_ops


def test_plain_backward_keeps_saved_activations_to_the_end():
    with config.patch(free_saved=False):
        saved, timeline = gelu_liveness_during_backward(mlp(), torch.randn(32, 64))
    last_mm = max(i for i, (op, _) in enumerate(timeline) if op == "aten.mm.default")
    assert all(alive[0] for _, alive in timeline[: last_mm + 1])


def test_record_counts_freed_and_reused():
    model, x = mlp(), torch.randn(8, 64, requires_grad=True)
    torch.compile(model, backend="donate_xla")(x).sum().backward()
    (backward,) = [r for r in donate_backend.reports() if r.kind == "backward"]
    forward = [r for r in donate_backend.reports() if r.kind == "forward"][0]
    assert backward.path == "native"
    assert backward.saved_freed_early >= 6  # 3 weights^T, 3 pre-activations, 3 gelu inputs
    assert backward.buffers_reused == 3  # one gelu_backward per layer writes into a dying buffer
    assert forward.saved_freed_early is None
    assert "saved tensors freed early" in donate_backend.format_record(backward)


def test_switch_off_records_nothing_freed():
    model, x = mlp(), torch.randn(8, 64, requires_grad=True)
    with config.patch(free_saved=False):
        torch.compile(model, backend="donate_xla")(x).sum().backward()
    (backward,) = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert backward.saved_freed_early == 0 and backward.buffers_reused == 0


def _backward_peak(model, x, tracker):
    compiled = torch.compile(model, backend="donate_xla")
    compiled(x).sum().backward()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    with tracker:
        loss = compiled(x).sum()
        loss.backward()
    return tracker.peak_bytes


def test_freeing_lowers_the_backward_peak_and_profiler_agrees():
    x = torch.randn(256, 256)
    model = mlp(width=256, depth=4)
    freeing = _backward_peak(model, x, StorageTracker())
    with config.patch(free_saved=False):
        plain = _backward_peak(model, x, StorageTracker())
    activation = 256 * 256 * 4
    # Plain holds all 8 activations to the end; freeing lets them go layer by layer.
    assert plain - freeing >= 3 * activation

    def step():
        compiled(x).sum().backward()

    compiled = torch.compile(model, backend="donate_xla")
    step()
    model.zero_grad(set_to_none=True)  # same starting level as the tracker's run
    by_profiler = profiler_peak_bytes(step)
    # Same run measured by the allocator's events: within a few small buffers.
    assert abs(by_profiler - freeing) <= activation // 4
