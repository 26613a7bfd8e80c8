"""Dropout on the XLA path: the mask saved for the backward, its scale, and its
recomputation under an activation budget.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import assert_close_tree

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla


def test_dropout_mask_saved_for_backward_is_a_bool_buffer():
    """Dropout in training with a gradient saves its mask for the backward.
    torch_xla's ``native_dropout`` mask says bool but is float32 underneath, so
    the forward's executable returned a float32 buffer where a bool one was
    planned and every call failed ("result 2 came back as float32[...], planned
    bool[...]"). Traced values that say bool are now XLA ``pred`` values (and
    dropout itself runs torch's decomposition, whose mask is a comparison; see
    below). The RNG differs from the CPU's, so the check is what dropout means:
    the input's gradient is the scale times the kept positions, and each call
    draws anew."""
    drop = torch.nn.Dropout(0.5)
    f = torch.compile(lambda x: drop(x * 3), backend="donate_xla")
    kept = []
    for i in range(3):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(i)).to(torch_xla.device()).requires_grad_(True)
        out = f(x)
        out.sum().backward()
        out, grad = out.detach().cpu(), x.grad.cpu()
        torch.testing.assert_close(grad, 6.0 * (out != 0), rtol=0, atol=0)
        assert 0.4 < (out != 0).float().mean().item() < 0.6
        kept.append(out != 0)
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])


@pytest.mark.parametrize("p", [0.1, 0.3, 0.9])
def test_dropout_scales_kept_values_by_one_over_one_minus_p(p):
    """torch_xla 2.9's ``native_dropout`` lowering keeps a value with probability
    ``1 - p`` and divides it by ``p``: with ``p=0.1`` every kept value came out
    times 10 instead of 1.11 (openxla too; eager torch_xla takes another route).
    donate_xla now runs torch's decomposition of it."""
    f = torch.compile(lambda x: F.dropout(x, p, True), backend="donate_xla")
    out = f(torch.ones(20_000).to(torch_xla.device())).cpu()
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    assert abs(kept.numel() / out.numel() - (1 - p)) < 0.02


def test_dropout_without_torchs_decomposition_is_refused(monkeypatch):
    """Without torch's decomposition of ``native_dropout`` (a private table)
    torch_xla's lowering, which scales kept values by 1/p, is not used: the graph
    is refused with a message that says what to do."""
    from donate_backend.xla import compat

    monkeypatch.setattr(compat, "decomposition", lambda op: None)
    f = torch.compile(lambda x: F.dropout(x, 0.1, True), backend="donate_xla")
    with pytest.raises(Exception, match="dropout needs torch's decomposition of native_dropout"):
        f(torch.ones(64).to(torch_xla.device()))


@pytest.mark.parametrize("budget,stitch", [(1.0, False), (0.5, False), (0.1, False), (1.0, True)])
def test_dropout_gradients_use_the_forwards_masks(budget, stitch):
    """Two dropouts (p 0.5 and 0.3) in a small network; each compiled call
    returns the dropped activations, whose zeros are its masks, and the CPU
    recomputes loss and gradients with those masks. Under an activation budget
    aot_autograd's partitioner recomputed a dropout in the backward, which on
    XLA draws another mask: wrong gradients at budgets 0.5 and 0.1. Random ops
    are now always saved (``xla.keep_random_values_saved``)."""
    from donate_backend import config

    torch.manual_seed(0)
    ref = torch.nn.ModuleDict(dict(a=torch.nn.Linear(16, 64), b=torch.nn.Linear(64, 64), c=torch.nn.Linear(64, 4)))
    model = copy.deepcopy(ref).to(torch_xla.device())

    def f(m, x):
        y = F.dropout(torch.tanh(m["a"](x)), 0.5, True)
        z = F.dropout(F.gelu(m["b"](y)), 0.3, True)
        return m["c"](z).square().mean() + y.square().mean(), y, z

    with config.patch(activation_budget=budget, stitch=stitch):
        compiled = torch.compile(lambda x: f(model, x), backend="donate_xla")
        for i in range(3):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i))
            loss, y, z = compiled(x.to(torch_xla.device()))
            loss.backward()
            y_mask, z_mask = y.detach().cpu() != 0, z.detach().cpu() != 0
            y_ref = torch.tanh(ref["a"](x)) * y_mask * 2
            z_ref = F.gelu(ref["b"](y_ref)) * z_mask / 0.7
            loss_ref = ref["c"](z_ref).square().mean() + y_ref.square().mean()
            loss_ref.backward()
            assert_close_tree([loss, y, z], [loss_ref, y_ref, z_ref], f"call {i} values")
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert_close_tree(p.grad, q.grad, f"call {i} {name}.grad")
                p.grad = q.grad = None


def test_a_budget_graph_with_nothing_but_dropout_to_recompute():
    """Left with only the dropout it must save, torch's budget partitioner
    returns the dropout's (output, mask) pair as one saved value, which
    aot_autograd cannot take ("'tuple' object has no attribute
    'untyped_storage'"); such a graph is partitioned as at the full budget."""
    from donate_backend import config

    def f(x):
        y = F.dropout(torch.tanh(x) * 3, 0.5, True)
        return (y**2).sum(), y

    with config.patch(activation_budget=0.5):
        compiled = torch.compile(f, backend="donate_xla")
        x = torch.randn(64, 32).to(torch_xla.device()).requires_grad_(True)
        loss, y = compiled(x)
        loss.backward()
    # y = mask * 2 * 3 tanh(x), so d(sum y^2)/dx = 2 y * mask * 6 (1 - tanh^2); y != 0 where kept
    x_cpu, y, grad = x.detach().cpu(), y.detach().cpu(), x.grad.cpu()
    kept = y != 0
    torch.testing.assert_close(y, kept * 6 * torch.tanh(x_cpu), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, 2 * y * kept * 6 * (1 - torch.tanh(x_cpu) ** 2), rtol=1e-4, atol=1e-5)
    assert 0.4 < kept.float().mean().item() < 0.6
