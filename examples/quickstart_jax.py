"""The quickstart's model on the JAX target: XLA from current torch, without torch_xla.

Run with `make demo` (in .venv-newest: the newest torch with jax). The model and batch live
on donate_backend.jax_device(); donate_xla lowers each graph to a JAX function, compiles it
from shapes alone and donates the buffers it overwrites. It prints the loss of each step, one
row per compiled graph, and the StableHLO signature of the optimizer's step, where each
donated input says which output XLA writes over it (tf.aliasing_output).
"""
import re

import donate_backend

device = donate_backend.jax_device()  # first: before the process runs any backward

from quickstart import train  # noqa: E402


def main() -> None:
    train(device)
    update = [r for r in donate_backend.reports() if r.kind == "inference"][-1]
    signature = re.search(r"func\.func public @main\((.*?)\) ->", update.lowered.lowered.stablehlo(), re.S).group(1)
    donated = [a for a in re.split(r",\s*(?=%arg)", signature) if "tf.aliasing_output" in a]
    print(f"\nthe optimizer's step donates {len(donated)} of its inputs, e.g.:")
    for argument in donated[:3]:
        print("  " + re.sub(r"\{.*?(tf\.aliasing_output = \d+).*\}", r"{\1}", re.sub(r"\s+", " ", argument)))


if __name__ == "__main__":
    main()
