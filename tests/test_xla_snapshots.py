"""Snapshots of the stages: aot FX graphs, and the HLO with its donated parameters."""
import expecttest
import pytest
import torch

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON

if HAS_TORCH_XLA:
    from donate_backend.xla.lower import LoweringRequest, lower
    from xla_capture import compiled_graphs, normalize_fx, normalize_hlo


@pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)
class TestSnapshots(expecttest.TestCase):
    def test_aot_forward_and_backward_graphs(self):
        import torch_xla

        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2).to(torch_xla.device())
        step = torch.compile(lambda x: torch.relu(layer(x)).sum(), backend="donate_xla")
        step(torch.randn(4, 3).to(torch_xla.device())).backward()
        captured = compiled_graphs()
        forward, _ = captured["forward"]
        backward, _ = captured["backward"]
        self.assertExpectedInline(normalize_fx(forward.code), """\
def forward(self, primals_1, primals_2, primals_3):
    t = torch.ops.aten.t.default(primals_1);  primals_1 = None
    addmm = torch.ops.aten.addmm.default(primals_2, primals_3, t);  primals_2 = t = None
    relu = torch.ops.aten.relu.default(addmm);  addmm = None
    detach = torch.ops.aten.detach.default(relu)
    detach_1 = torch.ops.aten.detach.default(detach);  detach = None
    sum_1 = torch.ops.aten.sum.default(relu);  relu = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    detach_3 = torch.ops.aten.detach.default(detach_2);  detach_2 = None
    return (sum_1, primals_3, detach_3)""")
        self.assertExpectedInline(normalize_fx(backward.code), """\
def forward(self, primals_3, detach_3, tangents_1):
    expand = torch.ops.aten.expand.default(tangents_1, [4, 2]);  tangents_1 = None
    threshold_backward = torch.ops.aten.threshold_backward.default(expand, detach_3, 0);  expand = detach_3 = None
    t_1 = torch.ops.aten.t.default(threshold_backward)
    mm = torch.ops.aten.mm.default(t_1, primals_3);  t_1 = primals_3 = None
    t_2 = torch.ops.aten.t.default(mm);  mm = None
    sum_2 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True);  threshold_backward = None
    view = torch.ops.aten.view.default(sum_2, [2]);  sum_2 = None
    t_3 = torch.ops.aten.t.default(t_2);  t_2 = None
    return (t_3, view, None)""")

    def test_functional_graph_and_hlo_of_an_sgd_update(self):
        import torch_xla

        device = torch_xla.device()
        param, grad = torch.randn(4).to(device), torch.randn(4).to(device)

        @torch.compile(backend="donate_xla")
        def sgd(p, g):
            with torch.no_grad():
                p.add_(g, alpha=-0.5)

        sgd(param, grad)
        gm, inputs = compiled_graphs()["inference"]
        lowered = lower(LoweringRequest(gm, tuple(inputs), "snapshot", donors=(0,), keep_hlo_text=True))
        self.assertExpectedInline(normalize_fx(gm.code), """\
def forward(self, arg0_1, arg1_1):
    mul = torch.ops.aten.mul.Tensor(arg1_1, -0.5);  arg1_1 = None
    add = torch.ops.aten.add.Tensor(arg0_1, mul);  mul = None
    copy_ = torch.ops.aten.copy_.default(arg0_1, add);  arg0_1 = add = copy_ = None
    return ()""")
        self.assertExpectedInline(normalize_hlo(lowered.hlo_text), """\
HloModule IrToHlo, entry_computation_layout={(f32[4]{0}, f32[4]{0})->(f32[4]{0}, s64[])}
ENTRY %IrToHlo (p0: f32[4], p1: f32[4]) -> (f32[4], s64[]) {
  %p1 = f32[4]{0} parameter(1)
  %p0 = f32[4]{0} parameter(0)
  %constant = f32[] constant(-0.5)
  %broadcast = f32[4]{0} broadcast(f32[] %constant), dimensions={}
  %multiply = f32[4]{0} multiply(f32[4]{0} %p0, f32[4]{0} %broadcast)
  %constant = f32[] constant(1)
  %broadcast = f32[4]{0} broadcast(f32[] %constant), dimensions={}
  %multiply = f32[4]{0} multiply(f32[4]{0} %multiply, f32[4]{0} %broadcast)
  %add = f32[4]{0} add(f32[4]{0} %p1, f32[4]{0} %multiply)
  %constant = s64[] constant(<fingerprint>)
  ROOT %tuple = (f32[4]{0}, s64[]) tuple(f32[4]{0} %add, s64[] %constant)
}""")

    def test_each_stage_prints_itself_from_the_graph_record(self):
        """Traced (inputs, donors, FX code) and lowered (parameter and result tables)."""
        import re

        import torch_xla

        import donate_backend

        device = torch_xla.device()
        param, grad, staged = (torch.randn(4).to(device) for _ in range(3))

        @torch.compile(backend="donate_xla")
        def step(p, g, q):
            with torch.no_grad():
                p.add_(g, alpha=-0.5)
                q.copy_(g)  # plain device data: the result is a copy
            out = g * 2
            return out, out.detach(), p.sum()

        step(param, grad, staged)
        (record,) = donate_backend.reports()
        number = lambda text: re.sub(r"graph \d+", "graph N", text)  # noqa: E731
        self.assertExpectedInline(number(record.lowered.traced.as_text()), """\
graph N inference: traced on placeholders
inputs:
  #0   float32[4] xla donor
  #1   float32[4] xla
  #2   float32[4] xla donor
code:
  def forward(self, arg0_1, arg1_1, arg2_1):
      mul = torch.ops.aten.mul.Tensor(arg1_1, -0.5)
      add = torch.ops.aten.add.Tensor(arg0_1, mul);  mul = None
      copy = torch.ops.aten.copy.default(arg2_1, arg1_1)
      mul_1 = torch.ops.aten.mul.Tensor(arg1_1, 2);  arg1_1 = None
      detach = torch.ops.aten.detach.default(mul_1)
      detach_1 = torch.ops.aten.detach.default(detach);  detach = None
      detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
      sum_1 = torch.ops.aten.sum.default(add)
      copy_ = torch.ops.aten.copy_.default(arg0_1, add);  arg0_1 = add = copy_ = None
      copy__1 = torch.ops.aten.copy_.default(arg2_1, copy);  arg2_1 = copy = copy__1 = None
      return (mul_1, detach_2, sum_1)""")
        self.assertExpectedInline(number(record.lowered.as_text()), """\
graph N inference: lowered
parameters:
  p0   input #1     float32[4]
  p1   input #0     float32[4]  donated
results:
  r0   float32[4] -> writes input #0
  r1   float32[4] (copy) -> writes input #2
  r2   float32[4] -> output 0, output 1
  r3   float32[] -> output 2""")
