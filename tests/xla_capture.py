"""Test helper: capture the FX graphs and inputs the XLA path compiles."""
from __future__ import annotations

import re

import donate_backend.xla as xla_path


def capture_graphs(monkeypatch) -> dict:
    """Record ``{kind: (gm, example_inputs)}`` for every graph the XLA path compiles."""
    captured = {}
    original = xla_path.compile_graph

    def recording(gm, example_inputs, ctx):
        captured[ctx.kind] = (gm, list(example_inputs))
        return original(gm, example_inputs, ctx)

    monkeypatch.setattr(xla_path, "compile_graph", recording)
    return captured


def normalize_fx(code: str) -> str:
    lines = [line.rstrip() for line in code.strip().splitlines() if line.strip()]
    return "\n".join(lines)


def normalize_hlo(text: str) -> str:
    """Drop the numeric suffixes XLA gives instructions and modules, and the graph fingerprint."""
    text = re.sub(r"(%?[A-Za-z_][\w-]*)\.\d+", r"\1", text)
    text = re.sub(r"s64\[\] constant\(\d{6,}\)", "s64[] constant(<fingerprint>)", text)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines)
