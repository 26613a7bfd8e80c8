"""Training programs shared by the XLA and the native tests: each runs on any device,
with ``compile_fn`` applied to its model and functions (the identity for eager)."""
from __future__ import annotations

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
