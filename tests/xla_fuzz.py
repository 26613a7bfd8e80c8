"""Differential fuzzer: random training programs, donate_xla on XLA vs eager PyTorch on the CPU.

``--path native`` runs donate_xla on the CPU instead, which is its native path (the
backward that frees saved tensors at their last use and reuses dying buffers), against
the same eager run; that needs no torch_xla. ``--path mesh`` runs it on XLA in SPMD
mode over a 4-device mesh, every tensor replicated (the executables lowered on real
buffers per sharding signature). ``--path cuda`` runs the native path on a CUDA device
against eager on that same device (``tools/gpu_check.sh``; CI has no GPU). ``--path jax``
runs the JAX target (``donate_backend.jax_device()``: torch 2.15 with jax, no torch_xla).

Each scenario is generated from one seed. It holds persistent state (a module
with parameters and buffers, optional tied weights, an optional frozen parameter
(``requires_grad=False``, as in fine-tuning), one or two optimizers,
extra tensors passed as arguments) and one to three functions written as
Python source, the way users write training code:

- forward passes with tensor literals made inside the function, slices,
  ``torch.where`` and in-place ops on intermediates; normalization layers
  (BatchNorm with running statistics, switched between train and eval mode
  between calls; layer and group norm);
- ``no_grad`` regions that update buffers (EMA), copy one input into another
  (target-network hard updates, staging a batch), or write literals;
- one or two backward/optimizer phases per function (GAN-style), manual SGD,
  gradient accumulation across calls, ``zero_grad`` either way;
- returns that mix inputs, views, detaches, reductions, losses and buffers,
  so several outputs alias one another or an input;
- eager code between calls (half the scenarios, its own random stream): a
  backup ``copy_`` of a parameter, buffer or optimizer state tensor into a
  tensor made before training, a swap-in-and-restore of it (EMA evaluation),
  two ``.data.copy_`` of uploads into it, an eager read or EMA update (half the
  backups and EMA updates followed by an in-place decay of the tensor read, as an
  eager optimizer's weight decay), and ``torch_xla.sync()``; the backups are
  compared like the state.

A third of the functions are split by ``torch._dynamo.graph_break()`` into two or
three graphs (own random stream), so intermediates and a backward cross graphs.

Half the calls of a function made under ``no_grad`` run under
``torch.inference_mode()`` (evaluation), so its outputs are inference tensors.

The functions are called in a random order for several steps, sharing the
state. After every call the outputs and every piece of state (parameters,
gradients, buffers, optimizer state, argument tensors) are compared with the
eager run; at the end every output returned so far is compared again, which
catches a buffer donated while an earlier output still reads it.

A scenario that eager PyTorch itself rejects is "invalid" and not compared.

``--mixed`` runs each call stitched or not at random (``DONATE_XLA_STITCH`` is read per
call), so stitched graphs and executables share state; ``DONATE_XLA_STITCH=1`` fuzzes
stitched steps alone.

Run ``python tests/xla_fuzz.py --count 2000`` (``make fuzz``; ``make fuzz-native``,
``make fuzz-mesh``); pytest runs a small budget of each (tests/test_xla_fuzz.py,
tests/test_native_fuzz.py, tests/test_xla_spmd.py). A failure prints the seed and the
source of the scenario.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
import traceback
from typing import Optional

import torch
import torch.nn.functional as F  # noqa: F401 - used by generated code

import donate_backend  # noqa: F401 - registers the backend where the package is not installed

MESH_ENV = "DONATE_XLA_FUZZ_MESH"  # set by ``--path mesh`` in its worker processes
JAX_ENV = "DONATE_XLA_FUZZ_JAX"  # set by ``--path jax``: the device is registered before any backward
# set by ``--mixed``: each donate_xla call on XLA runs stitched or not at random (the
# switch is read per call), so stitched graphs and executables share state
MIXED_ENV = "DONATE_XLA_FUZZ_MIXED"
MESH_DEVICES = "4"

try:  # before any backward runs: torch_xla registers its device with the autograd engine
    import torch_xla

    if os.environ.get(MESH_ENV) == "1":
        import torch_xla.runtime as xr

        xr.use_spmd()
        torch_xla.device_count()  # else the autograd engine sees no XLA device on a mesh
    torch_xla.device()
except ImportError:  # the generator still imports; running needs torch_xla
    torch_xla = None
if os.environ.get(JAX_ENV) == "1":
    donate_backend.jax_device()  # before the first backward: the autograd engine counts devices then

N, D = 4, 6  # batch rows, features
RTOL, ATOL = 2e-3, 2e-4
FLOAT64_TOL = (1e-6, 1e-7)  # (rtol, atol) of the float64 rerun (_agrees_in_float64)


# -- generation --------------------------------------------------------------------------

@dataclasses.dataclass
class Scenario:
    seed: int
    tied: bool  # W1 is W0
    optimizers: list  # source expressions building each optimizer
    args: list  # (name, shape) of the extra tensors passed as arguments
    functions: list  # (name, source)
    calls: list  # function index per step
    eval_calls: frozenset = frozenset()  # steps that run with the state in eval mode
    between: dict = dataclasses.field(default_factory=dict)  # step -> eager statements after it
    # steps whose call (of a function made under no_grad) runs under torch.inference_mode():
    # its outputs are inference tensors, which have no version counter
    inference_mode_calls: frozenset = frozenset()
    frozen: str = ""  # a parameter made with requires_grad=False (fine-tuning), or none

    def source(self) -> str:
        parts = [f"# seed {self.seed}; tied W1 is W0: {self.tied}; eval mode at steps {sorted(self.eval_calls)}"]
        if self.frozen:
            parts += [f"S.{self.frozen}.requires_grad_(False)  # frozen before training"]
        if self.inference_mode_calls:
            parts += [f"# under torch.inference_mode() at steps {sorted(self.inference_mode_calls)}"]
        parts += [f"opts[{k}] = {expr}" for k, expr in enumerate(self.optimizers)]
        parts += [f"# args: {self.args}"]
        parts += [src for _, src in self.functions]
        parts += [f"# calls: {[self.functions[i][0] for i in self.calls]}"]
        parts += [f"# eager after call {k}:\n" + textwrap.indent(src, "#   ") for k, src in sorted(self.between.items())]
        return "\n".join(parts)


class _Body:
    """Builds one function's statements, tracking the values in scope."""

    def __init__(
        self,
        rng: random.Random,
        args: list,
        n_opts: int,
        norm_rng: Optional[random.Random] = None,
        fallback_rng: Optional[random.Random] = None,
        update_rng: Optional[random.Random] = None,
    ):
        self.rng = rng
        # own stream too: state the forward updates in place and then reads (a counter,
        # a running mean, a parameter scaled under no_grad or through .detach(), a
        # BatchNorm with a cumulative average)
        self.update_rng = update_rng
        self.norm_rng = norm_rng  # own stream: the other choices stay those of the seed without norms
        self.fallback_rng = fallback_rng  # own stream too: weight norm, an op torch_xla runs on the CPU
        self.lines: list[str] = []
        self.acts: list[str] = ["x"]  # (N, D) values in the current grad region
        self.uses: dict[str, set] = {"x": set()}  # parameters each value depends on
        self.vecs: list[str] = []  # (D,) values made in the function
        self.scalars: list[str] = []
        self.returnable: list[str] = ["x"]
        self.args = args
        self.n_opts = n_opts
        self.k = 0

    def fresh(self, prefix: str) -> str:
        self.k += 1
        return f"{prefix}{self.k}"

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)

    def act(self) -> str:
        return self.rng.choice(self.acts)

    def literal(self) -> str:
        name = self.fresh("lit")
        kind = self.rng.randrange(3)
        if kind == 0:
            values = ", ".join(f"{self.rng.choice([-1.5, -0.5, 0.25, 1.0, 2.0])}" for _ in range(D))
            self.emit(f"{name} = torch.tensor([{values}], device=x.device)")
        elif kind == 1:
            self.emit(f"{name} = torch.arange({D}, dtype=torch.float32, device=x.device) * 0.1 - 0.2")
        else:
            self.emit(f"{name} = torch.full(({D},), {self.rng.choice([0.5, 1.5, -1.0])}, device=x.device)")
        self.vecs.append(name)
        self.returnable.append(name)
        return name

    def compute(self, with_params: bool = False) -> None:
        r = 0 if with_params else self.rng.randrange(8)
        out = self.fresh("h")
        src = self.act()
        used = set(self.uses[src])
        if r <= 1:
            act = self.rng.choice(["torch.tanh", "torch.relu", "torch.sigmoid", "F.gelu"])
            w = self.rng.choice(["W0", "W1"])
            weight = f"S.{w}"
            if self.fallback_rng is not None and self.fallback_rng.random() < 0.3:
                # torch_xla has no kernel for _weight_norm_interface (two results) nor its
                # backward: the graph runs in XLA segments around them
                weight = f"torch._weight_norm(S.{w}, S.ln_w[:, None], 0)"
                used.add("ln_w")
            self.emit(f"{out} = {act}({src} @ {weight} + S.b0)")
            used |= {w, "b0"}
        elif r == 2:
            lit = self.literal() if not self.vecs or self.rng.random() < 0.5 else self.rng.choice(self.vecs)
            self.emit(f"{out} = {src} * {lit}")
        elif r == 3:
            self.emit(f"{out} = {src} + S.{self.rng.choice(['v0', 'v1'])}")
        elif r == 4:
            self.emit(f"{out} = {src} @ S.M0")
        elif r == 5:
            other = self.act()
            self.emit(f"{out} = torch.cat([{src}[:, :3], {other}[:, 3:]], dim=1)")
            used |= self.uses[other]
        elif r == 6:
            other = self.act()
            self.emit(f"{out} = {src}.clone()")
            self.emit(f"{out}.mul_({self.rng.choice([0.5, 2.0])}).add_({other})")
            used |= self.uses[other]
        else:
            other = self.act()
            self.emit(f"{out} = torch.where({src} > 0, {src}, {other} * 0.1)")
            used |= self.uses[other]
        self.uses[out] = used
        self.acts.append(out)
        self.returnable.append(out)
        if self.norm_rng is not None and self.norm_rng.random() < 0.35:
            self.normalize(out)
        if self.update_rng is not None and self.update_rng.random() < 0.3:
            self.update_then_read(out)

    def update_then_read(self, src: str) -> None:
        """State updated in place inside the forward, then read by an op whose gradient
        needs the updated value (the partitioner must not recompute it from the old one)."""
        out = self.fresh("u")
        kind = self.update_rng.randrange(5)
        used = set(self.uses[src])
        if kind == 0:
            self.emit("S.c0 += 1")
            self.emit(f"{out} = {src} * (S.c0 * 0.1 + 1)")
        elif kind == 1:
            self.emit("with torch.no_grad():")
            self.emit(f"S.v1.lerp_({src}.mean(0), 0.3)", 2)
            self.emit(f"{out} = torch.tanh({src} * (S.v1 + 1))")
        elif kind == 2:
            w = self.update_rng.choice(["W0", "W1"])
            self.emit("with torch.no_grad():")
            self.emit(f"S.{w}.mul_(0.99)", 2)
            self.emit(f"{out} = torch.tanh({src} @ S.{w} + S.b0)")
            used |= {w, "b0"}
        elif kind == 3:
            w = self.update_rng.choice(["W0", "W1"])
            self.emit(f"S.{w}.detach().mul_(0.99)")
            self.emit(f"{out} = torch.tanh({src} @ S.{w})")
            used |= {w}
        else:  # momentum=None: dynamo runs the layer eagerly (it reads a Python float)
            self.emit(f"{out} = torch.tanh(S.bn_avg({src}))")
            used |= {"bn_avg.weight", "bn_avg.bias"}
        self.uses[out] = used
        self.acts.append(out)
        self.returnable.append(out)

    def normalize(self, src: str) -> None:
        """A norm layer, then an activation as in real models: a loss of normalized values
        alone, like their mean square, does not depend on the input, and its gradient is
        rounding noise that no two implementations agree on."""
        out = self.fresh("n")
        kind = self.norm_rng.randrange(3)
        act = self.norm_rng.choice(["torch.tanh", "torch.sigmoid", "F.gelu"])
        if kind == 0:  # batch statistics in train mode (and running ones updated), running ones in eval
            self.emit(f"{out} = {act}(S.bn({src}))")
            used = {"bn.weight", "bn.bias"}
        elif kind == 1:
            self.emit(f"{out} = {act}(F.layer_norm({src}, ({D},), S.ln_w, S.ln_b))")
            used = {"ln_w", "ln_b"}
        else:
            self.emit(f"{out} = {act}(F.group_norm({src}, {self.norm_rng.choice([2, 3])}, S.ln_w, S.ln_b))")
            used = {"ln_w", "ln_b"}
        self.uses[out] = self.uses[src] | used
        self.acts.append(out)
        self.returnable.append(out)

    def no_grad_block(self) -> None:
        if not self.vecs:
            self.literal()  # literals are made outside the block, some are written into buffers
        self.emit("with torch.no_grad():")
        for _ in range(self.rng.randint(1, 3)):
            r = self.rng.randrange(7)
            if r == 0:
                v = self.rng.choice(["v0", "v1"])
                self.emit(f"S.{v}.mul_(0.9).add_({self.act()}.mean(0), alpha=0.1)", 2)
            elif r == 1:
                a, b = self.rng.sample(["v0", "v1"], 2)
                self.emit(f"S.{a}.copy_(S.{b})", 2)
            elif r == 2:
                self.emit(f"S.M0.copy_(S.{self.rng.choice(['W0', 'W1'])})", 2)
            elif r == 3 and self.args:
                name, shape = self.rng.choice(self.args)
                src = self.act() if shape == (N, D) else f"S.{self.rng.choice(['v0', 'v1', 'b0'])}"
                self.emit(f"{name}.copy_({src})", 2)
            elif r == 4:
                self.emit(f"S.v{self.rng.randrange(2)}.add_({self.rng.choice(self.vecs)})", 2)
            elif r == 5 and self.args:
                a, b = self.rng.choice(self.args), self.rng.choice(self.args)
                if a != b and a[1] == b[1]:
                    self.emit(f"{a[0]}.copy_({b[0]})", 2)
                else:
                    self.emit(f"{a[0]}.mul_(0.5)", 2)
            else:
                self.emit(f"S.v1.copy_({self.act()}.mean(0))", 2)  # mean: values stay bounded

    def backward_phase(self) -> None:
        if not any(self.uses[a] for a in self.acts):
            self.compute(with_params=True)
        src = self.rng.choice([a for a in self.acts if self.uses[a]])
        loss = self.fresh("loss")
        kind = self.rng.randrange(4)
        if kind == 0:
            self.emit(f"{loss} = F.mse_loss({src}, y)")
        elif kind == 1:
            self.emit(f"{loss} = ({src} * {src}).mean() + {src}.sum() * 0.01")
        elif kind == 2:  # a reduction over every dimension by an empty dim list (x.amax())
            self.emit(f"{loss} = F.mse_loss({src} / (1 + {src}.detach().abs().amax()), y)")
        else:
            self.emit(f"{loss} = F.smooth_l1_loss({src}, y)")
        if self.rng.random() < 0.15 and "W0" in self.uses[src]:
            self.emit(f"{loss}.backward(inputs=[S.W0])")
        else:
            self.emit(f"{loss}.backward()")
        step = self.rng.randrange(5)
        if step <= 1 and self.n_opts:
            k = self.rng.randrange(self.n_opts)
            self.emit(f"opts[{k}].step()")
            self.emit(f"opts[{k}].zero_grad(set_to_none={self.rng.choice([True, False])})")
        elif step == 2:
            self.emit("with torch.no_grad():")
            self.emit("for p in (S.W0, S.b0):", 2)
            self.emit("if p.grad is not None:", 3)
            self.emit("p.sub_(0.05 * p.grad)", 4)
            self.emit("p.grad = None", 4)
        # else: gradients accumulate across calls
        self.scalars.append(loss)
        self.returnable += [loss, f"{loss}.detach()"]
        self.acts = ["x"]  # a new forward starts from the input again

    def returns(self) -> None:
        pool = list(self.returnable)
        for a in self.acts[1:]:
            pool += [f"{a}.detach()", f"{a}.sum()", f"{a}.t()", f"{a}[0]", f"{a}.view(-1)", f"{a}.amin(keepdim=True)"]
        pool += ["S.v0", "S.b0"] + [name for name, _ in self.args]
        chosen = self.rng.sample(pool, k=min(len(pool), self.rng.randint(1, 5)))
        self.emit(f"return ({', '.join(chosen)},)")


