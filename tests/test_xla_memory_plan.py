"""The memory plan on the XLA path: what it counts, a limit met by recomputing, a limit
refused before anything runs. The prediction against measured live bytes is in
tests/test_xla_memory.py (a fresh process) and bench/xla_plan_accuracy.py."""
from __future__ import annotations

import copy
import math
import os
import pathlib
import re
import warnings

import pytest
import torch

from conftest import XLA_SKIP_REASON

pytest.importorskip("torch_xla", reason=XLA_SKIP_REASON)

import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

import donate_backend  # noqa: E402
from xla_models import squared_mean_step  # noqa: E402

MIB = 2**20


def _layers(width=256, depth=4):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_plan_of_an_xla_step_counts_state_once_and_only_the_last_step(xla_device, tmp_path):
    """SGD with momentum compiles a first-step graph (it makes the momentum buffers)
    that later steps never run: the plan of the steady step leaves it out. Parameters
    read by the forward, the backward and the optimizer count once; at the peak (the
    backward) every gradient is live."""
    model = _layers().to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x = torch.randn(512, 256).to(xla_device)
    step = torch.compile(squared_mean_step(model, opt), backend="donate_xla")
    for _ in range(3):
        step(x)
        torch_xla.sync()
        xm.wait_device_ops()
    records = donate_backend.reports()
    plan = donate_backend.memory_plan()
    print("\n" + plan.as_text())
    params = _nbytes(model.parameters())
    momentum = _nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    assert plan.path == "xla"
    assert plan.resident_bytes == params + momentum + _nbytes([x])
    assert plan.breakdown["parameters"] == params
    # the peak is in the backward: every gradient live (and the loss's 4-byte tangent)
    assert params <= plan.breakdown["gradients"] <= params + 64
    assert plan.breakdown["activations"] > 0
    inference = [r.name for r in records if r.kind == "inference"]
    assert len(inference) == 2  # the optimizer's first step, and the steady one
    planned = [g.name for g in plan.graphs]
    assert len([n for n in planned if n in inference]) == 1, planned
    assert any("XLA" in note for note in plan.notes)
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.image

    image = matplotlib.image.imread(plan.plot(str(tmp_path / "plan.png")))
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_a_matmul_fused_into_a_returned_value_is_not_held_to_the_end():
    """A forward's saved ``a = relu(x @ w1)``, which no matmul reads (``a * 2`` is fused
    into the next matmul's operand), is computed where it stands, so ``x @ w1`` dies
    there: the temporaries peak at the second matmul with its operand ``a * 2`` and its
    result, and ``x @ w1`` is not among them (it was, held to the graph's end)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from donate_backend.xla import memory

    def forward(x, w1, w2, w3):
        a = torch.relu(x @ w1)
        b = torch.relu((a * 2) @ w2)
        return (b @ w3).sum(), a, b  # a and b: saved for the backward

    args = [torch.randn(256, 256) for _ in range(4)]
    graph = make_fx(forward, tracing_mode="fake")(*args).graph
    predicted = memory.predict(graph, "forward", "forward", forward_returns=1)
    one = 256 * 256 * 4
    assert dict(predicted.peak_parts)["activations"] == 2 * one
    assert dict(predicted.peak_parts)["temporaries"] == 2 * one


def _run_with_xla_dump(tmp_path, source: str, argument: str) -> tuple:
    """Run ``source`` with ``argument`` in a fresh process whose XLA dumps every executable;
    its last line of output, and the dump's folder."""
    import subprocess
    import sys

    from conftest import xla_flags_with

    script = tmp_path / "script.py"
    script.write_text(source)
    dump = tmp_path / "dump"
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=xla_flags_with(f"--xla_dump_to={dump}"))
    out = subprocess.run([sys.executable, str(script), argument], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1], dump


_LAYOUT_SCRATCH = """
import sys, torch, torch_xla, donate_backend
device = torch_xla.device()
torch.manual_seed(0)
if sys.argv[1] in ("convolution", "depthwise"):
    if sys.argv[1] == "convolution":
        conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to(device)
    else:  # ConvNeXt's: one input channel per group, 7 x 7
        conv = torch.nn.Conv2d(256, 256, 7, padding=3, groups=256, bias=False).to(device)
    x = torch.randn(4, 256, 8, 8, device=device, requires_grad=True)
    step = torch.compile(lambda x: conv(x).square().sum(), backend="donate_xla")
elif sys.argv[1] == "forward":
    convs = torch.nn.Sequential(*[torch.nn.Conv2d(256, 256, 3, padding=1, bias=False) for _ in range(3)]).to(device)
    x = torch.randn(4, 256, 8, 8, device=device)
    with torch.no_grad():
        torch.compile(lambda x: convs(x).sum(), backend="donate_xla")(x)
    torch_xla.sync()
    graph = next(r for r in donate_backend.reports() if r.kind == "inference")
    print(dict(graph.memory.peak_parts).get("temporaries", 0))
    sys.exit(0)
else:
    x = torch.randn(4, 64, 32, 32, device=device, requires_grad=True)
    step = torch.compile(lambda x: torch.nn.functional.max_pool2d(x, 3, 2, 1).square().sum(), backend="donate_xla")
step(x).backward()
torch_xla.sync()
backward = next(r for r in donate_backend.reports() if r.kind == "backward")
print(dict(backward.memory.peak_parts).get("temporaries", 0))
"""


