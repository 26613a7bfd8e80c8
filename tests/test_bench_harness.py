"""The benchmark harness's run order (bench/xla_common.py): no device needed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import xla_common  # noqa: E402


def test_repeats_warm_up_then_alternate_which_backend_runs_first(monkeypatch):
    order = []

    def fake_worker(script, flag, model, backend, *extra, env=None):
        order.append(backend)
        return {"n": len(order)}

    monkeypatch.setattr(xla_common, "run_worker", fake_worker)
    runs = xla_common.run_repeated("s.py", "mlp", ("a", "b"), 3, warm_up=True, alternate=True)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert runs == {"a": [{"n": 3}, {"n": 6}, {"n": 7}], "b": [{"n": 4}, {"n": 5}, {"n": 8}]}  # warm-up dropped
    order.clear()
    xla_common.run_repeated("s.py", "mlp", ("a", "b"), 2)
    assert order == ["a", "b", "a", "b"]
