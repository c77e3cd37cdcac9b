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

Memory: one step's worth (two while a step waits for its predecessor's
flush: :data:`PrevValues.KEEP`), and at most ``budget`` bytes (default: a quarter of the physical
memory, as the capture helper's predictor; ``DSTT_UPDATE_STATS_BYTES``):
beyond it, chunks get no copy and their next update statistics are NaN.

>>> import torch
>>> from dstt.format.codecs.keyframes import Link
>>> held = PrevValues(1 << 20)
>>> a = Link(None); b = Link(a)
>>> held.keep(("w", 0), a, 1, torch.tensor([1.0, 2.0]))
>>> held.take(("w", 0), b), held.take(("w", 0), a)
(tensor([1., 2.]), None)
>>> held.keep(("w", 0), b, 2, torch.tensor([1.0, 4.0]), settled=False)  # flushed before a
>>> held.update_sumsq(("w", 0), b), held.held
(4.0, 16)
>>> held.settle(("w", 0), 2); held.held  # b's update is done: a's values go
8
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
    """Per chunk, the values of the two latest steps flushed, each with the
    link of that step's chunk (module docstring). Two, not one: a step whose
    chunk is flushed before its predecessor's started finds the predecessor
    later (:meth:`update_sumsq`, once that link resolves). Thread-safe."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held = 0
        self._lock = threading.Lock()
        #: key -> [(that step's link, step, values), ...], newest last, at most KEEP
        self._by_key: dict[Key, list[tuple[Any, int, torch.Tensor]]] = {}

    #: Steps held per chunk.
    KEEP = 2

    def _find(self, key: Key, link: Any) -> torch.Tensor | None:
        with self._lock:
            for held, _, values in self._by_key.get(key, ()):
                if held is link:
                    return values
        return None

    def take(self, key: Key, link: Any) -> torch.Tensor | None:
        """The values of ``key`` at the step ``link`` follows, or None."""
        prev = getattr(link, "prev", None)
        return None if prev is None else self._find(key, prev)

    def update_sumsq(self, key: Key, link: Any) -> float | None:
        """Σ (x − prev)² of ``key`` between the step of ``link`` and the one
        it follows, where both are held (None otherwise)."""
        from dstt.store.stats import update_sumsq

        prev = getattr(link, "prev", None)
        cur = self._find(key, link)
        before = None if prev is None or cur is None else self._find(key, prev)
        return None if cur is None or before is None else update_sumsq(cur, before)

    def keep(self, key: Key, link: Any, step: int, values: torch.Tensor, *, settled: bool = True) -> None:
        """Hold ``values`` (a CPU tensor this object owns: the caller's copy,
        or a view of one) as ``key`` at ``step`` (its chunk's ``link``); the
        oldest of more than :data:`KEEP` steps goes. ``settled``: this
        step's update is computed (or cannot be), so earlier steps' values
        go now -- one step's worth held, not two. Over the budget: not held."""
        n = values.nbytes
        with self._lock:
            have = self._by_key.setdefault(key, [])
            if self._held + n <= self.budget:
                have.append((link, step, values))
                have.sort(key=lambda e: e[1])
                self._held += n
            self._drop(have, step if settled else None)

    def settle(self, key: Key, step: int) -> None:
        """``step``'s update is computed: the values of earlier steps go."""
        with self._lock:
            self._drop(self._by_key.get(key, []), step)

    def _drop(self, have: list[tuple[Any, int, torch.Tensor]], before: int | None) -> None:
        while have and (len(have) > self.KEEP or (before is not None and have[0][1] < before)):
            self._held -= have.pop(0)[2].nbytes

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit (before copying a group)."""
        with self._lock:
            return self._held + nbytes <= self.budget

    @property
    def held(self) -> int:
        with self._lock:
            return self._held
