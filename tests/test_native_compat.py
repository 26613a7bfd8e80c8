"""Each guard around a private torch API, with the API removed or changed by monkeypatching."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from donate_backend.native import compat, free_saved



def test_keep_graph_is_unknown_without_the_api(monkeypatch):
    monkeypatch.delattr(torch._C._autograd, "_get_current_graph_task_keep_graph")
    assert compat.keep_graph() is None
    assert free_saved.may_reuse_saved_buffers() is False


def test_keep_graph_is_unknown_when_the_api_raises(monkeypatch):
    def raising():
        raise RuntimeError("no current graph task")

    monkeypatch.setattr(torch._C._autograd, "_get_current_graph_task_keep_graph", raising)
    assert compat.keep_graph() is None


def test_when_keep_graph_is_unknown_the_backward_never_reuses(monkeypatch):
    # (aot_autograd itself calls the API, so it cannot be removed for a whole run.)
    monkeypatch.setattr(compat, "keep_graph", lambda: None)
    ran = []
    real_call = free_saved.FreeingProgram.__call__

    def spy(self, args):
        ran.append(self.reusing is not None and free_saved.may_reuse_saved_buffers())
        return real_call(self, args)

    monkeypatch.setattr(free_saved.FreeingProgram, "__call__", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    torch.compile(model, backend="donate_xla")(torch.randn(4, 8)).sum().backward()
    assert False in ran and True not in ran


def test_donated_indices_unknown_without_tracing_context_or_field(monkeypatch):
    assert compat.bw_donated_indices() is None  # no TracingContext here

    class Metadata:  # a torch whose fw_metadata lacks bw_donated_idxs
        pass

    class Context:
        fw_metadata = Metadata()

    monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: Context()))
    assert compat.bw_donated_indices() is None
    assert compat.lift_aot_donation_check() is False
    Context.fw_metadata.bw_donated_idxs = [1, 2]
    assert compat.bw_donated_indices() == [1, 2]
    assert compat.lift_aot_donation_check() is True
    assert Context.fw_metadata.bw_donated_idxs == []


def test_unknown_donated_indices_reuse_no_saved_buffer():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: (a * b).sum(), tracing_mode="fake")(torch.randn(4), torch.randn(4))
    assert free_saved.donated_placeholders(gm.graph, None) == set()
    program = free_saved.build_freeing(gm, "g", reuse_buffers=True, donated_indices=None)
    assert program.buffers_reused == 0


def test_as_boxed_refuses_a_module_and_marks_a_function():
    gm = torch.fx.symbolic_trace(lambda a: a + 1)
    with pytest.raises(TypeError, match="read-only"):
        compat.as_boxed(gm)

    def f(args):
        return args

    assert compat.as_boxed(f)._boxed_call is True


def test_read_only_boxed_call_on_graph_module_does_not_matter(monkeypatch):
    """torch 2.13 makes GraphModule._boxed_call read-only; we never set it."""
    monkeypatch.setattr(
        torch.fx.GraphModule, "_boxed_call", property(lambda self: False), raising=False
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(model, backend="donate_xla")(x).sum().backward()
    assert x.grad is not None


def test_native_path_imports_without_torch_xla():
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "import torch, donate_backend.native\n"
        "m = torch.nn.Linear(4, 4)\n"
        "torch.compile(m, backend='donate_xla')(torch.randn(2, 4)).sum().backward()\n"
        "assert 'torch_xla' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


# ---- the Inductor wiring and the partitioner -------------------------------------


def test_aten_executor_falls_back_to_the_default_partitioner(monkeypatch):
    import torch._functorch.partitioners as partitioners

    assert "partition_fn" in compat.aten_aot_options()
    monkeypatch.delattr(partitioners, "min_cut_rematerialization_partition")
    assert compat.aten_aot_options() == {}


def test_inductor_options_without_its_partition_function_use_min_cut(monkeypatch):
    import torch._inductor.compile_fx as inductor_compile_fx
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    options = compat.inductor_aot_options()
    assert options["partition_fn"] is not min_cut_rematerialization_partition  # Inductor's, wrapped
    monkeypatch.delattr(inductor_compile_fx, "partition_fn")
    assert compat.inductor_aot_options()["partition_fn"] is min_cut_rematerialization_partition


def test_joint_graph_passes_missing_leave_the_graph_alone(monkeypatch):
    import torch._inductor.compile_fx as inductor_compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a: (a + 0).relu(), tracing_mode="fake")(torch.randn(4))
    before = str(gm.graph)
    monkeypatch.delattr(inductor_compile_fx, "_recursive_joint_graph_passes")
    assert compat.inductor_graph_passes(gm) is False
    assert str(gm.graph) == before


def test_joint_graph_passes_run_under_the_graphs_fake_mode():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a: a * torch.rand(a.shape), tracing_mode="fake")(torch.randn(8))
    assert "aten.rand.default" in str(gm.graph)
    assert compat.inductor_graph_passes(gm) is True  # needs Inductor's fake mode set
    # replace_random turned the random op into Inductor's seeded one.
    assert "aten.rand.default" not in str(gm.graph)
    assert "inductor_random" in str(gm.graph)


def test_donated_indices_set_while_compiling_and_restored(monkeypatch):
    class Metadata:
        bw_donated_idxs = [1, 2]

    class Context:
        fw_metadata = Metadata()

    with compat.donated_indices([5]):
        pass  # no tracing context: nothing to set, no error
    monkeypatch.setattr(torch._guards.TracingContext, "try_get", staticmethod(lambda: Context()))
    with compat.donated_indices([]):
        assert Context.fw_metadata.bw_donated_idxs == []
    assert Context.fw_metadata.bw_donated_idxs == [1, 2]


def test_outputs_marked_user_visible():
    gm = torch.fx.symbolic_trace(lambda a, b: (a + 1, None, b * 2))
    compat.mark_outputs_user_visible(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert output.meta["user_visible_output_idxs"] == [0, 2]


def test_inductor_decompose_keeps_values_and_drops_ops_inductor_decomposes():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(w, x):
        return (torch.ops.aten.t.default(w) @ x).sum(0)

    w, x = torch.randn(3, 4), torch.randn(3, 5)
    gm = make_fx(f)(w, x)
    assert "aten.t.default" in str(gm.graph)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(w), mode.from_tensor(x)]
    decomposed = compat.inductor_decompose(gm, fake)
    assert "aten.t.default" not in str(decomposed.graph)
    torch.testing.assert_close(decomposed(w, x), f(w, x))


def test_inductor_options_import_the_lowerings_its_decompositions_need():
    # resnet18 under Inductor failed with "module 'torch._inductor'
    # has no attribute 'lowering'" (max_pool2d's decomposition reads it).
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "import torch, torch._inductor.decomposition\n"
        "assert not hasattr(torch._inductor, 'lowering')\n"
        "from donate_backend.native import compat\n"
        "compat.inductor_aot_options()\n"
        "assert hasattr(torch._inductor, 'lowering')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


# ---- the branch each guard takes on the torch running the tests -----------------------
# `make test` runs this file on torch 2.9.0 and on the newest release. The tests above
# remove each API to prove the fallback branch; these prove that the real branch is the
# one taken, so that a torch which drops or renames an API fails here instead of quietly
# running the fallback (correct, but without the memory savings).


def test_every_native_guard_finds_its_api_on_this_torch():
    import torch._inductor.compile_fx as inductor_compile_fx
    from torch._guards import TracingContext

    assert callable(getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None))
    assert callable(getattr(TracingContext, "try_get", None))
    assert callable(getattr(inductor_compile_fx, "_recursive_joint_graph_passes", None))
    assert callable(getattr(inductor_compile_fx, "partition_fn", None))
    assert "partition_fn" in compat.aten_aot_options()


def test_keep_graph_and_donated_indices_are_known_inside_a_real_backward(monkeypatch):
    seen = []
    real_call = free_saved.FreeingProgram.__call__

    def spy(self, args):
        seen.append((compat.keep_graph(), self.reusing is not None))
        return real_call(self, args)

    monkeypatch.setattr(free_saved.FreeingProgram, "__call__", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    compiled = torch.compile(model, backend="donate_xla")
    compiled(torch.randn(4, 8)).sum().backward(retain_graph=True)
    kept, seen[:] = list(seen), []
    compiled(torch.randn(4, 8)).sum().backward()
    # The backward's program has a reusing variant (aot_autograd's donated list was read),
    # and keep_graph answers inside it (never None). (The forward runs a program too.)
    assert [keep for keep, reusing in kept if reusing] == [True]
    assert [keep for keep, reusing in seen if reusing] == [False]


def test_boxed_call_is_read_only_exactly_on_newer_torch():
    """torch 2.13 made ``GraphModule._boxed_call`` a read-only property; 2.9 has none.
    Across the two environments both cases run for real; ``as_boxed`` never sets it."""
    import inspect

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    read_only = isinstance(inspect.getattr_static(torch.fx.GraphModule, "_boxed_call", None), property)
    assert read_only == ((major, minor) >= (2, 13))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(model, backend="donate_xla")(x).sum().backward()
    expected = torch.autograd.grad(model(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


def test_inductor_config_patch_sets_and_restores():
    import torch._inductor.config as inductor_config

    before = inductor_config.fx_graph_cache
    with compat.inductor_config_patch(fx_graph_cache=not before):
        assert inductor_config.fx_graph_cache == (not before)
    assert inductor_config.fx_graph_cache == before


READS_SAVED = compat.reads_saved_tensors()


@pytest.mark.skipif(not READS_SAVED, reason="this torch's saved-variable handles cannot be read unpacked")
def test_saved_by_eager_autograd_walks_eager_nodes_and_stops_at_compiled_graphs():
    """tanh saves its output and exp its output; the walk from their result finds both, each
    once through a diamond (a node reached twice is one node), and stops at a compiled graph's
    backward node: what that graph saved is its own."""
    w = torch.randn(8, 8, requires_grad=True)
    t = torch.tanh(w * 1)
    e = t.exp()
    both = e + e.sin()  # e reached twice
    found = compat.saved_by_eager_autograd([both])
    assert any(torch.equal(f, t) for f in found if f.shape == t.shape)
    assert sum(torch.equal(f, e) for f in found if f.shape == e.shape) == 2  # exp's result, sin's input

    compiled = torch.compile(lambda x: torch.tanh(x) * 3, backend="donate_xla")
    out = torch.cos(compiled(w))
    names = {f.data_ptr() for f in compat.saved_by_eager_autograd([out])}
    assert len(names) == 1  # cos's input only: the compiled graph's saved tanh is not eager's


def test_saved_by_eager_autograd_never_unpacks_what_hooks_packed():
    """A checkpointed region's saved tensors are packed by its hooks: reading them would
    recompute the region. They are skipped (on every torch), the region runs once in the
    forward, and the backward is eager's."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(8, 8, requires_grad=True)
    calls = []

    def region(x):
        calls.append(1)
        return torch.tanh(x @ w).exp()

    out = checkpoint(region, torch.randn(4, 8), use_reentrant=False)
    assert compat.saved_by_eager_autograd([out]) == []
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2 and w.grad is not None
    with torch.autograd.graph.save_on_cpu():
        saved_on_cpu = torch.tanh(w * 2)
    # tanh's result went through the hooks (only the product's scalar 2 did not)
    assert not [f for f in compat.saved_by_eager_autograd([saved_on_cpu]) if f.shape == saved_on_cpu.shape]


