"""DDP gradient buckets under torch.compile: every case against eager DDP, on every rank.

Multi-process tests: 2 gloo ranks on 127.0.0.1 (4 in test_ddp_world4.py),
spawned with torch.multiprocessing, bounded by a timeout. Each job trains eager
DDP and ``torch.compile(ddp, backend="donate_xla")`` from the same weights and
data through the same steps (tests/ddp_workers.py) and requires every
parameter and ``.grad`` after every step to be bitwise equal to eager DDP's,
on every rank. NCCL is not tested here (no GPU in this environment).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from donate_backend.ddp import parameters

from ddp_harness import run_job, train

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

LAYER_BYTES = (512 * 512 + 512) * 4


def assert_equal_on_every_rank(results: list) -> None:
    for result in results:
        assert result["problems"] == [], (result["rank"], result["problems"])


def steady(results: list, key: str, expected: int, last: int = -1, before: int = -2) -> None:
    """On every rank, ``key`` grew by ``expected`` between two steps."""
    for result in results:
        values = result[key]
        assert values[last] - values[before] == expected, (result["rank"], key, values)


def assert_equal_and_aliased(results: list, steady_writes: int, steady_out=0) -> None:
    assert_equal_on_every_rank(results)
    for result in results:
        # After the first step every param.grad lies inside its bucket's storage.
        assert all(result["in_buckets"]), (result["rank"], result["in_buckets"])
    # Step 1 learns the slots, step 2 follows DDP's bucket rebuild; by step 3
    # the compiled backward wrote every gradient straight into its slot, and
    # weight gradients (mm) were computed straight into it (out=).
    steady(results, "slot_writes", steady_writes)
    steady(results, "out_writes", steady_out)


@pytest.mark.parametrize("gradient_as_bucket_view", [True, False])
def test_three_sgd_steps_bitwise_equal_eager_ddp(gradient_as_bucket_view):
    results = run_job(
        dict(name="plain", program=train(3),
             ddp_kwargs={"gradient_as_bucket_view": gradient_as_bucket_view})
    )
    assert_equal_and_aliased(results, steady_writes=8, steady_out=4)
    for result in results:
        # DDPOptimizer split the graph at bucket boundaries (1 MiB cap): one graph per layer.
        assert result["bucket_grads"] == [2, 2, 2, 2]
        assert result["bucket_bytes"] == [LAYER_BYTES] * 4
        assert result["logs"] == []


def test_no_sync_accumulates_into_slots():
    program = [dict(kind="accumulate"), dict(kind="train")] * 3
    results = run_job(dict(name="no_sync", program=program))
    assert_equal_on_every_rank(results)
    for result in results:
        # From the second step on (the first learns the slots).
        assert all(result["in_buckets"][3:]), (result["rank"], result["in_buckets"])
    # Per step: the no_sync backward writes fresh (out=), the synced one adds.
    steady(results, "slot_writes", 16, last=-1, before=-3)
    steady(results, "out_writes", 4, last=-1, before=-3)


def test_unused_parameters():
    program = [dict(kind="train"), dict(kind="train", use_last=False), dict(kind="train")]
    results = run_job(dict(name="unused", program=program, ddp_kwargs={"find_unused_parameters": True}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert all(result["in_buckets"])
        assert result["slot_writes"][1] == 6  # step 2: last layer unused, 6 gradients written


def test_zero_grad_without_set_to_none():
    results = run_job(dict(name="keep", program=train(3, set_to_none=False)))
    # param.grad is kept (zeroed), so gradients are added into the slot: no out=.
    assert_equal_and_aliased(results, steady_writes=8, steady_out=0)


def test_bucket_written_by_several_graphs_is_reduced_once():
    results = run_job(
        dict(name="graph_break", program=train(3), options={"graph_break": True, "bucket_cap_mb": 25})
    )
    assert_equal_and_aliased(results, steady_writes=8, steady_out=4)
    for result in results:
        assert result["final"]["bucket_sizes"] == str(LAYER_BYTES * 4)  # one bucket...
        assert len(result["bucket_grads"]) == 4  # ...written by four backward graphs
    steady(results, "buckets_reduced", 1)  # and all-reduced once per step


@pytest.mark.parametrize("bucket_cap_mb", [1, 25])
def test_one_graph_run_for_several_layers_writes_each_layers_slots(bucket_cap_mb):
    # Dynamo compiles one graph for a layer and runs it for every layer, with
    # that layer's parameters: the gradients of each run belong to the layer
    # that ran, not to the one the graph was traced with (a mixture of experts
    # does this with its experts). Written into the tracing layer's slots, every
    # layer's gradient was wrong from the first step that writes into buckets.
    results = run_job(
        dict(name="shared", program=train(4),
             options={"shared_graph": True, "bucket_cap_mb": bucket_cap_mb})
    )
    assert_equal_and_aliased(results, steady_writes=8, steady_out=4)
    for result in results:
        assert len(result["bucket_grads"]) < 4, result["bucket_grads"]  # fewer graphs than layers


def test_parameters_kept_as_graph_attributes_are_written_into_buckets():
    # With inline_inbuilt_nn_modules=False dynamo leaves parameters as attributes of
    # the graph module and aot_autograd passes them before the placeholders; the
    # backward's outputs then did not match the placeholders and every gradient took
    # DDP's normal path, with a warning blaming merged inputs.
    results = run_job(dict(name="attributes", program=train(3), options={"inline_modules": False}))
    assert_equal_and_aliased(results, steady_writes=8, steady_out=4)
    for result in results:
        assert result["logs"] == []


def test_gradient_hook_keeps_that_parameter_on_ddp_path():
    results = run_job(dict(name="param_hook", program=train(3), options={"param_hook": True}))
    assert_equal_on_every_rank(results)  # layers[0].weight doubles its gradient
    steady(results, "slot_writes", 7)
    for result in results:
        assert all(result["in_buckets"])
        assert result["logs"] == [
            "donate_xla: DDP parameter #0 keeps DDP's normal path: a gradient hook is "
            "registered on the parameter (it may replace the gradient)"
        ]


def test_gradient_hook_on_one_layer_of_a_shared_graph_keeps_only_that_layer_on_ddp_path():
    # One compiled graph runs layers 1 to 3 (layer 0, whose input needs no gradient, has
    # its own); the hook is on layer 1's weight, the instance dynamo traced that graph
    # with. The writer decides per call, from the parameter that call is for: layers 2
    # and 3 are written into the buckets. (Decided when the graph was compiled, the
    # hook kept all three weights on DDP's path: 5 writes.)
    options = {"shared_graph": True, "param_hook": True, "hook_layer": 1}
    results = run_job(dict(name="shared_param_hook", program=train(3), options=options))
    assert_equal_on_every_rank(results)  # layers[1].weight doubles its gradient
    steady(results, "slot_writes", 7)
    for result in results:
        assert result["logs"] == [
            "donate_xla: DDP parameter #2 keeps DDP's normal path: a gradient hook is "
            "registered on the parameter (it may replace the gradient)"
        ]


def test_frozen_layer_gets_no_gradient_and_the_rest_land_in_the_buckets():
    """Fine-tuning: layer 1 frozen (``requires_grad_(False)`` before DDP, which leaves it
    out of its buckets). Its gradients stay None, as in eager DDP; the other 6
    parameters' gradients are written into the buckets."""
    results = run_job(dict(name="frozen_layer", program=train(3), options={"freeze": ["layers.1."]}))
    assert_equal_on_every_rank(results)  # compares every .grad, None included
    steady(results, "slot_writes", 6)


