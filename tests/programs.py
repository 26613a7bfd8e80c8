"""Training programs shared by the XLA and the native tests: each runs on any device,
with ``compile_fn`` applied to its model and functions (the identity for eager)."""
from __future__ import annotations

import copy

import torch


def inference_mode_program(device, compile_fn):
    """Evaluation under ``torch.inference_mode()`` with compiled functions, then training
    on a tensor made there. Outputs made in that mode are inference tensors, which
    have no version counter; one is accumulated into in place inside a compiled call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).to(device)
    forward = compile_fn(model)

    def accumulate(acc, y):
        acc.add_(y)
        return acc * 2

    accumulate = compile_fn(accumulate)
    x = torch.arange(8.0).reshape(2, 4).to(device)
    kept = []
    with torch.inference_mode():
        y = forward(x)  # BatchNorm in training mode: its running statistics move
        acc = torch.zeros(2, 3, device=device)
        for i in range(3):
            kept.append(accumulate(acc, y).clone())
            y = forward(x + i)
        model.eval()
        kept.append(forward(x))
        model.train()
    assert acc.is_inference()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(inp, target):  # the inference tensor as a plain input, never saved for backward
        loss = (model(inp) - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = compile_fn(step)
    kept += [step(x, acc).reshape(1) for _ in range(3)]
    return [t.cpu() for t in kept + [acc] + list(model.parameters()) + list(model.buffers())]



def grad_scaler_program(device, compile_fn, whole_step: bool):
    """6 AdamW steps with ``torch.amp.GradScaler``: the loss scaled before the backward,
    the gradients unscaled and checked for inf/NaN in ``scaler.step``, the scale
    updated. Step 3 feeds an infinite input, so its gradients overflow: the scaler skips
    that optimizer step and halves its scale. ``whole_step``: ``compile_fn`` applies to
    the whole step (scale, backward, unscale, step, update), else to the model.
    Returns the losses, the parameters and the final scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device.type)
    forward = model if whole_step else compile_fn(model)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss.detach()

    if whole_step:
        step = compile_fn(step)
    losses = []
    for i in range(6):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if i == 3:
            x[0, 0] = float("inf")
        losses.append(step(x.to(device), y.to(device)).cpu())
    params = [p.detach().cpu() for p in model.parameters()]
    return torch.stack(losses), params, torch.tensor(scaler.get_scale())


def varying_batch_program(device, compile_fn):
    """A compiled training step (LayerNorm, GELU, AdamW with weight decay,
    ``clip_grad_norm_``) called with batches of 4, 7, 4, 9, 7 and 5 rows, so dynamo
    compiles it again after a change. Returns the losses, the parameters and the optimizer state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step = compile_fn(step)
    losses = []
    for i, rows in enumerate([4, 7, 4, 9, 7, 5]):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen)
        losses.append(step(x.to(device), y.to(device)).cpu())
    state = [v.cpu() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return torch.stack(losses), [p.detach().cpu() for p in model.parameters()], state


def _classifier_step(model, optimizer, compile_fn, whole_step: bool):
    """``step(x, y)``: cross-entropy, backward, optimizer step, ``zero_grad``; the loss.
    ``compile_fn`` applies to the whole step when ``whole_step``, else to the model."""
    forward = model if whole_step else compile_fn(model)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return compile_fn(step) if whole_step else step


class _Block(torch.nn.Module):
    """A pre-norm residual MLP block, as transformer layers are built."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _CheckpointedNet(torch.nn.Module):
    """Three blocks, the first and last under ``torch.utils.checkpoint`` (the middle one
    saves its activations as usual), then a linear head."""

    def __init__(self, width: int, use_reentrant: bool | None):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, 4)
        self.use_reentrant = use_reentrant  # None: no checkpointing at all

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for k, block in enumerate(self.blocks):
            if self.use_reentrant is None or k == 1:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def checkpointed_program(device, compile_fn, whole_step: bool, use_reentrant: bool | None, width: int = 16):
    """4 AdamW steps of a model with activation checkpointing (``use_reentrant=None``:
    the same model without it). The input requires grad: a reentrant checkpoint whose
    inputs do not gives its block no gradients in eager, while under ``torch.compile``
    dynamo traces it like a non-reentrant one (any backend), so that case is not
    compared. ``whole_step``: ``compile_fn`` applies to the whole step, else to the model.
    Returns the losses, the inputs' gradients and the parameters."""
    torch.manual_seed(0)
    model = _CheckpointedNet(width, use_reentrant).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _classifier_step(model, optimizer, compile_fn, whole_step)
    losses, input_grads = [], []
    for i in range(4):
        gen = torch.Generator().manual_seed(40 + i)
        x = torch.randn(8, width, generator=gen).to(device).requires_grad_()
        y = torch.randint(0, 4, (8,), generator=gen).to(device)
        losses.append(step(x, y).cpu())
        input_grads.append(x.grad.cpu())
    return torch.stack(losses), input_grads, [p.detach().cpu() for p in model.parameters()]


