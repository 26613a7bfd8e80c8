"""Guards around the private torch APIs the native path uses (torch 2.9 and 2.11+).

Each function here touches one private API and says what happens when it is
missing or has changed, so the rest of the path never calls a private API
directly. Every guard has a test that removes the API by monkeypatching
(tests/test_native_compat.py).

- ``keep_graph()``: whether the running backward keeps its graph
  (``retain_graph``/``create_graph``). ``None`` when torch cannot tell; the
  caller must then assume the graph is kept and not reuse saved buffers.
- ``bw_donated_indices()``: aot_autograd's list of backward inputs that are
  saved tensors sharing no storage with a forward input, a user output or a
  backward output (``fw_metadata.bw_donated_idxs``). ``None`` when unknown.
- ``forward_returns_count()``: how many outputs of the forward being
  compiled go to the caller (``fw_metadata.num_forward_returns``); the rest
  are saved for the backward. ``None`` when unknown: the memory replay then
  counts every forward output as the caller's.
- ``allocation_peak_bytes(fn, device)``: the most bytes allocated above the
  starting level while ``fn`` runs. CUDA: the allocator's public statistics.
  CPU: the profiler's allocation events, read from its kineto results (no
  public API lists them); None when those are missing or a profiler is
  already running (``torch._C._autograd._profiler_enabled``: starting a
  second one would stop the user's).
- ``lift_aot_donation_check()``: aot_autograd refuses a ``retain_graph``
  backward once a backward with donated buffers was compiled (its check
  assumes the compiled code always overwrites them). Our backward decides
  per call (``free_saved``), so after reading the list we empty it in the
  metadata, which turns that check off for this graph only.
- ``activation_offloading(on_cuda)``: a context manager that turns on torch's
  own activation offloading in its min-cut partitioner
  (``torch._functorch.config.enable_activation_offloading`` and the module
  ``torch._functorch._activation_offloading``: torch 2.15 has them, torch 2.9
  does not); on CUDA with its separate copy stream, its waits sunk and its
  reloads prefetched, where those settings exist. ``None`` when this torch has
  no activation offloading. ``torch_version()``: torch's version, for messages.
- ``saved_by_eager_autograd(tensors)``: the tensors that eager autograd nodes hold
  for the backward, found by walking the ``grad_fn`` graph back from ``tensors``
  and stopping at compiled graphs' nodes (``CompiledFunctionBackward``). Each is
  read from the node's ``_raw_saved_*`` handle (``SavedTensor.data``) without
  unpacking it, and skipped where saved-tensor hooks packed it (its
  ``unpack_hook``: unpacking would run them: a checkpointed region would be
  recomputed, ``save_on_cpu`` would copy back). A saved leaf that requires grad (a
  parameter an eager op read) is left out by its storage, reached through its
  ``AccumulateGrad`` node: the read may hand back a detached alias of it. torch 2.9's handles have no
  ``data`` and ``unpack_hook``: there each is read by registering a pair of
  hooks that pass the tensor through unchanged (``register_hooks`` hands the
  pack hook the saved tensor at once, and refuses a handle that hooks packed
  already). Empty where the handles have neither way.
- ``as_boxed(fn)``: a function marked with ``_boxed_call``. In torch 2.13,
  ``GraphModule._boxed_call`` is read-only, so we never set it on a module;
  we always mark a plain function we own.
- ``donated_indices(indices)``: sets the donated list Inductor reads while it
  compiles one variant (donating or not) of a backward.
- ``inductor_compile(...)`` / ``inductor_aot_options()`` /
  ``inductor_graph_passes(gm)`` / ``mark_outputs_user_visible(gm)``: the
  Inductor entry points the ``inductor`` executor uses, wired the way
  ``torch._inductor.compile_fx.compile_fx`` wires them.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from .. import torch_compat


def keep_graph() -> Optional[bool]:
    """True/False while a backward runs; None if this torch has no way to ask."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None:
        return None
    try:
        return bool(query())
    except RuntimeError:
        # Not inside a backward (no current graph task): we cannot tell.
        return None


def bw_donated_indices() -> Optional[List[int]]:
    """aot_autograd's donated backward inputs for the graph being compiled, or None."""
    try:
        from torch._guards import TracingContext
    except ImportError:
        return None
    try_get = getattr(TracingContext, "try_get", None)
    if try_get is None:
        return None
    context = try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    indices = getattr(metadata, "bw_donated_idxs", None) if metadata is not None else None
    if indices is None:
        return None
    return [int(i) for i in indices]


def forward_returns_count() -> Optional[int]:
    """How many of the forward graph being compiled's outputs go to the caller
    (mutated inputs, user outputs, intermediate bases); the rest are saved for
    the backward. None when this torch does not say."""
    context = current_tracing_context()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    count = getattr(metadata, "num_forward_returns", None) if metadata is not None else None
    return int(count) if isinstance(count, int) else None


