"""Ordinary training programs (several models or optimizers, metrics, hooks, AMP,
checkpointing, recompiles), compiled with donate_xla on XLA against eager on the CPU.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from eager_oracle import (
    STITCHED,
    _batch,
    _compiled_under,
    _mlp,
    assert_close_tree,
    mse_training_step,
    parameters_and_optimizer_state,
    run_against_eager,
)
from programs import checkpointed_program, grad_scaler_program, held_state_program, inference_mode_program, varying_batch_program

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

if HAS_TORCH_XLA:
    import torch_xla


def test_target_network_hard_update_while_training():
    """DQN-style: a compiled hard update copies the online net into the target every other
    step; a compiled AdamW step trains the online net reading the target under no_grad."""

    def program(device, compile_):
        online = _mlp(1).to(device)
        target = _mlp(2).to(device)
        opt = torch.optim.AdamW(online.parameters(), lr=1e-2)

        def hard_update():
            with torch.no_grad():
                for tp, p in zip(target.parameters(), online.parameters()):
                    tp.copy_(p)

        def train(x, y):
            with torch.no_grad():
                goal = target(x) + y
            loss = F.mse_loss(online(x), goal)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        hard_update, train = compile_(hard_update), compile_(train)

        def step(i):
            if i % 2 == 0:
                hard_update()
            return train(*_batch(i, device=device))

        state = lambda: list(online.parameters()) + list(target.parameters())  # noqa: E731
        return step, state

    run_against_eager(program, steps=6)


def test_gan_step_with_two_optimizers_in_one_function():
    def program(device, compile_):
        torch.manual_seed(3)
        gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).to(device)
        disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)).to(device)
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))

        def step(real, z):
            # The generator runs again for its own update: reusing ``fake`` would
            # backward twice through one compiled forward (aot_eager refuses it too).
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(z).detach())).mean()
            d_loss.backward()
            opt_d.step()
            opt_d.zero_grad()
            g_loss = F.softplus(-disc(gen(z))).mean()
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()
            disc.zero_grad()
            return d_loss.detach(), g_loss.detach()

        cstep = compile_(step)

        def run(i):
            g = torch.Generator().manual_seed(i)
            return cstep(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))

        state = lambda: list(gen.parameters()) + list(disc.parameters())  # noqa: E731
        return run, state

    run_against_eager(program)


def test_step_returning_a_detached_output_for_metrics():
    def program(device, compile_):
        model = _mlp(4).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y):
            out = model(x)
            metrics = out.detach()
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss, metrics

        cstep = compile_(step)
        return (lambda i: cstep(*_batch(i, device=device))), (lambda: list(model.parameters()))

    run_against_eager(program)


def test_step_staging_its_batch_into_a_persistent_buffer():
    def program(device, compile_):
        model = _mlp(5).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        buf_x = torch.zeros(6, 8, device=device)
        buf_y = torch.zeros(6, 4, device=device)

        def step(x, y):
            buf_x.copy_(x)
            buf_y.copy_(y)
            loss = F.mse_loss(model(buf_x), buf_y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        cstep = compile_(step)
        state = lambda: list(model.parameters()) + [buf_x, buf_y]  # noqa: E731
        return (lambda i: cstep(*_batch(i, device=device))), state

    run_against_eager(program)


def test_step_returning_loss_and_its_detached_copy():
    def program(device, compile_):
        model = _mlp(7).to(device)

        def f(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss, loss.detach()

        cf = compile_(f)

        def step(i):
            out = cf(*_batch(i, device=device))
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return out, grads

        return step, lambda: list(model.parameters())

    run_against_eager(program, steps=3)


@pytest.mark.parametrize("optimizer", ["adamw", "adagrad", "rmsprop"])
@pytest.mark.parametrize("start", ["fresh", "one_eager_step"])
def test_parameter_groups_keep_their_step_counters_across_a_recompile(optimizer, start):
    """Two parameter groups and a learning-rate scheduler: dynamo replaced the first
    group's step counters by XLA copies while tracing the second group's
    initialisation, so ``state_dict()`` said step 0 for it, and after the
    scheduler's new ``lr`` recompiled the step the counting restarted (other
    parameters than eager; openxla too). Trained against the CPU with every
    optimizer state tensor compared, the counters included; also when one eager
    step made the state before compiling."""
    make_optimizer = {
        "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-3),
        "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, lr_decay=0.1),
        "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, centered=True),
    }[optimizer]

    def program(device, compile_):
        model = _mlp(seed=3).to(device)
        opt = make_optimizer([
            {"params": model[0].parameters(), "lr": 2e-2},
            {"params": model[2].parameters(), "lr": 5e-3},
        ])
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        f = mse_training_step(model, opt)
        if start == "one_eager_step":
            g = torch.Generator().manual_seed(599)
            f(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))
        cf = compile_(f)

        def step(i):
            g = torch.Generator().manual_seed(600 + i)
            loss = cf(torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device))
            sched.step()
            return loss

        return step, lambda: parameters_and_optimizer_state(model, opt)

    run_against_eager(program)


@pytest.mark.parametrize("optimizer", ["sgd_momentum_weight_decay", "adamw"])
def test_compiled_model_with_an_eager_optimizer_and_no_sync(optimizer):
    """``torch.compile(model)`` with the optimizer step left eager and no
    ``torch_xla.sync()`` between steps: the next forward found the parameters'
    updates pending, synced only those, and torch_xla gave each parameter's old
    buffer to its new value while a momentum buffer's pending IR (the weight
    decay) still read it ("buffer ... is deleted"; openxla too). The forward now
    runs all pending IR at once, as a step marker would. Against the CPU."""

    def program(device, compile_):
        model = _mlp(seed=5).to(device)
        opt = {
            "sgd_momentum_weight_decay": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        }[optimizer](model.parameters())
        compiled = compile_(model)

        def step(i):
            g = torch.Generator().manual_seed(700 + i)
            x, y = torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)
            loss = F.mse_loss(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return step, lambda: parameters_and_optimizer_state(model, opt)

    run_against_eager(program, state_every_step=False)


@STITCHED
def test_compiled_calls_under_inference_mode_match_eager(stitched):
    """Under ``torch.inference_mode()`` every compiled call failed after running, in
    donate_xla's own bookkeeping ("Inference tensors do not track version counter"):
    it recorded each new output's version. Such tensors are not recorded now (a
    donated one is copied first), and the values equal eager on the CPU."""
    got = inference_mode_program(torch_xla.device(), _compiled_under(stitched))
    expected = inference_mode_program(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "outputs, accumulator, parameters, buffers", tol=dict(rtol=2e-5, atol=1e-5))


@STITCHED
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_grad_scaler_training_matches_eager(stitched, whole_step):
    """``torch.amp.GradScaler`` on XLA with the model or the whole step compiled: the
    overflowing step is skipped and the scale halved, as in eager on the CPU."""
    got = grad_scaler_program(torch_xla.device(), _compiled_under(stitched), whole_step)
    expected = grad_scaler_program(torch.device("cpu"), lambda f: f, whole_step)
    assert expected[2].item() == 2.0**15  # the overflow was seen: 65536 halved once
    assert_close_tree(got, expected, "losses, parameters, scale", tol=dict(rtol=2e-5, atol=1e-5))


@STITCHED
def test_step_recompiled_for_a_changing_batch_size_matches_eager(stitched):
    """The batch size changes between calls (a smaller last batch does it), so dynamo
    compiles the whole step again for each new size (on XLA, with this LayerNorm, it
    keeps the sizes static). Values equal eager on the CPU. (openxla stops at the third
    call of this program with "Check failed: cachedComputation"; with ``dynamic=True``
    torch_xla 2.9's LayerNorm cannot be traced under any backend.)"""
    import donate_backend

    got = varying_batch_program(torch_xla.device(), _compiled_under(stitched))
    expected = varying_batch_program(torch.device("cpu"), lambda f: f)
    assert_close_tree(got, expected, "losses, parameters, optimizer state", tol=dict(rtol=2e-5, atol=1e-5))
    assert sum(r.kind == "forward" for r in donate_backend.reports()) >= 2  # it did recompile


@STITCHED
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_activation_checkpointing_trains_like_eager_and_saves_less(stitched, use_reentrant, whole_step):
    """``torch.utils.checkpoint`` around two of three blocks, the model or the whole step
    compiled: losses, input gradients and parameters equal eager on the CPU (eager
    torch_xla 2.9 cannot run the checkpointed model: ``torch.utils.checkpoint`` looks
    for a ``torch.xla`` module). The checkpointed blocks are recomputed in the backward,
    so the forward saves less than the same model without checkpointing."""
    import donate_backend

    def saved(program_args):
        torch._dynamo.reset()
        donate_backend.clear_reports()
        got = checkpointed_program(torch_xla.device(), _compiled_under(stitched), *program_args)
        return got, sum(r.saved_bytes or 0 for r in donate_backend.reports() if r.kind == "forward")

    got, checkpointed_bytes = saved((whole_step, use_reentrant))
    expected = checkpointed_program(torch.device("cpu"), lambda f: f, whole_step, use_reentrant)
    assert_close_tree(got, expected, "losses, input gradients, parameters", tol=dict(rtol=2e-5, atol=1e-5))
    _, plain_bytes = saved((whole_step, None))
    assert 0 < checkpointed_bytes <= 0.8 * plain_bytes, (checkpointed_bytes, plain_bytes)  # 17 against 24 kB


@STITCHED
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_state_dicts_and_averaged_model_held_during_training_match_eager(stitched, whole_step):
    """Tensors the program holds share the donated state's buffers: a state dict taken
    before training (aliases of the parameters and statistics), the optimizer's state
    dict (its moment tensors), an SWA ``AveragedModel``, and a restore by
    ``load_state_dict`` mid-training. Every held tensor equals eager's after training."""
    got = held_state_program(torch_xla.device(), _compiled_under(stitched), whole_step)
    expected = held_state_program(torch.device("cpu"), lambda f: f, whole_step)
    assert_close_tree(got, expected, "losses, held state dict, held moments, averaged model")


def _hooked_training(device, compile_fn, hooks: str):
    """4 SGD steps of a compiled model with hooks: tensor hooks that rescale and clamp
    gradients, an optimizer per parameter run from post-accumulate-grad hooks (the
    optimizer in backward), or module forward, forward-pre and full backward hooks.
    Per step: the loss and (but for the optimizer in backward) every gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hooks == "tensor":
        model[0].weight.register_hook(lambda g: g * 0.5)
        model[2].bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
    elif hooks == "optimizer_in_backward":
        per_param = {p: torch.optim.SGD([p], lr=0.05, momentum=0.5) for p in model.parameters()}

        def step_one(p):
            per_param[p].step()
            per_param[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_one)
    elif hooks == "module":
        model[0].register_forward_hook(lambda module, args, out: out * 1.5)
        model[2].register_forward_pre_hook(lambda module, args: (args[0] + 0.1,))
        model[1].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 2,))
    forward = compile_fn(model)
    kept = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g).to(device), torch.randn(5, 3, generator=g).to(device)
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        if hooks != "optimizer_in_backward":
            kept += [p.grad.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        kept.append(loss.detach())
        if device.type == "xla":
            torch_xla.sync()
    return [t.cpu() for t in kept + list(model.parameters())]


@STITCHED
@pytest.mark.parametrize("hooks", ["tensor", "optimizer_in_backward", "module"])
def test_hooks_see_and_change_what_they_do_in_eager(hooks, stitched):
    """Gradient hooks, the optimizer run from post-accumulate-grad hooks, and module
    hooks around a compiled model on XLA: gradients, losses and parameters equal eager
    on the CPU over 4 steps (the hooks change each of them, so a skipped or doubled
    hook shows)."""
    got = _hooked_training(torch_xla.device(), _compiled_under(stitched), hooks)
    expected = _hooked_training(torch.device("cpu"), lambda f: f, hooks)
    unhooked = _hooked_training(torch.device("cpu"), lambda f: f, "none")
    assert_close_tree(got, expected, f"{hooks} hooks: gradients, losses, parameters")
    assert not torch.allclose(expected[-1], unhooked[-1])
