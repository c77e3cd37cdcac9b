"""The mutation guard: a lazily copied tensor changed before its copy.

Lazy copies read the optimizer's parameters and state after ``snapshot()``
returned; the optimizer step pre-hook keeps ``optimizer.step()`` behind
them. A change made anywhere else (weight clipping in place, EMA into the
live weights, ``load_state_dict``) without ``wait_staged()`` would be
stored silently. PyTorch bumps a tensor's version counter (``t._version``,
shared by every view of one storage) after each in-place operation, so:

* ``snapshot()`` records the version of every lazy chunk's source;
* on CPU the stager compares it again right after the chunk's copy
  completed, on CUDA right when the copy is issued (the copy stream then
  runs behind the compute stream's state at ``snapshot()``);
* the trainer's next dstt call also scans the chunks not copied yet
  (:meth:`VersionGuard.scan`): a changed version there is a change that
  completed before the copy did.

A changed version fails the step (never committed) with a
:class:`dstt.CaptureError` naming the tensor and ``wait_staged()``.

Limits (docs/capture.md): a version is bumped when an in-place operation
*finishes*, so a CPU mutation still running at the instant the copy
completes is seen only if it finished before the next check; and an
inference-mode tensor has no version counter, so it is not guarded.

>>> import torch
>>> w = torch.zeros(3)
>>> g = VersionGuard([w])
>>> g.copied(0)
>>> w2 = torch.zeros(3); g2 = VersionGuard([w2]); _ = w2.add_(1)
>>> g2.copied(0) is not None
True
"""

from __future__ import annotations

import itertools
import operator
import threading
from typing import Any

#: What the trainer is told to do, in every guard error.
ADVICE = ("it was changed in place after snapshot() and before its lazy copy ran (call "
          "cap.wait_staged() before changing captured tensors outside optimizer.step())")


def version_of(t: Any) -> int | None:
    """``t._version``, or None where the tensor has no version counter."""
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):  # inference tensors track no version
        return None


_VERSION = operator.attrgetter("_version")


class VersionGuard:
    """Versions of one step's lazy sources, checked as their copies land.

    Thread-safe: the stager calls :meth:`copied`, the trainer :meth:`scan`.
    ``names`` (default ``#i``) name the tensors in the error.
    """

    def __init__(self, sources: list[Any], names: list[str] | None = None) -> None:
        self._sources = list(sources)
        self._names = names or [f"#{i}" for i in range(len(sources))]
        try:  # (one C-level pass: tens of thousands of sources per step, issue 16)
            self._versions: list[int | None] = list(map(_VERSION, self._sources))
        except (RuntimeError, AttributeError):  # an inference tensor: no version counter
            self._versions = [version_of(t) for t in self._sources]
        self._done = [False] * len(self._sources)
        self._lock = threading.Lock()
        self.violation: str | None = None

    def _changed(self, i: int) -> bool:
        v = self._versions[i]
        return v is not None and version_of(self._sources[i]) != v

    def _trip(self, i: int) -> str:
        if self.violation is None:
            self.violation = f"tensor {self._names[i]!r}: {ADVICE}"
        return self.violation

    def copied(self, i: int) -> str | None:
        """Called when source ``i``'s copy completed (CPU) or was issued
        (CUDA): the violation, if its version moved since ``snapshot()``."""
        with self._lock:
            self._done[i] = True
            if self._changed(i):
                return self._trip(i)
            return None

    def copied_range(self, i: int, j: int) -> str | None:
        """:meth:`copied` for sources ``i..j-1`` (one copy call), under one
        lock and with one pass over their versions."""
        with self._lock:
            self._done[i:j] = [True] * (j - i)
            try:
                if list(map(_VERSION, self._sources[i:j])) == self._versions[i:j]:
                    return None
            except (RuntimeError, AttributeError):  # an inference tensor: compared one by one
                pass
            for k in range(i, j):
                if self._changed(k):
                    return self._trip(k)
            return None

    def scan(self) -> str | None:
        """Check every source not copied yet (the trainer's next call): one
        C-level pass over their versions (the trainer's own thread, at the
        end of every snapshot(): a thousand lazy sources were ~1 ms of
        Python per step, issue 25), one by one only where one moved or has
        no version counter."""
        with self._lock:
            pending = list(itertools.compress(itertools.count(), map(operator.not_, self._done)))
            try:
                if list(map(_VERSION, map(self._sources.__getitem__, pending))) == \
                        list(map(self._versions.__getitem__, pending)):
                    return self.violation
            except (RuntimeError, AttributeError):  # an inference tensor: compared one by one
                pass
            for i, done in enumerate(self._done):
                if not done and self._changed(i):
                    return self._trip(i)
            return self.violation

    def release(self) -> None:
        """Forget the sources (the step is staged: no more checks)."""
        with self._lock:
            self._done = [True] * len(self._sources)
            self._sources = [None] * len(self._sources)
