"""One build per switch setting, shared by the XLA and native paths.

A compiled graph may be called under switch settings other than the ones it
was first built under (``config.patch``, or an environment read at import).
Code built under one setting must never run under another, so each path keeps
its builds in a ``BuildsPerSetting``: the build for the settings in force is
made on first use and reused whenever those settings come back.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Generic, TypeVar

from . import config

T = TypeVar("T")


class BuildsPerSetting(Generic[T]):
    """``current()`` returns the build for ``config.current()``, building it once."""

    def __init__(self, build: Callable[[config.Settings], T]):
        self._build = build
        self._by_key: Dict[tuple, T] = {}
        self._lock = threading.Lock()

    def current(self) -> T:
        settings = config.current()
        key = config.cache_key()
        built = self._by_key.get(key)
        if built is None:
            with self._lock:
                built = self._by_key.get(key)
                if built is None:
                    built = self._build(settings)
                    self._by_key[key] = built
        return built

    def built_keys(self) -> list:
        """The settings keys built so far (for tests and reports)."""
        return list(self._by_key)
