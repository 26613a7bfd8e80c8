"""User-facing switches of donate_xla.

The environment is read once, at import, into an immutable ``Settings``.
Tests and users change them from Python with ``config.patch(...)``. Every
compiled artefact records the ``Settings`` it was built with and checks
``cache_key()`` when it is called, so flipping a switch recompiles instead of
reusing code built under the other setting.

``torch.compile(f, backend="donate_xla", options={...})`` sets fields for one
compiled function: ``options_overrides`` validates them, and the backend
compiles and runs that function's graphs inside ``overriding(...)``, a
context-local layer over the process settings (options beat
``config.patch`` and the environment, for that function only).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Iterator, Mapping, Optional

_NATIVE_COMPILERS = ("aten", "inductor")


@dataclasses.dataclass(frozen=True)
class Settings:
    donation: bool = True  # DONATE_XLA_DONATION
    free_saved: bool = True  # DONATE_XLA_FREE_SAVED
    bucket_view: bool = True  # DONATE_XLA_BUCKET_VIEW
    debug: bool = False  # DONATE_XLA_DEBUG
    native_compiler: str = "aten"  # DONATE_XLA_NATIVE_COMPILER
    # DONATE_XLA_STITCH: XLA graphs run back to back as one executable; None (unset): each
    # step is stitched where its plan says that saves enough memory (``donate_backend.choice``)
    stitch: Optional[bool] = None
    activation_budget: float = 1.0  # DONATE_XLA_ACTIVATION_BUDGET: share of activations saved
    # DONATE_XLA_ORDER_RECOMPUTE: backward recomputation kept in place; None (unset): only
    # under an activation budget below 1.0 (see ``orders_recompute``)
    order_recompute: Optional[bool] = None
    # DONATE_XLA_BACKWARD_SEGMENTS: XLA backward graphs run as up to this many executables,
    # each saved tensor released after the last one that reads it (0 or 1: one executable);
    # None ("auto", the default): split where it releases enough (``xla.segments.worth_splitting``)
    backward_segments: Optional[int] = None
    # DONATE_XLA_MEMORY_LIMIT: bytes (or "12GiB", "500MB") a step may use; the native path
    # picks the least activation recomputation that fits, or refuses the graph before it runs
    memory_limit: Optional[int] = None
    # DONATE_XLA_OFFLOAD_SAVED: native path, torch's own activation offloading (its
    # partitioner copies the activations the backward needs to host memory after their last
    # forward use, and back before their first backward use); needs a torch that has it.
    # None (unset): only where a memory_limit on CUDA needs it (``native.offload.lever``);
    # 0: never; 1: always
    offload_saved: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.native_compiler not in _NATIVE_COMPILERS:
            raise ValueError(
                f"donate_xla: native_compiler must be one of {_NATIVE_COMPILERS}, "
                f"got {self.native_compiler!r} (set DONATE_XLA_NATIVE_COMPILER)"
            )
        if not 0.0 < self.activation_budget <= 1.0:
            raise ValueError(
                f"donate_xla: activation_budget must be in (0, 1], got {self.activation_budget!r} "
                "(set DONATE_XLA_ACTIVATION_BUDGET, e.g. 0.5 to save about half the activations)"
            )
        if self.memory_limit is not None and (
            isinstance(self.memory_limit, bool) or not isinstance(self.memory_limit, int) or self.memory_limit <= 0
        ):
            raise ValueError(
                f"donate_xla: memory_limit must be a number of bytes > 0, got {self.memory_limit!r} "
                "(set DONATE_XLA_MEMORY_LIMIT, e.g. 12GiB, or options={'memory_limit': '12GiB'})"
            )
        if self.backward_segments is not None and (
            isinstance(self.backward_segments, bool) or not isinstance(self.backward_segments, int)
            or self.backward_segments < 0
        ):
            raise ValueError(
                f"donate_xla: backward_segments must be a whole number >= 0 or None (automatic), got "
                f"{self.backward_segments!r} (set DONATE_XLA_BACKWARD_SEGMENTS, e.g. 8; 0 runs each backward "
                "as one executable; auto splits where it releases enough)"
            )

    @property
    def orders_recompute(self) -> bool:
        """Whether XLA backward graphs keep their recomputation in order (xla/recompute.py).

        By default only under an activation budget below 1.0: at the full budget
        the min-cut partitioner recomputes only cheap ops that XLA fuses into the
        gradient computations reading them, so the ordering lowered no memory and
        cost XLA compile time (docs/xla.md, "Measured reasons").
        ``DONATE_XLA_ORDER_RECOMPUTE`` 1 or 0 decides it at any budget.
        """
        if self.order_recompute is not None:
            return self.order_recompute
        return self.activation_budget < 1.0


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"donate_xla: {name}={raw!r} is not a boolean; use 1 or 0")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(raw, name: str = "memory_limit") -> int:
    """``12GiB``, ``500 MB``, ``1e9`` or an int -> bytes (``ValueError`` otherwise)."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    import re

    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(raw))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"donate_xla: {name}={raw!r} is not a size; use bytes or a number with a unit "
            "(KiB, MiB, GiB, TiB or KB, MB, GB, TB), e.g. 12GiB"
        )
    try:
        return int(float(match.group(1)) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"donate_xla: {name}={raw!r} is not a size; e.g. 12GiB") from None


