"""Python source for an FX graph in the boxed calling convention, freeing at last use.

``boxed_source(graph, name)`` returns ``(source, namespace)``. The generated
function takes the argument list itself, copies out only the inputs that some
node reads, clears the list (so the caller's list no longer keeps anything
alive), runs the nodes in graph order, and deletes each value right after its
last reader (``donate_backend.analysis.liveness``). Inputs that nothing reads
are never bound, so clearing the list drops them at once.

The code does not depend on ``torch.fx``'s private code generator, whose API
differs between torch 2.9 and 2.11+ (DESIGN §3). ATen ops are written as
``aten.<op>.<overload>``; every other callable and every constant that has
no plain literal form is bound in the namespace under a readable name.
"""
from __future__ import annotations

import keyword
import math
import re
from typing import Any, Dict, List, Tuple

import torch
import torch.fx

from ..analysis import liveness
from ..errors import UnsupportedGraphError

_RESERVED = {"args", "aten", "torch"}


class _Namespace:
    """Globals of the generated function, with readable, unique names."""

    def __init__(self) -> None:
        self.values: Dict[str, Any] = {"aten": torch.ops.aten, "torch": torch}
        self._ids: Dict[int, str] = {}

    def bind(self, value: Any, hint: str) -> str:
        key = id(value)
        if key in self._ids:
            return self._ids[key]
        base = re.sub(r"\W", "_", hint) or "_c"
        if not base.startswith("_"):
            base = "_" + base
        name, i = base, 0
        while name in self.values:
            i += 1
            name = f"{base}_{i}"
        self.values[name] = value
        self._ids[key] = name
        return name


def _variable_names(graph: torch.fx.Graph) -> Dict[torch.fx.Node, str]:
    names: Dict[torch.fx.Node, str] = {}
    taken = set(_RESERVED)
    for node in graph.nodes:
        base = node.name if node.name.isidentifier() else re.sub(r"\W", "_", node.name)
        if keyword.iskeyword(base) or base.startswith("_"):
            base = "v_" + base.lstrip("_")
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        names[node] = name
    return names


def _render(value: Any, names: Dict[torch.fx.Node, str], ns: _Namespace) -> str:
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, list):
        return "[" + ", ".join(_render(v, names, ns) for v in value) + "]"
    if isinstance(value, tuple):
        inner = ", ".join(_render(v, names, ns) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = ", ".join(f"{k!r}: {_render(v, names, ns)}" for k, v in value.items())
        return "{" + items + "}"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    return ns.bind(value, "_const_" + type(value).__name__)


def _target_expr(target: Any, ns: _Namespace) -> str:
    if isinstance(target, torch._ops.OpOverload):
        namespace = target.namespace
        packet = target._schema.name.split("::")[-1]
        overload = target._overloadname
        if namespace == "aten":
            return f"aten.{packet}.{overload}"
        return f"torch.ops.{namespace}.{packet}.{overload}"
    hint = getattr(target, "__name__", None) or type(target).__name__
    return ns.bind(target, "_fn_" + hint)


def _call_expr(node: torch.fx.Node, names, ns, owner) -> str:
    args = [_render(a, names, ns) for a in node.args]
    args += [f"{k}={_render(v, names, ns)}" for k, v in node.kwargs.items()]
    if node.op == "call_function":
        return f"{_target_expr(node.target, ns)}({', '.join(args)})"
    if node.op == "call_method":
        return f"{args[0]}.{node.target}({', '.join(args[1:])})"
    if node.op == "get_attr":
        value = owner
        for part in str(node.target).split("."):
            value = getattr(value, part)
        return ns.bind(value, "_attr_" + str(node.target))
    if node.op == "call_module":
        module = owner.get_submodule(str(node.target))
        return f"{ns.bind(module, '_mod_' + str(node.target))}({', '.join(args)})"
    raise UnsupportedGraphError(f"donate_xla: cannot generate code for FX node op {node.op!r}")


def boxed_source(
    graph: torch.fx.Graph, name: str = "boxed_graph", owner: Any = None
) -> Tuple[str, Dict[str, Any]]:
    """Source and globals of a boxed function that runs ``graph`` and frees at last use.

    ``owner`` is the module that ``get_attr``/``call_module`` nodes refer to.
    """
    names = _variable_names(graph)
    ns = _Namespace()
    dying = liveness.values_dying_at(graph)
    placeholders = graph.find_nodes(op="placeholder")
    lines: List[str] = [f"def {name}(args):"]
    for index, node in enumerate(placeholders):
        if node.users:
            lines.append(f"    {names[node]} = args[{index}]")
    lines.append("    args.clear()")
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"    return {_render(node.args[0], names, ns)}")
            break
        lines.append(f"    {names[node]} = {_call_expr(node, names, ns, owner)}")
        if node in dying:
            lines.append("    del " + ", ".join(names[v] for v in dying[node]))
    else:
        raise UnsupportedGraphError("donate_xla: FX graph has no output node")
    return "\n".join(lines) + "\n", ns.values


def compile_boxed(graph: torch.fx.Graph, name: str = "boxed_graph", owner: Any = None):
    """Build the boxed freeing function for ``graph``; returns ``(function, source)``."""
    source, namespace = boxed_source(graph, name, owner)
    code = compile(source, f"<donate_xla {name}>", "exec")
    exec(code, namespace)
    return namespace[name], source