# tensors the eager code between calls copies from, reads or swaps (``state_tensor``
# also reaches optimizer state once it exists)
_BETWEEN_SOURCES = ["S.W0", "S.b0", "S.W1", "S.M0", "S.v0", "state_tensor(opts, 0)", "state_tensor(opts, 1)"]


def _between_statements(rng: random.Random, decay_rng: Optional[random.Random] = None) -> str:
    """Eager code run between two calls: what users do outside the compiled step.

    ``decay_rng`` (its own stream, so that older seeds keep their programs) follows
    some backups and EMA updates with an in-place decay of the tensor they read, as
    an eager optimizer's weight decay does: pending IR then reads the tensor's old
    value while its new value is pending too."""
    lines = []
    for _ in range(rng.randint(1, 3)):
        source = rng.choice(_BETWEEN_SOURCES)
        slot = f"K[{_BETWEEN_SOURCES.index(source)}]"
        kind = rng.choice(["backup", "swap", "data_copies", "read", "ema", "sync"])
        lines.append(f"t = {source}")
        lines.append("if t is not None:")
        if kind == "backup":
            lines.append(f"    {slot} = backup_of(K, {_BETWEEN_SOURCES.index(source)}, t)")
        elif kind == "swap":
            lines.append(f"    {slot} = backup_of(K, {_BETWEEN_SOURCES.index(source)}, t)")
            lines.append("    t.copy_(torch.full_like(t, 0.5))")
            lines.append(f"    t.copy_({slot})")
        elif kind == "data_copies":
            lines.append("    t.data.copy_(torch.full_like(t, 0.25))")
            lines.append(f"    {slot} = upload_like(t, {rng.choice([0.1, -0.2, 0.3])})")
            lines.append(f"    t.data.copy_({slot})")
        elif kind == "read":
            lines.append("    _ = float(t.norm())")
        elif kind == "ema":
            lines.append("    S.v1.mul_(0.5).add_(t.reshape(-1)[: S.v1.numel()].reshape(S.v1.shape), alpha=0.5)")
        else:
            lines.append("    sync()")
        if kind in ("backup", "ema") and decay_rng is not None and decay_rng.random() < 0.5:
            lines.append("    with torch.no_grad():")
            lines.append("        t.mul_(0.99)")
    return "\n".join(lines)


