"""Shared test set-up: CPU PJRT, a fresh dynamo and report list per test."""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
# XLA:CPU compiles each kernel through LLVM; its optimisation passes were about a third of the
# CPU time of a real-model test and buy nothing for kernels that run a few times on tiny
# tensors. What donate_xla decides (the HLO, buffer assignment, input-output aliases) and the
# values (no fast-math either way) do not depend on them. Subprocesses of the tests inherit
# the setting; `XLA_FLAGS= pytest ...` runs with XLA's defaults, as `make fuzz` and the
# benchmarks always do.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)


def xla_flags_with(extra: str) -> str:
    """XLA_FLAGS for a subprocess that needs flags of its own (dumps, a scheduler): the
    test process's flags and ``extra``."""
    return f"{os.environ.get('XLA_FLAGS', '')} {extra}".strip()

import pytest  # noqa: E402
import torch  # noqa: E402

import donate_backend  # noqa: E402


def _has_torch_xla() -> bool:
    # Before any test runs autograd, torch_xla must register its devices with the
    # autograd engine, which sizes its device queues when it starts: importing it is
    # not enough, its runtime must have counted them (else an XLA backward after a
    # CPU one fails an INTERNAL ASSERT in engine.cpp).
    try:
        import torch_xla
    except ImportError:
        return False
    torch_xla.device_count()
    return True


HAS_TORCH_XLA = _has_torch_xla()
# Shown by `pytest -ra` for every XLA test in an environment without torch_xla
# (the newest-torch environment of `make test`).
XLA_SKIP_REASON = (
    "torch_xla is not installed: the XLA path needs the xla extra "
    "(torch==2.9.0, torch_xla==2.9.0)"
)


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    donate_backend.clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture
def xla_device():
    if not HAS_TORCH_XLA:
        pytest.skip(XLA_SKIP_REASON)
    import torch_xla

    return torch_xla.device()


_WORKER_MAPPINGS = {}  # pytest-xdist worker id -> its memory mappings at the end


def _mappings() -> str:
    from donate_backend.xla.mmap_guard import mapping_count, mapping_limit

    return f"{mapping_count()} of {mapping_limit()}"


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in a pytest-xdist worker
    if HAS_TORCH_XLA and workeroutput is not None:
        workeroutput["memory_mappings"] = _mappings()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: known only where xdist is installed
def pytest_testnodedown(node, error):  # in the controller: a worker finished
    count = getattr(node, "workeroutput", {}).get("memory_mappings")
    if count:
        _WORKER_MAPPINGS[node.gateway.id] = count


def pytest_terminal_summary(terminalreporter):
    """Each test process's memory mappings at the end (docs/xla.md, "memory mappings"):
    XLA:CPU maps memory for every kernel torch_xla keeps, and donate_xla refuses to compile
    from 80 % of the limit, so a suite that grows past it fails in whichever test is next."""
    if _WORKER_MAPPINGS:
        for worker, count in sorted(_WORKER_MAPPINGS.items()):
            terminalreporter.write_line(f"memory mappings at the end of worker {worker}: {count}")
    elif HAS_TORCH_XLA and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.write_line(f"memory mappings at the end: {_mappings()}")


_TIMES = os.environ.get("DONATE_XLA_TEST_TIMES")


def pytest_runtest_logreport(report):
    """With ``DONATE_XLA_TEST_TIMES=path``, each test's set-up, call and tear-down times
    are appended to ``path`` as they finish (``--durations`` prints nothing for a run
    that dies on its way)."""
    if _TIMES:
        with open(_TIMES, "a") as times:
            times.write(f"{report.duration:.2f} {report.when} {report.nodeid}\n")


# Files of independent, long cases (a model's training run each), which `make test` spreads over
# the pytest-xdist workers by model; every other file's tests share a worker (module fixtures,
# a DDP rank group, a per-process eager reference).
SPREAD_BY_MODEL = ("tests/test_xla_real_models.py", "tests/test_native_real_models.py")


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or in a SPREAD_BY_MODEL file the model
    its parameter id starts with (``bert`` of ``[bert-step]``), or the test itself."""
    path, _, rest = nodeid.partition("::")
    if path not in SPREAD_BY_MODEL:
        return path
    name, bracket, params = rest.partition("[")
    return f"{path}::{params.split('-', 1)[0].rstrip(']')}" if bracket else f"{path}::{name}"


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: known only where xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` schedules by ``xdist_scope``. (pytest-xdist's own loadgroup reads
    ``xdist_group`` marks by renaming test ids, which pytest 9 no longer allows: it fell back
    to scheduling test by test.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrModelScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return FileOrModelScheduling(config, log)
