"""Trainers people already use, driven as their docs say, against the same trainer uncompiled.

HF ``Trainer`` (the model compiled with ``model.compile(backend="donate_xla")`` before it is
handed over) on the CPU and on XLA (with ``donate_backend.trainers.compile_optimizer_step``,
so that the optimizer step is compiled and donates); Lightning's ``Trainer`` and ``Fabric``
on one CPU process, and Fabric's ``ddp`` strategy on two gloo ranks (tests/ddp_harness.py);
FSDP2 (``fully_shard``) on one gloo rank; an HF Trainer checkpoint resumed in a new process.
Each runs a few steps of a
tiny model with gradient accumulation, clipping, a warmup + cosine schedule and an
evaluation, and its losses and final parameters must match the same trainer run without
compilation. The recipes are in docs/trainers.md.

Run as a script (``python tests/test_trainers.py measure``), it measures the bytes donated
and the live growth of an HF Trainer step on XLA with and without the compiled optimizer
step (docs/trainers.md).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch

import donate_backend
from donate_backend.trainers import ZeroLearningRateWarning, compile_optimizer_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON  # noqa: E402
from real_models import _tokens, gpt2  # noqa: E402

STEPS = 3
# Compiled and eager AdamW differ in the last bits of an update; three steps keep that
# far below the tolerance (measured: 5e-7 on XLA, 0 on the native path).
TOL = dict(rtol=1e-4, atol=1e-5)


def _needs(module: str):
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"{module} is not installed: the trainer tests need the test extra "
                    f"(pip install -e '.[test]')")


def _assert_same(expected: dict, actual: dict, **tol) -> None:
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=lambda m, k=key: f"{k}: {m}", **(tol or TOL))


# ----------------------------------------------------------------------------- HF Trainer


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seed: int):
        self.ids = _tokens(seed, batch=count)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@contextlib.contextmanager
def _trainer_on_cpu():
    """What ``USE_TORCH_XLA=0`` does, for a process that has imported transformers and
    accelerate already: with torch_xla importable, accelerate sends the Trainer to XLA even
    with ``use_cpu=True``. Both libraries read the variable once, into these flags."""
    import accelerate.utils.imports as accelerate_imports
    import transformers.trainer  # noqa: F401  (imported with the flags as they were: it imports torch_xla)
    import transformers.utils.import_utils as transformers_imports

    saved = accelerate_imports._torch_xla_available, transformers_imports._torch_xla_available
    accelerate_imports._torch_xla_available = transformers_imports._torch_xla_available = False
    _clear_caches(accelerate_imports, transformers_imports)
    try:
        yield
    finally:
        accelerate_imports._torch_xla_available, transformers_imports._torch_xla_available = saved
        _clear_caches(accelerate_imports, transformers_imports)


def _clear_caches(*modules):
    for module in modules:
        module.is_torch_xla_available.cache_clear()


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def hf_train(*, compiled: bool, device=None, optimizer_step: bool = False, callbacks=(), steps=STEPS, model_fn=gpt2,
             batches: int = 16, output_dir=None, resume_from=None) -> dict:
    """The HF Trainer as a user sets it up: accumulation, clipping, warmup + cosine, an
    evaluation at the end. Returns the evaluation loss, the training loss and the final
    parameters (on the host). With ``output_dir``, a checkpoint is saved after every
    optimizer step; with ``resume_from``, training resumes from that checkpoint."""
    import transformers

    _reset_accelerate()
    torch.manual_seed(0)
    model = model_fn()
    if device is not None:
        model = model.to(device)  # before the optimizer: the Trainer checks that they agree
    if compiled:
        model.compile(backend="donate_xla")
    # An optimizer of our own: the Trainer's default (adamw_torch_fused) refuses XLA tensors.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizers = (compile_optimizer_step(opt) if optimizer_step else opt, None)
    args = transformers.TrainingArguments(
        output_dir or tempfile.mkdtemp(prefix="donate_xla_trainer_"), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1, lr_scheduler_type="cosine",
        max_grad_norm=1.0, eval_strategy="no", per_device_eval_batch_size=2, logging_steps=1,
        save_strategy="steps" if output_dir else "no", save_steps=1, report_to=[], use_cpu=device is None,
        dataloader_num_workers=0, seed=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(batches, 1),
                                   eval_dataset=_Tokens(4, 2), optimizers=optimizers, callbacks=list(callbacks))
    output = trainer.train(resume_from_checkpoint=resume_from)
    metrics = trainer.evaluate()
    return {
        "device": str(trainer.args.device),
        "eval_loss": torch.tensor(metrics["eval_loss"]),
        "train_loss": torch.tensor(output.training_loss),
        **{name: p.detach().cpu().clone() for name, p in model.named_parameters()},
    }


@pytest.fixture(scope="module")
def hf_reference():
    """The Trainer without compilation, on the CPU (once per process)."""
    _needs("transformers")
    _needs("accelerate")
    with _trainer_on_cpu():
        result = hf_train(compiled=False)
    assert result.pop("device") == "cpu"
    return result


def test_hf_trainer_native_model_compiled_before_the_trainer(hf_reference):
    with _trainer_on_cpu():
        result = hf_train(compiled=True)
    assert result.pop("device") == "cpu"
    _assert_same(hf_reference, result)
    kinds = {(r.path, r.kind) for r in donate_backend.reports()}
    assert {("native", "forward"), ("native", "backward"), ("native", "inference")} <= kinds


def test_hf_trainer_native_checkpoint_resumed_in_a_fresh_process(hf_reference, tmp_path):
    """A compiled Trainer saves a checkpoint after each step; a new process builds the
    compiled model again and resumes from the first one (weights, AdamW state, schedule and
    RNG from the checkpoint): it ends where the uninterrupted uncompiled run ends."""
    with _trainer_on_cpu():
        hf_train(compiled=True, output_dir=str(tmp_path / "run"))
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / "optimizer.pt").exists() and (checkpoint / "scheduler.pt").exists()
    out = tmp_path / "resumed.pt"
    env = dict(os.environ, USE_TORCH_XLA="0")  # the CPU, with torch_xla installed (docs/trainers.md)
    done = subprocess.run([sys.executable, __file__, "resume", str(checkpoint), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = torch.load(out)
    assert resumed.pop("device") == "cpu"
    assert resumed.pop("graphs") >= 2  # forward and backward reached donate_xla in the new process
    # the training loss averages the steps each process ran; evaluation and weights must agree
    resumed.pop("train_loss")
    _assert_same({k: v for k, v in hf_reference.items() if k != "train_loss"}, resumed)


def _resume(checkpoint: str, out: str) -> None:
    """``python tests/test_trainers.py resume CHECKPOINT OUT``: the second process of the test above."""
    donate_backend.clear_reports()
    result = hf_train(compiled=True, resume_from=checkpoint)
    result["graphs"] = len(donate_backend.reports())
    torch.save(result, out)


def test_hf_trainer_xla_with_the_optimizer_step_compiled(hf_reference):
    if not HAS_TORCH_XLA:
        pytest.skip(XLA_SKIP_REASON)
    import torch_xla

    # The schedule's first step has lr == 0.0: that step runs eagerly, with a warning.
    with pytest.warns(ZeroLearningRateWarning, match="learning rate of 0.0"):
        result = hf_train(compiled=True, device=torch_xla.device(), optimizer_step=True)
    assert result.pop("device").startswith("xla")
    _assert_same(hf_reference, result)
    records = donate_backend.reports()
    assert all(r.path == "xla" for r in records)
    # One optimizer graph for every learning rate of the schedule (no recompilation);
    # it donates the parameters and both AdamW moments, and only it donates.
    steps = [r for r in records if r.donated_bytes > 0]
    assert len(steps) == 1 and steps[0].kind == "inference"
    params = sum(v.numel() * v.element_size() for k, v in result.items() if "loss" not in k)
    # GPT-2 ties its LM head to the embedding: named_parameters lists it once.
    assert steps[0].donated_bytes == 3 * params


# ------------------------------------------------------------ the compiled optimizer step


def _tiny_adamw_run(step_fn, lrs, seed=0):
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(8, 4)
    opt = torch.optim.AdamW(emb.parameters(), lr=lrs[0])
    opt = step_fn(opt)
    for lr in lrs:
        for group in opt.param_groups:
            group["lr"] = lr
        emb(torch.tensor([0, 1])).square().sum().backward()  # rows 2..7 get zero gradients
        opt.step()
        opt.zero_grad()
    return emb.weight.detach().clone(), opt


def test_compiled_optimizer_step_values_warning_and_one_graph():
    lrs = [0.0, 1e-3, 5e-4, 2e-4]
    eager, _ = _tiny_adamw_run(lambda opt: opt, lrs)
    with pytest.warns(ZeroLearningRateWarning):
        compiled, opt = _tiny_adamw_run(compile_optimizer_step, lrs)
    assert not compiled.isnan().any()
    torch.testing.assert_close(compiled, eager, **TOL)
    # Three learning rates, one graph: the step reads them from a tensor.
    assert len([r for r in donate_backend.reports() if r.kind == "inference"]) == 1
    # Between steps param_groups hold the user's floats; the helper applies once.
    assert all(type(group["lr"]) is float for group in opt.param_groups)
    assert compile_optimizer_step(opt) is opt


def test_compiled_optimizer_step_without_zero_lr_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroLearningRateWarning)
        weights, _ = _tiny_adamw_run(compile_optimizer_step, [1e-3, 1e-3])
    assert not weights.isnan().any()


def test_compiled_optimizer_step_keeps_the_scheduler_and_closure_working():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    opt = compile_optimizer_step(torch.optim.SGD(lin.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    x = torch.randn(3, 4)

    def closure():
        opt.zero_grad()
        loss = lin(x).square().sum()
        loss.backward()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        assert torch.is_tensor(opt.step(closure))  # a closure runs eagerly
        sched.step()
        lin(x).square().sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0 / 3 * 0.1)


# -------------------------------------------------------------------------------- Lightning


def _regression_data(count: int = 16):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(count, 8, generator=gen), torch.randn(count, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


class _Net(torch.nn.Module):
    """The MLP inside a module of the user's own: a compiled DDP whose module is a bare
    ``nn.Sequential`` captures no graph at all (dynamo does not start tracing in torch.nn's
    own code), and runs eagerly (docs/ddp.md)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()

    def forward(self, x):
        return self.body(x)


