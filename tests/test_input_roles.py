"""Input roles from dynamo's source names (``analysis.mutation.input_role``): what the
graph reports and the memory plan call parameters, optimizer state and other inputs."""
import torch

from donate_backend.analysis import mutation


def _roles_of(fn, *args) -> list:
    """The roles of every graph dynamo hands a backend while compiling ``fn(*args)``."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(mutation.dynamo_input_roles(gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    torch._dynamo.reset()
    return seen


def test_an_input_named_hidden_states_is_not_optimizer_state():
    """HF models pass ``hidden_states`` from graph to graph when a forward breaks; the
    name contains "state" but it is an activation of the step, not state held between
    steps (the plan counted it as resident optimizer state, and its gradient as one
    the backward keeps instead of one it passes on)."""
    layer = torch.nn.Linear(8, 8)

    def block(hidden_states, current_state):
        return layer(hidden_states) + current_state

    (roles,) = _roles_of(block, torch.randn(2, 8), torch.randn(2, 8))
    assert sorted(roles) == ["other", "other", "parameter", "parameter"], roles


def test_an_optimizers_state_is_optimizer_state():
    model = torch.nn.Linear(8, 8)
    model(torch.randn(2, 8)).sum().backward()
    adam = torch.optim.AdamW(model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam.step()  # the state exists before the compiled steps read it
    sgd.step()

    def both():
        adam.step()
        sgd.step()

    roles = [role for graph in _roles_of(both) for role in graph]
    # per parameter: AdamW's step, exp_avg and exp_avg_sq, SGD's momentum buffer
    assert roles.count("optimizer_state") == 2 * 4, roles
    assert roles.count("gradient") >= 2 and "other" not in roles, roles
