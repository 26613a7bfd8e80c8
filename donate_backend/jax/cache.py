"""Warm starts on the JAX target: JAX's persistent compilation cache, on by default.

Every executable the JAX target compiles is written to JAX's compilation cache, and a
later process that lowers the same program (the same StableHLO, compile options,
devices, jax and jaxlib) loads it instead of running XLA again. The key is JAX's own: it
covers everything the executable depends on, so a changed graph, shape, dtype, donation
or version misses; an entry JAX cannot read is skipped with JAX's warning and compiled
again.

Where it lives: ``DONATE_XLA_CACHE_DIR``, or else ``$XDG_CACHE_HOME/donate_xla/jax``
(``~/.cache/donate_xla/jax``). ``DONATE_XLA_CACHE=0`` turns it off. Both are read once,
when the JAX device starts (JAX decides at its first compile whether it caches, for the
whole process). A directory the program set itself (``jax_compilation_cache_dir``) is
left as it is and used.

``watch()`` counts, around one compile, whether XLA ran or the cache served it; the
count of the process is logged once, at the first executable the cache serves.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Iterator, Optional

from .. import report
from ..config import _parse_bool

_HIT = "/jax/compilation_cache/cache_hits"
_local = threading.local()
_state: dict = {"directory": None, "hits": 0, "logged": False, "listening": False}


def default_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "donate_xla", "jax")


def configure(environ=os.environ) -> Optional[str]:
    """Turn JAX's persistent cache on (``jax.config``) unless ``DONATE_XLA_CACHE=0``, and
    return its directory (None: off). Called once, as the device starts."""
    import jax

    own = jax.config.jax_compilation_cache_dir
    enabled = _parse_bool("DONATE_XLA_CACHE", environ.get("DONATE_XLA_CACHE", "1"))
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        directory = None
    elif own:
        directory = own  # the program's own choice
    else:
        directory = environ.get("DONATE_XLA_CACHE_DIR") or default_directory()
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            report.log.warning("donate_xla: JAX compilation cache off: cannot create %s (%s); set "
                               "DONATE_XLA_CACHE_DIR to a writable directory or DONATE_XLA_CACHE=0",
                               directory, error)
            return None
        jax.config.update("jax_compilation_cache_dir", directory)
        # every executable: a training step's graphs each compile in well under JAX's
        # default threshold of one second on a small model, and still add up
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _state["directory"] = directory
    if directory is not None and not _state["listening"]:
        jax.monitoring.register_event_listener(_on_event)
        _state["listening"] = True
    return directory


def directory() -> Optional[str]:
    """The cache directory in use (None where the cache is off or the device has not started)."""
    return _state["directory"]


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT:
        watched = getattr(_local, "watched", None)
        if watched is not None:
            watched.hit = True


@dataclasses.dataclass
class Watched:
    hit: bool = False


@contextlib.contextmanager
def watch() -> Iterator[Watched]:
    """Around one ``Lowered.compile()``: ``.hit`` is True where the cache served it."""
    watched = Watched()
    saved = getattr(_local, "watched", None)
    _local.watched = watched
    try:
        yield watched
    finally:
        _local.watched = saved
    if watched.hit:
        _state["hits"] += 1
        if not _state["logged"]:
            _state["logged"] = True
            report.log.info("donate_xla: JAX target: executables loaded from JAX's compilation cache at %s "
                            "(DONATE_XLA_CACHE=0 turns it off)", _state["directory"])


def hits() -> int:
    """Executables of this process the cache served."""
    return _state["hits"]
