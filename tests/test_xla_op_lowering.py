"""Single ops torch_xla lowers differently from the CPU: the workarounds of xla/ops.py
and xla/rewrite.py, each against eager, and the lowerings donate_xla refuses.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import _batch, _mlp, run_against_eager

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla


def test_tensor_literal_saved_for_backward():
    """torch_xla's own DynamoTrainingBasicTest.test_simple_model shape."""

    def program(device, compile_):
        def f(x):
            return x.gather(1, torch.tensor([[1], [2], [3]]).to(x.device)).sum()

        cf = compile_(f)

        def step(i):
            x = torch.arange(12.0).reshape(3, 4).add(i).to(device).requires_grad_()
            loss = cf(x)
            loss.backward()
            return loss, x.grad

        return step, lambda: []

    run_against_eager(program, steps=3)


def test_cross_entropy_with_an_inline_target():
    def program(device, compile_):
        model = _mlp(6, out=5).to(device)

        def f(x):
            logits = model(x)
            return F.cross_entropy(logits, torch.tensor([0, 1, 2, 3, 4, 0]).to(x.device))

        cf = compile_(f)

        def step(i):
            loss = cf(_batch(i, device=device)[0])
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return loss, grads

        return step, lambda: list(model.parameters())

    run_against_eager(program, steps=3)


def test_reductions_over_every_dimension_by_an_empty_dim_list():
    """``x.amax()`` is ``amax(x, [])``, and an empty dim list means every dimension.
    torch_xla 2.9 reduced over none (eager torch_xla and openxla return x unchanged);
    donate_xla gives torch's answer. A max-abs loss scale, a normalised logit and
    variance statistics, trained for a few steps against the CPU."""
    aten = torch.ops.aten

    def program(device, compile_):
        model = _mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def f(x, y):
            out = model(x)
            scaled = out / out.detach().abs().amax()
            loss = F.mse_loss(scaled, y) + 0.1 * out.amin(keepdim=True).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = (aten.var.correction(out.detach(), []), aten.sum.dim_IntList(out.detach(), []),
                     aten.mean.dim(out.detach(), [], True), torch.amax(out.detach(), dim=()))
            return loss.detach(), stats

        cf = compile_(f)
        return (lambda i: cf(*_batch(i, device=device))), (lambda: list(model.parameters()))

    run_against_eager(program)


def test_a_lowering_that_changes_an_outputs_shape_is_refused(monkeypatch):
    """Should another torch_xla lowering compute the wrong shape, the graph is refused
    with a message naming the output, not run: here the empty-dim fix is undone."""
    from donate_backend.xla import ops

    monkeypatch.setattr(ops, "with_every_dim", lambda target, args, kwargs: (args, kwargs))
    f = torch.compile(lambda x: x.amax() * 2, backend="donate_xla")
    with pytest.raises(Exception, match=r"computed output 'mul' with shape \[3, 4\], but torch says \[\]"):
        f(torch.randn(3, 4).to(torch_xla.device()))


def test_traced_values_take_the_dtype_torch_declares():
    """The two helpers behind it: a traced result in another dtype than the node's
    fake value is cast to it (tuples element by element, the rest untouched), and a
    BatchNorm backward with mixed floating dtypes runs in float32."""
    from donate_backend.xla.ops import batch_norm_backward_args, conform_dtypes

    graph = torch.fx.Graph()
    single, pair = graph.placeholder("a"), graph.placeholder("b")
    single.meta["val"] = torch.empty(2, dtype=torch.float32)
    pair.meta["val"] = (torch.empty(2, dtype=torch.bfloat16), torch.empty(3, dtype=torch.float32))
    assert conform_dtypes(single, torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    same = torch.ones(2)
    assert conform_dtypes(single, same) is same
    out = conform_dtypes(pair, (torch.ones(2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)))
    assert [t.dtype for t in out] == [torch.bfloat16, torch.float32]
    untouched = (torch.ones(2, dtype=torch.bfloat16), torch.ones(3))
    assert conform_dtypes(pair, untouched) is untouched

    bnb = torch.ops.aten.native_batch_norm_backward.default
    half, full = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3)
    args = (half, half, None, None, None, full, full, True, 1e-5, [True, False, False])
    assert [a.dtype for a in batch_norm_backward_args(bnb, args)[:2]] == [torch.float32] * 2
    assert batch_norm_backward_args(bnb, args)[5] is full
    same_dtype = (full, full, None, None, None, full, full, True, 1e-5, [True, True, True])
    assert batch_norm_backward_args(bnb, same_dtype) is same_dtype
    assert batch_norm_backward_args(torch.ops.aten.add.Tensor, args) is args


@pytest.mark.parametrize("dims", [2, 3])
def test_global_average_pool_of_a_channels_last_input_trains_like_eager(dims):
    """``adaptive_avg_pool2d(x, 1)`` of a channels-last-strided input (ConvNeXt and Swin
    pool a permuted tensor) failed to compile, openxla too: aot_autograd re-ran ATen's
    ``as_strided_`` restride on the fake XLA tensor ("Expected XLA tensor").
    ``xla/rewrite.py`` replaces it by the mean ATen computes; other output sizes and
    keyword arguments go through as written."""
    pool = F.adaptive_avg_pool2d if dims == 2 else F.adaptive_avg_pool3d
    to_last = (0, 2, 3, 1) if dims == 2 else (0, 2, 3, 4, 1)
    back = (0, 3, 1, 2) if dims == 2 else (0, 4, 1, 2, 3)

    def program(device, compile_fn):
        torch.manual_seed(0)
        w = torch.randn(5, 3).to(device).requires_grad_(True)

        def f(x):
            h = (x.permute(*to_last) @ w).permute(*back)  # channels-last strides
            return pool(h, 1).sum() + pool(h, output_size=(1,) * dims).mean() + pool(h, 2).sum()

        step = compile_fn(f)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(2, 5, *(4,) * dims, generator=g) for _ in range(2)]

        def run(i):
            loss = step(xs[i].to(device))
            loss.backward()
            return loss.detach()

        return run, (lambda: [w, w.grad])

    run_against_eager(program, steps=2)


def test_rewrite_replaces_only_global_average_pools():
    from donate_backend.xla.rewrite import global_avg_pool2d, rewrite_for_xla

    gm = torch.fx.symbolic_trace(
        lambda x: F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, output_size=(2, 2)).sum() + F.relu(x)
    )
    assert rewrite_for_xla(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(global_avg_pool2d) == 2 and F.relu in targets
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    torch.testing.assert_close(
        gm(x), F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, (2, 2)).sum() + F.relu(x)
    )
