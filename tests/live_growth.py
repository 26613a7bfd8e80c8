"""The live bytes a compiled training step needs on top of its state, measured in a
fresh process (XLA:CPU, ``MALLOC_MMAP_THRESHOLD_=65536``: every buffer of 64 KiB or more
is its own mapping, so RSS follows the live bytes; docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, threading, time, torch, torch_xla, torch_xla.core.xla_model as xm
    import donate_backend

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    torch.manual_seed(0)
    dev = torch_xla.device()
    layers = []
    for _ in range({depth}):
        layers += [torch.nn.Linear({width}, {width}, bias={bias}), torch.nn.{activation}()]
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum={momentum})
    x = torch.randn({batch}, {width}).to(dev)

    @torch.compile(backend="donate_xla")
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):
        step(x); torch_xla.sync(); xm.wait_device_ops()
    plan = donate_backend.memory_plan()
    samples, stop = [], threading.Event()
    def sample():
        while not stop.is_set():
            samples.append(rss()); time.sleep(0.002)
    thread = threading.Thread(target=sample); thread.start()
    for _ in range(4):
        step(x); torch_xla.sync(); xm.wait_device_ops()
    stop.set(); thread.join()
    split = [r.backward_segments for r in donate_backend.reports() if r.backward_segments]
    print(json.dumps({{"growth": max(samples) - min(samples), "segments": split,
                      "predicted": plan.growth_bytes, "resident": plan.resident_bytes,
                      "state": sum(t.numel() * t.element_size() for t in [*model.parameters(), x]
                                   + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()])}}))
    """
)


def live_growth(env: dict, *, depth: int, width: int, batch: int, activation: str = "ReLU",
                bias: bool = True, momentum: float = 0.0) -> dict:
    """``depth`` x (Linear(width) + activation), SGD, a squared-mean loss, the whole step
    compiled; 4 steps after 3 warm-up ones. Returns ``growth`` (peak - trough RSS, bytes),
    ``segments`` (the backward segment counts the records report), ``predicted`` and
    ``resident`` (the memory plan's growth and resident bytes, taken before the measured
    steps) and ``state`` (the bytes of parameters, optimizer state and batch), run under ``env``
    (the switches) on top of this process's environment."""
    script = _SCRIPT.format(depth=depth, width=width, batch=batch, activation=activation, bias=bias, momentum=momentum)
    full_env = dict(os.environ, PJRT_DEVICE="CPU", MALLOC_MMAP_THRESHOLD_="65536", **env)
    out = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
