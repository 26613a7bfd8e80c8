"""The private-API fence: ``torch._...`` and ``torch_xla._XLAC`` are used only in the
compat modules (CONTRIBUTING.md), so a torch upgrade breaks in one known place."""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "donate_backend"
COMPAT = {"torch_compat.py", "compat.py", "autograd_compat.py", "dynamo_compat.py"}
# torch._ops.OpOverload is the type of every ATen op in an FX graph; torch has no public name for it
ALLOWED = {"torch._ops.OpOverload"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private torch / torch_xla name ``source`` uses (strings and
    comments aside)."""
    found = []
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            names = [(_dotted(node), node.lineno)]
        for name, line in names:
            if name in ALLOWED or any(name.startswith(a + ".") for a in ALLOWED):
                continue
            head = name.split(".")
            if (head[0] in ("torch", "torch_xla") and len(head) > 1 and head[1].startswith("_")) or "_XLAC" in head:
                found.append((line, name))
    return sorted(set(found))


def _outside_compat():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in COMPAT:
            yield path


def test_no_private_torch_api_outside_the_compat_modules():
    leaks = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in _outside_compat()
        for line, name in private_uses(path.read_text())
    ]
    assert not leaks, "private torch API outside a compat module:\n" + "\n".join(leaks)


@pytest.mark.parametrize("source, expected", [
    ("import torch\nx = torch._C._nn.gelu", "torch._C._nn.gelu"),
    ("from torch._guards import TracingContext", "torch._guards"),
    ("import torch._functorch.config as c", "torch._functorch.config"),
    ("import torch_xla\ntorch_xla._XLAC._xla_sync()", "torch_xla._XLAC._xla_sync"),
])
def test_the_fence_finds_a_private_use(source, expected):
    assert expected in [name for _, name in private_uses(source)]


def test_the_fence_leaves_strings_public_names_and_the_op_type_alone():
    source = (
        'import torch\n"wrap it in torch._dynamo.disable"\n'
        "ok = isinstance(op, torch._ops.OpOverload)\ny = torch.ops.aten.add.Tensor\n"
    )
    assert private_uses(source) == []


def test_contributing_names_every_module():
    """CONTRIBUTING's layout table names every module of the package (by file name, with
    its package's folder in the same row), so a newcomer finds each one's job there."""
    root = pathlib.Path(__file__).resolve().parent.parent
    rows = [line for line in (root / "CONTRIBUTING.md").read_text().splitlines() if line.startswith("| `donate_backend/")]
    missing = []
    for path in sorted((root / "donate_backend").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if path.name == "__init__.py" and path.parent.name != "xla":
            continue  # a package's __init__ is its folder's row
        folder = path.parent.relative_to(root).as_posix() + "/"
        if not any(f"`{relative}`" in row or (f"`{folder}`" in row and f"`{path.name}`" in row) for row in rows):
            missing.append(relative)
    assert not missing, f"CONTRIBUTING.md's layout table does not name: {missing}"
