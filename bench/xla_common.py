"""Models, training steps and measurement helpers shared by the XLA benchmarks.

Every benchmark runs each backend in a fresh subprocess (``run_worker``), so
compile caches, metrics and peak memory of one backend never leak into another.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from measure import RssSampler, current_rss, median, write_results  # noqa: F401  (the benchmarks import them from here)

os.environ.setdefault("PJRT_DEVICE", "CPU")


class WideMLP(nn.Module):
    """About 52M parameters: 8 x Linear(2560, 2560)."""

    def __init__(self, width=2560, depth=8, d_out=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.constrain = _unchanged  # SmallGPT(constrain=...): shards the residual stream

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        split = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        att = (split(q) @ split(k).transpose(-2, -1)) / (c // self.heads) ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = (att.masked_fill(~causal, float("-inf")).softmax(-1) @ split(v)).transpose(1, 2)
        x = self.constrain(x + self.proj(y.reshape(b, t, c)))
        return self.constrain(x + self.mlp(self.ln2(x)))


def _unchanged(t):
    return t


class SmallGPT(nn.Module):
    """6 layers, width 512, vocabulary 8192: 27.4M parameters.

    ``constrain`` (identity by default) is applied to the residual stream after
    the embedding and after each attention and MLP residual, and to the logits:
    a sharding constraint on activations (SPMD), as FSDP recipes add.
    """

    def __init__(self, vocab=8192, width=512, depth=6, heads=8, seq=128, constrain=None):
        super().__init__()
        self.constrain = constrain or _unchanged
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for block in self.blocks:
            block.constrain = self.constrain

    def forward(self, idx):
        x = self.constrain(self.tok(idx) + self.pos[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.constrain(self.head(self.ln(x)))


MODELS = {
    "mlp50m_sgd": dict(
        make=lambda: WideMLP(),
        opt=lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        batch=lambda: (torch.randn(64, 2560), torch.randn(64, 16)),
        loss=lambda out, y: F.mse_loss(out, y),
    ),
    "gpt6x512_adamw": dict(
        make=lambda: SmallGPT(),
        opt=lambda p: torch.optim.AdamW(p, lr=1e-4),
        batch=lambda: (torch.randint(0, 8192, (8, 128)), torch.randint(0, 8192, (8, 128))),
        loss=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
    ),
}


class PreLN(nn.Module):
    """A pre-LN transformer encoder: 4 layers, width 512, vocabulary 4096 (torch's own layers)."""

    def __init__(self, width=512, depth=4, heads=8, vocab=4096):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _gelu_mlp(width=2048, depth=8):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def _qwen2(width=512, depth=4, heads=8, kv_heads=2, vocab=4096, seq=128):
    """An HF Qwen2 causal LM from a config (random weights, offline): grouped-query attention,
    rotary embeddings, RMSNorm and a SwiGLU MLP; its forward breaks dynamo's graph where HF
    code does."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(2.75 * width), num_hidden_layers=depth,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        attention_dropout=0.0, use_cache=False,
    )
    config._attn_implementation = "eager"
    return transformers.Qwen2ForCausalLM(config).train()


# Three more models, not tuned for: `--models` takes them (bench/xla_plan_accuracy.py runs them by default)
MORE_MODELS = {
    "mlp8x2048_gelu": dict(
        make=_gelu_mlp,
        opt=lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
        batch=lambda: (torch.randn(256, 2048), torch.randn(256, 2048)),
        loss=lambda out, y: F.mse_loss(out, y),
    ),
    "preln4x512_adamw": dict(
        make=PreLN,
        opt=lambda p: torch.optim.AdamW(p, lr=1e-4),
        batch=lambda: (torch.randint(0, 4096, (8, 128)), torch.randint(0, 4096, (8, 128))),
        loss=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
    ),
    "qwen2_adamw": dict(
        make=_qwen2,
        opt=lambda p: torch.optim.AdamW(p, lr=1e-4),
        batch=lambda: (torch.randint(0, 4096, (8, 128)), torch.randint(0, 4096, (8, 128))),
        loss=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
    ),
}


# Calls before a measured step: they compile every graph and create the optimizer state; at
# the third the default chooses the step's levers (donate_backend.choice) and a limit plans the
# step again with the state counted (donate_backend.limit); where the default runs a lever, the
# calls after it time the lever against the plain executables (choice.TRIAL, waiting for the
# device at each timed step) and keep the faster; a step the default stitches compiles its
# donating variant at its second call, and XLA:CPU's compile works in host memory, which
# would count as the step's growth. From then on every setting runs the executables it keeps.
def _warm_up_calls() -> int:
    from donate_backend import choice

    return choice.STEPS + 1 + len(choice.TRIAL) + 2


WARM_UP_CALLS = _warm_up_calls()


def build(model_name: str, device):
    spec = {**MODELS, **MORE_MODELS}[model_name]
    torch.manual_seed(0)
    model = spec["make"]().to(device)
    opt = spec["opt"](list(model.parameters()))
    x, y = spec["batch"]()

    def step(x, y):
        loss = spec["loss"](model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, step, (x.to(device), y.to(device))


def state_tensors(model, opt) -> list:
    out = list(model.parameters())
    for group in opt.param_groups:
        for p in group["params"]:
            out += [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def run_worker(script: str, *args: str, timeout: int = 1200, env: Optional[dict] = None,
               python: Optional[str] = None) -> dict:
    """Run ``script`` in a fresh interpreter (``python``, else this one); it prints one JSON line last."""
    env = dict(os.environ, PJRT_DEVICE="CPU", **(env or {}))
    out = subprocess.run(
        [python or sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"{script} {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_repeated(
    script: str, model_name: str, backends, repeats: int, *extra: str, env: Optional[dict] = None,
    warm_up: bool = False, alternate: bool = False,
) -> dict:
    """Each backend ``repeats`` times, interleaved (a, b, c, a, b, c, ...), fresh processes.

    ``warm_up``: first one run of each backend, discarded (the first processes of a
    benchmark start with cold file caches). ``alternate``: every other repeat runs
    the backends in reverse order (a, b, b, a, ...), so neither always runs first.
    """
    runs = {b: [] for b in backends}
    if warm_up:
        for backend in backends:
            run_worker(script, "--worker", model_name, backend, *extra, env=env)
    for repeat in range(repeats):
        order = list(backends)[::-1] if alternate and repeat % 2 else backends
        for backend in order:
            runs[backend].append(run_worker(script, "--worker", model_name, backend, *extra, env=env))
    return runs


def summarize(runs: list, key: str) -> tuple[float, float, float]:
    """(median, min, max) of one figure over repeated runs."""
    values = [r[key] for r in runs]
    return median(values), min(values), max(values)


def bench_arguments(description: str) -> argparse.ArgumentParser:
    """The options both XLA benchmarks take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated; also {', '.join(MORE_MODELS)}")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "BACKEND"), help="internal: one run")
    parser.add_argument("--json", help="write the results here instead of bench/results/")
    return parser
