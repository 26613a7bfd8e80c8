"""One process of tests/test_jax_target.py's cache tests: trains a small MLP for two steps on
the JAX device, compiled with donate_xla, and prints as JSON what the compiled graphs' records
say of JAX's compilation cache, the losses, and the cache directory in use.

Usage: python tests/jax_cache_probe.py BATCH (the environment names the cache: DONATE_XLA_CACHE,
DONATE_XLA_CACHE_DIR)."""
from __future__ import annotations

import json
import sys
import warnings

import donate_backend

DEV = donate_backend.jax_device()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from donate_backend.jax import cache  # noqa: E402

CACHED = "loaded from JAX's compilation cache"


def main(batch: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    reference = [p.detach().clone() for p in model.parameters()]
    model.to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    @torch.compile(backend="donate_xla")
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(x.to(DEV), y.to(DEV)).item() for _ in range(2)]
    graphs = [[r.kind] + [name for name, _ in r.phases if name in (CACHED, "xla compile")]
              for r in donate_backend.reports()]
    # the same two steps eagerly on the CPU
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    with torch.no_grad():
        for p, value in zip(eager.parameters(), reference):
            p.copy_(value)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    expected = []
    for _ in range(2):
        loss = F.cross_entropy(eager(x), y)
        loss.backward()
        opt_e.step()
        opt_e.zero_grad()
        expected.append(loss.item())
    print(json.dumps(dict(graphs=graphs, losses=losses, expected=expected, directory=cache.directory(),
                          warnings=[str(w.message) for w in caught if "cache" in str(w.message).lower()])))


if __name__ == "__main__":
    main(int(sys.argv[1]))