def settings_from_env(environ: Mapping[str, str]) -> Settings:
    """Build ``Settings`` from an environment mapping (pure, for tests)."""
    kwargs = {}
    for field, var in (
        ("donation", "DONATE_XLA_DONATION"),
        ("free_saved", "DONATE_XLA_FREE_SAVED"),
        ("bucket_view", "DONATE_XLA_BUCKET_VIEW"),
        ("debug", "DONATE_XLA_DEBUG"),
        ("stitch", "DONATE_XLA_STITCH"),
        ("order_recompute", "DONATE_XLA_ORDER_RECOMPUTE"),
        ("offload_saved", "DONATE_XLA_OFFLOAD_SAVED"),
    ):
        if var in environ:
            kwargs[field] = _parse_bool(var, environ[var])
    if "DONATE_XLA_NATIVE_COMPILER" in environ:
        kwargs["native_compiler"] = environ["DONATE_XLA_NATIVE_COMPILER"].strip().lower()
    if "DONATE_XLA_ACTIVATION_BUDGET" in environ:
        raw = environ["DONATE_XLA_ACTIVATION_BUDGET"]
        try:
            kwargs["activation_budget"] = float(raw)
        except ValueError:
            raise ValueError(
                f"donate_xla: DONATE_XLA_ACTIVATION_BUDGET={raw!r} is not a number; use e.g. 0.5"
            ) from None
    if "DONATE_XLA_BACKWARD_SEGMENTS" in environ:
        raw = environ["DONATE_XLA_BACKWARD_SEGMENTS"]
        if raw.strip().lower() in ("", "auto"):
            kwargs["backward_segments"] = None
        else:
            try:
                kwargs["backward_segments"] = int(raw.strip())
            except ValueError:
                raise ValueError(
                    f"donate_xla: DONATE_XLA_BACKWARD_SEGMENTS={raw!r} is not a whole number or 'auto'; "
                    "use e.g. 8 (0: off)"
                ) from None
    if environ.get("DONATE_XLA_MEMORY_LIMIT", "").strip():
        kwargs["memory_limit"] = parse_bytes(environ["DONATE_XLA_MEMORY_LIMIT"], "DONATE_XLA_MEMORY_LIMIT")
    return Settings(**kwargs)


_current = settings_from_env(os.environ)


_overrides: contextvars.ContextVar[tuple] = contextvars.ContextVar("donate_xla_overrides", default=())


@functools.lru_cache(maxsize=256)
def _effective(base: Settings, overrides: tuple) -> tuple:
    settings = dataclasses.replace(base, **dict(overrides))
    return settings, dataclasses.astuple(settings)


def current() -> Settings:
    overrides = _overrides.get()
    return _current if not overrides else _effective(_current, overrides)[0]


_current_key = dataclasses.astuple(_current)


def cache_key() -> tuple:
    """The part of every compile cache key that comes from the switches (read on
    every compiled call, so computed only when the switches change)."""
    overrides = _overrides.get()
    return _current_key if not overrides else _effective(_current, overrides)[1]


@contextlib.contextmanager
def overriding(overrides: tuple) -> Iterator[Settings]:
    """Run with ``overrides`` (``options_overrides``'s result) over the process settings."""
    if not overrides:
        yield current()
        return
    token = _overrides.set(overrides)
    try:
        yield current()
    finally:
        _overrides.reset(token)


def active_overrides() -> tuple:
    """The ``torch.compile(options=...)`` in force here (``()`` outside any)."""
    return _overrides.get()


_FIELD_TYPES = {
    "bool": bool, "int": int, "float": (int, float), "str": str,
    "Optional[bool]": (bool, type(None)), "Optional[int]": (int, str, type(None)),
}


def options_overrides(options: Optional[Mapping]) -> tuple:
    """Check ``torch.compile(options=...)`` and return it as sorted ``(field, value)`` pairs.

    Raises ``ValueError`` naming an unknown key (with the valid ones) or a value of
    the wrong type or range.
    """
    if not options:
        return ()
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    unknown = sorted(str(k) for k in options if k not in fields)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)}; donate_xla's options are the fields of "
            f"donate_backend.config.Settings: {', '.join(fields)}"
        )
    for name, value in options.items():
        expected = _FIELD_TYPES.get(str(fields[name].type))
        if expected is not None and (not isinstance(value, expected) or (
            isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,))
        )):
            raise ValueError(f"option {name}={value!r}: expected {fields[name].type}")
    options = dict(options)
    if isinstance(options.get("memory_limit"), str):
        options["memory_limit"] = parse_bytes(options["memory_limit"])
    overrides = tuple(sorted(options.items()))
    dataclasses.replace(_current, **options)  # the fields' own checks (ranges, names)
    return overrides


@contextlib.contextmanager
def patch(**changes) -> Iterator[Settings]:
    """Temporarily change switches: ``with config.patch(donation=False): ...``."""
    global _current, _current_key
    saved, saved_key = _current, _current_key
    _current = dataclasses.replace(saved, **changes)
    _current_key = dataclasses.astuple(_current)
    try:
        yield _current
    finally:
        _current, _current_key = saved, saved_key
