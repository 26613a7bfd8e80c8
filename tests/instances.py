"""``instances_of(cls)``: the objects of a class made while a test runs."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def instances_of(cls):
    """Every instance of ``cls`` made inside the block, in order (its ``__init__`` wrapped)."""
    made = []
    init = cls.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    cls.__init__ = recording_init
    try:
        yield made
    finally:
        cls.__init__ = init
