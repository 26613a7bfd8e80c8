"""Stage 1 of lowering: run the FX graph on placeholder tensors.

Placeholders have a shape and dtype but no device buffer, so running the
graph on them builds lazy IR only and sends nothing to the device. Before a
node runs it is checked: ops torch_xla cannot lower (the CPU fallback would
read a placeholder and crash the process) and host reads are rejected with
an error that names the node.

``traced_on_placeholders`` is a context manager: every placeholder-derived
tensor lives only inside it (a live one would crash the process at the next
``torch_xla.sync()``). ``TracedGraph`` is what is kept afterwards: the FX
graph and the input signature, printable with ``as_text()``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Sequence

import torch
import torch.fx
import torch_xla

from ..errors import UnsupportedGraphError
from .. import config
from . import compat, ops, recompute, update_order
from .plan import LoweringMismatchError

def check_inputs(example_inputs: Sequence, graph_name: str) -> list[int]:
    """Validate inputs; return the indices of host (CPU) tensors.

    Host tensors (Adam's step counters, an index tensor made on the CPU) are
    uploaded with the inputs on every call and never donated. Symbolic sizes
    are allowed: the graph is then lowered per concrete signature.
    """
    host = []
    for i, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "xla":
            continue
        if value.device.type == "cpu":
            host.append(i)
            continue
        raise UnsupportedGraphError(
            f"{graph_name}: input #{i} is a {value.device.type} tensor of shape "
            f"{tuple(value.shape)} in a graph on the XLA device. Move it to the XLA device "
            "(tensor.to(torch_xla.device())) before calling the compiled function."
        )
    return host


def host_input_bytes(example_inputs: Sequence) -> int:
    """Bytes of the host (CPU) tensors a call uploads with its inputs."""
    return sum(
        t.numel() * t.element_size()
        for t in example_inputs
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not isinstance(t.numel(), torch.SymInt)
    )


def meta_device(node) -> Optional[torch.device]:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.device if isinstance(val, torch.Tensor) else None


def check_graph(gm: torch.fx.GraphModule, graph_name: str) -> None:
    """Reject, before anything runs, every node that cannot be traced on placeholders."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            _reject_host_reads(node, graph_name)
            _reject_unlowerable(node, graph_name)


def _reject_unlowerable(node: torch.fx.Node, graph_name: str) -> None:
    if not ops.lowerable_node(node):
        raise UnsupportedGraphError(
            f"{graph_name}: op {node.target} (node {node.name!r}) has no XLA lowering "
            "in torch_xla (for these arguments), so it cannot be compiled for the XLA device. Move it outside "
            "the compiled region (wrap it in torch._dynamo.disable) or replace it with "
            "supported ops."
        )


def _reject_host_reads(node: torch.fx.Node, graph_name: str) -> None:
    if node.target in ops.HOST_READ_OPS:
        raise UnsupportedGraphError(
            f"{graph_name}: node {node.name!r} reads device data on the host "
            f"({ops.HOST_READ_OPS[node.target]}) inside the compiled graph. Move the read "
            "out of the compiled function, or let dynamo break the graph there."
        )
    out_device = meta_device(node)
    if out_device is None or out_device.type != "cpu":
        return
    for arg in node.all_input_nodes:
        arg_device = meta_device(arg)
        if arg_device is not None and arg_device.type == "xla":
            raise UnsupportedGraphError(
                f"{graph_name}: node {node.name!r} ({node.target}) copies an XLA "
                "tensor to the host (.cpu() / .to('cpu')) inside the compiled graph. "
                "Do that after the compiled function returns."
            )


def _is_mark_sharding(target) -> bool:
    """Our ``donate_xla::mark_sharding`` or torch_xla's ``xla::dynamo_mark_sharding``."""
    from .sharding import OP

    if target is OP:
        return True
    xla_ops = getattr(torch.ops, "xla", None)
    op = getattr(xla_ops, "dynamo_mark_sharding", None) if xla_ops is not None else None
    return op is not None and target in (op, getattr(op, "default", None))


def _mark_sharding(t, device_ids, mesh_shape, axis_names: str, partition_spec: str):
    """Annotate a traced tensor's IR with the sharding and return it. (torch_xla's
    kernel would return an ``XLAShardedTensor`` wrapper that the rest of the
    trace cannot use, and on a buffer it would move data.)"""
    from .sharding import annotated

    return annotated(t, device_ids, mesh_shape, axis_names, partition_spec)


def _unwrapped(value):
    """The XLA tensor inside torch_xla's ``XLAShardedTensor`` wrapper (what
    ``xla::dynamo_mark_sharding`` returns); anything else as it is."""
    if isinstance(value, torch.Tensor) and type(value).__name__ == "XLAShardedTensor":
        return value.global_tensor
    return value


class _PlaceholderTracer(torch.fx.Interpreter):
    """Runs the graph on placeholders; host tensors are kept on the device."""

    def __init__(self, gm: torch.fx.GraphModule, graph_name: str, device: torch.device, gates: dict):
        super().__init__(gm, garbage_collect_values=True)
        self.graph_name = graph_name
        self.device = device
        self.constants_uploaded = 0
        # node -> the values it waits for: a recomputation root, the gradient before it
        # (recompute.py); in a stitched step, a parameter's gradient, its reads (update_order.py)
        self.gates = gates
        self.gate_nodes = {gate for waits in gates.values() for gate in waits}
        self.gate_values = {}  # kept past their last use in the graph (the interpreter frees those)
        self.gate_flags = {}  # gate -> the True computed from it

    def run_node(self, node: torch.fx.Node):
        try:
            if node in self.gates:
                return _unwrapped(self._run_gated(node))
            value = _unwrapped(super().run_node(node))
            if node.op == "call_function":
                value = ops.conform_dtypes(node, value)
            if node in self.gate_nodes:
                self.gate_values[node] = value
            return value
        except UnsupportedGraphError:
            raise
        except Exception as exc:  # noqa: BLE001 - rethrown with the op's name
            raise UnsupportedGraphError(
                f"{self.graph_name}: op {node.target} (node {node.name!r}) could not be "
                f"lowered to XLA: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}. "
                "If torch_xla has no lowering for it, move that op outside the compiled "
                "region (torch._dynamo.disable) or replace it with supported ops."
            ) from exc

    def _run_gated(self, node: torch.fx.Node):
        """Run a node with one input made dependent on its gates (``recompute.py``,
        ``update_order.py``), so XLA cannot run it before the gates' values exist."""
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        flag = None
        for gate in self.gates[node]:
            if gate not in self.gate_flags:
                self.gate_flags[gate] = recompute.always_true(self.gate_values.pop(gate))
            flag = self.gate_flags[gate] if flag is None else flag & self.gate_flags[gate]
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        args, kwargs = torch.utils._pytree.tree_unflatten(recompute.gated_inputs(leaves, flag), spec)
        return self.call_function(node.target, args, kwargs)

    def call_function(self, target, args, kwargs):
        target = ops.EQUIVALENT_OPS.get(target, target)
        if _is_mark_sharding(target):
            return _mark_sharding(*args, **kwargs)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            kwargs = {**kwargs, "device": self.device}
        args, kwargs = ops.with_every_dim(target, tuple(args), kwargs)
        decomposed = ops.eval_batch_norm_backward(target, args, kwargs)
        if decomposed is None:
            decomposed = ops.dropout_as_torch(target, args, kwargs)
        if decomposed is None:
            decomposed = ops.copy_into_fresh_tensor(target, args, kwargs)
        if decomposed is not None:
            return decomposed
        args = ops.batch_norm_backward_args(target, args)
        return ops.batch_norm_as_torch(target, args, super().call_function(target, args, kwargs))

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)
        if isinstance(value, torch.Tensor) and value.device.type != "xla":
            self.constants_uploaded += 1
            value = value.to(self.device)
        return value


