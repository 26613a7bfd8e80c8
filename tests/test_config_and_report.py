"""Switch parsing, patching and the printed report (no device needed)."""
import dataclasses

import pytest

from donate_backend import config, report


def test_defaults_are_on():
    s = config.settings_from_env({})
    assert (s.donation, s.free_saved, s.bucket_view, s.debug) == (True, True, True, False)
    assert s.native_compiler == "aten"
    assert (s.stitch, s.activation_budget, s.order_recompute) == (None, 1.0, None)
    assert s.backward_segments is None  # automatic (xla.segments.worth_splitting)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),  # full budget: nothing worth ordering is recomputed
        ({"DONATE_XLA_ACTIVATION_BUDGET": "0.5"}, True),
        ({"DONATE_XLA_ACTIVATION_BUDGET": "0.5", "DONATE_XLA_ORDER_RECOMPUTE": "0"}, False),
        ({"DONATE_XLA_ORDER_RECOMPUTE": "1"}, True),
    ],
)
def test_recomputation_is_ordered_under_a_budget_unless_told(env, expected):
    assert config.settings_from_env(env).orders_recompute is expected
    with config.patch(**{k: v for k, v in dataclasses.asdict(config.settings_from_env(env)).items()}):
        assert config.current().orders_recompute is expected


def test_memory_switches_parse_and_validate():
    s = config.settings_from_env(
        {"DONATE_XLA_STITCH": "1", "DONATE_XLA_ACTIVATION_BUDGET": "0.25", "DONATE_XLA_ORDER_RECOMPUTE": "0"}
    )
    assert (s.stitch, s.activation_budget, s.order_recompute) == (True, 0.25, False)
    with pytest.raises(ValueError, match="DONATE_XLA_ORDER_RECOMPUTE='maybe' is not a boolean"):
        config.settings_from_env({"DONATE_XLA_ORDER_RECOMPUTE": "maybe"})
    with pytest.raises(ValueError, match="DONATE_XLA_ACTIVATION_BUDGET='half' is not a number"):
        config.settings_from_env({"DONATE_XLA_ACTIVATION_BUDGET": "half"})
    with pytest.raises(ValueError, match=r"activation_budget must be in \(0, 1\], got 1.5"):
        config.settings_from_env({"DONATE_XLA_ACTIVATION_BUDGET": "1.5"})
    assert config.settings_from_env({"DONATE_XLA_BACKWARD_SEGMENTS": " 8 "}).backward_segments == 8
    assert config.settings_from_env({"DONATE_XLA_BACKWARD_SEGMENTS": "0"}).backward_segments == 0
    assert config.settings_from_env({"DONATE_XLA_BACKWARD_SEGMENTS": "auto"}).backward_segments is None
    with pytest.raises(ValueError, match="DONATE_XLA_BACKWARD_SEGMENTS='eight' is not a whole number"):
        config.settings_from_env({"DONATE_XLA_BACKWARD_SEGMENTS": "eight"})
    with pytest.raises(ValueError, match=r"backward_segments must be a whole number >= 0 or None \(automatic\), got -2"):
        config.settings_from_env({"DONATE_XLA_BACKWARD_SEGMENTS": "-2"})
    with pytest.raises(ValueError, match="got True"):
        config.Settings(backward_segments=True)


def test_env_parsing():
    s = config.settings_from_env(
        {"DONATE_XLA_DONATION": "0", "DONATE_XLA_DEBUG": "yes", "DONATE_XLA_NATIVE_COMPILER": "Inductor"}
    )
    assert s.donation is False and s.debug is True and s.native_compiler == "inductor"


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="DONATE_XLA_DONATION='maybe' is not a boolean"):
        config.settings_from_env({"DONATE_XLA_DONATION": "maybe"})
    with pytest.raises(ValueError, match="DONATE_XLA_NATIVE_COMPILER"):
        config.settings_from_env({"DONATE_XLA_NATIVE_COMPILER": "tvm"})


def test_patch_restores_and_changes_the_cache_key():
    before = config.cache_key()
    with config.patch(donation=not config.current().donation):
        assert config.cache_key() != before
    assert config.cache_key() == before


