"""Each guard of donate_backend/torch_compat.py against the torch installed (run on
torch 2.9 and on the newest torch), and what each falls back to when its API is gone."""
from __future__ import annotations

import builtins

import torch

from donate_backend import torch_compat


def test_tracing_context_look_ups_outside_a_compile():
    assert torch_compat.current_tracing_context() is None
    assert torch_compat.forward_output_count() is None
    with torch_compat.tracing(None):
        pass


def test_forward_output_count_reads_the_forward_compiler_s_context():
    counts = []

    def forward_compiler(gm, example_inputs):
        counts.append(torch_compat.forward_output_count())
        return gm

    backend = torch_compat.aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm)
    w = torch.randn(3, requires_grad=True)
    torch.compile(lambda x: (x * w).sin().sum(), backend=backend)(torch.randn(3))
    assert counts == [1]  # the loss; the rest of the forward's outputs are saved for backward


def test_min_cut_partition_and_its_fallback(monkeypatch):
    assert callable(torch_compat.min_cut_partition())
    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name == "torch._functorch.partitioners":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    assert torch_compat.min_cut_partition() is None


def test_activation_memory_budget_patches_the_partitioner_s_setting():
    import torch._functorch.config as functorch_config

    before = functorch_config.activation_memory_budget
    with torch_compat.activation_memory_budget(0.25):
        assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == before


def test_register_backend_is_idempotent_and_the_backend_is_listed():
    import donate_backend  # noqa: F401  (registers donate_xla)

    calls = []
    torch_compat.register_backend("donate_xla", lambda *a: calls.append(a))  # known: not replaced
    assert "donate_xla" in torch._dynamo.list_backends(exclude_tags=())
    assert calls == []


def test_functions_dynamo_records_in_graphs():
    assert torch_compat.nn_function("adaptive_avg_pool2d") is not None
    assert torch_compat.nn_function("no_such_function") is None
    assert torch_compat.set_grad_enabled_function() is not None
    assert torch_compat.get_data_attr_function() is not None


def test_fake_copies_trace_again_without_the_real_tensors_and_their_fallback(monkeypatch):
    """A graph compiled again under a lower memory limit is traced from fake copies of
    its example inputs, inside a fresh tracing context, as dynamo would give it."""
    weight = torch.nn.Parameter(torch.randn(4, 3))
    mode, (w, x, n) = torch_compat.fake_copies([weight, torch.randn(2, 4), 3])
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad and tuple(w.shape) == (4, 3)
    assert type(x).__name__ == "FakeTensor" and n == 3
    counts = []

    def forward_compiler(gm, example_inputs):
        counts.append(torch_compat.forward_output_count())
        return gm

    backend = torch_compat.aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm)
    gm = torch.fx.symbolic_trace(lambda w, x, n: ((x @ w).sin().sum() * n,))
    with torch_compat.fresh_tracing(mode):
        backend(gm, [w, x, n])
    assert counts == [1]  # the forward's metadata came through the fresh context
    assert torch_compat.current_tracing_context() is None

    assert torch_compat.fake_copies([torch.randn(2), "not a tensor"]) is None
    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name in ("torch._subclasses.fake_tensor", "torch._guards"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    assert torch_compat.fake_copies([torch.randn(2)]) is None
    with torch_compat.fresh_tracing(None):
        pass