def _lightning_trainer(compiled: bool):
    import lightning

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def validation_step(self, batch, index):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    class Losses(lightning.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            self.losses.append(outputs["loss"].detach().clone())

    torch.manual_seed(0)
    module = Regression()
    losses = Losses()
    trainer = lightning.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, accumulate_grad_batches=2, gradient_clip_val=1.0,
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses], default_root_dir=tempfile.mkdtemp(prefix="donate_xla_lightning_"),
    )
    trainer.fit(torch.compile(module, backend="donate_xla") if compiled else module,
                _regression_data(), _regression_data())
    return {"losses": torch.stack(losses.losses), "val_loss": trainer.callback_metrics["val_loss"].clone(),
            **{k: v.detach().clone() for k, v in module.state_dict().items()}}


def _fabric(compiled: bool):
    import lightning

    torch.manual_seed(0)
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    net = _mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = fabric.setup(torch.compile(net, backend="donate_xla") if compiled else net, opt)
    losses = _fabric_loop(fabric, model, opt, fabric.setup_dataloaders(_regression_data()))
    return {"losses": losses, **{k: v.detach().clone() for k, v in net.state_dict().items()}}


def _fabric_loop(fabric, model, opt, loader) -> torch.Tensor:
    """Accumulation over two micro-batches (``no_backward_sync``), clipping; the losses."""
    losses = []
    for index, (x, y) in enumerate(loader):
        accumulating = index % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / 2)
        losses.append(loss.detach().clone())
        if not accumulating:
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
    return torch.stack(losses)


