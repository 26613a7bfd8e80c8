"""Worker side of the multi-process DDP tests (importable for ``mp.spawn``).

Each worker joins an N-rank gloo group on 127.0.0.1 and runs the lists of *jobs*
the parent sends it (tests/ddp_harness.py keeps the group from test to test).
A job trains eager DDP and ``torch.compile(ddp, backend="donate_xla")`` from
the same initial weights and data through the same *program* (a list of
steps), snapshots every parameter and ``.grad`` after every step, and puts one
result dict per job in a queue for the parent: the differences from eager DDP
on this rank, and what the backend did (slot writes, log lines, ...). The
parent (tests/test_ddp*.py) asserts on the results of every rank.

A step is a dict; ``kind`` says what it does:

- ``train``: forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad(set_to_none=...)``;
- ``accumulate``: forward and backward under ``no_sync()`` (no optimizer step);
- ``accumulate_subset``: forward under ``no_sync()``, ``backward(inputs=<a subset>)``;
- ``grad_input``: forward, ``torch.autograd.grad(loss, x)`` (``.grad`` must stay as it is);
- ``subset``: forward, ``backward(inputs=<a subset>)`` (eager DDP cannot take
  another synced step after it, so it ends a program);
- ``retain``: forward, ``backward(retain_graph=True)`` then ``backward()`` (the second is not reduced).

(Eager DDP refuses ``backward(create_graph=True)`` with "a leaf Variable that
requires grad is being used in an in-place operation"; tests/test_native_grads.py
covers create_graph without DDP.)

Other step keys: ``set_to_none`` (train), ``use_last`` (False leaves the last
layer unused), ``subset`` (parameter indices for the subset kinds),
``settings`` (a ``config.patch`` for the compiled run of this step only).

Job options: ``graph_break``, ``shared_graph`` (one compiled graph run for
every layer, with each layer's parameters), ``bucket_cap_mb``, ``param_hook`` (on ``hook_layer``, default 0), ``comm_hook``,
``optimizer_in_backward`` (an SGD update in a post-accumulate-grad hook),
``join`` (``{"divide_by_initial_world_size": bool, "from_step": n}``: rank r
runs r fewer steps, inside ``ddp.join(...)`` from step n), ``real_model`` (a
name in tests/real_models.py), ``compile_inner`` (compile the module inside DDP,
``DDP(model.compile())``, instead of the DDP module), ``inline_modules`` (False:
dynamo keeps parameters as graph attributes), ``exact`` (False: compare with ``tolerance``,
default rtol 1e-5, atol 1e-6), ``try_comm_hook_after``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = 512  # 1 MiB weights: bucket_cap_mb=1 gives several buckets and graph splits


class MLP(torch.nn.Module):
    """Four Linear layers; ``use_last=False`` leaves the last layer unused."""

    def __init__(self, width: int = WIDTH, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, use_last: bool = True, graph_break: bool = False, shared_graph: bool = False):
        if graph_break:  # two dynamo graphs: layers 0-1, then layers 2-3
            x = torch.relu(self.layers[1](torch.relu(self.layers[0](x))))
            torch._dynamo.graph_break()
            return torch.relu(self.layers[3](torch.relu(self.layers[2](x))))
        if shared_graph:
            # A graph break in the loop: dynamo compiles one graph for a layer and
            # runs it for all four, each time with that layer's parameters (as it
            # does for the experts of a mixture of experts).
            for layer in self.layers if use_last else self.layers[:-1]:
                torch._dynamo.graph_break()
                x = _relu_layer(layer, x)
            return x
        layers = self.layers if use_last else self.layers[:-1]
        for layer in layers:
            x = torch.relu(layer(x))
        return x


def _relu_layer(layer, x):
    return torch.relu(layer(x))


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _init(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


# ---- models ------------------------------------------------------------------


class MLPTask:
    """The 4-layer MLP, ``sum()`` as the loss, batches of 4 per rank."""

    exact = True  # eager is deterministic here: compare bitwise

    def __init__(self, options: dict):
        self.options = options

    def build(self):
        torch.manual_seed(0)
        return MLP()

    def batch(self, rank: int, step: int):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(4, WIDTH, generator=gen)

    def loss(self, run, x, step: dict):
        kwargs = {}
        if not step.get("use_last", True):
            kwargs["use_last"] = False
        for option in ("graph_break", "shared_graph"):
            if self.options.get(option):
                kwargs[option] = True
        return run(x, **kwargs).sum()

    def input_for_grad(self, x):
        return x.requires_grad_()


class RealModelTask:
    """A model of tests/real_models.py (tiny config, random weights)."""

    exact = False

    def __init__(self, options: dict):
        from real_models import MODELS

        self.spec = MODELS[options["real_model"]]

    def build(self):
        return self.spec.build()

    def batch(self, rank: int, step: int):
        return self.spec.batch(1000 * rank + step)

    def loss(self, run, batch, step: dict):
        return self.spec.loss(run, batch)


def _task(options: dict):
    return RealModelTask(options) if "real_model" in options else MLPTask(options)


# ---- one run (eager or compiled) -----------------------------------------------


def _make_ddp(task, options: dict, ddp_kwargs: dict, compiled: bool):
    model = task.build()
    for name, param in model.named_parameters():  # fine-tuning: DDP leaves frozen parameters out
        if any(name.startswith(prefix) for prefix in options.get("freeze", ())):
            param.requires_grad_(False)
    ddp = DDP(model, bucket_cap_mb=options.get("bucket_cap_mb", 1), **ddp_kwargs)
    if options.get("param_hook"):
        model.layers[options.get("hook_layer", 0)].weight.register_hook(lambda grad: grad * 2)
    if options.get("comm_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    if compiled and options.get("compile_inner"):
        model.compile(backend="donate_xla")  # DDP(compiled model): DDP's forward runs eagerly
        runner = ddp
    else:
        compile_options = options.get("compile_options")  # torch.compile(options=...)
        runner = torch.compile(ddp, backend="donate_xla", options=compile_options) if compiled else ddp
    return model, ddp, runner


def _snapshot(model):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
    }


def _subset(model, step: dict) -> list:
    params = list(model.parameters())
    return [params[i] for i in step.get("subset", [len(params) - 2])]  # default: last weight


def _run_step(task, model, ddp, runner, opt, step: dict, rank: int, index: int, hooks_seen: list):
    batch = task.batch(rank, index)
    kind = step["kind"]
    if kind in ("accumulate", "accumulate_subset"):
        with ddp.no_sync():
            loss = task.loss(runner, batch, step)
        if kind == "accumulate":
            loss.backward()
        else:
            loss.backward(inputs=_subset(model, step))
    elif kind == "grad_input":
        x = task.input_for_grad(batch)
        (grad_x,) = torch.autograd.grad(task.loss(runner, x, step), x)
        hooks_seen.append((f"step {index} grad x", grad_x.detach().clone()))
    elif kind == "subset":
        task.loss(runner, batch, step).backward(inputs=_subset(model, step))
    elif kind == "retain":
        loss = task.loss(runner, batch, step)
        loss.backward(retain_graph=True)
        loss.backward()
    elif kind == "train":
        task.loss(runner, batch, step).backward()
    else:
        raise ValueError(f"unknown step kind {kind!r}")
    snapshot = _snapshot(model)
    if kind == "train":
        opt.step()
        opt.zero_grad(set_to_none=step.get("set_to_none", True))
    return snapshot


def _optimizer_in_backward(model, seen: list):
    """SGD applied per parameter from a post-accumulate-grad hook (optimizer in backward)."""
    handles = []

    def make_hook(index):
        def hook(param):
            seen.append((f"param {index}", param.grad.detach().clone()))
            with torch.no_grad():
                param.add_(param.grad, alpha=-0.01)

        return hook

    for index, param in enumerate(model.parameters()):
        handles.append(param.register_post_accumulate_grad_hook(make_hook(index)))
    return handles


def _train(compiled: bool, rank: int, job: dict):
    from donate_backend import config, ddp as ddp_path

    options = job.get("options", {})
    task = _task(options)
    model, ddp, runner = _make_ddp(task, options, job.get("ddp_kwargs", {}), compiled)
    opt = torch.optim.SGD(model.parameters(), lr=options.get("lr", 0.01))
    seen: list = []  # post-accumulate-grad hook values, autograd.grad results
    if options.get("optimizer_in_backward"):
        _optimizer_in_backward(model, seen)
    snapshots, observed = [], {"slot_writes": [], "out_writes": [], "buckets_reduced": [],
                               "in_buckets": [], "bucket_mode": []}
    program = list(job["program"])
    join = options.get("join")
    join_context = contextlib.nullcontext()
    if join is not None:
        # Uneven inputs: rank r runs r fewer steps inside the Join context.
        program = program[: len(program) - rank]
        join_from = join.get("from_step", 0)
    for index, step in enumerate(program):
        if join is not None and index == join_from:
            join_context = ddp.join(
                divide_by_initial_world_size=join["divide_by_initial_world_size"]
            )
            join_context.__enter__()
        patch = step.get("settings", {}) if compiled else {}
        with config.patch(**patch):
            snapshots.append(_run_step(task, model, ddp, runner, opt, step, rank, index, seen))
        if compiled:
            binding = ddp_path.binding_of(ddp)
            counts = binding.counts if binding is not None else None
            observed["slot_writes"].append(0 if counts is None else counts.slot_writes)
            observed["out_writes"].append(0 if counts is None else counts.out_writes)
            observed["buckets_reduced"].append(0 if counts is None else counts.buckets_reduced)
            observed["in_buckets"].append(_grads_in_buckets(binding))
            observed["bucket_mode"].append(binding is not None and binding.state is not None)
    if join is not None:
        if len(program) <= join_from:  # this rank ran out of data before the Join began
            join_context = ddp.join(
                divide_by_initial_world_size=join["divide_by_initial_world_size"]
            )
            join_context.__enter__()
        join_context.__exit__(None, None, None)  # joined ranks shadow the others' steps
        snapshots.append(_snapshot(model))
    if compiled:
        observed["final"] = _final_checks(ddp, options)
    return snapshots, seen, observed


def _grads_in_buckets(binding) -> bool:
    """Every ``param.grad`` lies inside the storage of one of our learned bucket slots."""
    state = None if binding is None else binding.state
    if state is None:
        return False
    ranges = []
    for index in range(len(state.params)):
        slot = state.slot(index)
        if slot is not None:
            storage = slot.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    if not ranges:
        return False
    for p in state.params:
        if p.grad is None:
            continue
        start = p.grad.data_ptr()
        end = start + p.grad.numel() * p.grad.element_size()
        if not any(lo <= start and end <= hi for lo, hi in ranges):
            return False
    return True


def _final_checks(ddp, options: dict) -> dict:
    """The module's state after the program: bucket views as given, and whether a
    user comm hook can be registered (it cannot while our hook is on the reducer)."""
    data = ddp._get_ddp_logging_data()
    final = {
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "bucket_sizes": data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes"),
    }
    if options.get("try_comm_hook_after"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        try:
            ddp.register_comm_hook(None, allreduce_hook)
            final["comm_hook_registered"] = True
        except RuntimeError as error:
            final["comm_hook_registered"] = str(error).splitlines()[0]
    return final


# ---- comparison --------------------------------------------------------------


def _differ(x, y, exact: bool, tolerance: dict):
    if exact:
        return not torch.equal(x, y)
    return not torch.allclose(x, y, **tolerance)


def compare(eager, compiled, exact: bool, tolerance=None) -> list:
    """Mismatch descriptions (empty when everything matches: bitwise when ``exact``)."""
    tolerance = tolerance or {"rtol": 1e-5, "atol": 1e-6}
    problems = []
    for step, (a, b) in enumerate(zip(eager, compiled)):
        for kind in ("params", "grads"):
            for i, (x, y) in enumerate(zip(a[kind], b[kind])):
                if (x is None) != (y is None):
                    problems.append(f"step {step} {kind}[{i}]: None mismatch (eager {x is None}, ours {y is None})")
                elif x is not None and _differ(x, y, exact, tolerance):
                    diff = (x - y).abs().max().item()
                    problems.append(f"step {step} {kind}[{i}]: max diff {diff}")
    if len(eager) != len(compiled):
        problems.append(f"{len(eager)} eager snapshots, {len(compiled)} compiled")
    return problems


def _run_job(rank: int, job: dict) -> dict:
    if "call" in job:  # a job another test file defines: "module:function", called with the rank
        import importlib

        module, name = job["call"].split(":")
        return {"rank": rank, "job": job["name"], **getattr(importlib.import_module(module), name)(rank)}
    from donate_backend import config, report

    from donate_backend.ddp import integration

    capture = LogCapture()
    logger = logging.getLogger("donate_xla")
    report.clear_reports()
    # as in a fresh process: a message logged once per process (keyed by a module's id,
    # which a later job's module may reuse) is logged again for this job
    integration._logged.clear()
    torch._dynamo.reset()
    eager, eager_seen, _ = _train(False, rank, job)
    torch._dynamo.reset()
    logger.addHandler(capture)
    try:
        inline = job.get("options", {}).get("inline_modules", True)
        with config.patch(**job.get("settings", {})), torch._dynamo.config.patch(
            inline_inbuilt_nn_modules=inline
        ):
            compiled, seen, observed = _train(True, rank, job)
    finally:
        logger.removeHandler(capture)
    options = job.get("options", {})
    exact = options.get("exact", _task(options).exact)
    problems = compare(eager, compiled, exact, options.get("tolerance"))
    # Hooks may fire in another order across parameters; per parameter, the
    # firings and their values must be eager's.
    eager_seen = sorted(eager_seen, key=lambda item: item[0])
    seen = sorted(seen, key=lambda item: item[0])
    if [tag for tag, _ in eager_seen] != [tag for tag, _ in seen]:
        problems.append(f"hook firings / autograd.grad results differ: eager {len(eager_seen)}, ours {len(seen)}")
    for (tag, a), (_, b) in zip(eager_seen, seen):
        if _differ(a, b, exact, options.get("tolerance") or {"rtol": 1e-5, "atol": 1e-6}):
            problems.append(f"{tag}: max diff {(a - b).abs().max().item()}")
    records = [r for r in report.reports() if r.kind == "backward"]
    return {
        "rank": rank,
        "job": job["name"],
        "problems": problems,
        **observed,
        "bucket_grads": [r.bucket_grads for r in records],
        "bucket_bytes": [r.bucket_bytes for r in records],
        "logs": capture.lines,
    }


def serve(rank, world_size, port, inboxes, queue):
    """A rank that stays in its group from test to test: it runs each list of jobs the
    parent puts in its inbox (one queue entry per job) until it gets ``None``. After a
    failure it reports it (one error entry) and leaves: the ranks may be out of step,
    so the parent starts another group."""
    try:
        _init(rank, world_size, port)
        inbox = inboxes[rank]
        while True:
            jobs = inbox.get()
            if jobs is None:
                break
            for job in jobs:
                queue.put(_run_job(rank, job))
                dist.barrier()
        dist.destroy_process_group()
    except Exception:  # report the failure to the parent instead of hanging it
        queue.put({"rank": rank, "error": traceback.format_exc()})
