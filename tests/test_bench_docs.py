"""docs/benchmarks.md and README.md's headline table are what bench/render.py makes of the
committed results files (bench/results/*.json): no benchmark runs here, only the renderer."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import render  # noqa: E402  (bench/render.py: no torch import)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_benchmarks_md_is_rendered_from_the_committed_results():
    rendered = render.render_docs(render.Results())
    assert rendered == _read(os.path.join(render.DOCS, "benchmarks.md")), (
        "docs/benchmarks.md differs from a render of bench/results/: run `make bench-docs` "
        "(edit bench/benchmarks.md.in, not the generated page)"
    )


def test_readme_headline_is_rendered_from_the_committed_results():
    readme = _read(render.README)
    assert render.headline_region(readme) == render.render_headline(render.Results()).rstrip("\n") + "\n", (
        "README.md's headline region differs from a render of bench/results/: run `make bench-docs`"
    )
    assert render.replace_headline(readme, render.render_headline(render.Results())) == readme


def test_every_linked_plot_exists():
    names = render.linked_plots(_read(os.path.join(render.DOCS, "benchmarks.md")),
                                render.headline_region(_read(render.README)))
    assert names
    for name in names:
        assert os.path.exists(os.path.join(render.DOCS, name)), f"docs/{name} is linked but missing"
        assert name in render.PLOTS, f"docs/{name} is linked but bench/render.py does not draw it"


def test_no_measured_number_in_the_templates():
    """Figures come from the results: the templates' prose holds no MiB, seconds or ratio values."""
    for path in (render.TEMPLATE, render.HEADLINE_TEMPLATE):
        text = render.PLACEHOLDER.sub("", _read(path))
        text = re.sub(r"every\s+\d+\s+ms", "", text)  # sampling intervals are settings, not results
        found = re.findall(r"\d+(?:\.\d+)?\s*(?:MiB|GiB|ms|s\b|%)|\d+\.\d+\s*×", text)  # 8 × Linear: a shape
        assert not found, f"{path}: measured-looking figures in the prose: {found}"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plots_are_drawn_from_the_results(tmp_path):
    results = render.Results()
    names = render.linked_plots(render.render_docs(results), render.render_headline(results))
    written = render.draw_plots(results, names, docs=str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == sorted(names)
    assert all(os.path.getsize(p) > 0 for p in written)


def _copy_results(tmp_path) -> str:
    target = tmp_path / "results"
    shutil.copytree(render.RESULTS, target)
    return str(target)


def test_a_missing_results_file_is_named(tmp_path):
    directory = _copy_results(tmp_path)
    os.remove(os.path.join(directory, "donation.json"))
    with pytest.raises(render.ResultsError, match=r"donation\.json: results file missing"):
        render.render_docs(render.Results(directory))


def test_a_corrupt_results_file_is_named(tmp_path):
    directory = _copy_results(tmp_path)
    path = os.path.join(directory, "compile.json")
    with open(path, "w") as f:
        f.write('{"machine": ')
    with pytest.raises(render.ResultsError, match=r"compile\.json: not a readable results file"):
        render.render_docs(render.Results(directory))


def test_a_results_file_without_its_samples_is_named(tmp_path):
    directory = _copy_results(tmp_path)
    path = os.path.join(directory, "dispatch.json")
    data = json.loads(_read(path))
    del data["results"]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(render.ResultsError, match=r"dispatch\.json: .*missing results"):
        render.render_docs(render.Results(directory))


def test_the_command_line_reports_a_bad_file_and_fails(tmp_path, capsys):
    directory = _copy_results(tmp_path)
    os.remove(os.path.join(directory, "native_speed.json"))
    assert render.main(["--results", directory, "--check"]) == 1
    assert "native_speed.json: results file missing" in capsys.readouterr().err
