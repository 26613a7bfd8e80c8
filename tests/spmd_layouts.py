"""SPMD training layouts, run eagerly and with donate_xla in one process (tests/test_xla_spmd.py).

Run as ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/spmd_layouts.py LAYOUT``; prints one
JSON line with both runs' losses, parameters, optimizer state and sharding specs, the alias
count against the donor count of every executable donate_xla ran, and the bytes transferred
while compiling.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()

import donate_backend  # noqa: E402
from donate_backend.xla import describe_mesh, mark_sharding  # noqa: E402
from donate_backend.xla.runtime import XlaExecutable  # noqa: E402

STEPS = 5
D_IN, WIDTH, D_OUT, BATCH = 16, 32, 8, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.fc3 = nn.Linear(WIDTH, D_OUT)

    def forward(self, x, shard=None):
        h = F.relu(self.fc1(x))
        if shard is not None:
            h = shard(h)
        h = F.relu(self.fc2(h))
        return self.fc3(h)


def mesh_for(layout: str) -> xs.Mesh:
    n = xr.global_runtime_device_count()
    if layout == "megatron_2d":
        return xs.Mesh(np.arange(n), (2, n // 2), ("data", "model"))
    if layout == "fsdpv2":  # the wrapper shards over the axis named "fsdp"
        return xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    return xs.Mesh(np.arange(n), (n, 1), ("data", "model"))


def build(layout: str, mesh: xs.Mesh, compiled: bool = True):
    """(model, optimizer, activation sharder or None) for a layout."""
    device = torch_xla.device()
    torch.manual_seed(0)
    model = MLP().to(device)
    shard_activation = None
    if layout in ("fsdp", "fsdp_activation"):  # weights, biases and (through them) optimizer state on dim 0
        for p in model.parameters():
            xs.mark_sharding(p, mesh, ("data",) + (None,) * (p.dim() - 1))
    if layout == "activation":  # an intermediate sharded inside the compiled function
        def shard_activation(h):
            return mark_sharding(h, mesh, ("data", None))
    if layout == "fsdp_activation":  # the same with the mesh described outside: no graph break
        described = describe_mesh(mesh)

        def shard_activation(h):
            return mark_sharding(h, described, ("data", None))
    if layout == "megatron_2d":  # fc1 column-parallel, fc2 row-parallel over "model"
        xs.mark_sharding(model.fc1.weight, mesh, ("model", None))
        xs.mark_sharding(model.fc1.bias, mesh, ("model",))
        xs.mark_sharding(model.fc2.weight, mesh, (None, "model"))
    elif layout == "fsdpv2":
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel as FSDPv2,
        )

        def shard_output(output, mesh):  # the wrapper's default (xs.mark_sharding) cannot be traced
            return mark_sharding(output, mesh, ("fsdp", None))

        model = FSDPv2(model, mesh=mesh, shard_output=shard_output if compiled else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, shard_activation


def batch(step: int, mesh: xs.Mesh):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, D_IN, generator=g).to(torch_xla.device())
    y = torch.randn(BATCH, D_OUT, generator=g).to(torch_xla.device())
    xs.mark_sharding(x, mesh, (mesh.axis_names[0], None))
    return x, y


def train(layout: str, backend: str) -> dict:
    mesh = mesh_for(layout)
    model, opt, shard_activation = build(layout, mesh, compiled=backend != "eager")

    def step(x, y):
        out = model(x, shard_activation) if shard_activation else model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = torch.compile(step, backend=backend) if backend != "eager" else step
    losses = []
    for i in range(STEPS):
        loss = run(*batch(i, mesh))
        torch_xla.sync()
        losses.append(loss.item())
    params = [getattr(p, "global_tensor", p) for p in model.parameters()]
    state = [v for s in opt.state.values() for k, v in sorted(s.items()) if k != "step"]
    return {
        "losses": losses,
        "params": [p.detach().cpu().tolist() for p in params],
        "state": [t.cpu().tolist() for t in state],
        "param_specs": torch_xla._XLAC._get_xla_sharding_specs(params),
        "state_specs": torch_xla._XLAC._get_xla_sharding_specs(state),
    }


def _sharding_annotations(records) -> int:
    """Sharding custom-calls in the HLO of the forward graphs (kept under debug)."""
    return sum(
        (r.lowered.hlo_text or "").count('custom_call_target="Sharding"')
        for r in records
        if r.kind == "forward" and r.lowered is not None
    )


def main(layout: str, variant: str = "") -> None:
    """``variant``: "" (as is), "donation_off" (the switch off), "budget" (activation
    budget 0.1: most activations recomputed in the backward)."""
    calls = []
    original = XlaExecutable.run

    def counted(self, args, device_args):
        out = original(self, args, device_args)
        calls.append((self.graph_name, len(self.last_call.donors), self.last_call.aliased))
        return out

    XlaExecutable.run = counted
    eager = train(layout, "eager")
    settings = dict(debug=True, donation=variant != "donation_off")
    if variant == "budget":
        settings["activation_budget"] = 0.1
    with donate_backend.config.patch(**settings):
        compiled = train(layout, "donate_xla")
    records = donate_backend.reports()
    print(json.dumps({
        "eager": eager,
        "donate_xla": compiled,
        "calls": calls,
        "transfers_while_compiling": sum(r.transfers_bytes for r in records),
        "donor_shardings": sorted({d.sharding for r in records for d in r.donated}),
        "forward_sharding_annotations": _sharding_annotations(records),
        "forward_graphs": len({r.graph_id for r in records if r.kind == "forward"}),
    }))


def rng_check() -> None:
    """Dropout on a sharded batch: a fresh mask every call, scaled as eager scales it."""
    mesh = mesh_for("dp")
    x = torch.ones(BATCH, 64).to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("data", None))
    drop = torch.compile(lambda t: F.dropout(t, 0.5, training=True), backend="donate_xla")
    masks = [drop(x).cpu() for _ in range(3)]
    print(json.dumps({
        "values": sorted({v for m in masks for v in m.unique().tolist()}),
        "kept_fraction": [float((m != 0).float().mean()) for m in masks],
        "distinct_masks": len({tuple(m.flatten().tolist()) for m in masks}),
    }))


def pending_results_check() -> None:
    """A compiled manual SGD update right after a compiled backward: the update's inputs
    are results of an execution that may still run. A sharded result not computed yet has
    no shards, and torch_xla 2.9 reads the first one for a buffer's handle or tag
    (undefined behaviour: a segfault now and then). Records, in order, donate_xla's
    executions, its waits for the devices and its reads of buffer handles or tags;
    counts the reads that meet a result not computed yet, and the reads that follow an
    execution with no wait between (what makes them possible); compares the weights
    with eager SPMD."""
    from donate_backend.xla import compat

    events, reads_of_pending = [], []

    def spy(kind, fn, is_read=False):
        def wrapper(*args, **kwargs):
            events.append(kind)
            if is_read:
                reads_of_pending.append(sum(bool(torch_xla._XLAC._is_placecholder(t)) for t in args[0]))
            return fn(*args, **kwargs)
        return wrapper

    compat.run_cached_graph = spy("execute", compat.run_cached_graph)
    compat.wait_device_ops = spy("wait", compat.wait_device_ops)
    compat.data_handles = spy("read", compat.data_handles, is_read=True)
    compat.device_data_nodes = spy("read", compat.device_data_nodes, is_read=True)
    device = torch_xla.device()
    # big enough that the backward may still run when the update is called
    start = [torch.randn(768, 768, generator=torch.Generator().manual_seed(k)) * 0.04 for k in range(6)]
    x_cpu = torch.randn(1024, 768, generator=torch.Generator().manual_seed(9))

    def train(compiled: bool) -> list:
        ws = [w.to(device).requires_grad_() for w in start]
        x = x_cpu.to(device)

        def loss_of(x):
            h = x
            for w in ws:
                h = torch.tanh(h @ w)
            return h.square().mean() * 100

        def update():
            with torch.no_grad():
                for w in ws:
                    w.sub_(0.5 * w.grad)
                    w.grad = None

        if compiled:
            loss_of = torch.compile(loss_of, backend="donate_xla")
            update = torch.compile(update, backend="donate_xla")
        for _ in range(STEPS):
            loss_of(x).backward()
            update()
        return [w.detach().cpu() for w in ws]

    eager = train(False)
    events.clear()
    reads_of_pending.clear()
    compiled = train(True)
    unsettled, executed = 0, False
    for kind in events:
        if kind == "execute":
            executed = True
        elif kind == "wait":
            executed = False
        else:
            unsettled += executed
    print(json.dumps({
        "reads_of_pending_results": sum(reads_of_pending),
        "reads": len(reads_of_pending),
        "reads_after_an_execution_without_a_wait": unsettled,
        "executions": events.count("execute"),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(eager, compiled)),
        "moved": max(float((a - w).abs().max()) for a, w in zip(eager, start)),
    }))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def shared_graph_check() -> None:
    """Four layers of one class, each its own frame (a graph break after each), so
    dynamo runs one compiled graph for all of them; their weights are sharded in
    turn on the output and on the input dimension (column- and row-parallel).
    3 SGD-momentum steps eagerly and with the layers compiled: losses, parameters,
    and each gradient's sharding right after the backward."""
    mesh = mesh_for("dp")
    device = torch_xla.device()
    torch.manual_seed(0)
    start = nn.ModuleList(_Layer() for _ in range(4))

    def run(compiled: bool) -> dict:
        layers = nn.ModuleList(_Layer() for _ in range(4))
        layers.load_state_dict(start.state_dict())
        layers.to(device)
        for i, layer in enumerate(layers):
            xs.mark_sharding(layer.lin.weight, mesh, ("data", None) if i % 2 == 0 else (None, "data"))
            if compiled:
                layer.compile(backend="donate_xla")
        optimizer = torch.optim.SGD(layers.parameters(), lr=0.05, momentum=0.9)
        losses, grad_specs = [], []
        for step in range(3):
            x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step)).to(device)
            xs.mark_sharding(x, mesh, ("data", None))
            h = x.requires_grad_()  # the first layer's input as the others': one graph for all
            for layer in layers:
                h = layer(h)
                torch._dynamo.graph_break()
            loss = h.square().mean()
            loss.backward()
            torch_xla.sync()
            grad_specs.append(torch_xla._XLAC._get_xla_sharding_specs([p.grad for p in layers.parameters()]))
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.append(loss.item())
        params = list(layers.parameters())
        return {
            "losses": losses,
            "params": [p.detach().cpu().flatten().tolist() for p in params],
            "param_specs": torch_xla._XLAC._get_xla_sharding_specs(params),
            "grad_specs": grad_specs,
        }

    eager = run(False)
    compiled = run(True)
    records = [r for r in donate_backend.reports() if r.path == "xla"]
    print(json.dumps({
        "eager": eager,
        "donate_xla": compiled,
        "forward_graphs": len({r.graph_id for r in records if r.kind == "forward"}),
        "forward_variants": sum(r.kind == "forward" for r in records),
        "backward_variants": sum(r.kind == "backward" for r in records),
    }))