@pytest.mark.parametrize("op", ["forward", "convolution", "depthwise", "max_pool"])
def test_xla_cpu_layout_scratch_is_planned_as_its_buffer_assignment_holds_it(tmp_path, op):
    """XLA:CPU copies a convolution's kernel into a layout of its own (reversed for the
    input's gradient) and its activations into channels-last, and expands a max-pool's
    backward into int32 indices of the pooled input. The backward of one 256-channel
    3 x 3 convolution holds the kernel's 2.25 MiB of them in XLA's buffer assignment, a
    3 x 3 max-pool's backward of a 1 MiB input over 5 MiB while it runs; a forward makes
    every kernel's copy at its start and holds each until its convolution (three kernels
    at once). The plan counts them (``_layout_scratch``, ``_hoisted_kernel_copies``),
    within one activation of the assignment. Without them it was short by the kernels
    (ResNet-18: its forward held 43.1 MiB of temporaries, 9.0 planned)."""
    last_line, dump = _run_with_xla_dump(tmp_path, _LAYOUT_SCRATCH, op)
    planned = int(last_line)
    kernel = 256 * 256 * 9 * 4
    if op == "forward":
        # three convolutions without gradients: XLA:CPU copies all three kernels at the
        # start of the executable and holds each copy until its convolution
        result, scratch, activation = None, 3 * kernel, 4 * 256 * 8 * 8 * 4
    elif op == "convolution":
        # the backward returns a new kernel-sized buffer, the weight's gradient (the
        # forward returns the weight it saves as the caller's input); its scratch: the kernel
        result, scratch, activation = 256 * 256 * 9 * 4, 256 * 256 * 9 * 4, 4 * 256 * 8 * 8 * 4
    elif op == "depthwise":
        # the kernel's gradient (256 x 1 x 7 x 7) computed as a dense 256 x 256 x 7 x 7
        # convolution, then its diagonal selected: both at once (49 KiB of gradient)
        result, scratch, activation = 256 * 49 * 4, 2 * 256 * 256 * 49 * 4, 4 * 256 * 8 * 8 * 4
    else:
        # the backward returns the input's gradient; its scratch: four int32 indices of it
        result, activation = 4 * 64 * 32 * 32 * 4, 4 * 64 * 16 * 16 * 4
        scratch = 4 * result
    assignments = [p.read_text() for p in dump.glob("*buffer-assignment.txt")]
    x_shape = "f32[4,256,8,8]" if op in ("convolution", "depthwise") else "f32[4,64,32,32]"
    if op == "forward":
        executable = [t for t in assignments if t.count("shape |f32[256,256,3,3]|") == 3]
    else:
        executable = [t for t in assignments if re.search(rf"^allocation \d+: size {result}, maybe-live-out", t, re.M)
                    and f"shape |{x_shape}|" in t]  # reads x (the forward does too, but returns no such buffer)
    assert len(executable) == 1, [t.splitlines()[:3] for t in assignments]
    temporaries = sum(int(m) for m in re.findall(r"^allocation \d+: size (\d+), preallocated-temp", executable[0], re.M))
    print(f"\n{op}: XLA's temporaries {temporaries / MIB:.2f} MiB, planned {planned / MIB:.2f} MiB")
    assert temporaries >= scratch
    assert abs(planned - temporaries) <= activation + 64


_GELU_MLP = """
import sys, torch, torch_xla, donate_backend
device = torch_xla.device()
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(device)
# ConvNeXt's and Swin's layout (images x 16 x 16 positions), or a GPT's (8 x 128 tokens)
shape = (4, 16, 16, 64) if sys.argv[1] == "short" else (8, 128, 64)
x = torch.randn(*shape, device=device)
step = torch.compile(lambda x: mlp(x).square().sum(), backend="donate_xla")
step(x).backward()
torch_xla.sync()
backward = next(r for r in donate_backend.reports() if r.kind == "backward")
print(dict(backward.memory.peak_parts).get("temporaries", 0))
"""


