"""A functional aot graph as a JAX function: each FX node run by its lowering.

``Program(gm)`` is what ``jax.jit`` traces. It takes the graph's inputs as JAX arrays
(a symbolic size as an int, static), and a random key where the graph draws random
numbers, and returns ``(outputs, new_values)``: the graph's outputs, then the new value
of each input it writes (aot_autograd keeps an input mutation in the graph as a
``copy_`` into the input: ``writes`` lists them). An input returned as it is comes back
as None (``passed_through``: the runtime returns the input itself). Any other in-place op, an op with no
lowering, and a call of anything but an ATen op, an operator on sizes or ``getitem`` is
refused with the op's and the graph's name, before anything is compiled (``check``).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Tuple

import torch
import torch.fx
from torch.utils._pytree import tree_map

from ..errors import UnsupportedGraphError
from . import lowerings

aten = torch.ops.aten

# ops on sizes: a symbolic size's value at the call (an int under ``jax.jit``, static)
_SIZE_OPS = {
    aten.sym_size.int: lambda x, dim: x.shape[dim],
    aten.sym_numel.default: lambda x: x.size,
    aten.sym_stride.int: lambda x, dim: _contiguous_stride(x.shape, dim),
    aten.sym_storage_offset.default: lambda x: 0,
}
_PYTHON_OPS = {
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
    operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.and_, operator.or_, operator.not_, abs, max, min,
}


def _contiguous_stride(shape, dim: int) -> int:
    stride = 1
    for size in shape[dim + 1:]:
        stride *= size
    return stride


def _sym_ops() -> dict:
    """torch's functions on symbolic values (``sym_max``, ``sym_float``...), as they are on ints."""
    out = {}
    for name in ("sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_sqrt", "sym_ite"):
        fn = getattr(torch, name, None)
        if fn is not None:
            out[fn] = fn
    return out


@dataclasses.dataclass(frozen=True)
class Write:
    """An input the graph writes: its index among the inputs, and the node of its new value."""

    input_index: int
    node: torch.fx.Node


