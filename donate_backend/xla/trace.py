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
from . import compat, recompute
from .plan import LoweringMismatchError

_LOWERABLE_KEYS = (
    "XLA",
    "CompositeImplicitAutograd",
    "CompositeExplicitAutograd",
)

# Ops with no XLA kernel that mean the same as one that has one.
_EQUIVALENT_OPS = {
    torch.ops.aten.lift_fresh_copy.default: torch.ops.aten.clone.default,
}

_aten = torch.ops.aten

# Ops torch_xla 2.9 has a kernel for that crash the process when traced on a
# placeholder (segmentation fault, or an abort in TransferFromDevice: the kernel
# reads its input's data, or hands it to torch_xla's CPU fallback). They run on
# the CPU, like ops with no kernel. Found by tracing torch's OpInfo samples and
# these ops on placeholders, each in a fresh process.
_CRASH_ON_PLACEHOLDERS = frozenset({
    "aten::rrelu_with_noise",  # F.rrelu in training
    "aten::rrelu_with_noise_functional",
    "aten::cummin",
    "aten::median.dim",
    "aten::nanmedian.dim",
    "aten::frexp.Tensor",
    "aten::linspace.Tensor_Tensor",
    "aten::linspace.Tensor_Scalar",
    "aten::linspace.Scalar_Tensor",
    "aten::logcumsumexp",
    "aten::mvlgamma",
    "aten::huber_loss",
    "aten::huber_loss_backward",
    "aten::_embedding_bag",
    "aten::_embedding_bag_forward_only",
    "aten::_embedding_bag_backward",
    "aten::_conj_physical",  # torch.fft.ihfft*, x.conj_physical() of a complex tensor
    "aten::conj_physical",
    "aten::complex",
    "aten::polar",
    "aten::_batch_norm_with_update_functional",  # a direct call (nn.BatchNorm takes another op)
    "aten::embedding_renorm",  # nn.Embedding(max_norm=...): the weight renormalised in place
    "aten::embedding_renorm_",
})


def _indivisible(input_shape, output_size, dims: int) -> bool:
    """torch_xla lowers adaptive pooling only when each spatial size divides by its output size."""
    pairs = list(zip(list(input_shape)[-dims:], list(output_size)[-dims:]))
    return any(not isinstance(i, int) or not isinstance(o, int) or o == 0 or i % o for i, o in pairs)


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


