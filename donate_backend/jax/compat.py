"""Private torch API the JAX target uses, each looked up here once.

The rule (CONTRIBUTING.md, checked by ``tests/test_fence.py``): a private torch
name (``torch._...``) is used only in a compat module. The JAX lowering table
(``lowerings.py``) needs only torch's decomposition tables; each function below
says what it returns when the API is missing.
"""
from __future__ import annotations

from typing import Dict, Iterable


def core_aten_decompositions() -> Dict:
    """A copy of ``torch._decomp.core_aten_decompositions()``: the table that lowers
    ATen to torch's core ATen op set (keys are ``OpOverload``s, values Python
    decompositions). An empty dict when this torch has no such table."""
    try:
        from torch._decomp import core_aten_decompositions as table
    except ImportError:
        return {}
    return dict(table())


def get_decompositions(ops: Iterable) -> Dict:
    """``torch._decomp.get_decompositions(ops)``: torch's registered decompositions
    of ``ops`` (``OpOverload``s); ops without one are left out. An empty dict when
    this torch has no decomposition registry."""
    try:
        from torch._decomp import get_decompositions as lookup
    except ImportError:
        return {}
    return dict(lookup(list(ops)))


def registered_decompositions() -> Dict:
    """torch's whole registry of decompositions, ``torch._decomp.decomposition_table``
    (for telling a refused op that has one); an empty dict when missing."""
    try:
        from torch._decomp import decomposition_table
    except ImportError:
        return {}
    return decomposition_table
