"""Small models and a training loop shared by the XLA tests and benchmarks."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla


class MLP(nn.Module):
    def __init__(self, width=32, depth=2, d_in=16, d_out=4):
        super().__init__()
        dims = [d_in] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], d_out)

    def forward(self, x):
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.head(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # BN follows: a bias gets only noise
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(x.flatten(1))


class TransformerBlock(nn.Module):
    def __init__(self, width=32, heads=4, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)  # a key bias gets only noise
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        scores = split(q) @ split(k).transpose(-2, -1) / (c // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (attn @ split(v)).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


@dataclasses.dataclass
class Case:
    """A model, its optimizer, and how to make a batch."""

    name: str
    make_model: Callable[[], nn.Module]
    make_optimizer: Callable[[list], torch.optim.Optimizer]
    make_batch: Callable[[torch.Generator], tuple]
    loss: Callable = staticmethod(lambda out, y: F.mse_loss(out, y))
    micro_batches: int = 1


def _mlp_batch(g):
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _cnn_batch(g):
    return torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 4, generator=g)


def _block_batch(g):
    return torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 32, generator=g)


CASES = {
    "mlp_sgd_momentum": Case(
        "mlp_sgd_momentum", MLP, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), _mlp_batch
    ),
    "cnn_bn_adam": Case("cnn_bn_adam", SmallCNN, lambda p: torch.optim.Adam(p, lr=1e-2), _cnn_batch),
    "transformer_adamw": Case(
        "transformer_adamw", TransformerBlock, lambda p: torch.optim.AdamW(p, lr=1e-2), _block_batch
    ),
    "mlp_grad_accumulation": Case(
        "mlp_grad_accumulation",
        MLP,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda g: (torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)),
        micro_batches=4,
    ),
}


def make_step(model, opt, case: Case):
    def step(x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(case.micro_batches), y.chunk(case.micro_batches)):
            loss = case.loss(model(xs), ys) / case.micro_batches
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    return step


@dataclasses.dataclass
class RunResult:
    losses: list
    params: list
    opt_state: list
    buffers: list


def _state_tensors(opt) -> list:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((key, value.detach().cpu().clone()))
    return out


def train(case: Case, backend: Optional[str], steps: int = 5, seed: int = 0, device=None) -> RunResult:
    """Train ``steps`` steps on the XLA device (or ``device``), eagerly (backend None) or compiled."""
    device = torch_xla.device() if device is None else torch.device(device)
    torch.manual_seed(seed)
    model = case.make_model().to(device)
    opt = case.make_optimizer(list(model.parameters()))
    step = make_step(model, opt, case)
    if backend is not None:
        step = torch.compile(step, backend=backend)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x, y = case.make_batch(g)
        loss = step(x.to(device), y.to(device))
        if device.type == "xla":
            torch_xla.sync()
        losses.append(float(loss.cpu()))
    return RunResult(
        losses=losses,
        params=[p.detach().cpu().clone() for p in model.parameters()],
        opt_state=_state_tensors(opt),
        buffers=[b.detach().cpu().clone() for b in model.buffers()],
    )


def linear_sgd_momentum(device, compile_fn=lambda f: f, seed: int = 0):
    """A Linear(4, 3) trained by SGD with momentum, its step (``compile_fn``-ed) and an
    input: the smallest program whose optimizer step donates parameters and state.
    Returns (parameters, optimizer, step, x)."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return list(model.parameters()), opt, compile_fn(squared_mean_step(model, opt)), torch.randn(8, 4).to(device)


def squared_mean_step(model, opt):
    """A whole training step on ``model(x).square().mean()``: backward, optimizer step,
    gradients zeroed; returns the loss."""

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step