def flatten_outputs(out) -> list:
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def output_nodes(gm: torch.fx.GraphModule) -> list:
    return flatten_outputs(gm.graph.output_node().args[0])


def check_output_shapes(gm: torch.fx.GraphModule, outputs: Sequence, graph_name: str) -> None:
    """Refuse a trace whose output has another shape than torch says it has.

    A torch_xla lowering that computes the wrong thing for some arguments
    (``amax`` with an empty dim list did) would otherwise be a silently wrong
    value; a wrong shape at least is caught here, before anything runs.
    """
    for node, value in zip(output_nodes(gm), outputs):
        expected = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not (isinstance(expected, torch.Tensor) and isinstance(value, torch.Tensor)):
            continue
        shape = tuple(expected.shape)
        if all(isinstance(d, int) for d in shape) and tuple(value.shape) != shape:
            raise LoweringMismatchError(
                f"donate_xla: {graph_name}: torch_xla computed output {node.name!r} with shape "
                f"{list(value.shape)}, but torch says {list(shape)}: the result would be wrong, so "
                "the graph is not compiled. The op that made it is torch_xla's; please report it "
                "with the graph (DONATE_XLA_DEBUG=1 writes it), and compute that value outside the "
                "compiled function (torch._dynamo.disable) meanwhile."
            )