# Ops whose torch_xla 2.9 kernel hands these arguments to its CPU fallback,
# which crashes on a placeholder (aten_xla_type.cpp): op -> (args, kwargs) ->
# whether it would. Their arguments here are fake tensors and Python values.
_FALLS_BACK_WITH = {
    _aten._adaptive_avg_pool2d.default: lambda a, k: _indivisible(a[0].shape, a[1], 2),
    _aten._adaptive_avg_pool3d.default: lambda a, k: _indivisible(a[0].shape, a[1], 3),
    _aten.adaptive_max_pool2d.default: lambda a, k: _indivisible(a[0].shape, a[1], 2),
    _aten._adaptive_avg_pool2d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 2),
    _aten._adaptive_avg_pool3d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 3),
    _aten.adaptive_max_pool2d_backward.default: lambda a, k: _indivisible(a[1].shape, a[0].shape, 2),
    _aten.addmm.default: lambda a, k: k.get("beta", 1) != 1 or k.get("alpha", 1) != 1,
    _aten.avg_pool2d_backward.default: lambda a, k: bool(a[5] and a[6]) or a[7] is not None,
    _aten.avg_pool3d_backward.default: lambda a, k: bool(a[5] and a[6]) or a[7] is not None,
    _aten.max_pool2d_with_indices.default: lambda a, k: any(d != 1 for d in _listed(_arg(a, k, 4, "dilation", 1))),
    _aten.max_pool3d_with_indices.default: lambda a, k: any(d != 1 for d in _listed(_arg(a, k, 4, "dilation", 1))),
    _aten.scatter.reduce: lambda a, k: _arg(a, k, 4, "reduce") != "add",
    _aten.scatter.value_reduce: lambda a, k: _arg(a, k, 4, "reduce") != "add",
    _aten.scatter_reduce.two: lambda a, k: not (
        _arg(a, k, 4, "reduce") in ("sum", "prod", "amin", "amax") and _arg(a, k, 5, "include_self", True)
    ),
    _aten.linalg_inv_ex.default: lambda a, k: bool(_arg(a, k, 1, "check_errors", False)),
    _aten.index_put.default: lambda a, k: any(_is_mask(i) for i in a[1]),  # x[mask] = v
    _aten.norm.ScalarOpt_dim: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.norm.ScalarOpt_dtype: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.norm.ScalarOpt_dim_dtype: lambda a, k: _arg(a, k, 1, "p") == 0,
    _aten.roll.default: lambda a, k: a[0].numel() == 0,  # SIGFPE on real empty tensors too
    _aten.cholesky_solve.default: lambda a, k: a[0].numel() == 0 or a[1].numel() == 0,
}


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _listed(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# Control flow (``torch.cond``, ``while_loop``, ``scan``, ``control_flow.map``): torch_xla
# runs it by reading the predicate or iterating over the data, which a placeholder does not
# have ("Check failed: handle->HasValue()", or a fake tensor meeting a real one, while tracing)
_CONTROL_FLOW = frozenset(
    op for op in (
        getattr(getattr(torch.ops, "higher_order", None), name, None)
        for name in ("cond", "while_loop", "scan", "map_impl", "associative_scan")
    ) if op is not None
)


def lowerable_node(node: torch.fx.Node) -> bool:
    """Whether torch_xla can trace ``node`` on placeholders: an op with an XLA (or
    composite) kernel that, for these arguments, does not hand them to its CPU fallback."""
    target = _EQUIVALENT_OPS.get(node.target, node.target)
    if target in _CONTROL_FLOW:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if not has_xla_lowering(target):
        return False
    falls_back = _FALLS_BACK_WITH.get(target)
    if falls_back is None:
        return True
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return not falls_back(tuple(args), dict(kwargs))
    except Exception:  # noqa: BLE001 - an unexpected signature: the CPU is the safe side
        return False

# Reductions whose empty dim list means "every dimension" (``x.amax()`` is
# ``amax(x, [])``). torch_xla 2.9 reduces over no dimension instead and returns x
# unchanged, a silently wrong value, in eager mode too. op -> index of the dim argument.
_EMPTY_DIMS_MEAN_ALL = {
    _aten.amax.default: 1,
    _aten.amin.default: 1,
    _aten.sum.dim_IntList: 1,
    _aten.mean.dim: 1,
    _aten.nansum.default: 1,
    _aten.var.dim: 1,
    _aten.var.correction: 1,
    _aten.std.dim: 1,
    _aten.std.correction: 1,
    _aten.var_mean.correction: 1,
    _aten.std_mean.correction: 1,
    _aten.linalg_vector_norm.default: 2,
}


def with_every_dim(target, args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` with an empty dim list of a reduction (given, or
    ``amax``/``amin``'s default) replaced by every dimension of its input, which
    is what the empty list means; anything else unchanged."""
    position = _EMPTY_DIMS_MEAN_ALL.get(target)
    if position is None:
        return args, kwargs
    if len(args) > position:
        dims = args[position]
    else:
        default = target._schema.arguments[position].default_value
        dims = kwargs.get("dim", default)
    if not isinstance(dims, (list, tuple)) or len(dims) > 0:
        return args, kwargs
    every = list(range(args[0].dim()))
    if len(args) > position:
        return args[:position] + (every,) + args[position + 1:], kwargs
    return args, {**kwargs, "dim": every}


def batch_norm_as_torch(target, args: tuple, out):
    """``out`` of a BatchNorm op, with what torch defines where torch_xla 2.9
    computes something else; anything else unchanged.

    - ``_native_batch_norm_legit_functional`` in training: the new running
      variance takes the batch's *unbiased* variance (torch_xla: the biased one,
      in eager mode too: a running variance off by a factor (n-1)/n per update).
    - ``_native_batch_norm_legit_no_training``: the saved mean and inverse std are
      the running mean and ``rsqrt(running_var + eps)``, in the computation dtype,
      as torch defines them off the CPU (torch_xla: empty tensors). aot_autograd's
      graph saves these ``[C]`` values for the backward of an eval-mode BatchNorm
      with trainable parameters, so empty ones would not fit the backward's
      inputs; that backward runs torch's decomposition (``eval_batch_norm_backward``).
    """
    if target is _aten._native_batch_norm_legit_functional.default and len(args) >= 8 and args[5]:
        x, running_var, momentum = args[0], args[4], args[6]
        var = x.to(_computation_dtype(x.dtype)).var([d for d in range(x.dim()) if d != 1], correction=1)
        new_running_var = (running_var * (1 - momentum) + var * momentum).to(running_var.dtype)
        return (*out[:4], new_running_var)
    if target is _aten._native_batch_norm_legit_no_training.default and len(args) >= 7:
        output, save_mean, _ = out
        if save_mean.numel() != 0:
            return out
        running_mean, running_var, eps = args[3], args[4], args[6]
        dtype = _computation_dtype(output.dtype)
        return output, running_mean.to(dtype), torch.rsqrt(running_var.to(dtype) + eps)
    return out


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def batch_norm_backward_args(target, args: tuple) -> tuple:
    """``native_batch_norm_backward``'s tensor arguments in one floating dtype
    when they mix two; anything else unchanged.

    Under autocast a bf16/fp16 input comes with float32 saved statistics (torch
    keeps them in float32), and XLA's BatchNormGrad takes one element type (the
    HLO verifier refused the mix). Everything goes to float32, the dtype torch
    computes such a backward in; the results are cast back to the dtypes torch
    declares (``conform_dtypes``).
    """
    if target is not _aten.native_batch_norm_backward.default:
        return args
    floating = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if len(floating) < 2:
        return args
    return tuple(
        a.to(_computation_dtype(a.dtype)) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )


def conform_dtypes(node: torch.fx.Node, value):
    """``value`` (a node's traced result) with each tensor in the dtype torch
    declares for it (``node.meta["val"]``), where torch_xla's lowering gives
    another; anything else unchanged.

    torch_xla returns BatchNorm's saved statistics in a bf16 input's dtype where
    torch says float32, and ``native_dropout``'s mask says bool but is float32
    underneath (the executable returned a float32 buffer where a bool one was
    planned); the graph's other ops, the next graph's inputs and the user's
    outputs all assume torch's dtypes.
    """
    expected = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return _conformed(value, expected)
    if isinstance(value, (tuple, list)) and isinstance(expected, (tuple, list)) and len(expected) == len(value):
        conformed = [_conformed(v, e) for v, e in zip(value, expected)]
        if any(c is not v for c, v in zip(conformed, value)):
            return type(value)(conformed)
    return value


def _conformed(value, expected):
    if not isinstance(value, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return value
    if value.dtype != expected.dtype:
        return value.to(expected.dtype)
    if value.dtype == torch.bool and compat.stores_as_pred(value) is False:
        # says bool, is another XLA type underneath (``native_dropout``'s mask):
        # ``.to(bool)`` would change nothing, a comparison gives a real pred
        return value != 0
    return value


def eval_batch_norm_backward(target, args: tuple, kwargs: dict):
    """torch's decomposition of ``native_batch_norm_backward`` when ``train`` is
    False, else None.

    torch_xla 2.9 ignores ``train``: XLA's BatchNormGrad always differentiates
    through the batch's statistics, a silently wrong input gradient for an
    eval-mode BatchNorm (eager torch_xla and openxla fail before that, on the
    empty saved statistics). The decomposition uses the running statistics.
    """
    if target is not _aten.native_batch_norm_backward.default:
        return None
    train = args[7] if len(args) > 7 else kwargs.get("train", True)
    if train:
        return None
    decomposition = compat.decomposition(target)
    if decomposition is None:
        raise UnsupportedGraphError(
            "donate_xla: an eval-mode BatchNorm's backward needs torch's decomposition of "
            "native_batch_norm_backward, which this torch lacks (torch_xla's own computes a "
            "wrong gradient). Keep the BatchNorm in training mode or freeze its parameters."
        )
    return decomposition(*args, **kwargs)


def dropout_as_torch(target, args: tuple, kwargs: dict):
    """torch's decomposition of ``native_dropout`` (``rand_like(x) > p``, kept
    values scaled by ``1 / (1 - p)``), else None.

    torch_xla 2.9's lowering draws the kept positions with probability ``1 - p``
    but divides them by ``p``: every dropout with ``p != 0.5`` in a graph from
    aot_autograd gave silently wrong values (``p=0.1``: kept values times 10
    instead of 1.11). Eager torch_xla does not reach that lowering (its
    ``F.dropout`` is a composite of ``bernoulli_``), openxla does.
    """
    if target is not _aten.native_dropout.default:
        return None
    decomposition = compat.decomposition(target)
    if decomposition is None:
        raise UnsupportedGraphError(
            "donate_xla: dropout needs torch's decomposition of native_dropout, which this "
            "torch lacks (torch_xla's own lowering scales the kept values by 1/p instead of "
            "1/(1-p)). Use torch 2.9, or move the dropout out of the compiled region."
        )
    return decomposition(*args, **kwargs)


def copy_into_fresh_tensor(target, args: tuple, kwargs: dict):
    """``aten.copy(self, src)`` as ``src`` copied into a new tensor shaped like
    ``self``, else None.

    torch_xla 2.9's kernel of the functional ``aten.copy`` writes ``src`` into
    ``self`` as well as returning it. aot_autograd's graphs use it for every
    in-place copy of a functionalised input (``buffer.copy_(x)``), so a later
    reader of ``self`` (a value saved for the backward, a second copy of the
    same buffer) read the new value: a silently wrong gradient (aot_eager on
    XLA tensors computes the same wrong value).
    """
    if target is not _aten.copy.default:
        return None
    self_, src = args[0], args[1]
    non_blocking = _arg(args, kwargs, 2, "non_blocking", False)
    return torch.empty_like(self_).copy_(src, non_blocking=non_blocking)


_HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default: ".item() / a Python number read",
}


def has_xla_lowering(op: torch._ops.OpOverload) -> bool:
    """False for ops (of any namespace) that torch_xla would run through its CPU fallback.

    The fallback copies inputs to the host, which a placeholder cannot do (it
    crashes the process), so such ops are rejected before they run. Custom ops
    count when they have an XLA kernel or a composite (Python) one, which then
    runs on placeholders like any other code.
    """
    name = op.name()
    if name in _CRASH_ON_PLACEHOLDERS:
        return False
    return any(compat.has_kernel_for_dispatch_key(name, k) for k in _LOWERABLE_KEYS)


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
    if not lowerable_node(node):
        raise UnsupportedGraphError(
            f"{graph_name}: op {node.target} (node {node.name!r}) has no XLA lowering "
            "in torch_xla (for these arguments), so it cannot be compiled for the XLA device. Move it outside "
            "the compiled region (wrap it in torch._dynamo.disable) or replace it with "
            "supported ops."
        )


def _reject_host_reads(node: torch.fx.Node, graph_name: str) -> None:
    if node.target in _HOST_READ_OPS:
        raise UnsupportedGraphError(
            f"{graph_name}: node {node.name!r} reads device data on the host "
            f"({_HOST_READ_OPS[node.target]}) inside the compiled graph. Move the read "
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
        self.gates = gates  # recomputation root -> the gradient value it waits for
        self.gate_nodes = set(gates.values())
        self.gate_values = {}  # kept past their last use in the graph (the interpreter frees those)
        self.gate_flags = {}  # gate -> the True computed from it

    def run_node(self, node: torch.fx.Node):
        try:
            if node in self.gates:
                return _unwrapped(self._run_gated(node))
            value = _unwrapped(super().run_node(node))
            if node.op == "call_function":
                value = conform_dtypes(node, value)
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
        """Run a recomputation root with one input made dependent on its gate
        (``recompute.py``), so XLA cannot run it before the gate's value exists."""
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        gate = self.gates[node]
        if gate not in self.gate_flags:
            self.gate_flags[gate] = recompute.always_true(self.gate_values.pop(gate))
        leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        args, kwargs = torch.utils._pytree.tree_unflatten(recompute.gated_inputs(leaves, self.gate_flags[gate]), spec)
        return self.call_function(node.target, args, kwargs)

    def call_function(self, target, args, kwargs):
        target = _EQUIVALENT_OPS.get(target, target)
        if _is_mark_sharding(target):
            return _mark_sharding(*args, **kwargs)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            kwargs = {**kwargs, "device": self.device}
        args, kwargs = with_every_dim(target, tuple(args), kwargs)
        decomposed = eval_batch_norm_backward(target, args, kwargs)
        if decomposed is None:
            decomposed = dropout_as_torch(target, args, kwargs)
        if decomposed is None:
            decomposed = copy_into_fresh_tensor(target, args, kwargs)
        if decomposed is not None:
            return decomposed
        args = batch_norm_backward_args(target, args)
        return batch_norm_as_torch(target, args, super().call_function(target, args, kwargs))

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
) -> Iterator[LiveTrace]:
    """Trace ``gm`` on stand-ins (donors flagged first) under the trace settings.

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
        gated = recompute.gates(gm.graph) if config.current().orders_recompute else {}
        tracer = _PlaceholderTracer(gm, graph_name, torch_xla.device(), gated)
        live = LiveTrace(holders, [], 0, reals, dict(zip(handles, tensor_inputs)), len(gated))
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