@pytest.mark.parametrize("reduced", ["short", "long"])
def test_exact_gelus_gradient_parts_are_planned_where_xla_cpu_computes_them_apart(tmp_path, reduced):
    """A ``Linear``, exact GELU and ``Linear`` over 4 x 16 x 16 positions: the GELU's
    gradient is read by the second matmul's reshape and by the bias's sum, which reduces
    dimensions of 16 and fewer. XLA:CPU fuses the gradient into both readers and computes
    ``erf`` and ``exp`` of the saved input apart, at the start of the backward: two
    hidden-sized buffers (2 MiB here) beside the rest. Over 8 x 128 tokens XLA rewrites the
    sum over 128 into a reduce-window first, which reads the gradient computed once, and
    there are no such parts. The plan counts them only in the first case (ConvNeXt's
    backward was planned 4 MiB short of XLA's buffer assignment without them). In both,
    the gradient the matmul reads through a reshape is a buffer of its own (the second
    case was planned one hidden-sized buffer short before the plan followed views to
    their matmul)."""
    last_line, dump = _run_with_xla_dump(tmp_path, _GELU_MLP, reduced)
    planned = int(last_line)
    hidden = 4 * 16 * 16 * 512 * 4 if reduced == "short" else 8 * 128 * 512 * 4
    backward = [p for p in dump.glob("*cpu_after_optimizations.txt") if "exponential" in p.read_text()]
    assert len(backward) == 1, [p.name for p in dump.glob("*cpu_after_optimizations.txt")]
    text = backward[0].read_text()
    apart = re.findall(r"^\s*(?:ROOT )?%\S*(?:exponential|erf)\S*fusion\S* = f32\[", text, re.M)
    assignment = pathlib.Path(str(backward[0]).replace(".txt", "-buffer-assignment.txt")).read_text()
    temporaries = sum(int(m) for m in re.findall(r"^allocation \d+: size (\d+), preallocated-temp", assignment, re.M))
    print(f"\n{reduced}: XLA's temporaries {temporaries / MIB:.2f} MiB, planned {planned / MIB:.2f} MiB, "
          f"parts computed apart: {len(apart)}")
    if reduced == "short":
        assert len(apart) >= 2 and temporaries >= 2 * hidden
    else:
        assert not apart
    assert abs(planned - temporaries) <= hidden // 2