class Program:
    """A functional aot graph as a JAX function (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.name = name
        self.placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.writes: Tuple[Write, ...] = tuple(self._writes())
        self.random = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                          and lowerings.is_random(n.target) for n in gm.graph.nodes)
        self.size_inputs = tuple(i for i, n in enumerate(self.placeholders)
                                 if isinstance(n.meta.get("val"), (torch.SymInt, int)) and
                                 not isinstance(n.meta.get("val"), bool))
        self.passed_through = self._passed_through()
        self.check()

    def _passed_through(self) -> dict:
        """Output position -> input index, for each tensor input the graph returns as it is and
        does not write (a parameter a forward saves for its backward): the executable does not
        return it, which would make XLA copy it into a buffer of its own; the runtime hands
        back the input itself."""
        output = self.gm.graph.output_node().args[0]
        values = list(output) if isinstance(output, (list, tuple)) else [output]
        index = {node: i for i, node in enumerate(self.placeholders)}
        written = {w.input_index for w in self.writes}
        return {position: index[value] for position, value in enumerate(values)
                if isinstance(value, torch.fx.Node) and value in index and index[value] not in written
                and isinstance(value.meta.get("val"), torch.Tensor)}

    def _writes(self):
        index = {node: i for i, node in enumerate(self.placeholders)}
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in index:
                yield Write(index[node.args[0]], node)

    def check(self) -> None:
        """Refuse, naming the op and the graph, what cannot be lowered (module docstring)."""
        written = {w.node for w in self.writes}
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or node in written:
                continue
            target = node.target
            if target is operator.getitem or target in _PYTHON_OPS or target in _SIZE_OPS or target in _sym_ops():
                continue
            if isinstance(target, torch._ops.OpOverload):
                if lowerings.lowering(target) is not None:
                    continue
                raise UnsupportedGraphError(
                    f"donate_xla: {self.name}: {lowerings.unsupported(target)} (node {node.name}). "
                    "Compute it outside the compiled function, or on the CPU.",
                    help_section="The JAX target",
                )
            raise UnsupportedGraphError(
                f"donate_xla: {self.name}: node {node.name} calls {target!r}, which the JAX target cannot "
                "lower (it lowers ATen ops and arithmetic on sizes).",
                help_section="The JAX target",
            )

    def __call__(self, *inputs, key=None):
        env = {}
        it = iter(inputs)
        written = {w.node: w for w in self.writes}
        output_values = None
        for position, node in enumerate(self.gm.graph.nodes):
            if node.op == "placeholder":
                env[node] = next(it)
            elif node.op == "get_attr":
                env[node] = _constant(self.gm, node.target)
            elif node.op == "call_function":
                args = _mapped(node.args, env)
                kwargs = _mapped(node.kwargs, env)
                if node in written:  # ``copy_(input, value)``: the input's new value
                    env[node] = _copied(args[1], node.args[0].meta.get("val"))
                else:
                    env[node] = _conformed(self._call(node.target, args, kwargs, key, position),
                                           node.meta.get("val"), node, self.name)
            elif node.op == "output":
                output_values = _mapped(node.args[0], env)
        outputs = tuple(output_values) if isinstance(output_values, (list, tuple)) else (output_values,)
        outputs = tuple(None if i in self.passed_through else v for i, v in enumerate(outputs))
        return outputs, tuple(env[w.node] for w in self.writes)

    @staticmethod
    def _call(target, args, kwargs, key, position: int):
        if target is operator.getitem:
            return args[0][args[1]]
        if target in _SIZE_OPS:
            return _SIZE_OPS[target](*args, **kwargs)
        if not isinstance(target, torch._ops.OpOverload):
            return target(*args, **kwargs)
        lowered = lowerings.lowering(target)
        if lowerings.is_random(target):
            import jax

            return lowered(*args, **kwargs, key=jax.random.fold_in(key, position))
        return lowered(*args, **kwargs)

    def input_specs(self, example_inputs) -> list:
        """``jax.ShapeDtypeStruct`` of each tensor input (an int for a size), from the fake
        example inputs: what the function is lowered for, with no data."""
        import jax

        specs = []
        for value in example_inputs:
            if isinstance(value, torch.Tensor):
                specs.append(jax.ShapeDtypeStruct(tuple(int(s) for s in value.shape),
                                                  lowerings.to_jax_dtype(value.dtype)))
            else:
                specs.append(int(value))
        return specs


def _conformed(value, fake, node: torch.fx.Node, graph: str):
    """A node's value in the shape its fake value has: the graph was traced with it, and what
    reads the node (a backward compiled for a saved tensor's shape) expects it. An empty
    result where the fake one has elements (a batch norm's saved statistics in eval mode,
    which torch's CPU kernel leaves empty and its meta kernel does not) becomes zeros of that
    shape; any other difference is a lowering's error, named."""
    import jax

    if isinstance(value, jax.Array) and isinstance(fake, torch.Tensor):
        want = tuple(int(s) for s in fake.shape)
        if tuple(value.shape) == want:
            return value
        if value.size == 0 or fake.numel() == 0:
            return jax.numpy.zeros(want, dtype=lowerings.to_jax_dtype(fake.dtype))
        raise UnsupportedGraphError(
            f"donate_xla: {graph}: the JAX lowering of {node.target} (node {node.name}) gives shape "
            f"{tuple(value.shape)} where torch's is {want}; this is a bug of the lowering table "
            "(donate_backend/jax/lowerings.py).", help_section="The JAX target")
    if isinstance(value, (tuple, list)) and isinstance(fake, (tuple, list)) and len(value) == len(fake):
        return type(value)(_conformed(v, f, node, graph) for v, f in zip(value, fake))
    return value


def _mapped(value, env):
    return tree_map(lambda v: env[v] if isinstance(v, torch.fx.Node) else v, value,
                    is_leaf=lambda v: isinstance(v, torch.fx.Node))


def _copied(value, target: Optional[torch.Tensor]):
    """``copy_``'s new value for its target: broadcast to its shape, cast to its dtype."""
    import jax.numpy as jnp

    if target is None:
        return value
    return jnp.broadcast_to(jnp.asarray(value).astype(lowerings.to_jax_dtype(target.dtype)), tuple(target.shape))


def _constant(gm: torch.fx.GraphModule, target: str):
    """A tensor the graph holds (a lifted constant), as a JAX array."""
    from . import device

    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.Tensor):
        if value.device.type == device.NAME:
            return device.read(value)
        return device.from_host(value)
    return value
