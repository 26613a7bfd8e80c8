"""The dynamo adjustment in donate_backend/dynamo_compat.py: installed on this torch,
once, and a no-op where the private method it wraps is gone. (Its effect on
training is tested on XLA in test_xla_training_programs.py.) And the watch on
dynamo's recompile-limit warnings."""
import torch
from conftest import HAS_TORCH_XLA

from donate_backend import dynamo_compat


def test_the_step_counter_adjustment_is_installed_once():
    from torch._dynamo.variables.optimizer import OptimizerVariable

    assert dynamo_compat.keep_xla_step_counters_on_host()
    installed = OptimizerVariable.move_step_if_cpu
    assert getattr(installed, dynamo_compat._MARK)
    assert dynamo_compat.keep_xla_step_counters_on_host()
    assert OptimizerVariable.move_step_if_cpu is installed


def test_without_the_private_method_nothing_is_installed(monkeypatch):
    from torch._dynamo.variables.optimizer import OptimizerVariable

    monkeypatch.delattr(OptimizerVariable, "move_step_if_cpu")
    assert not dynamo_compat.keep_xla_step_counters_on_host()
    assert not hasattr(OptimizerVariable, "move_step_if_cpu")


def test_only_xla_parameters_of_groups_that_are_not_capturable_keep_host_counters():
    class FakeXla:
        def __init__(self, kind):
            self.device = torch.device(kind)

    a, b, c = FakeXla("xla"), FakeXla("xla"), FakeXla("cpu")
    optimizer = type("Opt", (), {})()
    optimizer.param_groups = [{"params": [a, c]}, {"params": [b], "capturable": True}]
    assert dynamo_compat._host_step_params(optimizer) == {id(a)}


def test_compiled_optimizer_with_two_groups_on_the_cpu_still_matches_eager():
    """The wrapper leaves CPU parameters to dynamo: two groups, a scheduler, compiled
    with donate_xla's native path against eager."""
    if HAS_TORCH_XLA:  # the autograd engine must know the XLA device before its first backward
        import torch_xla

        torch_xla.device()

    def run(compile_):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters()}], lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

        def f(x):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        f = compile_(f)
        for i in range(3):
            f(torch.full((3, 4), float(i + 1)))
            sched.step()
        return [p.detach().clone() for p in model.parameters()] + [s["step"] for s in opt.state.values()]

    torch._dynamo.reset()
    got = run(lambda f: torch.compile(f, backend="donate_xla"))
    expected = run(lambda f: f)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_the_count_of_functions_dynamo_stopped_compiling_follows_its_warnings():
    """Each XLA forward's call reads ``recompile_limit_hit_count()``; it counts the
    distinct functions the warnings named, as ``recompile_limit_hits()`` holds them."""
    import logging

    def warning(function: str) -> logging.LogRecord:
        return logging.LogRecord(
            dynamo_compat._DYNAMO_LOGGER, logging.WARNING, __file__, 1,
            dynamo_compat._LIMIT_MESSAGE + "%s (%s) while compiling %s", ("recompile_limit", 8, function), None,
        )

    watch = dynamo_compat._RecompileLimitWatch()
    saved = dynamo_compat.recompile_limit_hits()
    dynamo_compat.clear_recompile_limit_hits()
    try:
        assert dynamo_compat.recompile_limit_hit_count() == 0
        assert watch.filter(warning("'expert' (moe.py:10)"))
        assert watch.filter(warning("'router' (moe.py:20)"))
        assert watch.filter(warning("'expert' (moe.py:10)"))  # named again: still two
        assert dynamo_compat.recompile_limit_hit_count() == 2 == len(dynamo_compat.recompile_limit_hits())
        dynamo_compat.clear_recompile_limit_hits()
        assert dynamo_compat.recompile_limit_hit_count() == 0
    finally:
        for function in saved:
            watch.filter(warning(function))
