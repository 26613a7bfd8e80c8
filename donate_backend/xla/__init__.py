"""XLA path (placeholder; filled in by the foundation issue)."""


def aot_options() -> dict:
    return {}


def compile_graph(gm, example_inputs, ctx):
    raise NotImplementedError("XLA path not built yet")
