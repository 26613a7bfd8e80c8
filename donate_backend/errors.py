"""Exceptions raised by donate_xla. Every message names the graph and says what to do.

The text of each ends with where docs/troubleshooting.md lists it, with its causes and fixes:
the section a subclass names in ``help_section``, or the one given where it is raised.
"""
from __future__ import annotations

from typing import Optional

TROUBLESHOOTING = "docs/troubleshooting.md"


class DonateXlaError(RuntimeError):
    """Base class for errors raised by the donate_xla backend."""

    help_section: Optional[str] = None  # the section of docs/troubleshooting.md that lists it

    def __init__(self, *args, help_section: Optional[str] = None):
        super().__init__(*args)
        if help_section is not None:
            self.help_section = help_section

    def __str__(self) -> str:
        where = TROUBLESHOOTING + (f', "{self.help_section}"' if self.help_section else "")
        return f"{super().__str__()}\n(causes and fixes: {where})"


class UnsupportedGraphError(DonateXlaError):
    """The graph uses an op or feature the backend cannot compile."""

    help_section = "Refused before anything runs"