@dataclasses.dataclass(frozen=True)
class InputSpec:
    index: int
    shape: tuple
    dtype: str
    device: str
    donor: bool = False
    host_scalar: bool = False


@dataclasses.dataclass(frozen=True)
class TracedGraph:
    """Stage 1, as kept after lowering: the FX graph and what it was traced with."""

    graph_name: str
    gm: torch.fx.GraphModule
    inputs: tuple  # InputSpec per graph input (None for non-tensors)
    constants_uploaded: int = 0
    example_inputs: tuple = dataclasses.field(default=(), repr=False, compare=False)  # fake
    recompute_gated: int = 0  # recomputation roots traced behind a gate (recompute.py)
    updates_ordered: int = 0  # gradients traced behind their parameter's reads (update_order.py)

    @property
    def code(self) -> str:
        return self.gm.code

    def as_text(self) -> str:
        lines = [f"{self.graph_name}: traced on placeholders", "inputs:"]
        for spec in self.inputs:
            if spec is None:
                continue
            flags = " donor" if spec.donor else ""
            flags += " host-scalar" if spec.host_scalar else ""
            lines.append(f"  #{spec.index:<3} {spec.dtype}{list(spec.shape)} {spec.device}{flags}")
        lines.append("code:")
        lines.extend("  " + line for line in self.gm.code.strip().splitlines() if line.strip())
        return "\n".join(lines)


def input_specs(example_inputs: Sequence, donors: Sequence[int], host_scalars: Sequence[int]) -> tuple:
    donor_set, host_set = set(donors), set(host_scalars)
    return tuple(
        InputSpec(
            i, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.device.type, i in donor_set, i in host_set
        )
        if isinstance(t, torch.Tensor)
        else None
        for i, t in enumerate(example_inputs)
    )


@dataclasses.dataclass
class LiveTrace:
    """Stand-in-derived tensors; valid only inside ``traced_on_placeholders``."""

    holders: list  # the stand-in per graph input (non-tensors as given)
    outputs: list
    constants_uploaded: int
    reals: list  # per input: the real device tensor a stand-in clones (SPMD), else None
    input_of_handle: dict = dataclasses.field(default_factory=dict)  # buffer handle -> input index
    recompute_gated: int = 0  # recomputation roots traced behind a gate
    updates_ordered: int = 0  # gradients traced behind their parameter's reads

    def data_read_by(self, tensors: Sequence[torch.Tensor]) -> tuple:
        """(tags, values, input index or None) of every device buffer the tensors'
        IR reads, in HLO parameter order.

        The inputs' own tensors are passed to torch_xla as "uncloned", so it hands
        them back instead of wrapping their buffers in new tensors, which would
        re-tag the buffers and upset the ownership checks of later calls.
        """
        known = {}
        for i, t in enumerate(self.holders):
            if isinstance(t, torch.Tensor):
                known[id(t)] = i
        for i, t in enumerate(self.reals):
            if _is_xla(t):
                known[id(t)] = i
        uncloned = [t for t in self.holders if isinstance(t, torch.Tensor)] + [t for t in self.reals if _is_xla(t)]
        tags, values = compat.device_data_nodes(tensors, uncloned)
        inputs = [known.get(id(v)) for v in values]
        unknown = [k for k, i in enumerate(inputs) if i is None]
        for k, handle in zip(unknown, compat.handles_or_none([values[k] for k in unknown])):
            inputs[k] = self.input_of_handle.get(handle)
        return tags, values, inputs