def test_table_lists_every_graph():
    records = [
        report.GraphRecord(0, "forward", "xla", "xla", 3, compile_seconds=0.5),
        report.GraphRecord(
            0,
            "inference",
            "xla",
            "xla",
            2,
            donated=[report.InputDonation(0, "parameter", (2, 2), "float32", 16)],
        ),
    ]
    table = report.format_table(records)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["graph", "path", "device", "inputs"]
    assert lines[2].startswith("graph 0 forward") and lines[3].startswith("graph 0 inference")
    assert lines[3].split()[8] == "1"  # the donated column ("graph 0 inference" is 3 words)
    assert "donated  #0   parameter" in report.format_record(records[1])


def test_record_says_how_many_recomputation_roots_were_ordered():
    ordered = report.GraphRecord(0, "backward", "xla", "xla", 5, recompute_gated=3)
    assert "recomputation kept in order: 3 roots wait for the gradient before them" in report.format_record(ordered)
    plain = report.GraphRecord(0, "backward", "xla", "xla", 5)
    assert "recomputation" not in report.format_record(plain)


def test_record_of_a_split_backward_says_how_many_segments_and_what_they_release():
    split = report.GraphRecord(
        graph_id=2, kind="backward", device="xla", path="xla", num_inputs=9, backward_segments=4, released_bytes=4096
    )
    text = report.format_record(split)
    assert "run in 4 segments (records follow): 4096 B of saved tensors and incoming gradients released" in text
    plain = report.GraphRecord(graph_id=2, kind="backward", device="xla", path="xla", num_inputs=9)
    assert "segments" not in report.format_record(plain)


def test_unknown_or_bad_compile_options_are_refused_and_modes_ignored_with_a_warning():
    """``torch.compile``'s ``options`` reach the backend as settings of that function; an
    unknown key or a bad value is refused with the settings that exist (ignoring it would
    let a user believe it took effect). A mode (Inductor's CUDA graphs, autotuning)
    compiles as the default does, with a warning."""
    import warnings

    import torch

    from donate_backend.errors import DonateXlaError

    def f(x):
        return x * 2 + 1

    x = torch.arange(3.0)
    with pytest.raises(Exception, match=r"options=\.\.\.\) refused: unknown option\(s\) budget") as info:
        torch.compile(f, backend="donate_xla", options={"budget": 0.5})(x)
    assert DonateXlaError.__name__ in str(info.value)  # dynamo wraps it, keeping the message
    assert "activation_budget" in str(info.value) and "stitch" in str(info.value)
    assert 'docs/troubleshooting.md, "Settings and `torch.compile` arguments"' in str(info.value)
    for bad, says in (
        ({"free_saved": 1}, "expected bool"),
        ({"activation_budget": 1.5}, "must be in"),
        ({"memory_limit": -5}, "memory_limit must be a number of bytes > 0"),
        ({"memory_limit": "lots"}, "memory_limit='lots' is not a size"),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=says):
            torch.compile(f, backend="donate_xla", options=bad)(x)
    from donate_backend.backend import compile_options

    with pytest.raises(DonateXlaError, match=r"unknown torch.compile argument\(s\) fullgraph_extra"):
        compile_options(0, fullgraph_extra=True)  # an argument a future torch might pass on
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="donate_xla", mode="reduce-overhead")(x)
    assert torch.equal(out, f(x))
    assert any("ignores torch.compile(mode='reduce-overhead')" in str(w.message) for w in caught)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(torch.compile(f, backend="donate_xla")(x), f(x))
    assert not any("ignores torch.compile" in str(w.message) for w in caught)