def test_a_saved_tensor_read_through_pass_through_hooks_leaves_the_backward_unchanged():
    """The reading torch 2.9 needs (and any torch has): ``register_hooks`` hands the pack
    hook the tensor the handle holds, the same storage; the backward then unpacks it
    through the hooks and computes eager's gradient. A second read is refused (hooks are
    set), as is a read of a handle hooks packed already or a backward freed."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(w @ w).exp().sum(), w)[0]
    t = torch.tanh(w @ w)
    e = t.exp()
    held = compat._held_through_identity_hooks(e.grad_fn._raw_saved_result)
    assert held is not None and held.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()
    assert torch.equal(held, e)
    assert compat._held_through_identity_hooks(e.grad_fn._raw_saved_result) is None
    e.sum().backward()
    assert torch.equal(w.grad, expected)
    assert compat._held_through_identity_hooks(t.grad_fn._raw_saved_result) is None  # freed

    calls = []

    def region(x):
        calls.append(1)
        return torch.tanh(x @ w).exp()

    out = checkpoint(region, torch.randn(4, 8), use_reentrant=False)
    assert compat._held_through_identity_hooks(out.grad_fn._raw_saved_result) is None
    assert len(calls) == 1


def test_a_handle_that_can_be_read_neither_way_gives_nothing_and_never_raises():
    """A handle with no ``data``, no ``unpack_hook`` and no ``register_hooks``, or one whose
    ``register_hooks`` refuses in a way this torch does not (a TypeError): nothing is read,
    and the walk (run inside a training step's first call) goes on."""

    class Refusing:
        def register_hooks(self, pack, unpack):
            raise TypeError("no hooks here")

    assert compat._packed_tensor(object()) is None
    assert compat._packed_tensor(Refusing()) is None


def test_saved_by_eager_autograd_leaves_out_the_parameters_eager_ops_saved():
    """A matmul saves its weight (a leaf that requires grad, resident between steps) and its
    input: only the input is found, on every torch, whichever way the handle is read."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True).tanh()
    found = compat.saved_by_eager_autograd([x @ w])
    shared = {f.untyped_storage().data_ptr() for f in found}
    assert w.untyped_storage().data_ptr() not in shared
    assert x.untyped_storage().data_ptr() in shared


def test_saved_by_eager_autograd_finds_nothing_where_nodes_hide_what_they_saved(monkeypatch):
    """A torch whose autograd nodes have no saved-variable handles: nothing is found (the
    memory plan then counts only what eager code passes to a graph)."""
    monkeypatch.setattr(compat, "_SAVED_PREFIX", "_no_such_prefix_")
    w = torch.randn(8, 8, requires_grad=True)
    assert compat.saved_by_eager_autograd([torch.tanh(w).exp()]) == []
