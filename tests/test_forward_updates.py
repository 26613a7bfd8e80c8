"""Buffers and parameters a forward updates in place and reads afterwards, on both paths.

- A counter (``+=``) or a running mean (``lerp_`` under ``no_grad``) read after its
  update: torch's min-cut partitioner recomputed the read in the backward from the
  updated buffer (``analysis/stale_reads.py``).
- ``nn.Embedding(max_norm=...)``, ``w.detach().mul_()``, ``w.data.mul_()`` in a graph
  that also returns a buffer it updated: torch 2.9's aot_autograd returned the
  buffer in place of the loss (``hidden_mutations.py``).
- ``torch.embedding_renorm_`` on XLA: torch_xla's kernel crashed the process on a
  placeholder; it runs on the CPU now.

Every program is compared with eager PyTorch on the CPU over five steps.
"""
from __future__ import annotations

import pytest
import torch

import donate_backend
from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON
from donate_backend import config
from donate_backend.analysis import stale_reads
from donate_backend.errors import UnsupportedGraphError
from donate_backend.hidden_mutations import rewrite_hidden_writes
from programs import _CountedScale, updated_buffer_program

TOL = dict(rtol=2e-5, atol=1e-5)
needs_xla = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        assert len(g) == len(e), step
        for k, (a, b) in enumerate(zip(g, e)):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"entry {step}.{k}: {m}")


def _compiled(f):
    return torch.compile(f, backend="donate_xla")


@pytest.mark.parametrize("executor", ["aten", "inductor"])
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_native_updates_read_after_the_update_match_eager(executor, whole_step):
    expected = updated_buffer_program(torch.device("cpu"), lambda f: f, whole_step)
    with config.patch(native_compiler=executor):
        got = updated_buffer_program(torch.device("cpu"), _compiled, whole_step)
    _assert_same(got, expected)


@needs_xla
@pytest.mark.parametrize("whole_step", [False, True], ids=["model", "step"])
def test_xla_updates_read_after_the_update_match_eager(whole_step):
    import torch_xla

    expected = updated_buffer_program(torch.device("cpu"), lambda f: f, whole_step)
    got = updated_buffer_program(torch_xla.device(), _compiled, whole_step)
    _assert_same(got, expected)


@needs_xla
def test_xla_embedding_renorm_runs_on_the_cpu_between_xla_segments():
    import torch_xla

    def f(w, idx):
        torch.embedding_renorm_(w, idx, 1.0, 2.0)
        return w.sum()

    w = torch.arange(15.0).view(5, 3)
    idx = torch.tensor([0, 2, 2])
    expected_w = w.clone()
    expected = f(expected_w, idx)
    xw = w.to(torch_xla.device())
    got = _compiled(f)(xw, idx.to(torch_xla.device()))
    torch.testing.assert_close(got.cpu(), expected)
    torch.testing.assert_close(xw.cpu(), expected_w)
    assert any("embedding_renorm" in " ".join(r.fallback_ops or ()) for r in donate_backend.reports())


def _joint_of(module, x):
    """The joint graph aot_autograd hands the partitioner for ``module(x).sum()``."""
    from torch._dynamo.backends.common import aot_autograd

    seen = {}

    def partition(joint, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        seen["joint"], seen["inputs"], seen["kwargs"] = joint, joint_inputs, kwargs
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition,
                           keep_inference_input_mutations=True)
    torch.compile(lambda v: module(v).sum(), backend=backend)(x)
    return seen


def test_partitioner_left_alone_recomputes_from_the_updated_buffer_and_the_check_refuses_it():
    """The unguarded min-cut saves the counter and recomputes ``count + 1`` in the
    backward (after the update): ``check_backward_reads`` refuses that partition; with
    the reader pinned, the same partitioner saves ``count + 1`` itself."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    seen = _joint_of(_CountedScale(), torch.randn(6))
    joint = seen["joint"]
    overwritten = [p.name for p in stale_reads.overwritten_primals(joint.graph)]
    assert overwritten == ["primals_1"]  # the counter
    fw, bw = min_cut_rematerialization_partition(joint, seen["inputs"], **seen["kwargs"])
    with pytest.raises(UnsupportedGraphError, match=r"graph 7: .*primals_1.*before the forward overwrote"):
        stale_reads.check_backward_reads(fw, bw, overwritten, "graph 7")

    assert stale_reads.pin_reads_of_overwritten_inputs(joint) == overwritten
    fw, bw = min_cut_rematerialization_partition(joint, seen["inputs"], **seen["kwargs"])
    stale_reads.check_backward_reads(fw, bw, overwritten, "graph 7")
    assert "primals_1" not in [p.name for p in bw.graph.find_nodes(op="placeholder")]


def test_hidden_writes_are_rewritten_only_where_the_graph_returns_an_input():
    counter = torch.zeros(())
    w = torch.nn.Parameter(torch.randn(10, 4))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, rewrite_hidden_writes(gm)))
        return gm

    def counts_and_renorms(idx):
        counter.add_(1)  # no rebinding: nothing returned
        return torch.nn.functional.embedding(idx, w, max_norm=1.0).sum()

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

    c = Counter()

    def rebinds_and_writes(idx):
        c.count += 1  # dynamo returns the buffer, to rebind the attribute
        w.detach().mul_(0.5)
        w.data.mul_(0.5)
        return torch.nn.functional.embedding(idx, w, max_norm=1.0).sum()

    idx = torch.tensor([1, 3])
    torch.compile(counts_and_renorms, backend=capture)(idx)
    torch.compile(rebinds_and_writes, backend=capture)(idx)
    (_, untouched), (rewritten, count) = graphs
    assert untouched == 0
    assert count == 3
    code = rewritten.code
    assert "detach" not in code and "_get_data_attr" not in code
    assert "embedding_renorm_" in code and "max_norm = 1.0" not in code
    assert code.count("_set_grad_enabled(False)") == 3


def test_without_torchs_grad_mode_function_nothing_is_rewritten(monkeypatch):
    """The guard around ``torch._C._set_grad_enabled``: where torch lacks it, graphs stay
    as dynamo made them."""
    import donate_backend.hidden_mutations as hidden

    c = _CountedScale()
    w = torch.nn.Parameter(torch.randn(10, 4))
    counts = []

    def capture(gm, example_inputs):
        counts.append(hidden.rewrite_hidden_writes(gm))
        return gm

    def f(idx):
        c.count += 1
        return torch.nn.functional.embedding(idx, w, max_norm=1.0).sum()

    monkeypatch.setattr(hidden, "_SET_GRAD", None)
    torch.compile(f, backend=capture)(torch.tensor([1, 2]))
    assert counts == [0]
    assert hidden._GET_DATA is torch._C._autograd._get_data_attr  # the real one on this torch
