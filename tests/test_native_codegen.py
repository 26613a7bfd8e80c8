"""Liveness and the generated boxed code: list cleared, values deleted at last use."""
from __future__ import annotations

import re

import expecttest
import pytest
import torch

import donate_backend
from donate_backend.analysis import liveness
from donate_backend.native import codegen
from donate_backend.native.compiled import CompiledGraph
from instances import instances_of


def observe(value):
    """A Python call the DDP rewrite might insert: a use with a side effect."""
    return None


def test_last_uses_and_dying_values():
    gm = torch.fx.symbolic_trace(lambda a, b, unused: (a + b) * a)
    nodes = {n.name: n for n in gm.graph.nodes}
    last = liveness.last_uses(gm.graph)
    assert last[nodes["a"]] is nodes["mul"]
    assert last[nodes["b"]] is nodes["add"]
    dying = liveness.values_dying_at(gm.graph)
    assert [v.name for v in dying[nodes["add"]]] == ["b"]
    assert [v.name for v in dying[nodes["mul"]]] == ["a", "add"]
    assert nodes["mul"] not in sum(dying.values(), [])  # returned: never deleted
    assert [n.name for n in liveness.unused_inputs(gm.graph)] == ["unused"]


def test_opaque_calls_count_as_uses_and_stay_in_place():
    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    add = next(n for n in gm.graph.nodes if n.name == "add")
    a = next(n for n in gm.graph.nodes if n.name == "a")
    with gm.graph.inserting_after(add):
        gm.graph.call_function(observe, (a,))
    last = liveness.last_uses(gm.graph)
    assert last[a].target is observe
    source, _ = codegen.boxed_source(gm.graph, "g")
    lines = source.splitlines()
    assert lines.index("    add = _fn_add(a, b)") < lines.index("    observe = _fn_observe(a)")
    # The call's own None result goes right away, together with ``a``.
    assert "    del a, observe" in lines


def test_generated_function_clears_the_list_and_runs():
    gm = torch.fx.symbolic_trace(lambda a, b, unused: (a + b) * a)
    fn, _ = codegen.compile_boxed(gm.graph, "g")
    args = [torch.ones(2), torch.ones(2), torch.ones(2)]
    out = fn(args)
    assert args == []
    assert torch.equal(out, torch.full((2,), 2.0))


def _normalise(source: str) -> str:
    """Stable names: graph ids and aot_autograd's numbering suffixes vary between runs."""
    source = re.sub(r"_graph_\d+", "_graph_N", source)
    return source


@pytest.fixture
def tiny_backward_source():
    torch._dynamo.reset()
    donate_backend.clear_reports()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    try:
        with instances_of(CompiledGraph) as compiled_graphs:
            torch.compile(model, backend="donate_xla")(torch.randn(2, 4)).sum().backward()
    finally:
        torch._dynamo.reset()
    (backward,) = [g for g in compiled_graphs if g.ctx.kind == "backward"]
    return _normalise(backward.source)


def test_snapshot_of_tiny_backward(tiny_backward_source):
    # Saved: the pre-activation ``addmm`` (donated) and the input ``primals_3``;
    # ``gelu_backward`` writes into ``addmm``, which dies there.
    expecttest.assert_expected_inline(
        tiny_backward_source,
        """\
def backward_graph_N_reusing(args):
    primals_3 = args[0]
    addmm = args[1]
    tangents_1 = args[2]
    args.clear()
    gelu_backward = aten.gelu_backward.grad_input(tangents_1, addmm, grad_input=addmm)
    del addmm, tangents_1
    t_1 = aten.t.default(gelu_backward)
    mm = aten.mm.default(t_1, primals_3)
    del primals_3, t_1
    t_2 = aten.t.default(mm)
    del mm
    sum_1 = aten.sum.dim_IntList(gelu_backward, [0], True)
    del gelu_backward
    view = aten.view.default(sum_1, [4])
    del sum_1
    t_3 = aten.t.default(t_2)
    del t_2
    return (t_3, view, None)
""",
    )