@pytest.mark.parametrize("client", ["trainer", "fabric"])
def test_lightning_compiled_module(client):
    _needs("lightning")
    run = _lightning_trainer if client == "trainer" else _fabric
    eager = run(compiled=False)
    compiled = run(compiled=True)
    _assert_same(eager, compiled)
    assert any(r.kind == "backward" for r in donate_backend.reports())


def _fabric_ddp(fabric, compiled: bool) -> tuple:
    """Fabric's DDP with accumulation (``no_backward_sync``) and clipping, on this rank's
    quarter of the data; the DDP module, to read donate_xla's bucket writes from."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = fabric.setup(torch.compile(net, backend="donate_xla") if compiled else net, opt)
    # three optimizer steps on each rank: DDP rebuilds its buckets after the first
    loader = fabric.setup_dataloaders(_regression_data(48), use_distributed_sampler=True)
    losses = _fabric_loop(fabric, model, opt, loader)
    wrapped = model._forward_module
    ddp = getattr(wrapped, "_orig_mod", wrapped)
    assert isinstance(ddp, DistributedDataParallel), type(ddp)
    result = {"losses": losses, **{k: v.detach().clone() for k, v in net.state_dict().items()}}
    return result, ddp


def fabric_ddp_job(rank: int) -> dict:
    """Run in a gloo rank of tests/ddp_harness.py (its process group is up): Fabric's
    ``strategy="ddp"`` as if its ranks had been started by a launcher (``torchrun`` sets
    these variables), eager and compiled. Returns both runs and the bucket writes."""
    import lightning

    from donate_backend.ddp import integration

    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    try:
        fabric = lightning.Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()  # the ranks exist already: nothing is started
        torch._dynamo.reset()
        eager, _ = _fabric_ddp(fabric, compiled=False)
        torch._dynamo.reset()
        donate_backend.clear_reports()
        compiled, ddp = _fabric_ddp(fabric, compiled=True)
        binding = integration.binding_of(ddp)
        slot_writes = 0 if binding is None else binding.counts.slot_writes
        return {"eager": eager, "compiled": compiled, "slot_writes": slot_writes,
                "kinds": sorted({r.kind for r in donate_backend.reports()})}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_lightning_fabric_ddp_on_two_gloo_ranks_writes_gradients_into_the_buckets():
    _needs("lightning")
    import ddp_harness

    results = ddp_harness.run_job({"name": "fabric_ddp", "call": "test_trainers:fabric_ddp_job"})
    for result in results:
        _assert_same(result["eager"], result["compiled"])
        assert "backward" in result["kinds"]
        assert result["slot_writes"] > 0, "no gradient was written into a DDP bucket"
    # the ranks trained on different data and ended with the same parameters
    _assert_same({k: v for k, v in results[0]["eager"].items() if k != "losses"},
                 {k: v for k, v in results[1]["eager"].items() if k != "losses"})


# ------------------------------------------------------------------------------------ FSDP2


def _fsdp2(mesh, compiled: bool):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Sequential(_mlp()[:2]), torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()),
                              torch.nn.Linear(16, 1))
    for block in net[:2]:
        if compiled:
            # The layers inside a sharded unit: dynamo skips FSDP's hooks, so compiling
            # the unit itself (or the whole model) compiles nothing.
            block[0].compile(backend="donate_xla")
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        for _ in range(2):  # accumulation
            loss = net(torch.randn(4, 8, generator=gen)).square().mean()
            (loss / 2).backward()
            losses.append(loss.detach().clone())
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"losses": torch.stack(losses), **{k: v.full_tensor().clone() for k, v in net.state_dict().items()}}


def test_fsdp2_one_gloo_rank():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        eager = _fsdp2(mesh, compiled=False)
        compiled = _fsdp2(mesh, compiled=True)
    finally:
        dist.destroy_process_group()
    _assert_same(eager, compiled)
    kinds = {r.kind for r in donate_backend.reports()}
    if torch.__version__.startswith("2.9."):
        # torch 2.9 never enters dynamo for a module inside an FSDP2 unit (nor for the
        # unit or the model compiled whole): the step runs eagerly (docs/trainers.md).
        assert kinds == set()
    else:
        assert kinds == {"forward", "backward"}


# ------------------------------------------------------------------ measured (run by hand)


def _measure(optimizer_step: bool) -> dict:
    """One HF Trainer run on XLA (this process is fresh): bytes donated, and the live
    growth (peak - trough RSS) over steps 4 to 8, after the warm-up steps compiled."""
    import torch_xla

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    import transformers

    class Sample(transformers.TrainerCallback):
        def __init__(self):
            self.samples, self.stop, self.thread = [], threading.Event(), None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3 and self.thread is None:
                torch_xla.sync()
                self.thread = threading.Thread(target=self.sample)
                self.thread.start()

        def sample(self):
            while not self.stop.is_set():
                self.samples.append(rss())
                time.sleep(0.002)

        def on_train_end(self, args, state, control, **kwargs):
            self.stop.set()
            self.thread.join()

    def model():
        import transformers as tf

        config = tf.GPT2Config(vocab_size=2048, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(config)

    sample = Sample()
    start = time.perf_counter()
    hf_train(compiled=True, device=torch_xla.device(), optimizer_step=optimizer_step, callbacks=[sample], steps=8,
             model_fn=model, batches=64)
    return {
        "optimizer_step_compiled": optimizer_step,
        "donated_bytes_per_step": sum(r.donated_bytes for r in donate_backend.reports()),
        "live_growth_bytes": max(sample.samples) - min(sample.samples),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv) -> None:
    if argv[1:2] == ["resume"]:
        _resume(argv[2], argv[3])
        return
    if argv[1:2] == ["run"]:
        warnings.simplefilter("ignore")
        print(json.dumps(_measure(argv[2] == "1")))
        return
    env = dict(os.environ, PJRT_DEVICE="CPU", MALLOC_MMAP_THRESHOLD_="65536")
    for flag in ("0", "1"):
        out = subprocess.run([sys.executable, __file__, "run", flag], env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main(sys.argv)
