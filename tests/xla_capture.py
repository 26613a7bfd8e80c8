"""Test helper: the FX graphs the XLA path compiled, read from the graph records."""
from __future__ import annotations

import re

import donate_backend


def compiled_graphs() -> dict:
    """``{kind: (gm, example_inputs)}`` of the graphs compiled so far (last one per kind)."""
    captured = {}
    for record in donate_backend.reports():
        if record.path == "xla" and record.lowered is not None:
            traced = record.lowered.traced
            captured[record.kind] = (traced.gm, list(traced.example_inputs))
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
