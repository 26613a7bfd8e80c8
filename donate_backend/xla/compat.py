"""Every private torch_xla API the XLA path uses, each behind one function.

torch_xla's ``_XLAC`` bindings are private and change between releases. The
rest of the XLA path calls only the functions below. Each looks its binding
up when it is called (so a test can remove it) and says what happens without
it:

- required bindings raise ``MissingXlaApiError``, which names the binding and
  the torch_xla release this backend is built for;
- optional ones fall back: no buffer donor configuration -> no donation
  (``supports_donation``), no HLO printer -> no HLO text, no cache size ->
  eviction is assumed possible and detected from the error.

The special-scalar switch is required: without it Python scalars, and the
graph fingerprint with them, would be uploaded as data instead of being HLO
constants, and the fingerprint would no longer tell graphs apart.

tests/test_xla_compat.py removes each binding and checks its guard.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional, Sequence

import torch
import torch_xla

from .. import torch_compat
from ..errors import DonateXlaError

BUILT_FOR = "torch_xla 2.9"
_DEFAULT_CACHE_SIZE = 2048  # XLA_COMPILATION_CACHE_SIZE's default in torch_xla 2.9


class MissingXlaApiError(DonateXlaError):
    """This torch_xla lacks a private binding the XLA path needs."""

    help_section = "A torch_xla that is not the one donate_xla is built for"


def _optional(name: str):
    return getattr(torch_xla._XLAC, name, None)


def _required(name: str):
    binding = _optional(name)
    if binding is None:
        version = getattr(torch_xla, "__version__", "unknown")
        raise MissingXlaApiError(
            f"donate_xla: this torch_xla ({version}) has no torch_xla._XLAC.{name}, which the "
            f"XLA path needs; donate_xla is built for {BUILT_FOR}. Install torch_xla==2.9.0 "
            "(with torch==2.9.0), or use backend='openxla'."
        )
    return binding


# -- placeholders and tensor identity --------------------------------------------------

def make_placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """An XLA tensor with no device buffer: tracing it builds lazy IR only."""
    import torch_xla.core.xla_builder as xla_builder

    _required("_xla_create_placeholder_tensor")  # what the builder below calls
    create = getattr(xla_builder, "create_placeholder_tensor", None)
    if create is None:
        raise MissingXlaApiError(
            "donate_xla: torch_xla.core.xla_builder has no create_placeholder_tensor; "
            f"donate_xla is built for {BUILT_FOR}. Install torch_xla==2.9.0."
        )
    return create(tuple(shape), dtype)


def tensor_id(t: torch.Tensor) -> int:
    """torch_xla's id of the XLATensor behind ``t`` (``t.detach()`` shares it)."""
    return _required("_xla_get_tensor_id")(t)


def tensor_ids(tensors: Sequence[torch.Tensor]) -> list[int]:
    get = _required("_xla_get_tensor_id")
    return [get(t) for t in tensors]