def real_model_check(name: str, compile_how: str) -> None:
    """A real model (tests/real_models.py) FSDP-style on the mesh: every parameter whose
    first dimension the devices divide is sharded on it, the batch (4 sequences) on the
    batch dimension. 3 AdamW steps eagerly and with donate_xla, the model compiled
    (``model``) or the whole step (``step``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import real_models

    real = real_models.MODELS[name]
    mesh = mesh_for("dp")
    n = xr.global_runtime_device_count()
    device = torch_xla.device()

    def batch_of(seed: int) -> dict:
        ids = real_models._tokens(seed, batch=4).to(device)
        xs.mark_sharding(ids, mesh, ("data", None))
        return {"input_ids": ids, "labels": ids}

    def run(how: str) -> dict:
        model = real.build_on(device)
        for p in model.parameters():
            if p.shape[0] % n == 0:
                xs.mark_sharding(p, mesh, ("data",) + (None,) * (p.dim() - 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(module, batch):
            loss = real.loss(module, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        if how == "model":
            compiled = torch.compile(model, backend="donate_xla")
            call = lambda batch: step(compiled, batch)  # noqa: E731
        elif how == "step":
            call = torch.compile(lambda batch: step(model, batch), backend="donate_xla")
        else:
            call = lambda batch: step(model, batch)  # noqa: E731
        losses = []
        for seed in range(3):
            losses.append(call(batch_of(seed)).cpu().item())
            torch_xla.sync()
        params = list(model.parameters())
        return {
            "losses": losses,
            "params": [p.detach().cpu().flatten().tolist() for p in params],
            "param_specs": torch_xla._XLAC._get_xla_sharding_specs(params),
            "sharded_params": sum(p.shape[0] % n == 0 for p in params),
        }

    eager = run("eager")
    torch._dynamo.reset()
    compiled = run(compile_how)
    records = [r for r in donate_backend.reports() if r.path == "xla"]
    print(json.dumps({
        "eager": eager,
        "donate_xla": compiled,
        "graphs": len(records),
        "donated_sharded": sum(d.sharding.startswith("{devices=") for r in records for d in r.donated),
        "donated": sum(len(r.donated) for r in records),
    }))


if __name__ == "__main__":
    if sys.argv[1] == "rng":
        rng_check()
    elif sys.argv[1] == "pending":
        pending_results_check()
    elif sys.argv[1] == "shared":
        shared_graph_check()
    elif sys.argv[1] == "real":
        real_model_check(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