def _insert_graph_breaks(lines: list, rng: random.Random) -> None:
    """Split a third of the functions into two or three dynamo graphs.

    A ``torch._dynamo.graph_break()`` goes before a random top-level statement
    (never the first), so values, views and ``requires_grad`` intermediates flow
    from one compiled graph into the next, and a backward crosses graphs."""
    if rng.random() >= 0.3:
        return
    starts = [i for i, line in enumerate(lines) if i > 0 and line.startswith("    ") and line[4] != " "]
    for i in sorted(rng.sample(starts, k=min(len(starts), rng.randint(1, 2))), reverse=True):
        lines.insert(i, "    torch._dynamo.graph_break()")


def generate(seed: int) -> Scenario:
    rng = random.Random(seed)
    tied = rng.random() < 0.15
    optimizers = []
    for _ in range(rng.choice([0, 1, 1, 2])):
        params = rng.choice(["[S.W0, S.b0]", "[S.W1]", "list(S.parameters())"])
        optimizers.append(
            rng.choice(
                [
                    f"torch.optim.SGD({params}, lr=0.05, momentum=0.9)",
                    f"torch.optim.Adam({params}, lr=0.01, eps=1e-3)",
                    f"torch.optim.AdamW({params}, lr=0.01, eps=1e-3, foreach={rng.choice([True, False])})",
                ]
            )
        )
    args = [(f"a{k}", rng.choice([(N, D), (D,)])) for k in range(rng.randint(0, 2))]
    norm_rng = random.Random(seed * 31 + 7)
    norms = norm_rng.random() < 0.5
    fallback_rng = random.Random(seed * 61 + 13)
    fallbacks = fallback_rng.random() < 0.3
    break_rng = random.Random(seed * 89 + 17)  # own stream: the programs stay those of the seed
    update_rng = random.Random(seed * 113 + 23)  # own stream too
    updates = update_rng.random() < 0.3
    functions, no_grad_functions = [], set()
    for f in range(rng.randint(1, 3)):
        body = _Body(
            rng, args, len(optimizers), norm_rng if norms else None, fallback_rng if fallbacks else None,
            update_rng if updates else None,
        )
        inference = rng.random() < 0.3  # the whole function under no_grad
        for _ in range(rng.randint(1, 2)):  # one or two phases
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.3:
                    body.no_grad_block()
                else:
                    body.compute()
            if not inference and rng.random() < 0.6:
                body.backward_phase()
            elif rng.random() < 0.5:
                body.no_grad_block()
        body.returns()
        _insert_graph_breaks(body.lines, break_rng)
        if inference:
            body.lines = ["    with torch.no_grad():"] + ["    " + line for line in body.lines]
            no_grad_functions.add(f)
        signature = ", ".join(["x", "y"] + [name for name, _ in args])
        functions.append((f"f{f}", f"def f{f}({signature}):\n" + "\n".join(body.lines)))
    calls = [rng.randrange(len(functions)) for _ in range(rng.randint(3, 5))]
    eval_calls = frozenset(k for k in range(len(calls)) if norms and norm_rng.random() < 0.3)
    between_rng = random.Random(seed * 17 + 3)  # own stream: the rest stays that of the seed
    decay_rng = random.Random(seed * 53 + 11)
    between = {}
    if between_rng.random() < 0.5:
        between = {
            k: _between_statements(between_rng, decay_rng)
            for k in range(len(calls) - 1) if between_rng.random() < 0.6
        }
    inference_rng = random.Random(seed * 71 + 5)  # own stream too
    inference_mode_calls = frozenset(
        k for k, index in enumerate(calls) if index in no_grad_functions and inference_rng.random() < 0.5
    )
    frozen_rng = random.Random(seed * 97 + 19)  # own stream too
    frozen = frozen_rng.choice(["W1", "b0"]) if frozen_rng.random() < 0.15 else ""
    return Scenario(seed, tied, optimizers, args, functions, calls, eval_calls, between, inference_mode_calls, frozen)