def need_materialization(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor: True if it holds pending IR other than plain device data."""
    return list(_required("_check_tensor_need_materialization")(list(tensors)))


def device_data_nodes(tensors: Sequence[torch.Tensor], uncloned: Sequence[torch.Tensor] = ()):
    """(tensor ids, tensors) of the device data the tensors' IR reads, in HLO parameter order.

    The id is the tensor id a buffer is tagged with. A buffer tagged with one of
    ``uncloned`` comes back as that tensor, not as a new wrapper.
    """
    ids, values = _required("_get_tensors_xla_device_data_node")(list(tensors), list(uncloned))
    return list(ids), list(values)


# -- which value a tensor holds (the exclusivity record of ownership.py) ---------------------

def stores_as_pred(t: torch.Tensor) -> Optional[bool]:
    """Whether the XLA value behind a bool tensor is XLA's ``pred`` type; None if
    this torch_xla cannot say. torch_xla keeps a logical dtype beside the XLA
    element type: ``native_dropout``'s mask says bool and is f32 underneath."""
    binding = _optional("_get_xla_tensor_shape_type")
    if binding is None:
        return None
    return binding(t) == "pred"


def value_identity(t: torch.Tensor) -> str:
    """What ``t``'s XLATensor holds now, without changing it: its IR node (the text
    has a comma) if it has one, else its device data object (or the tensor itself
    for host data). A tensor that some lazy op read since it last had no IR has
    one now: torch_xla gives a tensor an IR node when it is first read."""
    return _required("_unique_id_for_ir_and_data")(t)


def _torch_api(owner, name: str):
    """A private torch function (functionalization, version counters), or None."""
    return getattr(owner, name, None)


def functional_values(tensors: Sequence[torch.Tensor]) -> Optional[list]:
    """The tensors functionalization wraps: each holds its tensor's current buffer
    (an in-place update gives the wrapper a new one). None if one is not
    functionalized (``XLA_DISABLE_FUNCTIONALIZATION=1``) or torch lacks the API."""
    unwrap = _torch_api(torch, "_from_functional_tensor")
    is_functional = _torch_api(torch, "_is_functional_tensor")
    if unwrap is None or is_functional is None or not all(map(is_functional, tensors)):
        return None
    return [unwrap(t) for t in tensors]


def rewrap_values(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[bool]:
    """Hand each target its source's XLA tensor, which holds the same value (another
    tensor on the target's own buffer): like ``install_values`` but the version
    counter does not move, as the value does not change. Per pair, False if a
    tensor is not functionalized or torch lacks the API."""
    replace = _torch_api(torch, "_functionalize_replace")
    commit = _torch_api(torch, "_functionalize_commit_update")
    unwrap = _torch_api(torch, "_from_functional_tensor")
    is_functional = _torch_api(torch, "_is_functional_tensor")
    if None in (replace, commit, unwrap, is_functional):
        return [False] * len(targets)
    done = []
    for target, source in zip(targets, sources):
        ok = is_functional(target) and is_functional(source)
        if ok:
            replace(target, unwrap(source))
            commit(target)
        done.append(ok)
    return done


def copies_between_tensors() -> Optional[int]:
    """How many ``copy_`` calls into XLA tensors torch_xla has lowered so far (its
    ``xla::copy`` counter), or None if unknown. A ``copy_`` from a tensor that holds
    a buffer makes the destination read that buffer; ``p.data.copy_(u)`` does so
    without moving ``p``'s version. Only copies move it: not uploads (``.to``)."""
    value = _optional("_xla_counter_value")
    if value is None:
        return None
    count = value("xla::copy")
    return 0 if count is None else int(count)


def install_values(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[bool]:
    """Make each target hold its source's value as an in-place update would (its views
    see it, its version counter moves), by handing it the source's XLA tensor
    instead of building IR that reads it (what ``copy_`` does), so that the target
    holds the buffer with no IR node: nothing else can have read it yet. Per pair,
    False (nothing done) if a tensor is not functionalized or torch lacks the API."""
    bump = _torch_api(torch.autograd.graph, "increment_version")
    if bump is None:
        return [False] * len(targets)
    done = rewrap_values(targets, sources)
    bump([t for t, ok in zip(targets, done) if ok])
    return done


def aot_version_bumped_inputs() -> Optional[frozenset]:
    """Inputs of the graph being compiled whose version counter aot_autograd's runtime
    wrapper increments before each call (graph-handled input mutations autograd
    sees), or None if unknown (no tracing context, another torch)."""
    context = torch_compat.current_tracing_context()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    indices = getattr(metadata, "mutated_graph_handled_indices_seen_by_autograd", None)
    if indices is None or getattr(metadata, "keep_input_mutations", True) is False:
        return None
    return frozenset(int(i) for i in indices)


def data_handles(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The device buffer handle behind each tensor (a placeholder's too)."""
    return list(_required("_get_tensors_handle")(list(tensors)))


def value_identities(tensors: Sequence[torch.Tensor]) -> list[str]:
    """torch_xla's identity of each tensor's current value: its IR node when it has
    one (two tensors reading one buffer through one device-data node are equal),
    else its buffer. Reads nothing from the device and waits for nothing."""
    identity = _required("_unique_id_for_ir_and_data")
    return [identity(t) for t in tensors]


def buffer_identities(tensors: Sequence[torch.Tensor]) -> list:
    """Per tensor, something equal for two tensors exactly when they read one buffer:
    the buffer handles in one call, else (a tensor holds pending IR) ``value_identities``."""
    try:
        return data_handles(tensors)
    except MissingXlaApiError:
        raise
    except RuntimeError:  # torch_xla's error for a tensor without a buffer of its own
        return value_identities(tensors)


def handles_or_none(tensors: Sequence[torch.Tensor]) -> list:
    """Like ``data_handles``, with None for a tensor that holds no buffer handle itself
    (its value is pending IR or another tensor's device data)."""
    try:
        return data_handles(tensors)
    except RuntimeError:
        out = []
        for t in tensors:
            try:
                out.append(data_handles([t])[0])
            except RuntimeError:
                out.append(None)
        return out


def seed_info_id() -> int:
    return _required("_get_seed_info_id")()


def is_placeholder(t: torch.Tensor) -> bool:
    """True for a tensor whose buffer has no value (a placeholder's)."""
    return bool(_required("_is_placecholder")(t))  # sic: torch_xla's spelling


def buffer_donation_count() -> int:
    """How many times torch_xla set a buffer's donation flag (its XlaSetBufferDonation counter)."""
    return int(_required("_xla_counter_value")("XlaSetBufferDonation") or 0)


def get_buffer_donation(t: torch.Tensor) -> bool:
    return bool(_required("_get_buffer_donation")(t))


# -- SPMD --------------------------------------------------------------------------------

def is_spmd() -> bool:
    """Whether torch_xla runs in SPMD mode (``torch_xla.runtime.use_spmd()``)."""
    import torch_xla.runtime as xr

    is_spmd_fn = getattr(xr, "is_spmd", None)
    return bool(is_spmd_fn()) if is_spmd_fn is not None else False


def sharding_specs(tensors: Sequence[torch.Tensor]) -> list[str]:
    """torch_xla's sharding spec text of each tensor ("" when it has none)."""
    return list(_required("_get_xla_sharding_specs")(list(tensors)))


def op_sharding(t: torch.Tensor):
    """The ``xla::OpSharding`` of ``t``, or None."""
    return _required("_get_xla_op_sharding")(t)


def annotate_sharding(t: torch.Tensor, sharding) -> None:
    """Pin the sharding of a pending (computed) tensor in the HLO being built."""
    _required("_xla_mark_sharding")(t, sharding)


# -- tracing settings --------------------------------------------------------------------

def supports_donation() -> bool:
    return all(
        _optional(name) is not None
        for name in (
            "_set_buffer_donation",
            "_xla_get_enable_alias_with_buffer_donor_config",
            "_xla_set_enable_alias_with_buffer_donor_config",
        )
    )


def donation_turned_off() -> Optional[str]:
    """Why torch_xla will not donate buffers in this process, or None.

    ``XLA_ENABLE_PARAM_ALIASING=0`` and auto-sharding make torch_xla compile
    without buffer donors, while the graph hash it reports still counts them: a
    graph lowered with donors would be cached under another hash than the one
    asked for ("Failed to get computation by hash"). Parsed as torch_xla's
    ``GetEnvBool`` does.
    """
    raw = os.environ.get("XLA_ENABLE_PARAM_ALIASING")
    if raw is not None and not _env_bool(raw):
        return f"XLA_ENABLE_PARAM_ALIASING={raw} turns off buffer donation in torch_xla"
    auto_sharding = _optional("_xla_get_auto_sharding")
    if auto_sharding is not None and auto_sharding():
        return "torch_xla's auto-sharding turns off buffer donation"
    return None


def functionalization_disabled() -> Optional[str]:
    """``XLA_DISABLE_FUNCTIONALIZATION=<value>`` if it is set to true, else None."""
    raw = os.environ.get("XLA_DISABLE_FUNCTIONALIZATION")
    return f"XLA_DISABLE_FUNCTIONALIZATION={raw}" if raw is not None and _env_bool(raw) else None


def _env_bool(raw: str) -> bool:
    """A set variable read as torch_xla's ``GetEnvBool`` reads it."""
    return raw == "true" or (raw != "false" and _atoi(raw) != 0)


def _atoi(raw: str) -> int:
    """C's ``atoi``: the leading integer of ``raw``, 0 if there is none."""
    digits = raw.lstrip()
    sign, digits = (digits[0], digits[1:]) if digits[:1] in ("+", "-") else ("", digits)
    n = len(digits) - len(digits.lstrip("0123456789"))
    return int(sign + digits[:n]) if n else 0


def set_buffer_donation(t: torch.Tensor, donate: bool) -> bool:
    return bool(_required("_set_buffer_donation")(t, donate))


@contextlib.contextmanager
def tracing_settings(donate: bool) -> Iterator[None]:
    """Python scalars become HLO constants; build in the buffer-donor configuration.

    Both settings are global in torch_xla and restored afterwards.
    """
    get_scalars = _required("_get_xla_all_numbers_special_scalars")
    set_scalars = _required("_set_xla_all_numbers_special_scalars")
    # XLA_NO_SPECIAL_SCALARS=1 turns this one off, and with it the switch above
    get_handled = _required("_get_xla_handle_special_scalars")
    set_handled = _required("_set_xla_handle_special_scalars")
    get_donor = _optional("_xla_get_enable_alias_with_buffer_donor_config")
    set_donor = _optional("_xla_set_enable_alias_with_buffer_donor_config")
    saved_scalars, saved_handled = get_scalars(), get_handled()
    saved_donor = get_donor() if get_donor and set_donor else None
    set_scalars(True)
    set_handled(True)
    if saved_donor is not None:
        set_donor(bool(donate))
    try:
        with lazy_mode():
            yield
    finally:
        set_scalars(saved_scalars)
        set_handled(saved_handled)
        if saved_donor is not None:
            set_donor(saved_donor)


@contextlib.contextmanager
def lazy_mode() -> Iterator[None]:
    """torch_xla's eager mode off (``torch_xla.experimental.eager_mode``,
    XLA_USE_EAGER_DEBUG_MODE=1): it runs each op as it is traced, on placeholders
    that have no buffers (a segmentation fault), and would run a stitched step's
    pieces one by one. Without the binding (no eager mode) nothing to do."""
    get_eager = _optional("_get_use_eager_mode")
    set_eager = _optional("_set_use_eager_mode")
    saved = get_eager() if get_eager and set_eager else False
    if saved:
        set_eager(False)
    try:
        yield
    finally:
        if saved:
            set_eager(True)


@contextlib.contextmanager
def outside_fake_tracing() -> Iterator[None]:
    """aot_autograd calls compilers under its FakeTensorMode and the python
    dispatcher; placeholder ops must run on the real XLA backend instead."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes(), torch._C._DisablePythonDispatcher():
        yield


def traced_call(args: Sequence) -> bool:
    """Whether a compiled graph is being called while something traces it rather than
    runs it: with fake tensors among its arguments, or from inside torch_xla's ``scan``
    with placeholders or IR computed from them. ``scan`` (torch_xla's ``nn.GRU``) runs
    the function it scans through ``aot_function`` on fake tensors, then on placeholders
    to lower it, so a graph compiled inside that function is called with no device data.

    Placeholders are recognised only inside ``scan``, their one maker here: elsewhere a
    tensor whose execution is still in flight looks the same to torch_xla, and reading
    an IR's device data re-tags the buffers it finds. Costs a stack walk per call.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    subclassed = [a for a in tensors if type(a) not in _PLAIN_TENSOR_TYPES]
    if subclassed and any(_is_fake(a) for a in subclassed):
        return True
    xla = [a for a in tensors if a.is_xla]
    if not xla or not _inside_torch_xla_scan():
        return False
    need = need_materialization(xla)
    return any(need) or any(_holds_placeholder(a) for a in xla)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor, or a functional wrapper of one."""
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # the API moved: compare class names instead
        return type(t).__name__ in ("FakeTensor", "FunctionalTensor")
    return is_fake(t)


def _holds_placeholder(t: torch.Tensor) -> bool:
    """``is_placeholder``, False for a tensor that holds no device buffer at all (a value
    still on the host, or one a stitched step will produce): torch_xla's check fails there."""
    try:
        return is_placeholder(t)
    except RuntimeError:
        return False


def _inside_torch_xla_scan() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_SCAN_FILE):
            return True
        frame = frame.f_back
    return False


_SCAN_FILE = os.path.join("torch_xla", "experimental", "scan.py")


# -- compiling ---------------------------------------------------------------------------

def graph_hash(tensors: Sequence[torch.Tensor]) -> bytes:
    return _required("_get_graph_hash")(list(tensors))


def warm_up_cache(tensors: Sequence[torch.Tensor]) -> None:
    """Compile the graph computing ``tensors`` into torch_xla's cache; run nothing."""
    _required("_xla_warm_up_cache")(list(tensors), [])


def computation(tensors: Sequence[torch.Tensor], name: str) -> tuple:
    """(the HLO computing ``tensors`` as a computation lazy IR can call
    (``user_computation``), the (shape, dtype) of each of its parameters)."""
    import torch_xla.core.xla_builder as xla_builder

    lowering = _required("lowering")
    context = lowering.LoweringContext("donate_xla")
    context.build(list(tensors))
    by_id = context.device_parameter_id_tensor_mapping()
    signature = [(tuple(by_id[k].shape), by_id[k].dtype) for k in sorted(by_id)]
    from_proto = getattr(xla_builder, "computation_from_module_proto", None)
    if from_proto is None:
        raise MissingXlaApiError(
            "donate_xla: torch_xla.core.xla_builder has no computation_from_module_proto, which "
            f"DONATE_XLA_STITCH needs; donate_xla is built for {BUILT_FOR}."
        )
    return from_proto(name, context.hlo()), signature


def reordered_computation(computation, inputs: Sequence[torch.Tensor], order: Sequence[int], name: str):
    """A computation whose parameter ``j`` is ``computation``'s parameter ``order[j]``
    (shaped like ``inputs[order[j]]``), calling ``computation``; call it on
    ``[inputs[k] for k in order]``. XLA inlines the call."""
    import torch_xla.core.xla_builder as xla_builder

    needed = ("create_computation", "tensor_shape", "Op")
    if not all(hasattr(xla_builder, attribute) for attribute in needed):
        raise MissingXlaApiError(
            f"donate_xla: torch_xla.core.xla_builder lacks one of {', '.join(needed)}; "
            f"donate_xla is built for {BUILT_FOR}."
        )
    shapes = [xla_builder.tensor_shape(inputs[k]) for k in order]

    def call_in_original_order(*params):
        operands = [None] * len(params)
        for j, k in enumerate(order):
            operands[k] = params[j]
        return xla_builder.Op.call(computation, operands)

    return xla_builder.create_computation(name, call_in_original_order, shapes)


def user_computation(name: str, inputs: list, computation) -> list:
    """Lazy tensors for the results of calling ``computation`` on ``inputs``: IR only,
    nothing runs until something syncs them."""
    return list(_required("_xla_user_computation")(name, inputs, computation))


def sync_live_tensors(device: torch.device, wait: bool) -> None:
    """Make every live tensor's pending IR concrete, as one execution (a step marker's sync)."""
    _required("_xla_sync_live_tensors")(str(device), [], wait)


def sync_live_tensors_async(device: torch.device) -> None:
    """Schedule every live tensor's pending IR as one execution; do not wait."""
    sync_live_tensors(device, wait=False)


def hlo_text(tensors: Sequence[torch.Tensor]) -> Optional[str]:
    printer = _optional("_get_xla_tensors_hlo")
    return printer(list(tensors)) if printer is not None else None


def cache_capacity() -> int:
    try:
        return int(os.environ.get("XLA_COMPILATION_CACHE_SIZE", _DEFAULT_CACHE_SIZE))
    except ValueError:
        return _DEFAULT_CACHE_SIZE


def cached_graph_count() -> Optional[int]:
    """Graphs in torch_xla's in-memory computation cache, or None if unknown."""
    count = _optional("_xla_get_num_cached_compilation_graph")
    return int(count()) if count is not None else None


def cache_may_have_evicted() -> bool:
    """False only when the cache has never been full, so nothing was ever evicted.

    torch_xla's LRU cache evicts only when an insertion finds it full, and it
    never shrinks otherwise.
    """
    count = cached_graph_count()
    return count is None or count >= cache_capacity()


# -- running -----------------------------------------------------------------------------

def run_cached_graph(hash_: bytes, inputs: list) -> list:
    return _required("_run_cached_graph")(hash_, inputs)


def sync(tensors: Sequence[torch.Tensor], wait: bool) -> None:
    """Make the tensors' pending IR concrete (and tag their buffers as theirs)."""
    _required("_xla_sync_multi")(list(tensors), devices=[], wait=wait, sync_xla_data=True)


def add_step_closure(fn) -> bool:
    """Run ``fn()`` after the next ``torch_xla.sync()`` (or ``xm.mark_step()``) has
    launched the step (torch_xla's step closures); False where this torch_xla has none."""
    import torch_xla.core.xla_model as xm

    add = getattr(xm, "add_step_closure", None)
    if add is None:
        return False
    add(fn)
    return True


def wait_device_ops() -> None:
    """Wait until every execution scheduled on the devices has finished (and so every
    result buffer of one exists)."""
    _required("_xla_wait_device_ops")(devices=[])


def base_seed_tensor(device: torch.device) -> torch.Tensor:
    return _required("_get_base_seed_as_tensor")(str(device))


def rng_seed() -> int:
    return int(_required("_xla_get_rng_seed")())


# -- torch -------------------------------------------------------------------------------

def decomposition(op: torch._ops.OpOverload):
    """torch's Python decomposition of ``op`` (``torch._decomp``, private), or None."""
    try:
        from torch._decomp import decomposition_table
    except ImportError:
        return None
    return decomposition_table.get(op)


def view_meta_sequence_function():
    """torch's ``get_view_meta_sequence`` (the view steps a functional tensor was made
    by), or None on a torch without it."""
    return getattr(getattr(torch._C, "_functionalization", None), "get_view_meta_sequence", None)


def has_kernel_for_dispatch_key(op_name: str, key: str) -> bool:
    """Whether ``op_name`` has a kernel for dispatch key ``key``: which ops torch_xla
    lowers (a missing function is the wrong torch for this torch_xla: refused)."""
    check = _torch_api(torch._C, "_dispatch_has_kernel_for_dispatch_key")
    if check is None:
        raise MissingXlaApiError(
            f"donate_xla: this torch ({torch.__version__}) has no "
            "torch._C._dispatch_has_kernel_for_dispatch_key, which the XLA path needs to tell "
            f"which ops torch_xla lowers; donate_xla is built for {BUILT_FOR}."
        )
    return bool(check(op_name, key))
