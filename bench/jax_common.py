"""The JAX rows of the XLA benchmarks: the benchmark GPT as one whole-step ``jax.jit`` with
``donate_argnums`` (``bench/jax_gpt.py``), run in an environment of its own.

``make bench`` creates ``.venv-jax`` from ``requirements-jax.txt`` (torch_xla imports JAX
where it is installed, so JAX stays out of ``.venv``); ``DONATE_XLA_JAX_PYTHON`` names
another interpreter. ``bench/donation.py`` (memory) and ``bench/compile.py`` (time to the
first step) both run it through ``jax_worker``.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
JAX_MODELS = ("gpt6x512_adamw",)  # the models bench/jax_gpt.py has a twin of


def jax_python() -> Optional[str]:
    """The interpreter of the JAX environment, or None when there is none."""
    path = os.environ.get("DONATE_XLA_JAX_PYTHON") or os.path.join(HERE, "..", ".venv-jax", "bin", "python")
    return path if os.path.exists(path) else None


def jax_worker(model_name: str, steps: int, flags: Sequence[str] = ()) -> dict:
    """Run ``bench/jax_gpt.py`` (with ``flags``) from the torch model's initial weights and batch
    (as ``xla_common.build`` makes them). The JAX model must give the same parameter count and,
    on the CPU, the same first loss as torch within 1e-4, or this raises."""
    import subprocess
    import tempfile

    import numpy as np
    import torch

    from xla_common import MODELS, build

    spec = MODELS[model_name]
    model, _, _, (x, y) = build(model_name, torch.device("cpu"))  # the torch rows' weights and batch
    with torch.no_grad():
        torch_loss = float(spec["loss"](model(x), y))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.npz")
        np.savez(path, x=x.numpy(), y=y.numpy(),
                 **{f"param:{n}": p.detach().numpy() for n, p in model.named_parameters()})
        command = [jax_python(), os.path.join(HERE, "jax_gpt.py"), path, "--steps", str(steps), *flags]
        out = subprocess.run(command, capture_output=True, text=True, timeout=1200,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    torch_params = sum(p.numel() for p in model.parameters())
    if result["params"] != torch_params or abs(result["first_loss"] - torch_loss) > 1e-4:
        raise RuntimeError(
            f"the JAX GPT does not match the torch one: {result['params']} parameters against "
            f"{torch_params}, first loss {result['first_loss']:.6f} against {torch_loss:.6f}"
        )
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(result, model=model_name, torch_first_loss=torch_loss, grad_bytes=grad_bytes)
