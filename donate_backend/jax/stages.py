"""The JAX target's stages, each a value you can print: ``LoweringRequest`` -> ``Traced`` ->
``Lowered`` -> ``Compiled``, as JAX's own ``jit(...).trace(...).lower().compile()``.

- ``LoweringRequest``: the graph, its example inputs (fake: shapes and dtypes only) and
  the inputs to donate, decided from the graph (``compiler.choose_donors``);
- ``Traced``: the graph as a JAX function (``interpret.Program``) and the shapes it is
  traced for; ``as_text()`` prints the FX code and the inputs;
- ``Lowered``: JAX's lowering from ``jax.ShapeDtypeStruct``s alone (no device data);
  ``as_text()`` gives the inputs, donors and outputs, ``stablehlo()`` the StableHLO, in
  which each donated input carries ``tf.aliasing_output`` where XLA pairs it with an output;
- ``Compiled``: XLA's executable and its buffer assignment (``memory``: argument,
  output, alias and temporary bytes, from ``Compiled.memory_analysis()``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from .interpret import Program


@dataclasses.dataclass(frozen=True)
class LoweringRequest:
    """What to lower: a functional aot graph, for these inputs, donating ``donors``."""

    gm: torch.fx.GraphModule
    example_inputs: tuple
    name: str
    donors: Tuple[int, ...] = ()

    def without_donation(self) -> "LoweringRequest":
        return dataclasses.replace(self, donors=())


@dataclasses.dataclass(frozen=True)
class Traced:
    request: LoweringRequest
    program: Program
    specs: tuple  # jax.ShapeDtypeStruct per tensor input (an int per size), then the key's

    def as_text(self) -> str:
        lines = [f"{self.request.name}: traced for"]
        for i, spec in enumerate(self.specs):
            lines.append(f"  input {i}: {spec}")
        lines.append(self.request.gm.code.strip())
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """XLA's buffer assignment of one executable, in bytes."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Above its arguments, while it runs: its temporaries and the outputs that reuse no
        donated buffer (XLA:CPU's own peak figure leaves the temporaries out)."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class Lowered:
    traced: Traced
    jax_lowered: object  # jax.stages.Lowered
    donors: Tuple[int, ...]
    phases: tuple = ()  # (phase, seconds)

    @property
    def request(self) -> LoweringRequest:
        return self.traced.request

    def stablehlo(self) -> str:
        """The StableHLO JAX lowered the graph to."""
        return self.jax_lowered.as_text()

    def as_text(self) -> str:
        program = self.traced.program
        lines = [f"{self.request.name}: {len(self.traced.specs)} inputs, donated {list(self.donors)}"]
        for w in program.writes:
            lines.append(f"  input {w.input_index} <- new value {w.node.args[1]}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Compiled:
    lowered: Lowered
    executable: object  # jax.stages.Compiled
    memory: Optional[MemoryAnalysis]

    def as_text(self) -> str:
        text = self.lowered.as_text()
        if self.memory is not None:
            m = self.memory
            text += (f"\n  XLA buffer assignment: arguments {m.argument_bytes} B, outputs {m.output_bytes} B, "
                     f"aliased {m.alias_bytes} B, temporaries {m.temp_bytes} B")
        return text
