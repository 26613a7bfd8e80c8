"""Sharded (SPMD) training on 4 CPU devices: donate_xla equals eager SPMD and donates.

Each case runs tests/spmd_layouts.py in a fresh process (SPMD mode is
process-wide) with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``: the same model
trains 5 AdamW steps eagerly and compiled, from the same weights and batches.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import HAS_TORCH_XLA, XLA_SKIP_REASON, xla_flags_with

pytestmark = pytest.mark.skipif(not HAS_TORCH_XLA, reason=XLA_SKIP_REASON)

HERE = os.path.dirname(__file__)
TOL = dict(rel=1e-4, abs=1e-5)


def run_layout(*args, env=None) -> dict:
    environment = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    for key, value in (env or {}).items():  # XLA flags join the ones the tests compile with
        environment[key] = xla_flags_with(value) if key == "XLA_FLAGS" else value
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "spmd_layouts.py"), *args],
        capture_output=True, text=True, timeout=600, env=environment,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _flat(value):
    if isinstance(value, list):
        return [v for item in value for v in _flat(item)]
    return [value]


def assert_same_training(result):
    eager, compiled = result["eager"], result["donate_xla"]
    assert compiled["losses"] == pytest.approx(eager["losses"], **TOL)
    for key in ("params", "state"):
        assert len(compiled[key]) == len(eager[key]), key
        assert _flat(compiled[key]) == pytest.approx(_flat(eager[key]), **TOL), key
    assert compiled["param_specs"] == eager["param_specs"]
    assert compiled["state_specs"] == eager["state_specs"]
    assert result["transfers_while_compiling"] == 0


@pytest.mark.parametrize("layout", ["dp", "fsdp", "megatron_2d", "activation", "fsdpv2"])
def test_layout_trains_like_eager_spmd_and_donates_every_state_buffer(layout):
    result = run_layout(layout)
    assert_same_training(result)
    optimizer_calls = [c for c in result["calls"] if c[0].endswith("inference")]
    assert len(optimizer_calls) == 5
    for _, donors, aliased in optimizer_calls:  # 6 parameters + 12 Adam moments, every step
        assert donors == 18 and aliased == donors
    if layout in ("fsdp", "megatron_2d", "fsdpv2"):
        assert any(spec.startswith("{devices=") for spec in result["donor_shardings"])
    if layout == "activation":
        assert result["forward_sharding_annotations"] >= 1


def test_sharded_activations_under_a_small_budget_with_the_memory_scheduler():
    """The recipe of docs/spmd.md for the least memory: FSDP, activations sharded on the
    batch, most activations recomputed (budget 0.1), XLA's memory-minimising scheduler."""
    result = run_layout(
        "fsdp_activation", "budget",
        env={"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=false"},
    )
    assert_same_training(result)
    optimizer_calls = [c for c in result["calls"] if c[0].endswith("inference")]
    assert len(optimizer_calls) == 5 and all(d == 18 and a == d for _, d, a in optimizer_calls)
    assert result["forward_sharding_annotations"] >= 1
    assert result["forward_graphs"] == 1  # describe_mesh: mark_sharding does not break the graph


def test_switch_off_on_a_mesh_donates_nothing():
    result = run_layout("fsdp", "donation_off")
    assert_same_training(result)
    assert all(donors == 0 and aliased == 0 for _, donors, aliased in result["calls"])


def test_evicted_sharded_graphs_are_compiled_again():
    result = run_layout("fsdp", env={"XLA_COMPILATION_CACHE_SIZE": "2"})
    assert_same_training(result)


def test_dropout_on_a_mesh_draws_fresh_masks():
    result = run_layout("rng")
    assert result["values"] == [0.0, 2.0]
    assert result["distinct_masks"] == 3
    assert all(0.3 < f < 0.7 for f in result["kept_fraction"])


