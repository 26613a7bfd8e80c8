"""Exceptions raised by donate_xla. Every message names the graph and says what to do."""


class DonateXlaError(RuntimeError):
    """Base class for errors raised by the donate_xla backend."""


class UnsupportedGraphError(DonateXlaError):
    """The graph uses an op or feature the backend cannot compile."""