def test_a_value_fused_again_into_a_later_reader_keeps_what_it_reads_alive():
    """``z = x @ w + b`` is returned, and ``(z * 2).sum()`` reads it again at the end of the
    graph. XLA computes ``z`` for the output and fuses ``+ b`` and ``* 2`` into the sum too,
    reading the matmul's result there: the matmul lives until the sum, beside the second
    matmul computed in between (BART's logits plus their bias, returned and fused again into
    its loss: 32 MiB of temporaries in XLA's buffer assignment, 16 planned before)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from donate_backend.xla import memory

    def forward(x, w, b, w2):
        z = x @ w + b
        u = torch.relu(x @ w2)
        return z, (z * 2).sum() + u.sum()

    args = [torch.randn(256, 256), torch.randn(256, 256), torch.randn(256), torch.randn(256, 256)]
    graph = make_fx(forward, tracing_mode="fake")(*args).graph
    predicted = memory.predict(graph, "forward", "inference")
    one = 256 * 256 * 4
    # x @ w and x @ w2 (and a sum's scalar)
    assert 2 * one <= dict(predicted.peak_parts)["temporaries"] < 2 * one + 64


def test_a_returned_reshape_of_a_matmul_is_the_output_buffer_not_a_temporary():
    """``torch.matmul`` of a 3-d input is a ``view``, an ``mm`` and an ``_unsafe_view`` back to
    3-d. XLA's reshape is the same buffer, so the ``mm`` writes the returned output: it is no
    temporary beside it (GPT-2's forward returning its logits was planned 16 MiB of
    temporaries too many, 5 in XLA's buffer assignment, 3 planned now)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from donate_backend.xla import memory

    def forward(x, w):
        return torch.matmul(x, w)

    graph = make_fx(forward, tracing_mode="fake")(torch.randn(8, 128, 256), torch.randn(256, 4096)).graph
    assert "_unsafe_view" in {memory._op_name(n) for n in graph.nodes}
    predicted = memory.predict(graph, "forward", "inference")
    assert dict(predicted.peak_parts).get("temporaries", 0) == 0
    assert predicted.peak_bytes == 8 * 128 * 4096 * 4


_LOG_SOFTMAX = """
import sys, torch, torch_xla, donate_backend
import torch.nn.functional as F
device = torch_xla.device()
torch.manual_seed(0)
w = torch.randn(256, 4096, device=device, requires_grad=True)
x = torch.randn(1024, 256, device=device)
y = torch.randint(0, 4096, (1024,), device=device)
loss = torch.compile(lambda x, y: F.cross_entropy(x @ w, y), backend="donate_xla")
if sys.argv[1] == "inference":
    with torch.no_grad():
        loss(x, y)
else:
    loss(x, y).backward()
torch_xla.sync()
graph = next(r for r in donate_backend.reports() if r.kind == sys.argv[1])
print(graph.lowered.fingerprint, dict(graph.memory.peak_parts).get("temporaries", 0))
"""


@pytest.mark.parametrize("kind", ["forward", "inference"])
def test_a_log_softmax_is_planned_as_xla_cpu_assigns_it(tmp_path, kind):
    """A language model's loss on XLA:CPU: the logits and one more logits-sized buffer (the
    shifted logits) are temporaries. In training the log-softmax's result is returned (saved
    for the backward), so the forward holds both beside it; without gradients its result is
    fused into the loss and that buffer takes its place. The plan was one logits short in
    training (the benchmark GPT's forward: 64 MiB in XLA's assignment, 32 planned). The
    executable is found in XLA's dump by the fingerprint its graph carries."""
    last_line, dump = _run_with_xla_dump(tmp_path, _LOG_SOFTMAX, kind)
    fingerprint, planned = (int(v) for v in last_line.split())
    modules = [p for p in dump.glob("*after_optimizations.txt") if f"s64[] constant({fingerprint})" in p.read_text()]
    assert len(modules) == 1, [p.name for p in dump.glob("*after_optimizations.txt")]
    assignment = pathlib.Path(str(modules[0]).replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt"))
    temporaries = sum(int(m) for m in re.findall(r"^allocation \d+: size (\d+), preallocated-temp", assignment.read_text(), re.M))
    logits = 1024 * 4096 * 4
    print(f"\n{kind}: XLA's temporaries {temporaries / MIB:.2f} MiB, planned {planned / MIB:.2f} MiB")
    assert temporaries >= 2 * logits
    assert abs(planned - temporaries) <= logits // 8


def test_a_view_of_an_input_saved_for_the_backward_is_counted_as_the_copy_xla_returns(xla_device):
    """XLA's results never share a buffer with an input that is not donated, so a forward
    that saves ``x.view(...)`` of its input for the backward returns a copy of it (the
    lowering's result), while one that saves the input itself (or its ``detach``, the same
    torch_xla tensor) returns nothing new. The
    prediction counts the copy; it counted neither before (a language model's loss
    graph saves its hidden states reshaped: 1 MiB per graph, unplanned, on BART)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from donate_backend.xla import memory

    def forward(x, w):
        return (x @ w).sum(), x, x.detach(), x.view(-1), w.t()

    args = [torch.randn(64, 32), torch.randn(32, 16)]
    graph = make_fx(forward, tracing_mode="fake")(*args).graph
    predicted = memory.predict(graph, "forward", "forward", forward_returns=1)
    x_bytes, w_bytes = 64 * 32 * 4, 32 * 16 * 4
    assert dict(predicted.peak_parts)["activations"] == x_bytes + w_bytes  # the two views, not x nor its detach
    assert predicted.end_bytes == 4 + x_bytes + w_bytes

    # Compiled: the bytes the lowering returns as new buffers (its results that are
    # graph outputs, not write-backs) are what the prediction counts at the forward's end.
    model = torch.nn.Linear(32, 16, bias=False).to(xla_device)
    x = torch.randn(64, 32).to(xla_device)
    step = torch.compile(lambda x: (model(x.view(8, 8, 32)) ** 2).sum(), backend="donate_xla")
    step(x).backward()
    torch_xla.sync()
    forward_record = next(r for r in donate_backend.reports() if r.kind == "forward")
    lowered = forward_record.lowered
    returned = {slot.index for slot in lowered.outputs if slot.kind == "result"}
    result_bytes = sum(
        math.prod(spec.shape) * spec.dtype.itemsize for k, spec in enumerate(lowered.results) if k in returned
    )
    print("\n" + lowered.as_text().split("hlo:")[0])
    assert forward_record.memory.end_bytes == result_bytes


def _train(model, step, x, steps=5):
    losses = []
    for _ in range(steps):
        losses.append(step(x))
        torch_xla.sync()
    return [float(v) for v in losses]


def _limited_training(xla_device, width, depth, batch, limit_of):
    """Plan the default step, compile it again under ``limit_of(plan)``, train five SGD
    steps and check they equal eager's. Returns (default plan, limit, fitted plan)."""
    x_cpu = torch.randn(batch, width)
    eager = _layers(width=width, depth=depth)
    default = copy.deepcopy(eager).to(xla_device)
    x = x_cpu.to(xla_device)
    opt = torch.optim.SGD(default.parameters(), lr=1e-2)
    _train(default, torch.compile(squared_mean_step(default, opt), backend="donate_xla"), x, steps=2)
    plan = donate_backend.memory_plan()
    limit = limit_of(plan)
    torch._dynamo.reset()
    donate_backend.clear_reports()

    limited = copy.deepcopy(eager).to(xla_device)
    opt = torch.optim.SGD(limited.parameters(), lr=1e-2)
    step = torch.compile(squared_mean_step(limited, opt), backend="donate_xla", options={"memory_limit": limit})
    losses = _train(limited, step, x)
    fitted = donate_backend.memory_plan()
    print(f"\nlimit {limit / MIB:.1f} MiB; default plan {plan.peak_bytes / MIB:.1f} MiB\n{fitted.as_text()}")

    eager_opt = torch.optim.SGD(eager.parameters(), lr=1e-2)
    eager_losses = _train(eager, squared_mean_step(eager, eager_opt), x_cpu)
    assert losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-6)
    for got, expected in zip(limited.parameters(), eager.parameters()):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)
    return plan, limit, fitted