def test_checks_wait_for_sharded_results_still_being_computed():
    """A compiled update right after a compiled backward on a mesh: the gradients are
    results of an execution that may still run, whose sharded buffers do not exist yet.
    Reading one's handle or tag crashed torch_xla now and then (a segfault); every read
    now follows a wait for the devices, and the values equal eager SPMD."""
    result = run_layout("pending")
    assert result["reads"] > 0 and result["executions"] >= 10
    assert result["reads_after_an_execution_without_a_wait"] == 0
    assert result["reads_of_pending_results"] == 0
    assert result["moved"] > 1e-3  # the updates do something
    assert result["max_abs_diff"] < 1e-5


def test_one_graph_for_differently_sharded_layers_gives_each_gradient_its_layers_sharding():
    """dynamo runs one compiled graph for four layers, two column-parallel and two
    row-parallel. Each call's weight gradient takes the sharding of the weight it
    belongs to (the autograd node running the backward names it), not that of the
    layer the backward was first compiled for; values equal eager SPMD."""
    result = run_layout("shared")
    eager, compiled = result["eager"], result["donate_xla"]
    assert compiled["losses"] == pytest.approx(eager["losses"], **TOL)
    assert compiled["losses"][0] != compiled["losses"][-1]
    assert _flat(compiled["params"]) == pytest.approx(_flat(eager["params"]), **TOL)
    assert result["forward_graphs"] == 1
    weights = compiled["param_specs"][0::2]
    assert weights[0] != weights[1] and weights[0].startswith("{devices=")
    for step_specs in compiled["grad_specs"]:
        assert step_specs[0::2] == weights  # every weight gradient sharded like its weight
    assert result["backward_variants"] <= 4  # 12 backward calls: variants are reused


REAL_CASES = [("gpt2", "step"), ("llama", "model"), ("t5", "step")]


@pytest.mark.parametrize("name,compile_how", REAL_CASES, ids=[f"{n}-{h}" for n, h in REAL_CASES])
def test_real_model_sharded_fsdp_style_trains_like_eager_spmd(name, compile_how):
    """HF models nobody here wrote, on the 4-device mesh: parameters sharded on their first
    dimension where the devices divide it, the batch on the batch dimension. Losses,
    parameters and their shardings after 3 AdamW steps equal eager SPMD's; compiling the
    whole step donates the sharded parameters and Adam's moments."""
    pytest.importorskip("transformers")
    result = run_layout("real", name, compile_how)
    eager, compiled = result["eager"], result["donate_xla"]
    assert eager["sharded_params"] > 0
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-6)
    assert compiled["losses"][0] != compiled["losses"][-1]  # it trains
    for got, want in zip(compiled["params"], eager["params"]):
        assert got == pytest.approx(want, rel=1e-4, abs=2.5e-3)
    assert compiled["param_specs"] == eager["param_specs"]
    assert any(spec.startswith("{devices=") for spec in compiled["param_specs"])
    assert result["graphs"] > 0
    if compile_how == "step":
        assert result["donated_sharded"] >= 2 * eager["sharded_params"]


def test_random_training_programs_on_a_mesh_match_eager():
    """The differential fuzzer's programs (tests/xla_fuzz.py --path mesh) in SPMD mode on
    4 devices, every tensor replicated: the sharded executables (lowered on the real
    buffers at each new signature, waiting for executions before their checks) give
    eager's values after every call."""
    seeds = list(range(40_000, 40_012))
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import xla_fuzz\n"
        "from donate_backend.xla import dispatch\n"
        "calls = []\n"
        "original = dispatch.PerSignatureExecutable.__call__\n"
        "def counted(self, args):\n"
        "    calls.append(self.graph_name)\n"
        "    return original(self, args)\n"
        "dispatch.PerSignatureExecutable.__call__ = counted\n"
        f"outcomes = [xla_fuzz.check(seed, 'mesh') for seed in {seeds!r}]\n"
        "print(json.dumps({'outcomes': [[o.seed, o.status, o.detail[:800]] for o in outcomes],"
        " 'sharded_calls': len(calls)}))\n"
    )
    environment = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", DONATE_XLA_FUZZ_MESH="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=environment)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sharded_calls"] > len(seeds)  # the programs ran on the mesh's executables
    failed = [o for o in result["outcomes"] if o[1] == "failed"]
    assert not failed, failed
    assert sum(o[1] == "passed" for o in result["outcomes"]) >= len(seeds) // 2