def _is_xla(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


def _stand_in(example, real: Optional[torch.Tensor]) -> torch.Tensor:
    """What the graph is traced on for one tensor input.

    A placeholder (no device data) of the example's shape and dtype; or, given
    the real device tensor (SPMD, where the HLO parameter must carry its
    sharding and placeholders cannot), a lazy clone of it: it reads the real
    buffer, sharding included, and moves no data; in-place ops on it leave
    the real tensor alone.
    """
    if _is_xla(real):
        return real.clone()
    return compat.make_placeholder(example.shape, example.dtype)


@contextlib.contextmanager
def traced_on_placeholders(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence,
    donors: Sequence[int],
    graph_name: str,
    real_inputs: Optional[Sequence] = None,
    stitch: bool = False,
) -> Iterator[LiveTrace]:
    """Trace ``gm`` on stand-ins (donors flagged first) under the trace settings.
    ``stitch``: for a stitched step, where each parameter's gradient waits for the
    backward's reads of that parameter (``update_order.py``).

    The settings stay in force inside the block, where the caller compiles the
    traced tensors; on exit every stand-in-derived tensor is dropped, and the
    donation flags of real buffers are put back as they were.
    """
    check_graph(gm, graph_name)
    reals = list(real_inputs) if real_inputs is not None else [None] * len(example_inputs)
    xla_reals = [t for t in reals if _is_xla(t)]
    without_buffer = [t for t, h in zip(xla_reals, compat.handles_or_none(xla_reals)) if h is None]
    if without_buffer:  # a value that is another tensor's buffer: give it the buffer (no data moves)
        compat.sync(without_buffer, wait=False)
    with compat.outside_fake_tracing(), compat.tracing_settings(donate=bool(donors)):
        holders = [
            _stand_in(t, real) if isinstance(t, torch.Tensor) else t for t, real in zip(example_inputs, reals)
        ]
        tensor_inputs = [i for i, h in enumerate(holders) if isinstance(h, torch.Tensor)]
        # a clone has no buffer of its own yet: it reads (and is identified by) the real one
        handles = compat.data_handles([reals[i] if _is_xla(reals[i]) else holders[i] for i in tensor_inputs])
        shared = [i for i in donors if _is_xla(reals[i])]  # their flags live on real buffers
        saved_flags = [compat.get_buffer_donation(holders[i]) for i in shared]
        recomputed = recompute.gates(gm.graph) if config.current().orders_recompute else {}
        updated = update_order.gates(gm) if stitch else {}
        gated = {node: (gate,) for node, gate in recomputed.items()}
        for node, readers in updated.items():
            gated[node] = gated.get(node, ()) + readers
        tracer = _PlaceholderTracer(gm, graph_name, torch_xla.device(), gated)
        live = LiveTrace(holders, [], 0, reals, dict(zip(handles, tensor_inputs)), len(recomputed), len(updated))
        try:
            for i in donors:
                compat.set_buffer_donation(holders[i], True)
            live.outputs.extend(flatten_outputs(tracer.run(*holders)))
            check_output_shapes(gm, live.outputs, graph_name)
            live.constants_uploaded = tracer.constants_uploaded
            yield live
        finally:
            for i, flag in zip(shared, saved_flags):
                compat.set_buffer_donation(reals[i], flag)
            live.outputs.clear()
            holders.clear()
            tracer.env.clear()
            tracer.gate_values.clear()
            tracer.gate_flags.clear()
