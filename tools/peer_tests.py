#!/usr/bin/env python3
"""Run torch_xla's own dynamo tests against donate_xla and against openxla, and compare.

The peer suites are four files of pytorch/xla's ``test/dynamo/`` at tag v2.9.0. No
code of pytorch/xla is kept in this repository: the files are read from a pytorch/xla git
checkout or snapshot given on the command line (``--xla-src``, or ``$PEER_XLA_SRC``), extracted
into a temporary directory, and run there twice, each as ``python FILE -v`` in a fresh process
from inside ``test/dynamo/`` (the files find ``test/test_utils.py`` and ``examples/`` through
``sys.argv[0]``):

- *openxla*: the files as they are;
- *donate_xla*: every quoted backend name ``'openxla'`` / ``"openxla"`` (and ``openxla_eval``)
  replaced by ``'donate_xla'``. ``if backend == 'openxla':`` branches are rewritten too, so the
  openxla-only assertions run under donate_xla as well.

A test counts against donate_xla (a *regression*) when it passes under openxla and fails (FAIL,
ERROR, CRASH, TIMEOUT, NOT RUN) under donate_xla. The exit status is 1 if there is a regression
not listed in ``EXPECTED`` below, else 0. (test_dynamo.py's ``...1`` parameterizations run
torch_xla's experimental ``dynamo_backend2``, which needs jax: they fail under both backends
here and so never count.) Logs and extracted trees go to a temporary directory (``--keep DIR``
keeps them); a full run of both backends takes about 20 minutes on 2 busy CPU cores.

    make peer-tests
    .venv/bin/python tools/peer_tests.py --xla-src ~/src/xla --json peer.json
    .venv/bin/python tools/peer_tests.py --files test_dynamo_aliasing.py --backends donate_xla \\
        --baseline peer.json            # reuse the openxla outcomes of an earlier run
    .venv/bin/python tools/peer_tests.py --files test_dynamo.py \\
        --test DynamoTrainingBasicTest.test_resnet18   # selected tests only (unittest names)

Needs torchvision 0.24.x (the release that matches torch 2.9.0) in the same environment:
``.venv/bin/pip install torchvision==0.24.0``. ``PJRT_DEVICE`` defaults to ``CPU``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SRC = "/work/.mirror/pytorch+xla/repo"
DEFAULT_TAG = "v2.9.0"
DEFAULT_FILES = (
    "test_dynamo.py",
    "test_dynamo_aliasing.py",
    "test_dynamo_dynamic_shape.py",
    "test_bridge.py",
)
BACKENDS = ("openxla", "donate_xla")

# Tests that pass under openxla and fail under donate_xla by design: test id -> reason. A test
# id is "FILE::Class.method", as printed in the table. Listed ones do not fail the run; each
# passes when its openxla-internal assertions are removed (values and gradients are right).
_COUNTERS = "asserts openxla-internal counters ({}), which donate_xla's own pipeline does not produce"
EXPECTED: dict[str, str] = {
    "test_dynamo.py::DynamoCpuFallbackTest.test_fallback_multiple_submodules": _COUNTERS.format(
        "CompileTime == 2: donate_xla compiles each XLA segment around the CPU op, 3"
    ),
    "test_dynamo.py::DynamoInferenceBasicTest.test_simple_model": _COUNTERS.format("DynamoSyncInputExecuteTime"),
    "test_dynamo.py::DynamoTrainingBasicTest.test_resnet18": _COUNTERS.format("CompileTime <= 3"),
    "test_dynamo.py::DynamoTrainingOptimizerTest.test_resnet18": _COUNTERS.format("ExecuteTime"),
    "test_dynamo.py::DynamoErrorMessageTest.test_all_cpu_tensor": (
        "expects openxla's warning for a graph of CPU tensors only; donate_xla compiles such a "
        "graph on its native (CPU) path, as intended, without the warning"
    ),
    "test_dynamo_aliasing.py::TestDynamoBufferDonationAliasingWithCustomOp.test_manual_buffer_donation":
        _COUNTERS.format("XlaSetBufferDonation == 2: openxla flags the buffer again on the real tensor"),
    "test_dynamo_aliasing.py::TestDynamoBufferDonationAliasingWithCustomOp"
    ".test_manual_buffer_donation_for_non_inplce_op": (
        "asserts openxla's per-buffer flag after the call and its XlaSetBufferDonation counter; the "
        "buffer is donated (deleted) and reported as requested, but donate_xla sets no flag on it"
    ),
    **{
        f"test_dynamo_dynamic_shape.py::DynamoDynamicShapeBasicTest.{name}": _COUNTERS.format(
            "DynamoExtractCompiledGraph"
        )
        for name in (
            "test_dynamic_shape_basic",
            "test_dynamic_shape_basic_with_mark_dynamic",
            "test_dynamic_shape_multiple_batchs",
            "test_dynamic_shape_mix_with_non_dynamic",
            "test_dynamic_decoder",
            "test_dynamic_shape_decoder_mark_dynamic",
        )
    },
}

PASS = {"ok", "expected failure"}
SKIP = {"skipped"}
# everything else (FAIL, ERROR, CRASH, TIMEOUT, NOT RUN, unexpected success) is a failure

# 'openxla' or "openxla" (also openxla_eval), as a whole quoted string literal.
_BACKEND_LITERAL = re.compile(r"""(['"])openxla(?:_eval)?\1""")


def rewrite_backend(text: str, backend: str) -> tuple[str, int]:
    """Return ``text`` with every quoted openxla backend name replaced by ``backend``."""
    return _BACKEND_LITERAL.subn(lambda m: f"{m.group(1)}{backend}{m.group(1)}", text)


# --------------------------------------------------------------------------------------------
# Getting the sources


def extract_sources(src: str, tag: str, dest: Path) -> str:
    """Put ``test/`` and ``examples/`` of pytorch/xla at ``tag`` under ``dest``.

    ``src`` is a git directory (bare or not) or a checkout with a work tree. A plain directory
    that is no git repository is copied as it is (``tag`` is then not checked).
    Returns a description of what was extracted.
    """
    dest.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", src]
    probe = subprocess.run(git + ["rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        commit = probe.stdout.strip()
        archive = subprocess.run(git + ["archive", "--format=tar", commit, "test/", "examples/"],
                                 capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"git archive failed in {src}: {archive.stderr.decode()[-500:]}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        return f"{src} @ {tag} ({commit[:12]})"
    is_git = subprocess.run(git + ["rev-parse", "--git-dir"], capture_output=True).returncode == 0
    if is_git:
        raise SystemExit(f"{src} is a git repository without tag {tag}")
    root = Path(src)
    if not (root / "test" / "dynamo").is_dir():
        raise SystemExit(f"{src}: neither a pytorch/xla git repository nor a source tree "
                         "(no test/dynamo/). Pass --xla-src or set PEER_XLA_SRC.")
    for sub in ("test", "examples"):
        shutil.copytree(root / sub, dest / sub)
    return f"{src} (plain source tree, tag not checked)"


def prepare_tree(src: str, tag: str, base: Path, backend: str, files: list[str]) -> dict:
    """Extract a tree for ``backend``; rewrite the backend name in ``files`` unless openxla."""
    tree = base / backend
    origin = extract_sources(src, tag, tree)
    replaced = {}
    for name in files:
        path = tree / "test" / "dynamo" / name
        if not path.is_file():
            raise SystemExit(f"{origin}: test/dynamo/{name} does not exist")
        if backend != "openxla":
            text, n = rewrite_backend(path.read_text(), backend)
            path.write_text(text)
            replaced[name] = n
    return {"tree": tree, "origin": origin, "replaced": replaced}


# --------------------------------------------------------------------------------------------
# Parsing `python FILE -v` (unittest's verbose stream, which goes to stderr)

_SEP_EQ = "=" * 70
_SEP_DASH = "-" * 70
# Python 3.11: "test_x (__main__.Class.test_x) ... ok"; absl's parameterized.TestCase:
# "test_x0 ('openxla') (__main__.Class)" followed by description lines, the last one
# "test_x('openxla') ... ok"; class-level errors: "setUpClass (__main__.Class) ... ERROR".
_START = re.compile(r"^(\w+)(?: \(.*?\))? \(([\w.]+)\)(?: \[.*?\])?(?:$| \.\.\. ?(.*)$)")
_RESULT = re.compile(
    r"(?:^|\.\.\. ?)(ok|FAIL|ERROR|expected failure|unexpected success|skipped(?: .*)?)\s*$")
_BLOCK = re.compile(r"^(FAIL|ERROR|UNEXPECTED SUCCESS): (\w+)(?: \(.*?\))? \(([\w.]+)\)")
_CLASS_LEVEL = {"setUpClass", "tearDownClass", "setUpModule", "tearDownModule"}
_RAN = re.compile(r"^Ran (\d+) tests? in ")


def _test_name(method: str, inner: str) -> str:
    """'Class.method' from unittest's 'method (module.Class.method)' or absl's
    'method (module.Class)'; 'Class.<setUpClass>' for class-level errors such as
    'setUpClass (module.Class)'."""
    parts = inner.split(".")
    if method in _CLASS_LEVEL:
        return f"{parts[-1]}.<{method}>"
    if parts[-1] == method and len(parts) >= 2:
        return f"{parts[-2]}.{method}"
    return f"{parts[-1]}.{method}"


def _error_line(tb: str) -> str:
    """The exception line of a traceback (the first line after the last frame)."""
    lines = tb.rstrip().splitlines()
    last_frame = max((i for i, l in enumerate(lines) if l.startswith('  File "')), default=-1)
    rest = lines[last_frame + 1:]
    for k, line in enumerate(rest):
        if line.strip() and not line.startswith(" "):
            text = line.strip()
            if text.endswith(":"):  # "BackendCompilerFailed: backend='x' raised:" + the cause
                following = [l.strip() for l in rest[k + 1:] if l.strip()]
                if following:
                    text += " " + following[0]
            return text
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def _frames(tb: str) -> list[tuple[str, int, str, str]]:
    """(file, line, function, code) of every frame of a traceback text."""
    out = []
    lines = tb.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r'^\s*File "([^"]+)", line (\d+), in (.+)$', line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if code.startswith("File ") or set(code) <= set("^~ "):
                code = ""
            out.append((m.group(1), int(m.group(2)), m.group(3), code))
    return out


def _locations(tb: str, test_file: str) -> dict:
    """Innermost frame in the test file and in donate_backend, as 'path:line in fn: code'."""
    loc = {}
    for path, line, fn, code in _frames(tb):
        where = f"{Path(path).name}:{line} in {fn}: {code}".rstrip(": ")
        if Path(path).name == test_file:
            loc["test"] = where
        if "donate_backend" in path:
            rel = path[path.index("donate_backend"):]
            loc["donate_backend"] = f"{rel}:{line} in {fn}: {code}".rstrip(": ")
    return loc


def parse_verbose(stderr: str, test_file: str) -> tuple[dict, dict]:
    """Parse unittest's ``-v`` stream.

    Returns ``(tests, info)``: ``tests`` maps 'Class.method' to a dict with ``outcome`` and, for
    failures, ``error`` (exception line), ``traceback`` and ``where``; ``info`` has ``ran`` (the
    count of the 'Ran N tests' line, or None when the process ended before it) and ``in_flight``
    (the test that had started without a result, if any).
    """
    lines = stderr.splitlines()
    tests: dict[str, dict] = {}
    order: list[str] = []
    current = None
    segment: list[str] = []
    ran = None
    summary_at = len(lines)

    def close():
        if current is None:
            return
        outcome = None
        for seg_line in segment:
            m = _RESULT.search(seg_line)
            if m:
                outcome = m.group(1)
        if outcome is not None:
            entry = {"outcome": "skipped" if outcome.startswith("skipped") else outcome}
            if outcome.startswith("skipped"):
                entry["reason"] = outcome[len("skipped"):].strip()
            tests[current] = entry

    i = 0
    while i < len(lines):
        line = lines[i]
        if line == _SEP_EQ or (line == _SEP_DASH and i + 1 < len(lines) and _RAN.match(lines[i + 1])):
            summary_at = i
            break
        m = _START.match(line)
        if m:
            close()
            current = _test_name(m.group(1), m.group(2))
            if current not in order:
                order.append(current)
            segment = [m.group(3) or ""]
            # A docstring line follows a bare description: "doc ... ok".
        else:
            segment.append(line)
        i += 1
    close()

    # Error blocks: ===, "FAIL: name (...)", ---, traceback, until the next === or --- + Ran.
    i = summary_at
    while i < len(lines):
        if _RAN.match(lines[i]):
            ran = int(_RAN.match(lines[i]).group(1))
        m = _BLOCK.match(lines[i]) if i > 0 and lines[i - 1] == _SEP_EQ else None
        if m:
            name = _test_name(m.group(2), m.group(3))
            j = i + 1
            # the rest of a multi-line description, up to the dashes
            k = j
            while k < len(lines) and k < j + 6 and lines[k] != _SEP_DASH:
                k += 1
            if k < len(lines) and lines[k] == _SEP_DASH:
                j = k + 1
            body = []
            while j < len(lines) and lines[j] != _SEP_EQ and not (
                    lines[j] == _SEP_DASH and j + 1 < len(lines) and _RAN.match(lines[j + 1])):
                body.append(lines[j])
                j += 1
            tb = "\n".join(body).strip("\n")
            kind = m.group(1)
            entry = tests.setdefault(name, {})
            entry["outcome"] = "unexpected success" if kind == "UNEXPECTED SUCCESS" else kind
            entry["error"] = _error_line(tb) if tb else kind
            entry["traceback"] = tb
            entry["where"] = _locations(tb, test_file)
            if name not in order:
                order.append(name)
            i = j
            continue
        i += 1

    in_flight = [t for t in order if t not in tests]
    # A test that started but reported nothing is the one that was running when the process
    # ended: only the last one can be; earlier ones would be a parsing gap.
    info = {"ran": ran, "in_flight": in_flight[-1] if in_flight else None,
            "unparsed": in_flight[:-1], "order": order}
    return tests, info


# --------------------------------------------------------------------------------------------
# Running one file


_LIST_TESTS = r"""
import json, runpy, sys, types, unittest
path = sys.argv[1]
sys.argv = [path]
ns = runpy.run_path(path, run_name="__peer_list__")
mod = types.ModuleType("__peer_list__")
mod.__dict__.update(ns)
names = []
def walk(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            walk(t)
        else:
            method = getattr(t, "_testMethodName", None)
            if method and method != "runTest":
                names.append(type(t).__name__ + "." + method)
walk(unittest.defaultTestLoader.loadTestsFromModule(mod))
print("PEER_TESTS " + json.dumps(names))
"""


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _run(cmd, cwd, env, timeout, out_path: Path, err_path: Path):
    """Run ``cmd`` in its own process group; on timeout kill the group. Returns (rc, timed_out,
    seconds)."""
    start = time.monotonic()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM: take the test process down with us
            _kill_group(proc)
            proc.wait()
            raise
    return rc, timed_out, time.monotonic() - start


def list_tests(python, cwd, env, name, logdir: Path, timeout) -> list[str] | None:
    out, err = logdir / f"{name}.list.out", logdir / f"{name}.list.err"
    rc, timed_out, _ = _run([python, "-c", _LIST_TESTS, name], cwd, env, timeout, out, err)
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("PEER_TESTS "):
            return json.loads(line[len("PEER_TESTS "):])
    return None


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def run_file(python, tree: Path, name: str, backend: str, env, timeout, logdir: Path,
             selected: list[str] | None, log) -> dict:
    """Run one test file with ``python FILE -v``; after a crash or timeout, run the tests that
    have not run yet (found by loading the module) in a new process, until all ran."""
    cwd = tree / "test" / "dynamo"
    stem = f"{backend}.{name}"
    results: dict[str, dict] = {}
    rounds = []
    all_tests = None
    todo = list(selected) if selected else []  # empty: the whole file
    started = time.monotonic()
    for rnd in range(1, 1000):
        out, err = logdir / f"{stem}.{rnd}.out", logdir / f"{stem}.{rnd}.err"
        cmd = [python, name, "-v"] + todo
        log(f"  [{backend}] {name}" + (f" ({len(todo)} tests)" if todo else "") +
            (f", round {rnd}" if rnd > 1 else "") + " ...")
        rc, timed_out, secs = _run(cmd, cwd, env, timeout, out, err)
        stderr = err.read_text(errors="replace")
        tests, info = parse_verbose(stderr, name)
        results.update(tests)
        finished = info["ran"] is not None and not timed_out
        round_info = {"cmd": " ".join(cmd[1:]), "rc": rc, "timed_out": timed_out,
                      "seconds": round(secs, 1), "completed": finished,
                      "tests": len(tests), "stderr": str(err), "stdout": str(out)}
        rounds.append(round_info)
        log(f"  [{backend}] {name}: {len(tests)} tests in {secs:.0f} s"
            + ("" if finished else (", TIMEOUT" if timed_out else f", ended early ({_signal_name(rc)})")))
        if not finished:
            # unittest prints tracebacks only in its final summary, which a killed process never
            # reached.
            for entry in tests.values():
                if entry["outcome"] in ("FAIL", "ERROR") and "error" not in entry:
                    entry["error"] = ("(no traceback: the process ended before unittest's "
                                      "summary; rerun the test alone with --test)")
        if finished:
            break
        victim = info["in_flight"]
        tail = _tail(stderr)
        if victim is not None:
            results[victim] = {
                "outcome": "TIMEOUT" if timed_out else "CRASH",
                "error": (f"timed out after {timeout} s" if timed_out else
                          f"process ended ({_signal_name(rc)}) during the test"),
                "traceback": tail, "where": {}}
        if all_tests is None:
            all_tests = list_tests(python, cwd, env, name, logdir, timeout)
            if all_tests is None:
                # The module cannot even be loaded: one pseudo test for the whole file.
                results[f"<module>.{name}"] = {
                    "outcome": "TIMEOUT" if timed_out else "ERROR",
                    "error": _error_line(stderr) or _signal_name(rc),
                    "traceback": tail, "where": _locations(stderr, name)}
                break
            if selected:
                all_tests = [t for t in all_tests if t in selected or
                             any(t.startswith(s + ".") for s in selected)]
        remaining = [t for t in all_tests if t not in results]
        if victim is None or not remaining:
            # No progress can be made (or nothing is left): whatever did not run is NOT RUN.
            for t in remaining:
                results[t] = {"outcome": "NOT RUN", "error": "the process ended before the "
                              f"test ran ({_signal_name(rc)})", "traceback": tail, "where": {}}
            break
        todo = remaining
    return {"tests": results, "rounds": rounds,
            "seconds": round(time.monotonic() - started, 1)}


# --------------------------------------------------------------------------------------------
# Report


def classify(outcome: str | None) -> str:
    if outcome is None:
        return "absent"
    if outcome in PASS:
        return "pass"
    if outcome in SKIP:
        return "skip"
    return "fail"


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def print_table(rows: list[dict], backends: list[str], out=sys.stdout, width: int = 110):
    idw = max([len("test")] + [len(r["id"]) for r in rows])
    head = f"{'test':<{idw}}  " + "  ".join(f"{b:<10}" for b in backends) + "  error"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        cells = []
        for b in backends:
            o = r.get(b) or {}
            cells.append(f"{o.get('outcome', '-'):<10}")
        err = ""
        for b in reversed(backends):  # donate_xla's error first
            o = r.get(b) or {}
            if classify(o.get("outcome")) == "fail":
                err = (f"[{b}] " if len(backends) > 1 and b != backends[-1] else "") + o.get("error", "")
                break
        mark = ""
        if r.get("regression"):
            mark = "  << expected: " + EXPECTED[r["id"]] if r["id"] in EXPECTED else "  << REGRESSION"
        print(f"{r['id']:<{idw}}  " + "  ".join(cells) + "  " + _short(err, width) + mark,
              file=out)


def _git(*args) -> str:
    p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return p.stdout.strip()


def repo_state() -> dict:
    diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD", "--", "donate_backend"],
                          capture_output=True).stdout
    return {"commit": _git("log", "--oneline", "-1"),
            "donate_backend_uncommitted_changes": bool(diff),
            "donate_backend_diff_sha1": hashlib.sha1(diff).hexdigest()[:12] if diff else None}


def preflight(python, env) -> dict:
    code = ("import json, torch, torch_xla, torchvision, torch._dynamo as d;"
            "print(json.dumps({'torch': torch.__version__, 'torch_xla': torch_xla.__version__,"
            "'torchvision': torchvision.__version__,"
            "'donate_xla_registered': 'donate_xla' in d.list_backends(exclude_tags=()),"
            "'donate_backend': __import__('donate_backend').__file__}))")
    # from a neutral directory, as the tests run: not from the repository root
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    if p.returncode != 0:
        msg = _tail(p.stderr, 3)
        hint = ""
        if "torchvision" in p.stderr:
            hint = "\nThe peer tests need torchvision 0.24.x: pip install torchvision==0.24.0"
        raise SystemExit(f"preflight failed with {python}:\n{msg}{hint}")
    info = json.loads(p.stdout.strip().splitlines()[-1])
    if not info["donate_xla_registered"]:
        raise SystemExit("the donate_xla backend is not registered in this environment "
                         "(pip install -e . ?)")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--xla-src", default=os.environ.get("PEER_XLA_SRC", DEFAULT_SRC),
                    help="pytorch/xla git repository, bare git dir or source tree "
                         "(default $PEER_XLA_SRC or %(default)s)")
    ap.add_argument("--tag", default=DEFAULT_TAG, help="git tag to extract (default %(default)s)")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                    help="files of test/dynamo/ to run (default: the four peer files)")
    ap.add_argument("--test", action="append", default=[], metavar="Class[.method]",
                    help="run only these tests (unittest names; repeatable)")
    ap.add_argument("--backends", default="openxla,donate_xla",
                    help="comma-separated, of openxla and donate_xla (default both)")
    ap.add_argument("--baseline", metavar="JSON",
                    help="take the openxla outcomes from an earlier --json output instead of "
                         "running openxla")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per file and process")
    ap.add_argument("--python", default=sys.executable, help="interpreter (default: this one)")
    ap.add_argument("--json", metavar="OUT", help="write all outcomes to this file")
    ap.add_argument("--keep", metavar="DIR",
                    help="extract and keep the trees and logs in DIR instead of a temporary one")
    ap.add_argument("--failures-only", action="store_true",
                    help="print only tests that did not pass under every backend")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    baseline = None
    if args.baseline:
        baseline = json.loads(Path(args.baseline).read_text())
        backends = [b for b in backends if b != "openxla"]
    shown = (["openxla"] if baseline is not None else []) + backends
    shown = [b for b in BACKENDS if b in shown]

    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    versions = preflight(args.python, env)
    state = repo_state()
    imported = Path(versions["donate_backend"]).resolve().parent
    if imported != (REPO / "donate_backend").resolve():
        # e.g. PYTHONPATH pointing at another copy: this repository's commit says nothing
        state["commit"] = f"{imported} (not this repository's donate_backend)"
        state["donate_backend_uncommitted_changes"] = False
    log(f"donate_xla at {state['commit']}"
        + (" (+ uncommitted changes in donate_backend/)" if state["donate_backend_uncommitted_changes"] else ""))
    log(f"donate_backend imported from {Path(versions['donate_backend']).parent}")
    log(f"torch {versions['torch']}, torch_xla {versions['torch_xla']}, "
        f"torchvision {versions['torchvision']}, PJRT_DEVICE={env['PJRT_DEVICE']}")

    if args.keep:
        base = Path(args.keep).resolve()
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)
        cleanup = False
    else:
        base = Path(tempfile.mkdtemp(prefix="peer_tests."))
        cleanup = True

    t0 = time.monotonic()
    meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
            "repo": state, "versions": versions, "xla_src": args.xla_src, "tag": args.tag,
            "files": args.files, "selected": args.test, "timeout_s": args.timeout,
            "pjrt_device": env["PJRT_DEVICE"], "backends_run": backends,
            "baseline": args.baseline}
    runs: dict[str, dict[str, dict]] = {}
    try:
        trees = {}
        for b in backends:
            trees[b] = prepare_tree(args.xla_src, args.tag, base, b, args.files)
            if b != "openxla":
                log(f"{b}: backend name replaced " +
                    ", ".join(f"{n}: {k}x" for n, k in trees[b]["replaced"].items()))
        if trees:
            meta["source"] = next(iter(trees.values()))["origin"]
            meta["replacements"] = {b: t["replaced"] for b, t in trees.items()}
        logdir = base / "logs"
        logdir.mkdir(exist_ok=True)
        # One file at a time, openxla then donate_xla, each in a fresh process.
        for name in args.files:
            runs[name] = {}
            for b in backends:
                runs[name][b] = run_file(args.python, trees[b]["tree"], name, b, env,
                                         args.timeout, logdir, args.test or None, log)
    finally:
        if cleanup:
            shutil.rmtree(base, ignore_errors=True)
        else:
            log(f"trees and logs kept in {base}")
    meta["seconds"] = round(time.monotonic() - t0, 1)

    # Merge into rows.
    rows = []
    for name in args.files:
        per_backend = {b: runs[name][b]["tests"] for b in backends}
        if baseline is not None:
            per_backend["openxla"] = {
                tid.split("::", 1)[1]: t["openxla"] for tid, t in baseline["tests"].items()
                if tid.split("::", 1)[0] == name and t.get("openxla") is not None
                and (not args.test or tid.split("::", 1)[1] in set().union(
                    *(per_backend[b].keys() for b in backends)))}
        names = []
        for b in shown:
            for t in per_backend.get(b, {}):
                if t not in names:
                    names.append(t)
        for t in names:
            row = {"id": f"{name}::{t}", "file": name, "test": t}
            for b in shown:
                row[b] = per_backend.get(b, {}).get(t)
            o = classify((row.get("openxla") or {}).get("outcome"))
            d = classify((row.get("donate_xla") or {}).get("outcome"))
            row["regression"] = ("openxla" in shown and "donate_xla" in shown
                                 and o == "pass" and d in ("fail", "absent"))
            row["expected"] = EXPECTED.get(row["id"])
            rows.append(row)

    table_rows = rows
    if args.failures_only:
        table_rows = [r for r in rows
                      if any(classify((r.get(b) or {}).get("outcome")) != "pass" for b in shown)]
    print()
    print_table(table_rows, shown)

    regressions = [r for r in rows if r["regression"]]
    unexpected = [r for r in regressions if r["id"] not in EXPECTED]
    fixed = [tid for tid in EXPECTED
             if any(r["id"] == tid and not r["regression"] for r in rows)]
    print()
    for b in shown:
        counts: dict[str, int] = {}
        for r in rows:
            k = (r.get(b) or {}).get("outcome", "absent")
            counts[k] = counts.get(k, 0) + 1
        print(f"{b:<11} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if "openxla" in shown and "donate_xla" in shown:
        print(f"regressions (pass under openxla, fail under donate_xla): {len(regressions)}, "
              f"of them listed in EXPECTED: {len(regressions) - len(unexpected)}")
        for tid in fixed:
            print(f"  note: {tid} is in EXPECTED but no longer fails: remove it")
    elif "donate_xla" in shown:
        failing = [r for r in rows if classify((r.get("donate_xla") or {}).get("outcome")) == "fail"
                   and r["id"] not in EXPECTED]
        print(f"no openxla outcomes to compare with: {len(failing)} unlisted donate_xla failures")
        unexpected = failing
    print(f"donate_xla at {state['commit']}"
          + (" + uncommitted changes" if state["donate_backend_uncommitted_changes"] else "")
          + f"; {meta['seconds']:.0f} s")

    if args.json:
        doc = {"meta": meta,
               "runs": {n: {b: {k: v for k, v in r.items() if k != "tests"}
                            for b, r in runs[n].items()} for n in runs},
               "tests": {r["id"]: {k: r[k] for k in ("file", "test", "regression", "expected")}
                         | {b: r.get(b) for b in shown} for r in rows}}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