def test_two_functions_in_one_process_run_under_their_own_options():
    """One model compiled with ``options={"free_saved": False}`` (the plain backward, which
    frees nothing early) and one with the defaults: each graph is built and run under its
    own function's settings, backwards (compiled when they first run) included, and the
    process settings are untouched. Values equal eager for both."""
    import copy

    import torch

    import donate_backend
    from donate_backend import config

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    plain, freeing = copy.deepcopy(eager), copy.deepcopy(eager)
    run_plain = torch.compile(plain, backend="donate_xla", options={"free_saved": False})
    run_freeing = torch.compile(freeing, backend="donate_xla")
    x = torch.randn(8, 16)
    for _ in range(2):
        for model, run in ((eager, eager), (plain, run_plain), (freeing, run_freeing)):
            run(x).square().mean().backward()
    for a, b, c in zip(eager.parameters(), plain.parameters(), freeing.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
        torch.testing.assert_close(c.grad, a.grad)
    backwards = [r for r in donate_backend.reports() if r.kind == "backward"]
    assert sorted(r.saved_freed_early for r in backwards) == [0, max(r.saved_freed_early for r in backwards)]
    assert max(r.saved_freed_early for r in backwards) > 0
    assert config.current().free_saved is True


def test_every_error_names_a_section_of_the_troubleshooting_page_that_exists():
    """Each DonateXlaError's text ends with where docs/troubleshooting.md lists it: the
    section its class names, or the one given where it is raised."""
    import importlib
    import pathlib
    import re

    from donate_backend.errors import DonateXlaError

    root = pathlib.Path(__file__).resolve().parent.parent
    headings = {
        line[3:].split(" (`")[0].strip()
        for line in (root / "docs" / "troubleshooting.md").read_text().splitlines()
        if line.startswith("## ")
    }
    for module in ("donate_backend.xla.mmap_guard", "donate_backend.xla.plan", "donate_backend.xla.compat"):
        try:
            importlib.import_module(module)
        except ImportError:  # the XLA modules, where torch_xla is not installed
            pass
    classes, todo = [], [DonateXlaError]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    named = {cls.help_section for cls in classes if cls.help_section}
    # and those of classes in modules this environment cannot import (the XLA path without
    # torch_xla), and the ones given where an error is raised
    sources = "".join(p.read_text() for p in (root / "donate_backend").rglob("*.py"))
    named |= set(re.findall(r'help_section\s*=\s*"([^"]+)"', sources))
    assert len(named) >= 6 and named <= headings, (named - headings, headings)
    error = DonateXlaError("graph 1: something", help_section="While running")
    assert str(error) == 'graph 1: something\n(causes and fixes: docs/troubleshooting.md, "While running")'
    assert str(DonateXlaError("x")).endswith("(causes and fixes: docs/troubleshooting.md)")


def test_compile_time_is_split_into_phases():
    """Each record says where its compile time went, and ``compile_phases()`` adds dynamo's
    and aot_autograd's share (dynamo's timers exist on every torch this runs on)."""
    import torch

    import donate_backend

    donate_backend.clear_reports()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    torch.compile(model, backend="donate_xla")(torch.randn(4, 8)).sum().backward()
    records = donate_backend.reports()
    assert [r.kind for r in records] == ["forward", "backward"]
    for r in records:
        assert [name for name, _ in r.phases] == ["build", "memory prediction"]
        assert r.compile_seconds == pytest.approx(sum(s for _, s in r.phases))
    split = donate_backend.compile_phases()
    assert split.dynamo > 0 and split.aot_autograd > 0 and split.backend > 0  # roles, capture: some work
    assert split.graphs["build"] == pytest.approx(sum(dict(r.phases)["build"] for r in records))
    assert "aot_autograd" in split.as_text() and "memory prediction" in split.as_text()


def test_a_segments_context_names_its_part_and_carries_nothing_of_the_whole_graph():
    """A part of a graph compiled on its own (a backward segment, an XLA segment around
    CPU ops, or such a segment of a segment) is named after its graph and its place, and
    carries no input roles or captured data: those describe the whole graph's inputs."""
    from donate_backend.graphs import GraphContext

    whole = GraphContext(3, "backward", input_roles=("parameter", "other"), captured=object())
    part = whole.for_segment(2)
    assert (part.graph_id, part.kind, part.segment) == (3, "backward", "2")
    assert part.input_roles == () and part.captured is None
    assert part.name == "graph 3 backward (segment 2)"
    assert part.for_segment(0).name == "graph 3 backward (segment 2.0)"
    assert whole.name == "graph 3 backward" and whole.segment is None
