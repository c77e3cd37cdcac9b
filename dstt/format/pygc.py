"""Pause Python's cyclic garbage collector while a bulk of objects is built
(torch-free base helper).

Parsing or writing a step index of 100,000 tensors allocates millions of
containers; each allocation burst triggers collections that walk every
live object (the whole state included), which doubled the time of an index
parse at 20,000 tensors (issue 16). Those objects form no cycles, so the
collector has nothing to find there: it runs again once the block exits.

>>> import gc
>>> with paused_gc():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the block, re-enabling it after only
    if it was enabled before (so a caller's ``gc.disable()`` is kept; with
    threads racing here it may be left enabled, never left disabled)."""
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
