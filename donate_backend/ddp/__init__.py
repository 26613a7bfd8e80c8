"""DDP bucket rewrite (placeholder; filled in by the DDP issue).

``prepare`` is called by the native path on every graph before its own passes.
It returns the graph to compile and a dict of ``GraphRecord`` fields to set.
"""
from __future__ import annotations


def prepare(gm, example_inputs, ctx):
    return gm, {}
