"""A compiled graph that runs more than once in a step: a graph break inside a layer makes
dynamo compile the layer's pieces once and run them for every layer. The memory plan
replays the step call by call (``report``'s call log), so each run's activations count,
on both paths."""
from __future__ import annotations

import pytest
import torch

import donate_backend
from donate_backend import report
from memtrack import profiler_peak_bytes


class _Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return x + torch.tanh(self.b(h))


WIDTH, BATCH = 256, 512


def _train(device, blocks, steps=3, width=WIDTH, batch=BATCH):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(width) for _ in range(blocks)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width).to(device)

    def step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = torch.compile(step, backend="donate_xla")
    losses = []
    for _ in range(steps):
        losses.append(compiled())
        if device.type == "xla":
            import torch_xla

            torch_xla.sync()
    return model, compiled, [float(v.cpu()) for v in losses]


def _plan_of(device, blocks):
    torch._dynamo.reset()
    donate_backend.clear_reports()
    model, compiled, _ = _train(device, blocks)
    return donate_backend.memory_plan(), model, compiled


def _check_per_run(device):
    plan3, _, _ = _plan_of(device, 3)
    plan6, model, compiled = _plan_of(device, 6)
    names = [g.name for g in plan6.graphs]
    forwards = [n for n in names if n.endswith("forward")]
    repeated = max(set(forwards), key=forwards.count)
    # six blocks, each cut in two by the break: the pieces inside run once per block
    assert forwards.count(repeated) >= 5, plan6.as_text()
    assert names.count(repeated.replace("forward", "backward")) == forwards.count(repeated)
    # three more blocks, three more blocks' activations: with one entry per graph the two
    # plans differed by the blocks' gradients only (half a [batch, width] tensor a block)
    per_block = (plan6.growth_bytes - plan3.growth_bytes) / 3
    assert per_block >= 2 * BATCH * WIDTH * 4, (plan3.as_text(), plan6.as_text())
    # the gradient a block's backward returns for the block's input is the next backward's
    # tangent: counted where it is made, not a second time where it is taken
    graph_id = int(repeated.split()[1])
    backward = next(r for r in donate_backend.reports() if r.graph_id == graph_id and r.kind == "backward")
    assert backward.memory.passed_grad_bytes >= BATCH * WIDTH * 4
    return plan6, model, compiled


def test_a_graph_that_runs_once_per_layer_is_planned_once_per_run_on_the_native_path():
    plan, model, compiled = _check_per_run(torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    measured = profiler_peak_bytes(compiled)
    assert abs(plan.growth_bytes / measured - 1) < 0.10, (plan.as_text(), measured)


def test_a_graph_that_runs_once_per_layer_is_planned_once_per_run_on_the_xla_path(xla_device):
    plan, _, _ = _check_per_run(xla_device)
    assert plan.path == "xla"


def test_values_with_graph_breaks_in_every_layer_equal_eager(xla_device):
    _, _, compiled_losses = _train(xla_device, 4, steps=4)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(WIDTH) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH)
    eager = []
    for _ in range(4):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        eager.append(float(loss))
    assert compiled_losses == pytest.approx(eager, rel=1e-5, abs=1e-6)


def test_without_the_call_log_each_graph_is_planned_once():
    """The log keeps the last 8192 calls: a step older than that is planned one call per
    graph, as when each graph runs once."""
    _train(torch.device("cpu"), 3)
    repeated = donate_backend.memory_plan()
    report._call_log.clear()
    once = donate_backend.memory_plan()
    names = [g.name for g in once.graphs]
    assert len(names) == len(set(names)) < len(repeated.graphs)
    assert once.growth_bytes < repeated.growth_bytes