def test_comm_hook_falls_back_and_logs_reason():
    results = run_job(dict(name="comm_hook", program=train(3), options={"comm_hook": True}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert result["slot_writes"] == [0, 0, 0]
        assert result["logs"] == [
            "donate_xla: DDP gradient buckets off for MLP: a communication hook is registered "
            "(allreduce_hook); gradients take DDP's normal path"
        ]


# ---- gradients land only where autograd puts them -----------------------------


@pytest.mark.parametrize("set_to_none", [True, False])
def test_backward_inputs_subset_leaves_other_grads_untouched(set_to_none):
    # Eager DDP leaves every other .grad as zero_grad left it.
    # The last layer's bias shares its bucket with layers[2].weight, so the
    # bucket is not ready. (A subset that readies a bucket makes DDP start its
    # all-reduce, which nothing waits for, in eager DDP too: .grad is then
    # whatever the all-reduce has written so far; docs/ddp.md.)
    program = train(3, set_to_none=set_to_none) + [dict(kind="subset", subset=[7])]
    results = run_job(dict(name="subset", program=program))
    assert_equal_on_every_rank(results)
    steady(results, "slot_writes", 1)  # only that gradient was written
    steady(results, "buckets_reduced", 0)


def test_autograd_grad_of_an_input_leaves_every_grad_untouched():
    # A gradient of an input only (gradient penalties, R1, adversarial examples).
    program = train(3) + [dict(kind="grad_input"), dict(kind="train")]
    results = run_job(dict(name="grad_input", program=program))
    assert_equal_on_every_rank(results)  # includes the input gradient itself
    steady(results, "slot_writes", 0, last=-2, before=-3)  # the autograd.grad step wrote nothing
    steady(results, "slot_writes", 8)  # and the next step is back in the buckets


def test_no_sync_backward_with_inputs_subset():
    program = train(3) + [dict(kind="accumulate_subset", subset=[0, 7]), dict(kind="train")]
    results = run_job(dict(name="accumulate_subset", program=program))
    assert_equal_on_every_rank(results)
    steady(results, "slot_writes", 2, last=-2, before=-3)


def test_retain_graph_backward_twice():
    # The second backward is not reduced (DDP's hooks are done for this step)
    # and adds into .grad, in eager DDP as here.
    program = train(3) + [dict(kind="retain"), dict(kind="train")]
    results = run_job(dict(name="retain", program=program))
    assert_equal_on_every_rank(results)
    steady(results, "slot_writes", 16, last=-2, before=-3)
    steady(results, "slot_writes", 8)


def test_optimizer_in_backward_hooks_fire_as_in_eager():
    results = run_job(dict(name="opt_in_bw", program=train(4), options={"optimizer_in_backward": True}))
    assert_equal_on_every_rank(results)  # includes every hook firing and its gradient
    steady(results, "slot_writes", 8)


# ---- switches flipped after capture -------------------------------------------


def test_switch_off_from_the_start_keeps_ddp_path():
    results = run_job(dict(name="off", program=train(3), settings={"bucket_view": False}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert result["slot_writes"] == [0, 0, 0]
        assert all(n in (None, 0) for n in result["bucket_grads"])


def _offloading() -> bool:
    from donate_backend.native import compat

    return compat.activation_offloading(on_cuda=False) is not None


@pytest.mark.parametrize("compile_options", [
    {"activation_budget": 0.3}, {"memory_limit": "1GiB"},
    pytest.param({"offload_saved": True}, marks=pytest.mark.skipif(
        not _offloading(), reason=f"torch {torch.__version__} has no activation offloading")),
])
def test_memory_levers_keep_bucket_writes_and_eager_ddp_values(compile_options):
    """The activation budget (recomputation in the backward), a memory limit and torch's
    activation offloading, given as options of the compiled DDP module: gradients still go
    straight into the buckets and every rank equals eager DDP."""
    results = run_job(dict(name="levers", program=train(3), options={"compile_options": compile_options}))
    assert_equal_and_aliased(results, steady_writes=8, steady_out=4)


def test_bucket_view_off_as_a_compile_option_keeps_ddp_path():
    """``options={"bucket_view": False}`` for the compiled DDP module only: its graphs and
    its forward pre-hook (which runs outside them) both keep DDP's normal path."""
    results = run_job(dict(name="option_off", program=train(3),
                           options={"compile_options": {"bucket_view": False}}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert result["slot_writes"] == [0, 0, 0]
        assert all(n in (None, 0) for n in result["bucket_grads"])


@pytest.mark.parametrize("gradient_as_bucket_view", [True, False])
def test_switch_turned_off_after_capture_restores_ddp(gradient_as_bucket_view):
    program = train(3) + train(2, settings={"bucket_view": False})
    results = run_job(
        dict(name="on_off", program=program, options={"try_comm_hook_after": True},
             ddp_kwargs={"gradient_as_bucket_view": gradient_as_bucket_view})
    )
    assert_equal_on_every_rank(results)
    steady(results, "slot_writes", 0)
    for result in results:
        assert result["bucket_mode"] == [True, True, True, False, False]
        # The reducer is DDP's own again: as the user configured it, with no hook
        # of ours on it (DDP accepts a comm hook only on a reducer without one).
        assert result["final"]["gradient_as_bucket_view"] is gradient_as_bucket_view
        assert result["final"]["comm_hook_registered"] is True


def test_switch_turned_on_after_capture_rewrites():
    program = train(2) + train(4, settings={"bucket_view": True})
    results = run_job(dict(name="off_on", program=program, settings={"bucket_view": False}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert result["bucket_mode"] == [False, False, True, True, True, True]
    steady(results, "slot_writes", 8)


def test_executor_flipped_to_inductor_after_capture():
    program = train(3) + train(2, settings={"native_compiler": "inductor"}) + train(3)
    results = run_job(dict(name="flip", program=program, options={"exact": False}))
    assert_equal_on_every_rank(results)  # Inductor: within 1e-5
    for result in results:
        assert result["bucket_mode"] == [True] * 3 + [False] * 2 + [True] * 3
        assert (
            "donate_xla: DDP gradient buckets off for MLP: native compiler 'inductor' cannot "
            "run the slot writes; gradients take DDP's normal path"
        ) in result["logs"]
    steady(results, "slot_writes", 0, last=4, before=2)  # no writes under Inductor
    steady(results, "slot_writes", 8)  # back in the buckets


# ---- Join -------------------------------------------------------------------------


def test_join_dividing_by_live_ranks_falls_back_with_reason():
    join = {"divide_by_initial_world_size": False, "from_step": 3}
    results = run_job(dict(name="join_live", program=train(6), options={"join": join}))
    assert_equal_on_every_rank(results)
    for result in results:
        steps = len(result["bucket_mode"])
        assert result["bucket_mode"] == [True] * 3 + [False] * (steps - 3)
        assert any("a Join context with divide_by_initial_world_size=False" in line for line in result["logs"])


def test_join_dividing_by_initial_world_size_keeps_buckets():
    join = {"divide_by_initial_world_size": True, "from_step": 3}
    results = run_job(dict(name="join_initial", program=train(6), options={"join": join}))
    assert_equal_on_every_rank(results)
    for result in results:
        assert all(result["bucket_mode"])


# ---- pure parts, no processes ------------------------------------------------


def test_input_param_indices_by_identity():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    x = torch.zeros(2)
    assert parameters.input_param_indices([x, b, a, 3], [a, b]) == (None, 1, 0, None)


def test_gradient_outputs_pairs_and_mismatch():
    graph = torch.fx.Graph()
    g0, g1 = graph.placeholder("g0"), graph.placeholder("g1")
    assert parameters.gradient_outputs([None, g0, g1], (None, 0, 1)) == [(1, 0), (2, 1)]
    assert parameters.gradient_outputs([g0, None], (0, 1)) == [(0, 0)]
    assert parameters.gradient_outputs([g0], (0, 1)) is None