def lift_aot_donation_check() -> bool:
    """Empty ``fw_metadata.bw_donated_idxs`` of the graph being compiled; True if done."""
    context = current_tracing_context()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    if metadata is None or getattr(metadata, "bw_donated_idxs", None) is None:
        return False
    metadata.bw_donated_idxs = []
    return True


current_tracing_context = torch_compat.current_tracing_context
tracing = torch_compat.tracing


def as_boxed(fn: Callable) -> Callable:
    """Mark a plain Python function as taking the argument list itself."""
    if isinstance(fn, torch.nn.Module):
        raise TypeError(
            "donate_xla: as_boxed needs a plain function; GraphModule._boxed_call is "
            "read-only in newer torch, wrap the module in a function first"
        )
    fn._boxed_call = True
    return fn


@contextlib.contextmanager
def donated_indices(indices):
    """Set ``fw_metadata.bw_donated_idxs`` of the current tracing context while
    Inductor compiles (it reads the list there); restore it afterwards. A no-op
    when there is no such metadata."""
    context = current_tracing_context()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    if metadata is None or not hasattr(metadata, "bw_donated_idxs"):
        yield
        return
    saved = metadata.bw_donated_idxs
    metadata.bw_donated_idxs = list(indices)
    try:
        yield
    finally:
        metadata.bw_donated_idxs = saved


def inductor_graph_passes(gm) -> bool:
    """Run Inductor's joint-graph passes on ``gm`` in place; False if this torch has none.

    ``compile_fx`` runs them inside its partitioner (training) or before
    compiling (inference). Among them ``replace_random`` turns dropout's random
    ops into the ones Inductor lowers ("should have been handled in
    replace_random.py" otherwise). Without them a graph with random ops fails
    to lower, with Inductor's own error; other graphs compile as before.
    """
    from torch._inductor import compile_fx as inductor_compile_fx

    passes = getattr(inductor_compile_fx, "_recursive_joint_graph_passes", None)
    if passes is None:
        return False
    values = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    with _inductor_fake_mode(values):
        passes(gm)
    return True


def _inductor_fake_mode(values):
    """Inductor's passes read the fake mode from its ``V`` handler, which
    ``compile_fx`` sets around aot_autograd; set it from the graph's values."""
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return contextlib.nullcontext()
    return V.set_fake_mode(fake_mode)


def inductor_decompose(gm, example_inputs):
    """``gm`` retraced with Inductor's decompositions (a new GraphModule).

    ``compile_fx_inner`` expects graphs that aot_autograd traced with Inductor's
    decomposition table; a graph captured for the ATen executor (before the
    switch was flipped to Inductor) has ops Inductor both decomposes and falls
    back on ("both a fallback and a decomp for same op: aten.t.default").
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = detect_fake_mode(list(example_inputs))
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return make_fx(
            torch.fx.Interpreter(gm).run, decomposition_table=select_decomp_table()
        )(*example_inputs)


def mark_outputs_user_visible(gm) -> None:
    """Ask Inductor to keep the eager strides of every output of ``gm``.

    ``compile_fx`` marks the user-visible outputs in the output node's meta
    (``user_visible_output_idxs``); ``compile_fx_inner`` alone leaves Inductor
    free to pick strides. Marking every output is the conservative choice. A
    torch that ignores the key is unaffected.
    """
    output = gm.graph.output_node()
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    output.meta["user_visible_output_idxs"] = [
        i for i, value in enumerate(values) if isinstance(value, torch.fx.Node)
    ]


def inductor_compile(gm, example_inputs, *, is_backward: bool, is_inference: bool):
    """Compile an aot_autograd graph with Inductor; returns a boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(
        gm, example_inputs, is_backward=is_backward, is_inference=is_inference
    )


def aten_aot_options() -> dict:
    """aot_autograd options for the ATen executor: the min-cut partitioner, as aot_eager.

    Without it (a torch that moved it) aot_autograd's default partitioner is
    used: the same gradients, more saved activations.
    """
    min_cut = torch_compat.min_cut_partition()
    return {"partition_fn": min_cut} if min_cut is not None else {}


def inductor_aot_options() -> dict:
    """aot_autograd options Inductor expects: its decompositions and partitioner.

    Inductor's decompositions call into ``torch._inductor.lowering`` (e.g.
    ``max_pool2d_with_indices``), which only ``compile_fx`` imports; without
    that import aot_autograd's tracing fails with "module 'torch._inductor' has
    no attribute 'lowering'" (torchvision resnet18).
    """
    from torch._inductor import compile_fx as inductor_compile_fx  # imports ...lowering
    from torch._inductor.decomposition import select_decomp_table

    # Inductor's own partitioner runs its joint-graph passes, then min-cut.
    inductor_partition = getattr(inductor_compile_fx, "partition_fn", None)
    if inductor_partition is None:
        return {"decompositions": select_decomp_table(), "partition_fn": torch_compat.min_cut_partition()}

    def partition_fn(gm, joint_inputs, **kwargs):
        with _inductor_fake_mode(list(joint_inputs)):
            return inductor_partition(gm, joint_inputs, **kwargs)

    return {"decompositions": select_decomp_table(), "partition_fn": partition_fn}


