"""The memory plan of a step whose graphs run at sizes that change within the step.

A mixture of experts routes a different number of tokens to each expert: dynamo
compiles the expert once for the first size it sees, then once more with symbolic
sizes when a second size comes, and that one graph runs for every expert, each time
at other sizes, with the routing run eagerly in between. The plan replays each call
at the sizes of that call (``GraphRecord.memory_at_sizes``), leaves out the graph
compiled for the first size once the step no longer runs it, and lets go of the
input gradients the eager code consumes between two backwards
(``GraphRecord.outputs_dropped``).
"""
from __future__ import annotations

import pytest
import torch

import donate_backend
from donate_backend import graph_memory, report
from memtrack import profiler_peak_bytes

TOLERANCE = 0.10
FIRST = (900, 500, 260, 60)  # tokens routed to each expert in the first step
ROWS = (800, 560, 300, 60)  # and in every later step


class Expert(torch.nn.Module):
    def __init__(self, width: int = 64, hidden: int = 2048):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _expert(up_weight, up_bias, down_weight, down_bias, rows):
    hidden = torch.nn.functional.gelu(torch.nn.functional.linear(rows, up_weight, up_bias))
    return torch.nn.functional.linear(hidden, down_weight, down_bias)


def _needs_symbolic_sizes() -> None:
    if not any(r.memory_at_sizes is not None for r in donate_backend.reports()):
        # importing torch_xla turns dynamo's automatic dynamic shapes off, for every
        # device (torch_xla/__init__.py): a graph is compiled for each size instead
        pytest.skip("dynamo compiled no graph with symbolic sizes here (torch_xla imported: "
                    "torch._dynamo.config.automatic_dynamic_shapes is off)")


def _mixture():
    torch.manual_seed(0)
    router = torch.nn.Linear(64, 64)
    experts = torch.nn.ModuleList(Expert() for _ in ROWS)
    # one compiled function for every expert, its weights passed in (as a graph break
    # inside an HF mixture of experts' block runs one graph for every expert)
    run_expert = torch.compile(_expert, backend="donate_xla")
    x = torch.randn(sum(ROWS), 64)

    def step(rows=ROWS):
        h = torch.tanh(router(x))  # eager, as the routing of an HF mixture of experts
        # each expert's rows sliced on their own: the slice's backward consumes the
        # expert's input gradient at once (torch.split's would wait for all of them)
        starts = [sum(rows[:i]) for i in range(len(rows))]
        parts = [h[start:start + n] for start, n in zip(starts, rows)]
        out = torch.cat([run_expert(e.up.weight, e.up.bias, e.down.weight, e.down.bias, part)
                         for e, part in zip(experts, parts)])
        out.square().sum().backward()

    return torch.nn.ModuleList([router, experts]), step


def test_each_call_of_a_graph_with_symbolic_sizes_is_planned_at_its_own_sizes():
    torch._dynamo.reset()
    donate_backend.clear_reports()
    model, step = _mixture()
    for rows in (FIRST, ROWS):  # the first step compiles one graph per size
        step(rows)
        model.zero_grad(set_to_none=True)
    _needs_symbolic_sizes()
    plan = donate_backend.memory_plan()
    forwards = [g for g in plan.graphs if g.name.endswith("forward")]
    print("\n" + plan.as_text())
    # one graph for every expert: the one compiled for the first step's first size (which
    # the later steps do not run) is left out
    assert len(forwards) == len(ROWS) and len({g.name for g in forwards}) == 1
    assert any(r.kind == "forward" and r.name != forwards[0].name for r in donate_backend.reports())
    # each call keeps what its own rows need: more rows, more bytes
    added = [g.end_bytes - g.start_bytes for g in forwards]
    assert added == sorted(added, reverse=True) and added[0] > 2 * added[-1]
    measured = profiler_peak_bytes(step)
    print(f"predicted growth {plan.growth_bytes / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB")
    assert abs(plan.growth_bytes / measured - 1) <= TOLERANCE


def test_sizes_of_each_call_are_in_the_call_log():
    torch._dynamo.reset()
    donate_backend.clear_reports()
    model, step = _mixture()
    for rows in (FIRST, ROWS):
        step(rows)
        model.zero_grad(set_to_none=True)
    _needs_symbolic_sizes()
    dynamic = [r for r in donate_backend.reports() if r.memory_at_sizes is not None]
    assert {r.kind for r in dynamic} == {"forward", "backward"}
    sizes = [s[0] for _, key, s in report.calls()[-2 * len(ROWS):] if s is not None]
    assert sizes == list(ROWS) + list(reversed(ROWS))  # the forwards, then their backwards


def test_input_gradients_eager_code_consumes_between_two_backwards_are_let_go():
    """The second graph's backward returns the gradient of its input, which the eager
    multiplication's backward reads and drops before the first graph's backward runs."""
    torch.manual_seed(0)
    first_layer, second_layer = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    first = torch.compile(lambda x: torch.tanh(first_layer(x)), backend="donate_xla")
    second = torch.compile(lambda h: torch.tanh(second_layer(h)).sum(), backend="donate_xla")
    x = torch.randn(1024, 256)
    model = torch.nn.ModuleList([first_layer, second_layer])

    def step():
        second(first(x) * 2).backward()

    for _ in range(2):
        step()
        model.zero_grad(set_to_none=True)
    backwards = sorted((r for r in donate_backend.reports() if r.kind == "backward"), key=lambda r: r.first_call)
    assert backwards[0].outputs_dropped >= x.numel() * 4  # the gradient of ``first(x) * 2``
    assert backwards[1].outputs_dropped == 0  # a forward ran after it, no backward
    # the plan lets it go before the first graph's backward: that one starts no higher than
    # the second's end plus its own fresh tangent (the multiplication's gradient)
    plan = donate_backend.memory_plan()
    second_backward, first_backward = plan.graphs[2], plan.graphs[3]
    assert first_backward.start_bytes <= second_backward.end_bytes, plan.as_text()


def test_size_hint_reads_a_symbolic_size_at_the_sizes_bound():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(7, ConstantSource("n")), hint=7)
    m = env.create_symintnode(env.create_symbol(3, ConstantSource("m")), hint=3)
    with graph_memory.sizes_bound({n.node.expr: 11}):
        assert graph_memory.size_hint(n * 4) == 44
        assert graph_memory.size_hint(n * m) == 21  # m not bound: the whole size at its hint
    assert graph_memory.size_hint(n * 4) == 28  # outside: the hint
    assert len(env.guards) == 0
