"""The benchmark GPT (``xla_common.SmallGPT``: 6 layers, width 512, vocabulary 8192) as one
whole-step ``jax.jit`` with ``donate_argnums``: JAX's answer to the step donate_xla compiles.

Run by ``bench/donation.py`` in an environment with JAX and without torch
(``make bench`` creates ``.venv-jax`` from ``requirements-jax.txt``):

    python bench/jax_gpt.py WEIGHTS.npz --steps 10 [--remat]

``WEIGHTS.npz`` holds the torch model's initial parameters (their ``named_parameters()``
names and order) and the batch (``x``, ``y``), written by the torch side, so both
frameworks start from the same numbers. The step is the torch one: cross-entropy of the
logits, backward, AdamW (lr 1e-4, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01, torch's
update order), parameters and both moments donated. ``--remat`` wraps each block in
``jax.checkpoint`` (the per-layer policy: a block keeps only its input for the backward
and recomputes the rest).

Prints one JSON line: the first loss (to check the models match), the parameter count,
the live growth over the measured steps (peak minus trough of the RSS, as the torch rows),
how many state buffers kept their address, and the median step time.

``bench/jax_target.py`` runs it too (through ``jax_common.jax_worker``), as the reference row
of the GPT trained on XLA:CPU four ways: donate_xla's JAX target on
``donate_backend.jax_device()``, donate_xla and openxla on torch_xla, and this step; it compares
their time to the first step, step time, live growth and first loss.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from measure import RssSampler, current_rss, median  # noqa: E402

HEADS = 8
LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-4, 0.9, 0.999, 1e-8, 0.01  # torch.optim.AdamW(lr=1e-4)


def layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight + bias


def linear(x, weight, bias=None):  # torch's layout: weight is (out, in)
    y = x @ weight.T
    return y if bias is None else y + bias


def block(p: dict, x):
    b, t, c = x.shape
    q, k, v = jnp.split(linear(layer_norm(x, p["ln1.weight"], p["ln1.bias"]), p["qkv.weight"]), 3, axis=-1)
    split = lambda z: z.reshape(b, t, HEADS, c // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
    att = (split(q) @ split(k).transpose(0, 1, 3, 2)) / (c // HEADS) ** 0.5
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
    y = (att @ split(v)).transpose(0, 2, 1, 3).reshape(b, t, c)
    x = x + linear(y, p["proj.weight"], p["proj.bias"])
    h = layer_norm(x, p["ln2.weight"], p["ln2.bias"])
    h = jax.nn.gelu(linear(h, p["mlp.0.weight"], p["mlp.0.bias"]), approximate=False)  # nn.GELU()
    return x + linear(h, p["mlp.2.weight"], p["mlp.2.bias"])


def blocks_of(params: dict) -> list:
    depth = 1 + max(int(name.split(".")[1]) for name in params if name.startswith("blocks."))
    return [
        {name[len(f"blocks.{i}."):]: value for name, value in params.items() if name.startswith(f"blocks.{i}.")}
        for i in range(depth)
    ]


def loss_fn(params: dict, x, y, remat: bool):
    run_block = jax.checkpoint(block) if remat else block
    h = params["tok.weight"][x] + params["pos"][: x.shape[1]]
    for p in blocks_of(params):
        h = run_block(p, h)
    logits = linear(layer_norm(h, params["ln.weight"], params["ln.bias"]), params["head.weight"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()


def make_step(remat: bool):
    def step(params, m, v, count, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, remat)
        count = count + 1
        correction1 = 1 - BETA1 ** count
        correction2 = 1 - BETA2 ** count
        new_params, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            g = grads[name]
            p = p * (1 - LR * WEIGHT_DECAY)
            new_m[name] = BETA1 * m[name] + (1 - BETA1) * g
            new_v[name] = BETA2 * v[name] + (1 - BETA2) * g * g
            denom = jnp.sqrt(new_v[name]) / jnp.sqrt(correction2) + EPS
            new_params[name] = p - (LR / correction1) * new_m[name] / denom
        return new_params, new_m, new_v, count, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


def addresses(*trees) -> list:
    return [leaf.unsafe_buffer_pointer() for tree in trees for leaf in jax.tree_util.tree_leaves(tree)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--remat", action="store_true")
    args = parser.parse_args()
    data = np.load(args.weights)
    x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])
    params = {name[len("param:"):]: jnp.asarray(data[name]) for name in data.files if name.startswith("param:")}
    m = {name: jnp.zeros_like(p) for name, p in params.items()}
    v = {name: jnp.zeros_like(p) for name, p in params.items()}
    count = jnp.zeros((), jnp.float32)
    step = make_step(args.remat)

    def run(params, m, v, count):
        out = step(params, m, v, count, x, y)
        jax.block_until_ready(out)
        return out

    start = time.perf_counter()
    params, m, v, count, first_loss = run(params, m, v, count)
    first_step_s = time.perf_counter() - start
    params, m, v, count, _ = run(params, m, v, count)  # as the torch rows: two warm-up steps
    before = addresses(params, m, v)
    times, rss_before = [], current_rss()
    with RssSampler() as sampler:
        for _ in range(args.steps):
            start = time.perf_counter()
            params, m, v, count, loss = run(params, m, v, count)
            times.append(time.perf_counter() - start)
    after = addresses(params, m, v)
    print(json.dumps(dict(
        first_loss=float(first_loss),
        last_loss=float(loss),
        params=int(sum(p.size for p in params.values())),
        peak_growth=sampler.peak - rss_before,
        transient=sampler.peak - sampler.trough,
        state_buffers=len(before),
        reused=len(set(before) & set(after)),
        own=sum(a == b for a, b in zip(before, after)),
        step_s=median(times),
        step_times=times,
        first_step_s=first_step_s,
        rss=[(t, r - sampler.trough) for t, r in sampler.samples[::4]],
        jax=jax.__version__,
    )))


if __name__ == "__main__":
    main()
