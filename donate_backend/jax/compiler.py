"""The JAX target's compiler: one functional aot graph -> donors -> JAX's stages -> an executable.

``compile_graph`` (the path's entry, ``paths.JaxPath``) is called inside aot_autograd
with fake example inputs. It interprets the graph into a JAX function
(``interpret.Program``), chooses the inputs to donate (``choose_donors``: those the
graph overwrites, less any whose old value something can still read), lowers the
function with ``jax.jit(..., donate_argnums=...)`` from ``jax.ShapeDtypeStruct``s
(no byte reaches the device while compiling), compiles it, and records what it
compiled to, XLA's buffer assignment included. A graph with symbolic sizes is lowered
at its first call for each signature. Each switch setting has its own build
(``builds.BuildsPerSetting``).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from .. import config, graph_memory, graph_meta, report, torch_compat
from ..analysis import aliasing, mutation
from ..analysis.host_part import host_part
from ..builds import BuildsPerSetting
from ..errors import UnsupportedGraphError
from . import cache
from . import memory as jax_memory
from .interpret import Program
from .runtime import JaxExecutable
from .stages import Compiled, Lowered, LoweringRequest, MemoryAnalysis, Traced


def _role(roles: Sequence[str], count: int, index: int, kind: str) -> str:
    if kind == "backward" or len(roles) != count:
        return "other"
    return roles[index]


def choose_donors(gm, example_inputs: Sequence, program: Program, ctx, user_outputs: Optional[int]):
    """(the inputs to donate, ``report.InputExclusion`` of every overwritten input that is
    not): an input the graph writes is donated unless it is on the host, shares its storage
    with another input, or an output returns or saves its old value."""
    written = [w.input_index for w in program.writes]
    shared = aliasing.shared_storage_partner(example_inputs)
    reaching = aliasing.inputs_reaching_outputs(gm.graph)
    reasons = {}
    for i in written:
        value = example_inputs[i]
        if not isinstance(value, torch.Tensor) or value.device.type != "jax":
            reasons[i] = aliasing.HOST_SCALAR
        elif i in shared:
            reasons[i] = shared[i]
        elif i in reaching:
            reasons[i] = aliasing.classify_output_use(reaching[i], user_outputs)
    donors = tuple(i for i in written if i not in reasons)
    exclusions = [report.InputExclusion(i, _role(ctx.input_roles, len(example_inputs), i, ctx.kind), reason)
                  for i, reason in sorted(reasons.items())]
    return donors, exclusions


def _symbolic(example_inputs) -> bool:
    for value in example_inputs:
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def _key_spec():
    import jax

    return jax.eval_shape(lambda: jax.random.key(0))


def lower(request: LoweringRequest, program: Program, specs: list) -> Lowered:
    """``jax.jit`` of the program, lowered for ``specs`` (shapes and dtypes only)."""
    import jax

    started = time.perf_counter()
    static = program.size_inputs
    dynamic = [s for i, s in enumerate(specs) if i not in static]
    donate = tuple(sum(1 for j in range(i) if j not in static) for i in request.donors)
    if program.random:
        dynamic.append(_key_spec())
    statics = {i: specs[i] for i in static}

    def function(*arrays):
        it = iter(arrays)
        inputs = [statics[i] if i in statics else next(it) for i in range(len(specs))]
        key = next(it) if program.random else None
        return program(*inputs, key=key)

    jitted = jax.jit(function, donate_argnums=donate, keep_unused=True)
    traced = Traced(request, program, tuple(dynamic))
    lowered = jitted.lower(*dynamic)
    return Lowered(traced, lowered, request.donors, (("lower", time.perf_counter() - started),))


def compile_lowered(lowered: Lowered) -> Compiled:
    started = time.perf_counter()
    with cache.watch() as watched:
        executable = lowered.jax_lowered.compile()
    analysis = executable.memory_analysis()
    memory = None
    if analysis is not None:
        memory = MemoryAnalysis(
            argument_bytes=int(analysis.argument_size_in_bytes), output_bytes=int(analysis.output_size_in_bytes),
            alias_bytes=int(analysis.alias_size_in_bytes), temp_bytes=int(analysis.temp_size_in_bytes),
        )
    phase = "loaded from JAX's compilation cache" if watched.hit else "xla compile"
    object.__setattr__(lowered, "phases", lowered.phases + ((phase, time.perf_counter() - started),))
    return Compiled(lowered, executable, memory)


def compile_abstractly(gm: torch.fx.GraphModule, kind: str, forward_returns: Optional[int]):
    """A graph compiled from its fake values' shapes alone, for its ``GraphMemory``
    (``jax.memory.predict_step``: a candidate partition under a memory limit)."""
    program = Program(gm, f"candidate {kind}")
    examples = [n.meta.get("val") for n in program.placeholders]
    request = LoweringRequest(gm, tuple(examples), program.name)
    compiled = compile_lowered(lower(request, program, program.input_specs(examples)))
    return jax_memory.graph_memory_of(program, compiled.memory, program.name, kind, forward_returns)


class _JaxGraph:
    """One aot graph on the JAX target: what is read once inside aot_autograd's compile,
    and a build per switch setting."""

    def __init__(self, gm, example_inputs: list, ctx) -> None:
        if _symbolic(example_inputs):
            raise UnsupportedGraphError(
                f"donate_xla: {ctx.name} was traced with symbolic sizes (dynamic shapes); the JAX target "
                "compiles each graph for fixed sizes. Compile with torch.compile(..., dynamic=False).",
                help_section="The JAX target",
            )
        self.gm = gm
        self.example_inputs = example_inputs
        self.ctx = ctx
        self.program = Program(gm, ctx.name)
        self.user_outputs = torch_compat.forward_output_count() if ctx.kind == "forward" else None
        # host inputs (an optimizer's step counts): what only they feed is computed on the host
        host_inputs = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        self.on_host = host_part(gm, host_inputs)
        output = gm.graph.output_node().args[0]
        values = list(output) if isinstance(output, (list, tuple)) else [output]
        self.host_outputs = tuple(i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)
                                  and isinstance(v.meta.get("val"), torch.Tensor)
                                  and v.meta["val"].device.type == "cpu")

    def build(self, settings: config.Settings) -> JaxExecutable:
        ctx = self.ctx
        analysed = time.perf_counter()
        donors, exclusions = choose_donors(self.gm, self.example_inputs, self.program, ctx, self.user_outputs)
        active = donors if settings.donation else ()
        request = LoweringRequest(self.gm, tuple(self.example_inputs), ctx.name, donors=active)
        specs = self.program.input_specs(self.example_inputs)
        donors_seconds = time.perf_counter() - analysed
        compiled = compile_lowered(lower(request, self.program, specs))
        predicted_at = time.perf_counter()
        predicted = None
        if compiled.memory is not None:
            predicted = jax_memory.graph_memory_of(self.program, compiled.memory, ctx.name, ctx.kind, self.user_outputs)
        phases = (("donors", donors_seconds),) + compiled.lowered.phases + (
            ("memory prediction", time.perf_counter() - predicted_at),)
        record = self._record(compiled, active, exclusions, settings, phases, predicted)
        plain = []

        def without_donation():
            if not plain:
                plain.append(compile_lowered(lower(request.without_donation(), self.program, specs)))
            return plain[0]

        on_call = _Observer(record, ctx)
        return JaxExecutable(ctx.name, compiled, without_donation if active else (lambda: compiled), on_call,
                             host=self.on_host, host_outputs=self.host_outputs)

    def _record(self, compiled: Compiled, donors, exclusions, settings, phases, predicted) -> report.GraphRecord:
        ctx, examples = self.ctx, self.example_inputs
        donated = [
            report.InputDonation(
                index=i, role=_role(ctx.input_roles, len(examples), i, ctx.kind), shape=tuple(examples[i].shape),
                dtype=str(examples[i].dtype).replace("torch.", ""),
                nbytes=examples[i].numel() * examples[i].element_size(),
            )
            for i in donors
        ]
        saved = None
        if self.user_outputs is not None:
            output = self.gm.graph.output_node().args[0]
            saved = sum(graph_memory.dense_bytes(v) for node in list(output)[self.user_outputs:]
                        if isinstance(node, torch.fx.Node) for v in graph_memory.node_tensors(node))
        return report.add(report.GraphRecord(
            graph_id=ctx.graph_id, kind=ctx.kind, device="jax", path="jax", num_inputs=len(examples),
            compile_seconds=sum(s for _, s in phases), phases=phases, donated=donated, excluded=exclusions,
            donation_enabled=settings.donation, saved_bytes=saved,
            overwritten_roles=tuple(sorted({_role(ctx.input_roles, len(examples), w.input_index, ctx.kind)
                                            for w in self.program.writes})),
            lowered=compiled, memory=predicted, estimator=jax_memory,
            budget_choice=self.gm.meta.get(graph_meta.BUDGET_CHOICE),
            planned_peak=self.gm.meta.get(graph_meta.PLANNED_PEAK),
            step_choice=ctx.choice, build_key=config.cache_key(),
        ))


class _Observer:
    """After each call: that the graph ran (the plan's step order), and at the first call of a
    forward or an optimizer's step, the inputs its caller holds between steps and what it
    returned (as ``xla.memory.note_call`` notes them, by tensor identity: storages here)."""

    def __init__(self, record: report.GraphRecord, ctx) -> None:
        self.record = record
        self.roles = ctx.input_roles
        self.kind = ctx.kind

    def __call__(self, tensors: list, outputs: list) -> None:
        record = self.record
        if record.first_call is not None:
            report.mark_call(record)
            return
        report.mark_first_call(record)
        if self.kind == "backward":
            record.runs.outputs_held = graph_memory.outputs_held(r for r in report.reports() if r.path == "jax")
            return
        record.runs.held_inputs, record.runs.returned = graph_memory.first_call_identities(
            self.roles or ["other"] * len(tensors), tensors, outputs,
            lambda t: aliasing.storage_key(t) if t.device.type == "jax" else None, graph_memory.dense_bytes,
        )


class CompiledGraph:
    """The boxed callable aot_autograd gets: the build for the switches in force."""

    def __init__(self, builds: BuildsPerSetting) -> None:
        self._boxed_call = True  # an instance attribute: dynamo's disable() copies __dict__
        self._builds = builds

    def executable(self) -> JaxExecutable:
        return self._builds.current()

    def __call__(self, args):
        return self._builds.current()(args)


def compile_graph(gm, example_inputs, ctx) -> CompiledGraph:
    """Compile one aot graph for the JAX target (module docstring)."""
    mutation.strip_donation_requests(gm)
    graph = _JaxGraph(gm, list(example_inputs), ctx)
    compiled = CompiledGraph(BuildsPerSetting(graph.build))
    compiled.executable()  # compile now, under the switches in force
    return compiled