def test_a_memory_limit_on_the_xla_path_is_met_by_recomputing_with_eager_values(xla_device):
    """A limit at the resident bytes plus 0.75 of the default's growth: the partitioner
    saves less (a budget below 1.0), the plan fits under the limit, and five SGD steps
    equal eager's."""
    plan, limit, fitted = _limited_training(
        xla_device, 512, 6, 1024, lambda plan: plan.resident_bytes + int(0.75 * plan.growth_bytes)
    )
    assert plan.peak_bytes > limit >= fitted.peak_bytes
    assert any("chosen under memory_limit" in c for c in fitted.choices)
    (planned,) = [r for r in donate_backend.reports() if r.budget_choice]
    seconds = dict(planned.phases)["memory limit plan"]
    assert 0 < seconds <= planned.compile_seconds
    assert f"planned in {seconds:.3f}s" in donate_backend.format_record(planned)


def test_a_memory_limit_met_by_backward_segments_recomputes_nothing(xla_device):
    """Wide layers, few activations (too few for automatic segments): the step's peak is
    the end of the backward, saved activations and gradients together. A limit 1 MiB
    below the default's peak is met by splitting the backward, at activation budget 1."""
    plan, limit, fitted = _limited_training(xla_device, 1024, 4, 1024, lambda plan: plan.peak_bytes - MIB)
    assert not any("segments" in c for c in plan.choices)
    assert plan.peak_bytes > limit >= fitted.peak_bytes
    assert any("activation budget 1 chosen" in c for c in fitted.choices), fitted.choices
    assert any("chosen to fit memory_limit: backward in" in c for c in fitted.choices), fitted.choices


def test_a_limit_the_optimizer_state_breaks_is_planned_again_with_the_state_counted(xla_device):
    """The limit is planned while the forward and backward compile, before Adam's state
    exists. A limit they meet at the full activation budget, but the whole step with its
    12 MiB of state does not, is planned again after the second step with the state
    counted: the graph is compiled again (recomputing some activations), the whole step's
    plan fits, no warning is given, and five steps equal eager's. A limit above the
    whole step is never planned again."""
    eager = _layers(width=512, depth=6)
    x_cpu = torch.randn(2048, 512)
    x = x_cpu.to(xla_device)
    params = _nbytes(eager.parameters())

    def train(limit):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        model = copy.deepcopy(eager).to(xla_device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        options = {} if limit is None else {"memory_limit": limit}
        step = torch.compile(squared_mean_step(model, opt), backend="donate_xla", options=options)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            losses = _train(model, step, x)
        assert [str(w.message) for w in seen if "memory_limit" in str(w.message)] == []
        return model, losses, donate_backend.memory_plan()

    _, _, default = train(None)
    assert default.breakdown["optimizer state"] == pytest.approx(2 * params, abs=1024)  # and the step counts
    limit = default.peak_bytes - params
    model, losses, fitted = train(limit)
    print(f"\nlimit {limit / MIB:.1f} MiB; default plan {default.peak_bytes / MIB:.1f} MiB\n{fitted.as_text()}")
    assert fitted.peak_bytes <= limit < default.peak_bytes
    (choice,) = [c for c in fitted.choices if "chosen under memory_limit" in c]
    assert "planned again after 2 steps" in choice and "optimizer state 12.0 MiB" in choice
    assert len([r for r in donate_backend.reports() if r.kind == "forward"]) == 1  # the first build's is gone

    eager_opt = torch.optim.Adam(eager.parameters(), lr=1e-3)
    eager_losses = _train(eager, squared_mean_step(eager, eager_opt), x_cpu)
    assert losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-6)
    for got, expected in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-5)

    _, _, above = train(default.peak_bytes + MIB)
    assert not any("planned again" in c for c in above.choices)


def test_an_impossible_memory_limit_on_the_xla_path_is_refused_before_anything_runs(xla_device):
    model = _layers().to(xla_device)
    before = [p.detach().cpu().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    step = torch.compile(squared_mean_step(model, opt), backend="donate_xla", options={"memory_limit": "1MiB"})
    with pytest.raises(Exception, match=r"graph \d+'s training step needs at least [\d.]+ MiB") as info:
        step(torch.randn(512, 256).to(xla_device))
    text = str(info.value)  # dynamo wraps the backend's error; the text is ours
    assert "MemoryLimitError" in text and "memory_limit is 1.0 MiB (1048576 bytes)" in text and "Nothing has run" in text
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p.cpu(), b) for p, b in zip(model.parameters(), before))


def test_a_plan_over_graphs_of_both_paths_is_refused_with_what_to_pass(xla_device):
    on_cpu = torch.nn.Linear(8, 8)
    torch.compile(on_cpu, backend="donate_xla")(torch.randn(4, 8)).sum().backward()
    on_xla = torch.nn.Linear(8, 8).to(xla_device)
    torch.compile(on_xla, backend="donate_xla")(torch.randn(4, 8).to(xla_device)).sum().backward()
    torch_xla.sync()
    with pytest.raises(donate_backend.DonateXlaError, match="found graphs of several paths") as info:
        donate_backend.memory_plan()
    assert "records=[r for r in donate_backend.reports() if r.path == 'xla']" in str(info.value)
    xla_only = [r for r in donate_backend.reports() if r.path == "xla"]
    assert donate_backend.memory_plan(records=xla_only).path == "xla"


