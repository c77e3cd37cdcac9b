"""The previous stored step's chunk values, for the update statistics of a
capture with no memory tier (issue 29).

``update_norm``/``update_ratio`` (:mod:`dstt.store.stats`) need the same
chunk at the previous step. The memory tier has it in its ring and hands it
to the flush (``prev_staged``); every other capture (in-process, the capture
helper, ``torch.distributed`` ranks) flushes each chunk in the background
and keeps here a copy of what it flushed, taken by the same chunk of the
next step. The copy is made on the flush thread (no trainer stall) and held
for one step only.

Correct by construction: a chunk's values are used only by the step whose
link (:class:`dstt.format.codecs.keyframes.Link`) names them as its
predecessor, i.e. the previous step this writer planned. A step flushed out
of order, a chunk of a step that failed, or a copy over the budget gives
NaN, never an update against the wrong step.

Memory: at most ``budget`` bytes (default: a quarter of the physical
memory, as the capture helper's predictor; ``DSTT_UPDATE_STATS_BYTES``):
beyond it, chunks get no copy and their next update statistics are NaN.

>>> import torch
>>> from dstt.format.codecs.keyframes import Link
>>> held = PrevValues(1 << 20)
>>> a = Link(None); b = Link(a)
>>> held.keep(("w", 0), a, 1, torch.tensor([1.0, 2.0]))
>>> held.take(("w", 0), b), held.take(("w", 0), a)
(tensor([1., 2.]), None)
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

#: The key of a chunk: (array, chunk index).
Key = tuple[str, int]


def default_budget() -> int:
    """Bytes the copies may hold: ``DSTT_UPDATE_STATS_BYTES``, else a quarter
    of physical memory (1 GiB where it cannot be read)."""
    from dstt import knobs

    told = knobs.update_stats_bytes()
    if told is not None:
        return told
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class PrevValues:
    """Per chunk, the values of the latest step flushed and the link of that
    step's chunk (module docstring). Thread-safe."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held = 0
        self._lock = threading.Lock()
        #: key -> (that step's link, step, values, bytes charged)
        self._by_key: dict[Key, tuple[Any, int, torch.Tensor, int]] = {}

    def take(self, key: Key, link: Any) -> torch.Tensor | None:
        """The values of ``key`` at the step ``link`` follows, or None."""
        prev = getattr(link, "prev", None)
        if prev is None:
            return None
        with self._lock:
            got = self._by_key.get(key)
        return got[2] if got is not None and got[0] is prev else None

    def keep(self, key: Key, link: Any, step: int, values: torch.Tensor) -> None:
        """Hold ``values`` (a CPU tensor this object owns: the caller's copy,
        or a view of one) as ``key`` at ``step`` (its chunk's ``link``),
        replacing an earlier step's; a later step's is kept instead."""
        n = values.nbytes
        with self._lock:
            old = self._by_key.get(key)
            if old is not None and old[1] > step:
                return
            freed = 0 if old is None else old[3]
            if self._held - freed + n > self.budget:
                if old is not None:  # (stale now: the step after it is not held)
                    del self._by_key[key]
                    self._held -= freed
                return
            self._by_key[key] = (link, step, values, n)
            self._held += n - freed

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit (before copying a group)."""
        with self._lock:
            return self._held + nbytes <= self.budget

    @property
    def held(self) -> int:
        with self._lock:
            return self._held
