"""Rank side of tests/test_fsdp2.py: FSDP2 (``fully_shard``) eager against donate_xla.

Run in the gloo ranks of tests/ddp_harness.py (their process group is up) as
``"call": "fsdp2_workers:<case name>"`` jobs; the module's ``__getattr__`` turns a
name of ``CASES`` into the function the harness calls with the rank. A case trains a
small model sharded with FSDP2 over both ranks (a ``DeviceMesh`` on the CPU) for
``STEPS`` optimizer steps eagerly and with donate_xla, from the same weights and data,
and returns the differences of the losses, of every gradient (before each optimizer step) and
of every parameter (after the last step), all as full tensors, plus what donate_xla
compiled (its graph records). The test asserts on the results of every rank.

A case: ``how`` compiles

- ``whole``: ``torch.compile(model)`` of the root ``fully_shard`` module;
- ``block``: each sharded block, ``block.compile()`` after ``fully_shard(block)`` (what
  FSDP2 users do);
- ``inner``: the layers inside each block before ``fully_shard(block)`` (docs/trainers.md's
  recipe);

``options``: ``torch.compile(..., options=...)``; ``bf16_params``: FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
``reshard_after_forward``: given to every ``fully_shard``; ``optimizer``: ``sgd`` or ``adamw``;
``micro_batches``: backward passes accumulated per optimizer step; ``baseline``: also
compile with no options and return its records (what a lever changed).

The blocks are modules of this file (as a transformer's blocks are the user's): with
``nn.Sequential`` units (tests/test_trainers.py), whose forward is torch's own code,
dynamo captured no graph for ``whole`` or ``block`` on torch 2.9.0 or 2.15.0.
"""
from __future__ import annotations

import traceback

import torch

WIDTH = 32
BATCH = 16
BLOCKS = 2
STEPS = 3

CASES = {
    "whole": dict(how="whole", optimizer="adamw"),
    "block": dict(how="block", optimizer="sgd"),
    "block_accumulate": dict(how="block", optimizer="sgd", micro_batches=2),
    "block_bf16_params": dict(how="block", optimizer="sgd", bf16_params=True),
    "block_no_reshard": dict(how="block", optimizer="sgd", reshard_after_forward=False),
    "inner": dict(how="inner", optimizer="sgd"),
    "block_activation_budget": dict(how="block", optimizer="sgd", options={"activation_budget": 0.3},
                                    baseline=True),
    "block_memory_limit": dict(how="block", optimizer="sgd", options={"memory_limit": "1GiB"}),
    "whole_activation_budget": dict(how="whole", optimizer="adamw", options={"activation_budget": 0.3},
                                    baseline=True),
}


def fully_shard_api():
    """``fully_shard`` where this torch has it (``torch.distributed.fsdp`` from 2.6,
    ``torch.distributed._composable.fsdp`` before), or None."""
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard

        return fully_shard
    except ImportError:
        return None


class Block(torch.nn.Module):
    """A residual MLP block; GELU gives the activation budget something to recompute."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _full(tensor):
    """A DTensor's full value (all-gathered), a plain tensor as it is; detached copies."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def _train(rank: int, mesh, case: dict, compiled: bool, options) -> dict:
    import donate_backend

    fully_shard = fully_shard_api()
    how = case["how"]
    torch._dynamo.reset()
    donate_backend.clear_reports()
    torch.manual_seed(0)
    net = Net()
    shard_kwargs = {"mesh": mesh}
    if "reshard_after_forward" in case:
        shard_kwargs["reshard_after_forward"] = case["reshard_after_forward"]
    if case.get("bf16_params"):
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # before torch 2.6, beside fully_shard
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        shard_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in net.blocks:
        if compiled and how == "inner":
            block.fc1.compile(backend="donate_xla", options=options)
            block.fc2.compile(backend="donate_xla", options=options)
        fully_shard(block, **shard_kwargs)
        if compiled and how == "block":
            block.compile(backend="donate_xla", options=options)
    fully_shard(net, **shard_kwargs)
    run = torch.compile(net, backend="donate_xla", options=options) if compiled and how == "whole" else net
    if case["optimizer"] == "adamw":
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    micro_batches = case.get("micro_batches", 1)
    losses, grads = [], []
    for step in range(STEPS):
        for micro in range(micro_batches):
            gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            loss = run(torch.randn(BATCH, WIDTH, generator=gen)).square().mean()
            (loss / micro_batches).backward()
            losses.append(loss.detach().clone())
        grads.append({name: None if p.grad is None else _full(p.grad) for name, p in net.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    records = [
        {"graph_id": r.graph_id, "kind": r.kind, "path": r.path, "num_inputs": r.num_inputs,
         "saved_freed_early": r.saved_freed_early, "budget_choice": r.budget_choice}
        for r in donate_backend.reports()
    ]
    return {"losses": torch.stack(losses), "grads": grads,
            "params": {name: _full(p) for name, p in net.named_parameters()}, "records": records}


def _differences(eager: dict, compiled: dict) -> list:
    """Every value that is not bitwise equal (the native path runs the same ATen kernels
    on the same shards in the same order as eager FSDP2)."""
    problems = []

    def check(what, a, b):
        if (a is None) != (b is None):
            problems.append(f"{what}: None in one run only (eager {a is None}, compiled {b is None})")
        elif a is not None and not torch.equal(a, b):
            problems.append(f"{what}: max diff {(a - b).abs().max().item()}")

    check("losses", eager["losses"], compiled["losses"])
    for step, (a, b) in enumerate(zip(eager["grads"], compiled["grads"])):
        for name in a:
            check(f"step {step} grad {name}", a[name], b[name])
    for name in eager["params"]:
        check(f"param {name}", eager["params"][name], compiled["params"][name])
    return problems


def run_case(rank: int, name: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    case = CASES[name]
    if fully_shard_api() is None:
        return {"skip": f"torch {torch.__version__} has no FSDP2 fully_shard"}
    world = dist.get_world_size()
    try:
        mesh = init_device_mesh("cpu", (world,))
        eager = _train(rank, mesh, case, compiled=False, options=None)
    except Exception:  # FSDP2 itself does not run here: not donate_xla's to test
        return {"skip": "eager FSDP2 does not run on CPU/gloo here: "
                        + traceback.format_exc().strip().splitlines()[-1]}
    compiled = _train(rank, mesh, case, compiled=True, options=case.get("options"))
    result = {"problems": _differences(eager, compiled), "records": compiled["records"],
              "losses": compiled["losses"], "torch": torch.__version__}
    if case.get("baseline"):
        baseline = _train(rank, mesh, case, compiled=True, options=None)
        result["baseline_records"] = baseline["records"]
        result["baseline_problems"] = _differences(eager, baseline)
    torch._dynamo.reset()
    return result


def __getattr__(name: str):
    """``fsdp2_workers.<case name>``: the job function tests/ddp_harness.py calls with the rank."""
    if name in CASES:
        return lambda rank: run_case(rank, name)
    raise AttributeError(name)