def test_a_backward_in_segments_is_planned_through_its_segments(xla_device):
    """The split backward's own record has no prediction (its segments have one each):
    the plan counts the segments and notes nothing missing."""
    from donate_backend import config

    model = _layers(depth=4).to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(512, 256).to(xla_device)
    with config.patch(backward_segments=2):
        step = torch.compile(squared_mean_step(model, opt), backend="donate_xla")
        for _ in range(2):
            step(x)
            torch_xla.sync()
    split = [r for r in donate_backend.reports() if r.backward_segments]
    assert split and split[0].memory is None
    plan = donate_backend.memory_plan()
    assert len([g for g in plan.graphs if "backward" in g.name]) == split[0].backward_segments
    assert not [note for note in plan.notes if "no prediction" in note], plan.notes


def test_an_output_read_by_a_later_graph_is_not_counted_as_held_between_steps(xla_device):
    """A graph break between the model and its loss: the second graph reads the first
    one's output, a value of the step. The resident bytes are the parameters, the
    optimizer state and the batch."""
    model = _layers(depth=2).to(xla_device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(512, 256).to(xla_device)

    def step(x):
        out = model(x)
        torch._dynamo.graph_break()
        loss = out.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = torch.compile(step, backend="donate_xla")
    for _ in range(2):
        step(x)
        torch_xla.sync()
    forwards = [r for r in donate_backend.reports() if r.kind == "forward"]
    assert len(forwards) == 2
    plan = donate_backend.memory_plan()
    # AdamW's state, which its first step's graph returned, is held between steps all the same
    state = _nbytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    expected = _nbytes(model.parameters()) + state + _nbytes([x])
    assert expected <= plan.resident_bytes <= expected + 64  # and AdamW's 4-byte step counters
    assert plan.breakdown["inputs"] == _nbytes([x])
    assert any("graph breaks" in note for note in plan.notes), plan.notes


def test_what_lazy_code_between_graphs_saves_for_the_backward_is_counted_once(xla_device):
    """A function dynamo skips runs in torch_xla's lazy mode between two compiled graphs:
    its tanh saves its 512 KiB result for the backward, and it passes the second graph a
    product of its own (512 KiB more). Both are activations held until the second
    graph's backward; the first graph's output, which the tanh reads, is that graph's
    (not counted again), and so are the weights. The values are eager's."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    reference = copy.deepcopy(torch.nn.ModuleList([first, second]))
    model = torch.nn.ModuleList([first, second]).to(xla_device)

    @torch._dynamo.disable
    def eager(h):
        return torch.tanh(h) * 2

    def f(layers, x):
        return torch.tanh(layers[1](eager(torch.relu(layers[0](x))))).sum()

    run = torch.compile(f, backend="donate_xla")
    x = torch.randn(512, 256)
    for _ in range(2):
        run(model, x.to(xla_device)).backward()
        f(reference, x).backward()
        torch_xla.sync()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        # XLA:CPU's tanh is not ATen's: plain lazy mode's gradients differ from the CPU's
        # by up to 2.4e-4 here, ours by 6e-5
        torch.testing.assert_close(ours.grad.cpu(), theirs.grad, rtol=1e-4, atol=5e-4)
    plan = donate_backend.memory_plan()
    (note,) = [n for n in plan.notes if "lazy mode" in n]
    assert f"({2 * 512 * 256 * 4 / 1024:.1f} KiB" in note, note
    # held from the second forward to its backward: the activations at the peak include them
    assert plan.breakdown["activations"] >= 2 * 512 * 256 * 4, plan.as_text()


def test_a_failing_walk_of_eager_autograd_never_stops_the_step(xla_device, monkeypatch):
    """Finding what lazy code saved runs inside the step's calls: where it fails, the step
    runs on and the plan counts none of it."""
    from donate_backend.xla import memory as xla_memory

    def broken(args):
        raise RuntimeError("an autograd node this walk cannot read")

    monkeypatch.setattr(xla_memory, "eager_saved", broken)
    lin = torch.nn.Linear(64, 64).to(xla_device)

    @torch._dynamo.disable
    def eager(h):
        return torch.tanh(h)

    run = torch.compile(lambda x: lin(eager(lin(x))).sum(), backend="donate_xla")
    for _ in range(2):
        run(torch.randn(8, 64, device=xla_device)).backward()
        torch_xla.sync()
    assert lin.weight.grad is not None
    (note,) = [n for n in donate_backend.memory_plan().notes if "lazy mode" in n]
    assert "(0.0 KiB" in note, note


def test_what_a_function_dynamo_stopped_compiling_saves_is_counted_from_then_on(xla_device):
    """torch_xla turns dynamic shapes off, so a function called with a new size each time
    reaches dynamo's recompile limit and runs in lazy mode from then on (a mixture of
    experts' expert). Its tanh then saves its result (128 x 256 floats) for the backward,
    and it passes the next graph a sum of its own (256 floats): the next graph's call
    after the limit finds them, and the plan holds them from before that graph's forward
    (at its first call, squash was a compiled graph of its own, and nothing lay between
    the two). The gradients are eager's."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(256, 256)
    head = copy.deepcopy(reference).to(xla_device)

    def squash(h):
        return (torch.tanh(h) * 2).sum(0)

    run_squash = torch.compile(squash, backend="donate_xla")
    run_head = torch.compile(lambda v: head(v).square().sum(), backend="donate_xla")
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        for rows in (64, 128, 128):
            x = torch.randn(rows, 256, device=xla_device, requires_grad=True)
            run_head(run_squash(x)).backward()
            torch_xla.sync()
            expected = x.detach().cpu().requires_grad_()
            reference(squash(expected)).square().sum().backward()
            torch.testing.assert_close(x.grad.cpu(), expected.grad, rtol=1e-4, atol=1e-3)
    plan = donate_backend.memory_plan()
    print("\n" + plan.as_text())
    assert any("recompile_limit (1)" in n and "'squash'" in n for n in plan.notes), plan.notes
    (graph,) = [g for g in plan.graphs if g.name.endswith("forward")]
    # held from before the forward: the tanh's result of the size squash last ran at, and
    # the sum it passed
    assert graph.start_bytes - plan.resident_bytes == (128 * 256 + 256) * 4, plan.as_text()


def test_an_xla_tensor_has_no_storage_address_and_asking_never_raises(xla_device):
    """XLA storages have no data pointer (torch raises on asking): a graph that returns
    an XLA tensor to the native path's bookkeeping gets None, not an error."""
    from donate_backend.analysis.aliasing import storage_address

    value = torch.randn(6, device=xla_device)
    with pytest.raises(RuntimeError):
        value.untyped_storage().data_ptr()
    assert storage_address(value) is None
    assert storage_address(value * 2) is None


@pytest.mark.parametrize("keep", [False, True])
def test_a_forward_output_the_caller_dropped_is_not_held_through_the_backward(xla_device, keep):
    """A graph break between the model and a loss whose backward does not read the
    model's output (``out.mean()``): a caller that drops ``out`` once the loss is taken
    (as an HF model's output object drops its logits) frees it before the backward, and
    the plan lets it go there; one that keeps it in a local holds it through the
    backward."""
    model = _layers(depth=2).to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(2048, 256).to(xla_device)

    def loss_of(out):
        torch._dynamo.graph_break()
        return out.mean()

    def update(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    def keeping(x):  # returns the output: alive through the backward
        out = model(x)
        loss = loss_of(out)
        update(loss)
        return loss.detach(), out.detach()

    def dropping(x):  # the output lives on the stack until loss_of returns
        loss = loss_of(model(x))
        update(loss)
        return loss.detach()

    step = keeping if keep else dropping

    step = torch.compile(step, backend="donate_xla")
    for _ in range(2):
        step(x)
        torch_xla.sync()
    plan = donate_backend.memory_plan()
    print(plan.as_text())
    model_graph = min(r.graph_id for r in donate_backend.reports() if r.kind == "forward")
    graph = {g.name: g for g in plan.graphs}
    held = _nbytes([torch.empty(2048, 256)])  # out
    assert graph[f"graph {model_graph} forward"].end_bytes - graph[f"graph {model_graph} forward"].start_bytes >= held
    for record in [r for r in donate_backend.reports() if r.kind == "backward"]:
        assert record.outputs_held[model_graph] == (held if keep else 0)
    # the loss's backward runs first: what the caller dropped is let go before it
    loss_forward, loss_backward = graph[f"graph {model_graph + 1} forward"], graph[f"graph {model_graph + 1} backward"]
    assert loss_backward.start_bytes == loss_forward.end_bytes - (0 if keep else held) + 4  # + the loss's tangent


def test_a_limit_the_optimizer_step_alone_breaks_is_met_stitched_or_refused_before_the_third_step(xla_device):
    """SGD momentum on a small batch: the step's peak holds every gradient with the
    parameters and momentum buffers (the backward's end and the optimizer's graph, whose
    update in place needs no temporaries), which no recomputation lowers. A
    limit just under it is met by the forward and backward when they compile; at the
    third call, with the momentum counted, the step is stitched, which holds one
    gradient at a time and fits, with eager's values. A limit under the stitched plan
    too is refused before that step runs, with the bytes needed and the stitched plan."""
    from donate_backend.budget import MemoryLimitError

    eager = _layers(width=512, depth=4)
    x = torch.randn(8, 512).to(xla_device)

    def train(options, steps, fresh=True):
        if fresh:
            torch._dynamo.reset()
            donate_backend.clear_reports()
        torch.manual_seed(0)
        model = copy.deepcopy(eager).to(xla_device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        step = torch.compile(squared_mean_step(model, opt), backend="donate_xla", options=options)
        return _train(model, step, x, steps=steps), model

    expected, expected_model = train({"stitch": False}, 4)
    whole = donate_backend.memory_plan()
    params = _nbytes(eager.parameters())
    assert whole.breakdown["gradients"] >= params  # every gradient live at the peak
    assert whole.graphs[-1].peak_bytes >= whole.peak_bytes - 256 * 1024  # the optimizer's graph: as high
    limit = whole.peak_bytes - MIB
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses, model = train({"memory_limit": limit}, 4)
    assert not [str(w.message) for w in seen if "memory_limit" in str(w.message)]
    assert losses == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), expected_model.parameters()):
        assert torch.allclose(p.cpu(), q.cpu(), atol=1e-6)
    stitched = donate_backend.memory_plan()
    print("\n" + stitched.as_text())
    (chosen,) = [c for c in stitched.choices if "chosen to fit memory_limit" in c]
    assert "stitched step" in chosen and "recomputes nothing" in chosen
    assert stitched.peak_bytes <= limit
    assert stitched.breakdown["gradients"] <= whole.breakdown["gradients"] / 4  # one layer's of four

    with pytest.raises(MemoryLimitError) as refused:
        train({"memory_limit": stitched.peak_bytes - MIB}, 3)
    text = str(refused.value)
    assert re.search(r"the step needs at least [\d.]+ MiB \(\d+ bytes\): graph \d+ inference \(outside this "
                     r"graph's forward and backward\) peaks at", text), text
    assert "this one has not run" in text and "options={'stitch': True}" in text
    assert refused.value.least_bytes == whole.graphs[-1].peak_bytes  # the optimizer's graph's
    estimate = int(re.search(r"this step stitched is planned at [\d.]+ MiB \((\d+) bytes\)", text).group(1))
    assert abs(estimate - stitched.peak_bytes) <= MIB

    # a step already stitched and still over its limit is not planned again: it warns
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        forced, _ = train({"memory_limit": stitched.peak_bytes - MIB, "stitch": True}, 4)
    (warned,) = [str(w.message) for w in seen if "memory_limit" in str(w.message)]
    assert "the step is stitched" in warned and "not planned again" in warned
    assert forced == pytest.approx(expected, rel=1e-5)

    # another model stitched earlier in the process is not this step: it is still stitched to fit
    torch._dynamo.reset()
    donate_backend.clear_reports()
    small = _layers(width=32, depth=2).to(xla_device)
    small_opt = torch.optim.SGD(small.parameters(), lr=1e-3, momentum=0.9)
    small_step = torch.compile(squared_mean_step(small, small_opt), backend="donate_xla", options={"stitch": True})
    _train(small, small_step, torch.randn(8, 32).to(xla_device), steps=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        losses, _ = train({"memory_limit": limit}, 4, fresh=False)
    assert not [str(w.message) for w in seen if "memory_limit" in str(w.message)]
    assert losses == pytest.approx(expected, rel=1e-5)
    assert [c for c in donate_backend.memory_plan().choices if "chosen to fit memory_limit" in c]


@pytest.mark.parametrize("segments", [8])
def test_a_backward_in_segments_ends_where_the_whole_backward_ends(xla_device, segments):
    """Split into segments, a backward still leaves the gradients and nothing of what it
    read: a saved activation two segments read, or a weight's view one segment passes to
    the next, is let go once (after its last reader), or not at all (a view of a
    parameter). Each was let go by every segment that read it, and the step's level
    after the backward fell below the resident bytes plus the gradients."""
    eager = _layers(width=512, depth=6)
    x = torch.randn(512, 512).to(xla_device)

    def backward_end(options):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        model = copy.deepcopy(eager).to(xla_device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        _train(model, torch.compile(squared_mean_step(model, opt), backend="donate_xla", options=options), x, steps=2)
        plan = donate_backend.memory_plan()
        backwards = [g for g in plan.graphs if "backward" in g.name]
        return plan, len(backwards), backwards[-1].end_bytes

    whole, count, end = backward_end({"backward_segments": 0})
    assert count == 1
    assert 0 <= end - whole.resident_bytes - _nbytes(eager.parameters()) <= 64  # the gradients (and the loss)
    split, count, split_end = backward_end({"backward_segments": segments})
    assert count > 1
    assert split_end == end


def test_the_plan_keeps_no_output_alive(xla_device):
    """The plan watches whether a caller still holds a forward's outputs, and the
    backward's gradients at each sync, without holding them: once the caller drops the
    first call's output its XLA tensor is destroyed (a ``StorageWeakRef`` on an XLA
    tensor kept its data alive for the whole process, 64 MiB per reference)."""
    import gc

    import torch_xla.debug.metrics as met

    model = _layers(width=256, depth=2).to(xla_device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="donate_xla")
    x = torch.randn(64, 256).to(xla_device)
    for _ in range(2):
        out = compiled(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        xm.wait_device_ops()
        gc.collect()
        gc.disable()  # nothing but ``out`` is freed in between
        try:
            before = met.counter_value("DestroyXlaTensor")
            del out
            assert met.counter_value("DestroyXlaTensor") == before + 1
        finally:
            gc.enable()
    assert [r for r in donate_backend.reports() if r.kind == "forward" and r.output_storages]