# -- running -----------------------------------------------------------------------------

class State(torch.nn.Module):
    """Built on its device: ``Module.to`` would untie W1 from W0 when moving to XLA."""

    def __init__(self, tied: bool, seed: int, device: torch.device, frozen: str = ""):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def make(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(device)

        self.W0 = torch.nn.Parameter(make(D, D, scale=0.5))
        self.W1 = self.W0 if tied else torch.nn.Parameter(make(D, D, scale=0.5))
        self.b0 = torch.nn.Parameter(make(D, scale=0.1))
        self.register_buffer("M0", make(D, D, scale=0.3))
        self.register_buffer("v0", make(D))
        self.register_buffer("v1", make(D))
        # normalization (drawn after the rest, so the tensors above stay those of the seed)
        self.bn = torch.nn.BatchNorm1d(D, momentum=0.3).to(device)
        with torch.no_grad():
            self.bn.weight.copy_(make(D, scale=0.2) + 1)
            self.bn.bias.copy_(make(D, scale=0.1))
        self.ln_w = torch.nn.Parameter(make(D, scale=0.2) + 1)
        self.ln_b = torch.nn.Parameter(make(D, scale=0.1))
        # updated in the forward (drawn from no generator: the tensors above stay those of the seed)
        self.register_buffer("c0", torch.zeros((), device=device))
        self.bn_avg = torch.nn.BatchNorm1d(D, momentum=None).to(device)
        if frozen:  # fine-tuning: one parameter (both, if tied) gets no gradient
            getattr(self, frozen).requires_grad_(False)


@dataclasses.dataclass
class Run:
    outputs: list  # per call: the returned tuple, as returned (kept alive)
    snapshots: list  # per call: (outputs, state) copied to the CPU right after the call
    error: Optional[BaseException] = None


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return [_to_cpu(v) for v in value]
    return value


def state_tensor(opts: list, k: int):
    """The k-th optimizer state tensor of the first optimizer, if it exists yet."""
    tensors = [
        v for opt in opts for p_state in opt.state.values() for _, v in sorted(p_state.items())
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return tensors[k] if k < len(tensors) else None


def backup_of(kept: dict, k: int, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the backup made before training for source ``k`` (or a new one)."""
    backup = kept.get(k)
    if backup is None or backup.shape != t.shape:
        backup = torch.zeros_like(t)
    backup.copy_(t)
    return backup


def _state_values(state: State, opts: list, args: dict) -> dict:
    values = {}
    for name, p in state.named_parameters(remove_duplicate=False):
        values[name] = p
        values[name + ".grad"] = p.grad
    for name, b in state.named_buffers():
        values[name] = b
    for k, opt in enumerate(opts):
        for i, p_state in enumerate(opt.state.values()):
            for key, v in sorted(p_state.items()):
                values[f"opts[{k}].state[{i}].{key}"] = v
    values.update(args)
    out = {}
    for k, v in values.items():
        try:
            out[k] = _to_cpu(v)
        except RuntimeError as exc:
            raise RuntimeError(f"reading {k}: {exc}") from exc
    return out


def run(scenario: Scenario, device: torch.device, compiled, backend: str = "donate_xla") -> Run:
    state = State(scenario.tied, scenario.seed, device, scenario.frozen)
    g = torch.Generator().manual_seed(scenario.seed + 1)
    args = {name: torch.randn(*shape, generator=g).to(device) for name, shape in scenario.args}
    opts: list = [None] * len(scenario.optimizers)
    kept = {k: torch.zeros(D, D).to(device) for k in range(len(_BETWEEN_SOURCES))}  # made before training
    namespace = {"torch": torch, "F": torch.nn.functional, "S": state, "opts": opts}
    between_namespace = dict(
        namespace, K=kept, state_tensor=state_tensor, backup_of=backup_of,
        upload_like=lambda like, v: torch.full(tuple(like.shape), v).to(device),
        sync=(torch_xla.sync if device.type == "xla" else lambda: None),
    )
    for k, expr in enumerate(scenario.optimizers):
        opts[k] = eval(expr, namespace)  # noqa: S307 - our own generated source
    functions = []
    for name, source in scenario.functions:
        exec(compile(source, f"<fuzz {scenario.seed} {name}>", "exec"), namespace)  # noqa: S102
        fn = namespace[name]
        functions.append(torch.compile(fn, backend=backend) if compiled else fn)
    result = Run([], [])
    mixed = compiled and backend == "donate_xla" and device.type == "xla" and os.environ.get(MIXED_ENV) == "1"
    coin = random.Random(scenario.seed * 31 + 7)
    for step, index in enumerate(scenario.calls):
        state.train(step not in scenario.eval_calls)
        # the cumulative-average BatchNorm always trains: in eval mode its running variance,
        # which eager torch_xla computes biased on XLA, would reach the outputs too
        state.bn_avg.train()
        gb = torch.Generator().manual_seed(scenario.seed * 100 + step)
        x = torch.randn(N, D, generator=gb).to(device)
        y = torch.randn(N, D, generator=gb).to(device)
        try:
            grad_mode = torch.inference_mode() if step in scenario.inference_mode_calls else contextlib.nullcontext()
            if mixed:
                from donate_backend import config

                with config.patch(stitch=coin.random() < 0.5), grad_mode:
                    out = functions[index](x, y, *args.values())
            else:
                with grad_mode:
                    out = functions[index](x, y, *args.values())
            result.outputs.append(out)
            if step in scenario.between:
                with torch.no_grad():
                    exec(scenario.between[step], between_namespace)  # noqa: S102 - our own generated source
            values = dict(args, **{f"K[{k}]": v for k, v in kept.items()})
            result.snapshots.append((_to_cpu(out), _state_values(state, opts, values)))
        except Exception as exc:  # noqa: BLE001 - compared with the other run
            result.error = exc
            return result
    try:
        result.snapshots.append(([_to_cpu(o) for o in result.outputs], {}))  # every output, at the end
    except Exception as exc:  # noqa: BLE001
        result.error = exc
    return result


def _compare(expected, got, where: str, tol=(RTOL, ATOL), skip: frozenset = frozenset()) -> Optional[str]:
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"{where}: {type(got).__name__} where eager has {type(expected).__name__}"
        if expected.shape != got.shape or expected.dtype != got.dtype:
            return f"{where}: {got.dtype}{list(got.shape)} where eager has {expected.dtype}{list(expected.shape)}"
        if not torch.allclose(got, expected, rtol=tol[0], atol=tol[1], equal_nan=True):
            diff = (got - expected).abs().max().item()
            return f"{where}: values differ (max abs diff {diff:.3g})"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"{where}: {got!r:.80} where eager has {expected!r:.80}"
        for k, (e, g) in enumerate(zip(expected, got)):
            problem = _compare(e, g, f"{where}[{k}]", tol, skip)
            if problem:
                return problem
        return None
    if isinstance(expected, dict):
        for key in expected:
            if key in skip:
                continue
            problem = _compare(expected[key], got.get(key), f"{where}.{key}", tol, skip)
            if problem:
                return problem
        return None
    return None if expected == got else f"{where}: {got!r} where eager has {expected!r}"


@dataclasses.dataclass
class Outcome:
    seed: int
    # "passed"; "invalid": eager PyTorch rejects the program; "upstream": torch.compile
    # with aot_eager on the CPU deviates from eager too, or, on the native path with the
    # Inductor executor, plain Inductor does, or on XLA eager torch_xla raises the same
    # error (not donate_xla's doing);
    # "numerics": on XLA, donate_xla equals eager CPU when the scenario runs in float64
    # (float32 rounding the program amplifies), or equals eager torch_xla, whose
    # arithmetic differs from the CPU's (never for a scenario with BatchNorm);
    # "failed": donate_xla deviates or raises
    status: str
    detail: str = ""
    source: str = ""


def difference(
    scenario: Scenario, expected: Run, got: Run, who: str, tol=(RTOL, ATOL), skip: frozenset = frozenset()
) -> Optional[str]:
    """The first difference between two runs of ``scenario``, or None; state entries
    named in ``skip`` are not compared."""
    if got.error is not None:
        text = "".join(traceback.format_exception_only(type(got.error), got.error))[-1500:]
        return f"{who} raised: {text}"
    for step, (exp, actual) in enumerate(zip(expected.snapshots, got.snapshots)):
        where = (
            "outputs at the end"
            if step == len(scenario.calls)
            else f"call {step} ({scenario.functions[scenario.calls[step]][0]})"
        )
        problem = _compare(exp[0], actual[0], f"{where} outputs", tol, skip) or _compare(
            exp[1], actual[1], f"{where} state", tol, skip
        )
        if problem:
            return problem
    return None


PATHS = ("xla", "native", "mesh", "cuda", "jax")


def _native_compiler() -> str:
    """The executor of donate_xla's native path (DONATE_XLA_NATIVE_COMPILER)."""
    from donate_backend import config

    return config.current().native_compiler


def _device(path: str) -> torch.device:
    if path == "native":
        return torch.device("cpu")
    if path == "jax":
        return donate_backend.jax_device()
    return torch_xla.device()


def check(seed: int, path: str = "xla") -> Outcome:
    """Generate scenario ``seed``, run it eagerly on the CPU and with donate_xla: on XLA
    (``path="xla"``); on XLA in SPMD mode, every tensor replicated over a 4-device mesh
    (``path="mesh"``, in a process started with DONATE_XLA_FUZZ_MESH=1 and
    CPU_NUM_DEVICES=4); or on the CPU, which is its native path (``path="native"``: the
    freeing backward and buffer reuse, with the executor DONATE_XLA_NATIVE_COMPILER names);
    or on the JAX device (``path="jax"``: the JAX target, torch 2.15 with jax)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "mesh" and os.environ.get(MESH_ENV) != "1":
        raise RuntimeError(f"path 'mesh' runs in a process started with {MESH_ENV}=1 (the CLI does that)")
    if path == "cuda":
        return _check_on_cuda(generate(seed))
    scenario = generate(seed)
    torch._dynamo.reset()
    expected = run(scenario, torch.device("cpu"), compiled=False)
    if expected.error is not None:
        return Outcome(seed, "invalid", f"eager: {type(expected.error).__name__}: {expected.error}")
    device = _device(path)
    got = run(scenario, device, compiled=True)
    torch._dynamo.reset()
    problem = difference(scenario, expected, got, "donate_xla")
    if problem is None:
        return Outcome(seed, "passed")
    reference = run(scenario, torch.device("cpu"), compiled=True, backend="aot_eager")
    torch._dynamo.reset()
    upstream = difference(scenario, expected, reference, "aot_eager")
    if upstream is not None:
        return Outcome(seed, "upstream", f"aot_eager on the CPU: {upstream}; donate_xla: {problem}", scenario.source())
    if path != "native" and _agrees_in_float64(scenario, device):
        return Outcome(
            seed, "numerics", f"float32 rounding: in float64 donate_xla equals eager CPU; in float32: {problem}",
            scenario.source(),
        )
    if path == "jax":  # every difference left is the JAX target's (no eager device of another's to blame)
        return Outcome(seed, "failed", problem, scenario.source())
    if path == "native":
        if _native_compiler() == "inductor":  # our executor is Inductor: its own deviations are upstream
            inductor = run(scenario, torch.device("cpu"), compiled=True, backend="inductor")
            torch._dynamo.reset()
            deviation = difference(scenario, expected, inductor, "inductor")
            if deviation is not None:
                return Outcome(seed, "upstream", f"Inductor on the CPU: {deviation}; donate_xla: {problem}",
                               scenario.source())
        # same device and arithmetic as the eager run: any other difference is ours
        return Outcome(seed, "failed", problem, scenario.source())
    device_eager = run(scenario, torch_xla.device(), compiled=False)
    if same_error(device_eager.error, got.error):
        # e.g. torch_xla's own sync() donating a buffer a clone still reads (docs/xla.md)
        return Outcome(seed, "upstream", f"eager torch_xla raises the same: {problem}", scenario.source())
    if _lost_to_a_data_copy(scenario, got.error):
        return Outcome(
            seed, "upstream",
            f"torch_xla's sync donated the buffer that t.data.copy_(u) shares with u (docs/xla.md): {problem}",
            scenario.source(),
        )
    # XLA's own arithmetic (e.g. gelu of large negatives is -3e-4 where the CPU gives 0):
    # donate_xla equal to eager torch_xla to float precision is not donate_xla's doing.
    # Except with BatchNorm, where eager torch_xla itself is wrong (biased running
    # variance, eval-mode gradients through batch statistics): agreeing with it proves nothing.
    eager_agrees = device_eager.error is None and difference(
        scenario, device_eager, got, "donate_xla", (1e-5, 1e-6)
    ) is None
    if "S.bn_avg(" in scenario.source() and (
        eager_agrees or difference(scenario, expected, got, "donate_xla", skip=_EAGER_ONLY_STATE) is None
    ):
        # dynamo cannot trace a BatchNorm with momentum=None: it runs eagerly in torch_xla
        # (biased running variance), outside anything donate_xla compiles
        return Outcome(seed, "upstream", f"eager torch_xla's BatchNorm (momentum=None): {problem}", scenario.source())
    if "S.bn(" in scenario.source():
        return Outcome(seed, "failed", problem, scenario.source())
    if eager_agrees:
        return Outcome(seed, "numerics", f"equals eager torch_xla; eager CPU differs: {problem}", scenario.source())
    return Outcome(seed, "failed", problem, scenario.source())


# state that eager torch_xla computes, never donate_xla (docs/xla.md, BatchNorm)
_EAGER_ONLY_STATE = frozenset({"bn_avg.running_var"})


def _check_on_cuda(scenario: Scenario) -> Outcome:
    """donate_xla's native path on a CUDA device against eager on that device: the same
    kernels run in both, so a difference is the freeing backward's, the buffer reuse's or
    the executor's, unless aot_eager (or, under the Inductor executor, Inductor) on CUDA
    shows it too."""
    if not torch.cuda.is_available():
        raise RuntimeError("path 'cuda' needs a CUDA device (torch.cuda.is_available() is False)")
    seed, device = scenario.seed, torch.device("cuda")
    torch._dynamo.reset()
    expected = run(scenario, device, compiled=False)
    if expected.error is not None:
        return Outcome(seed, "invalid", f"eager on CUDA: {type(expected.error).__name__}: {expected.error}")
    got = run(scenario, device, compiled=True)
    torch._dynamo.reset()
    problem = difference(scenario, expected, got, "donate_xla")
    if problem is None:
        return Outcome(seed, "passed")
    references = ("aot_eager", "inductor") if _native_compiler() == "inductor" else ("aot_eager",)
    for backend in references:
        reference = run(scenario, device, compiled=True, backend=backend)
        torch._dynamo.reset()
        deviation = difference(scenario, expected, reference, backend)
        if deviation is not None:
            return Outcome(seed, "upstream", f"{backend} on CUDA: {deviation}; donate_xla: {problem}",
                           scenario.source())
    return Outcome(seed, "failed", problem, scenario.source())


def _lost_to_a_data_copy(scenario: Scenario, error: Optional[BaseException]) -> bool:
    """Whether ``error`` is reading an upload ``u`` that eager code copied into a tensor
    with ``t.data.copy_(u)``: once a read has synced ``t``, both hold one buffer, and
    the sync after an in-place update of ``t`` donates it (plain torch_xla, no
    compiled call needed; docs/xla.md). Eager torch_xla can escape it by chance: a
    read of ``t`` inside the function gives ``t`` an IR node first."""
    if error is None or "while an async operation is in flight" not in str(error):
        return False
    match = re.match(r"reading (K\[\d+\]):", str(error))
    if match is None:
        return False
    copied = f"t.data.copy_({match.group(1)})"
    return any(copied in source for source in scenario.between.values()) or _lost_to_a_decayed_backup(
        scenario, match.group(1)
    )


def _lost_to_a_decayed_backup(scenario: Scenario, slot: str) -> bool:
    """Whether ``slot`` is a backup (``zeros_like(t).copy_(t)``) of a tensor that eager
    code decayed in place (``t.mul_(0.99)``) and then synced, after the fuzzer's
    snapshot had read both on the host: the read leaves the backup holding ``t``'s
    buffer, and the sync after the in-place update donates it (plain torch_xla, no
    compiled call needed; docs/xla.md, and ``tests/test_xla_fuzz.py`` keeps the
    repro). Eager torch_xla can escape it when ``t`` holds pending IR rather than a
    buffer of its own at the backup."""
    source = None  # what the backup copied, once a snapshot has read it
    for _, block in sorted(scenario.between.items()):
        current, backed_up, decayed = None, None, False
        for line in (line.strip() for line in block.splitlines()):
            if line.startswith("t = "):
                current = line[len("t = "):]
            elif line.startswith(f"{slot} = backup_of("):
                source, backed_up = None, current
            elif source is not None and line == "t.mul_(0.99)" and current == source:
                decayed = True
            elif decayed and line == "sync()":
                return True
        if backed_up is not None:
            source = backed_up  # read on the host by the snapshot after this block
    return False


def same_error(a: Optional[BaseException], b: Optional[BaseException]) -> bool:
    """Whether two runs raised the same error: same type and message, tensor ids and
    other numbers aside."""
    if a is None or b is None or type(a) is not type(b):
        return False
    return re.sub(r"\d+", "#", str(a)) == re.sub(r"\d+", "#", str(b))


def _agrees_in_float64(scenario: Scenario, device: torch.device) -> bool:
    """Whether ``scenario`` run in float64 (the default dtype for its tensors) gives
    donate_xla on ``device`` the eager CPU values to 1e-6: then its float32 difference
    is rounding the program amplifies (a group norm over two nearly equal values
    divides by their tiny spread), which XLA's arithmetic and the CPU's round
    differently; a donation or write-back error shows in float64 as well."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch._dynamo.reset()
        expected = run(scenario, torch.device("cpu"), compiled=False)
        got = run(scenario, device, compiled=True) if expected.error is None else None
        torch._dynamo.reset()
    finally:
        torch.set_default_dtype(previous)
    return got is not None and difference(scenario, expected, got, "donate_xla", FLOAT64_TOL) is None


# -- command line ------------------------------------------------------------------------

def _run_chunk(seeds: list[int], progress_path: str, path: str) -> list[dict]:
    outcomes = []
    for seed in seeds:
        with open(progress_path, "w") as f:
            f.write(str(seed))
        outcomes.append(dataclasses.asdict(check(seed, path)))
    return outcomes


def _worker_env(path: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    if path == "jax":
        env[JAX_ENV] = "1"
    if path == "mesh":
        env[MESH_ENV] = "1"
        if env["PJRT_DEVICE"] == "CPU":
            env["CPU_NUM_DEVICES"] = MESH_DEVICES
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=50, help="scenarios per fresh process")
    parser.add_argument("--out", default="fuzz-results.json")
    parser.add_argument(
        "--path", choices=PATHS, default="xla",
        help="xla: donate_xla on torch_xla's device; mesh: the same in SPMD mode on a 4-device "
        "mesh, tensors replicated; native: on the CPU (its native path); cuda: the native path "
        "on a CUDA device, against eager on that device; jax: the JAX target on jax_device()",
    )
    parser.add_argument(
        "--mixed", action="store_true",
        help="xla path: run each call stitched or not at random (DONATE_XLA_STITCH per call)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("SEEDS", "PROGRESS"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.mixed:
        os.environ[MIXED_ENV] = "1"  # the workers inherit it
    if opts.worker:
        seeds = json.loads(opts.worker[0])
        print(json.dumps(_run_chunk(seeds, opts.worker[1], opts.path)))
        return 0
    seeds = list(range(opts.start, opts.start + opts.count))
    outcomes: list[dict] = []
    started = time.time()
    progress = opts.out + ".progress"
    while seeds:
        chunk, seeds = seeds[: opts.chunk], seeds[opts.chunk :]
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(chunk), progress, "--path", opts.path],
            capture_output=True, text=True, env=_worker_env(opts.path),
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        if proc.returncode == 0 and lines:
            outcomes += json.loads(lines[-1])
        else:  # the process died: the scenario it was running is a failure, the rest run again
            with open(progress) as f:
                crashed = int(f.read())
            outcomes.append(
                dataclasses.asdict(
                    Outcome(crashed, "failed", f"process died (exit {proc.returncode}): {proc.stderr[-1500:]}",
                            generate(crashed).source())
                )
            )
            seeds = [s for s in chunk if s > crashed] + seeds
        done = len(outcomes)
        failed = sum(o["status"] == "failed" for o in outcomes)
        print(f"{done} scenarios, {failed} failed, {time.time() - started:.0f} s", flush=True)
    summary = {s: sum(o["status"] == s for o in outcomes) for s in ("passed", "invalid", "upstream", "numerics", "failed")}
    with open(opts.out, "w") as f:
        json.dump({"summary": summary, "outcomes": outcomes}, f, indent=1)
    print(json.dumps(summary))
    for o in outcomes:
        if o["status"] == "failed":
            print(f"\n--- seed {o['seed']}: {o['detail']}\n{o['source']}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
