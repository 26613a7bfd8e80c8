"""Train a small model on the XLA device with backend="donate_xla".

Run with `make demo` (PJRT_DEVICE=CPU is set there). It prints the loss of
each step, then one row per compiled graph: its kind, inputs, bytes sent to the
device while compiling, what was donated, and compile time.
examples/quickstart_jax.py trains the same model on the JAX target.
"""
import os

import torch
import torch.nn.functional as F

import donate_backend  # only for the report; the backend needs no import


def train(device, steps: int = 5) -> None:
    """The model and its whole training step compiled with donate_xla on ``device``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @torch.compile(backend="donate_xla")
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(32, 64).to(device)
    y = torch.randint(0, 10, (32,)).to(device)
    for i in range(steps):
        loss = step(x, y)
        print(f"step {i}: loss {loss.item():.4f}  (on {loss.device})")
    print()
    print(donate_backend.format_table())


def main() -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    train(torch_xla.device())
    print()
    for record in donate_backend.reports():
        print(donate_backend.format_record(record))


if __name__ == "__main__":
    main()
