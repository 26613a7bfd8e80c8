"""Where compile time goes: dynamo, aot_autograd, and each phase of our compilers.

``compile_phases()`` splits the compile time of the process so far into

- **dynamo**: tracing Python bytecode into FX graphs, building guards (all frames),
  less the time in backends;
- **backend**: donate_xla's work on dynamo's graph before aot_autograd (input roles,
  rewrites, checks);
- **aot_autograd**: functionalization, the joint graph, the partitioner (with the
  activation budget's search under a memory limit), less our graph compilers;
- **graphs**: our graph compilers, phase by phase, summed over the compiled graphs
  (``GraphRecord.phases``; XLA: donors, trace on placeholders, plan, XLA compile,
  memory prediction; native: build, memory prediction).

dynamo's figures are its own timers (``torch_compat.dynamo_compile_seconds``),
kept since the process started; the graphs' are the records since the last
``clear_reports()``. ``bench/compile.py`` prints the split for a training step.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

from . import report, torch_compat


@dataclasses.dataclass(frozen=True)
class CompilePhases:
    """Seconds per phase (None: this torch does not time it)."""

    dynamo: Optional[float]
    backend: Optional[float]
    aot_autograd: Optional[float]
    graphs: Dict[str, float]

    @property
    def total(self) -> float:
        return sum(v for v in (self.dynamo, self.backend, self.aot_autograd) if v) + sum(self.graphs.values())

    def as_text(self) -> str:
        def fmt(v):
            return "n/a" if v is None else f"{v:.3f} s"

        lines = [f"compile time {self.total:.3f} s: dynamo {fmt(self.dynamo)}, donate_xla before aot_autograd "
                 f"{fmt(self.backend)}, aot_autograd {fmt(self.aot_autograd)}, graph compilers "
                 f"{sum(self.graphs.values()):.3f} s"]
        lines += [f"  {name:<20} {seconds:8.3f} s" for name, seconds in self.graphs.items()]
        return "\n".join(lines)


def compile_phases(records: Optional[Sequence[report.GraphRecord]] = None) -> CompilePhases:
    """The split of compile time (see the module docstring)."""
    records = list(report.reports() if records is None else records)
    graphs: Dict[str, float] = {}
    for r in records:
        for name, seconds in r.phases:
            graphs[name] = graphs.get(name, 0.0) + seconds
    ours = sum(graphs.values())
    timers = torch_compat.dynamo_compile_seconds()
    frames = timers.get("_compile.compile_inner")
    in_backends = timers.get("OutputGraph.call_user_compiler")
    in_aot = timers.get("create_aot_dispatcher_function")
    lazy_backwards = timers.get("backward._backward_impl", 0.0)
    dynamo = frames - in_backends if frames is not None and in_backends is not None else None
    backend = in_backends - in_aot if in_backends is not None and in_aot is not None else None
    aot = max(0.0, in_aot + lazy_backwards - ours) if in_aot is not None else None
    return CompilePhases(dynamo=dynamo, backend=backend, aot_autograd=aot, graphs=graphs)