def held_state_program(device, compile_fn, whole_step: bool):
    """4 AdamW steps while the program holds tensors that share the state's buffers:
    ``model.state_dict()`` taken before training (its tensors alias the parameters and
    BatchNorm statistics, so they follow every update), ``opt.state_dict()`` taken
    after step 1 (it holds the optimizer's own moment tensors), and an
    ``AveragedModel`` (SWA) updated after every step. After step 2 the model and the
    optimizer are restored to clones taken after step 1 (``load_state_dict`` copies into
    the parameters and installs the loaded moments). Returns the losses, the held state
    dicts' tensors and the averaged model's state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # no bias before the BatchNorm: its gradient would be rounding noise
        torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held = model.state_dict()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    step = _classifier_step(model, optimizer, compile_fn, whole_step)
    losses = []
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        losses.append(step(x.to(device), y.to(device)).cpu())
        averaged.update_parameters(model)
        if i == 1:
            held_optimizer = optimizer.state_dict()
            model_copy = {k: v.clone() for k, v in model.state_dict().items()}
            optimizer_copy = copy.deepcopy(optimizer.state_dict())
        if i == 2:
            model.load_state_dict(model_copy)
            optimizer.load_state_dict(optimizer_copy)
    moments = [v for s in held_optimizer["state"].values() for v in s.values() if torch.is_tensor(v)]
    return (
        torch.stack(losses),
        [t.cpu() for t in held.values()],
        [t.cpu() for t in moments],
        [t.cpu() for t in averaged.state_dict().values()],
    )


class _CountedScale(torch.nn.Module):
    """A buffer incremented in the forward, then read by an op the gradient needs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.w * x * self.count


class _RunningMeanScale(torch.nn.Module):
    """A running mean moved with ``lerp_`` under ``no_grad``, then read."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x):
        with torch.no_grad():
            self.mean.lerp_(x.mean(0), 0.3)
        return torch.tanh(self.w * x) * (self.mean + 1)


class _ShrunkWeight(torch.nn.Module):
    """A parameter scaled in place inside the forward (as weight clipping does), then read."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.9)
        return self.lin(x).sin()


def updated_buffer_program(device, compile_fn, whole_step: bool):
    """Buffers and parameters a forward updates in place and reads afterwards: a
    counter (``+=``), a running mean (``lerp_``), a weight shrunk under ``no_grad``,
    and an ``nn.Embedding(max_norm=...)`` (its weight renormalised in place). The
    backward must see the values the forward read, not recompute them from the
    updated buffers. Five SGD steps; the losses and every parameter, gradient and
    buffer after each."""
    torch.manual_seed(0)
    parts = torch.nn.ModuleDict({
        "count": _CountedScale(), "mean": _RunningMeanScale(), "shrunk": _ShrunkWeight(),
        "emb": torch.nn.Embedding(10, 6, max_norm=1.0),
    })
    with torch.no_grad():
        parts["emb"].weight.mul_(3.0)  # rows well above max_norm, so renorm changes them
    parts = parts.to(device)
    opt = torch.optim.SGD(parts.parameters(), lr=0.05, momentum=0.5)

    def forward(x, idx):
        h = parts["count"](x) + parts["mean"](x) + parts["shrunk"](x)
        return (h * parts["emb"](idx)).square().mean()

    if whole_step:
        def step(x, idx):
            loss = forward(x, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = compile_fn(step)
    else:
        compiled = compile_fn(forward)

        def step(x, idx):
            loss = compiled(x, idx)
            loss.backward()
            grads = [p.grad.clone() for p in parts.parameters()]
            opt.step()
            opt.zero_grad()
            return [loss.detach()] + grads

    results = []
    for i in range(5):
        g = torch.Generator().manual_seed(700 + i)
        x = torch.randn(4, 6, generator=g).to(device)
        idx = torch.randint(0, 10, (4,), generator=g).to(device)
        out = step(x, idx)
        results.append([t.detach().cpu().clone() for t in (out if isinstance(out, list) else [out])])
        results.append([t.detach().cpu().clone() for t in list(parts.parameters()) + list(parts.buffers())])
    return results


def retained_graph_program(model, run, x):
    """``run`` (``model`` or its compiled function; ``model`` a Sequential of at least 3
    modules, Linear at 0 and 2, ``x`` requiring grad) through two backwards of one retained
    graph (gradients accumulate), a gradient hook, ``backward(inputs=)`` that leaves the
    other gradients as they were, and ``torch.autograd.grad``, which writes no ``.grad``.
    Returns the gradients, the hook's and ``autograd.grad``'s."""
    seen = []
    handle = model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    loss = run(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    run(2 * x).sum().backward(inputs=[model[2].weight])
    handle.remove()
    grads = [p.grad.clone() for p in model.parameters()] + seen + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    by_grad = torch.autograd.grad(run(x).tanh().sum(), [x, model[2].weight])
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    return grads + list(by_grad)
