"""Room for one more executable: the process's memory mappings.

XLA:CPU compiles each fused kernel of an executable into memory of its own
(separate mappings for code and data), and torch_xla keeps every executable it
compiled in its cache (``XLA_COMPILATION_CACHE_SIZE``, 2048 by default). A
process that compiles many graphs (a notebook that resets dynamo, recompiles on
changing shapes or Python scalars, a sweep in one process) so gains mappings
with every compilation: 12,000 to 14,000 per round of the GPT-2 training loop
in ``tests/test_xla_training_loop.py``. Linux refuses a mapping beyond
``vm.max_map_count`` (65,530 by default), and then XLA's compiler or any large
allocation fails, and the process dies with a segmentation fault, not an error.

Before each lowering donate_xla counts the mappings (``/proc/self/maps``): past
``WARN_SHARE`` of the limit it warns once, past ``REFUSE_SHARE`` it raises
``MappingLimitError`` naming the graph and what to do, while the process can
still report it. The margin is wide because torch_xla also compiles between
two of donate_xla's lowerings (eager code, stitched graphs at their sync).
Evicted executables give their mappings back, so a smaller cache
(``XLA_COMPILATION_CACHE_SIZE``) is one way out (docs/xla.md, "Measured reasons"). Where ``/proc`` is absent (not Linux) nothing is checked.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..errors import DonateXlaError

log = logging.getLogger("donate_xla")

WARN_SHARE = 0.6
REFUSE_SHARE = 0.8
_MAPS = "/proc/self/maps"
_LIMIT = "/proc/sys/vm/max_map_count"


class MappingLimitError(DonateXlaError):
    """Compiling another executable would run the process out of memory mappings."""

    help_section = "Refused because the process would crash"


def mapping_count(path: str = _MAPS) -> Optional[int]:
    try:
        with open(path, "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def mapping_limit(path: str = _LIMIT) -> Optional[int]:
    try:
        with open(path) as limit:
            return int(limit.read().strip())
    except (OSError, ValueError):
        return None


def verdict(count: Optional[int], limit: Optional[int]) -> str:
    """``"ok"``, ``"warn"`` or ``"refuse"`` for ``count`` mappings of ``limit`` (pure)."""
    if count is None or not limit:
        return "ok"
    if count >= REFUSE_SHARE * limit:
        return "refuse"
    if count >= WARN_SHARE * limit:
        return "warn"
    return "ok"


def _advice(count: int, limit: int) -> str:
    return (
        f"this process holds {count:,} memory mappings of the {limit:,} Linux allows "
        "(vm.max_map_count). XLA:CPU maps memory for every kernel of every executable it "
        "compiles, and torch_xla keeps up to XLA_COMPILATION_CACHE_SIZE (default 2048) "
        "executables, so the process crashes (segmentation fault) once the limit is hit. "
        "Compiling this many graphs usually means something changes between calls: "
        "TORCH_LOGS=recompiles shows what. Otherwise start the process with a smaller "
        "cache (e.g. XLA_COMPILATION_CACHE_SIZE=64; evicted executables give their "
        "mappings back) or raise the limit (sysctl -w vm.max_map_count=262144)."
    )


_warned = False


def check_room(graph_name: str, count: Optional[int] = None, limit: Optional[int] = None) -> None:
    """Warn (once) or raise before ``graph_name`` is compiled, if the mappings
    are close to the limit. ``count`` and ``limit`` default to this process's."""
    global _warned
    limit = mapping_limit() if limit is None else limit
    count = mapping_count() if count is None else count
    decision = verdict(count, limit)
    if decision == "refuse":
        raise MappingLimitError(f"donate_xla: {graph_name} is not compiled: {_advice(count, limit)}")
    if decision == "warn" and not _warned:
        _warned = True
        log.warning("donate_xla: compiling %s: %s", graph_name, _advice(count, limit))