def allocation_peak_bytes(fn: Callable[[], object], device) -> Optional[int]:
    """Peak allocated bytes above the start while ``fn()`` runs on ``device`` (see above)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    if enabled is None or enabled():
        return None  # a second profiler would stop the user's running one
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    events_of = getattr(results, "events", None)
    if events_of is None:
        return None
    events = sorted((e.start_ns(), e.nbytes()) for e in events_of() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def torch_version() -> str:
    """torch's version string, for messages."""
    return str(getattr(torch, "__version__", "unknown"))


def activation_offloading(on_cuda: bool):
    """See above."""
    import importlib

    try:
        importlib.import_module("torch._functorch._activation_offloading.activation_offloading")
        from torch._functorch import config as functorch_config
    except ImportError:
        return None
    if not hasattr(functorch_config, "enable_activation_offloading"):
        return None
    changes = {"enable_activation_offloading": True}
    if on_cuda:
        for name in ("activation_offload_separate_stream", "activation_offload_sink_wait",
                     "activation_reload_prefetch"):
            if hasattr(functorch_config, name):
                changes[name] = True
    return functorch_config.patch(**changes)


def inductor_config_patch(**changes):
    """Context manager: Inductor's config with ``changes``."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(**changes)


_SAVED_PREFIX = "_raw_saved_"  # a grad_fn node's handles of what it saved


def _packed_tensor(saved) -> Optional[torch.Tensor]:
    """The tensor a saved-variable handle holds, read without unpacking it; None where
    hooks packed it (see above)."""
    if not hasattr(saved, "unpack_hook") or not hasattr(saved, "data"):
        return _held_through_identity_hooks(saved)
    try:
        if saved.unpack_hook is not None:
            return None
        data = saved.data
    except Exception:  # noqa: BLE001  (released by a backward already)
        return None
    return data if isinstance(data, torch.Tensor) else None


def _held_through_identity_hooks(saved) -> Optional[torch.Tensor]:
    """torch 2.9, whose handles show neither ``data`` nor ``unpack_hook``: the handle's
    documented ``register_hooks(pack, unpack)`` calls ``pack`` at once with the tensor the
    handle holds (detached, the same storage). Registered with a pack and an unpack that
    return what they are given, the saved variable keeps the same tensor and the backward
    unpacks it as before. ``register_hooks`` refuses a handle that hooks packed already (a
    checkpointed region, ``save_on_cpu``, or this function on an earlier walk) and one a
    backward has freed: None for those, and nothing is unpacked."""
    register = getattr(saved, "register_hooks", None)
    if register is None:
        return None
    held: List[torch.Tensor] = []

    def pack(tensor):
        held.append(tensor)
        return tensor

    try:
        register(pack, _unchanged)
    except Exception:  # noqa: BLE001  (refused; a plan never stops a step)
        return None
    return held[0] if held and isinstance(held[0], torch.Tensor) else None


def _unchanged(tensor):
    return tensor


def reads_saved_tensors() -> bool:
    """Whether this torch's saved-variable handles can be read without unpacking them
    (``saved_by_eager_autograd`` finds nothing where they cannot)."""
    handle = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
    if handle is None:
        return False
    return all(hasattr(handle, name) for name in ("data", "unpack_hook")) or hasattr(handle, "register_hooks")


def saved_by_eager_autograd(tensors, identity: Optional[Callable] = None) -> List[torch.Tensor]:
    """See above. ``identity(tensor)``: what tells a leaf's aliases apart from other tensors
    (default: its storage's address; an XLA tensor has none, and the XLA path passes the
    tensor's id in torch_xla)."""
    from ..analysis.aliasing import storage_address

    identity = identity or storage_address
    out: List[torch.Tensor] = []
    leaves = set()  # storages of the leaves the walk reaches (parameters: resident, not saved)
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    visited = {}  # id -> node, kept alive: a wrapper freed early would hand its id to another
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        if "CompiledFunction" in type(node).__name__:
            continue  # a compiled graph's backward: its saved tensors are that graph's own
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(leaf, torch.Tensor):
            leaves.add(identity(leaf))
        for name in dir(node):
            if not name.startswith(_SAVED_PREFIX):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # noqa: BLE001  (released already, or not a saved variable)
                continue
            for item in value if isinstance(value, (tuple, list)) else (value,):
                tensor = _packed_tensor(item)
                if tensor is not None:
                    out.append(tensor)
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    leaves.discard(None)
    return [t for t in out if identity(t) not in leaves]
