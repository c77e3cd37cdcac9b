"""The one place that decides whether staging bytes a seal describes may be
reused (issue 23): :class:`SealKeeper`.

A seal (ring.py, seals.py) names bytes of a pool file in /dev/shm. Written
without CRCs (the trainer's copy is not read a second time: issue 16), it
is trusted as it is by recovery -- so while it exists, the bytes it names
must stay exactly as they were. Every path of this process that frees
staging memory a sealed step used asks the keeper first, and reuses it only
on a yes: the commit loop with or without the capture helper
(crashsafe.py), the flight recorder's slots (tier.py), failed steps,
pool growth and close. The answer, for one step:

* its seal removed (the step is committed, or given up): yes;
* else its seal rewritten with the CRC-32C of every chunk's bytes: yes --
  recovery checks each CRC and skips a step whose bytes changed;
* else: no, never (the step's bytes are *pinned*). The first pin retires
  the ring for sealing: later steps are not sealed (they are not
  crash-safe, said once), so what stays reserved is bounded by what was
  sealed then; the caller stages later steps elsewhere.

``recoverable`` chooses the order: a step the next Capture should still
commit (the helper failed it) is rewritten with CRCs first, a step that is
committed or dropped (memory-only, evicted) is removed first -- the
common, cheap path: one unlink.

A pool file is removed only once no seal names it (:meth:`drop_pool`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dstt.capture.ring import Ring, RingError, ring_advice

log = logging.getLogger("dstt.capture")


class SealKeeper:
    """The seals this process wrote in its ring, and whether their bytes may
    be reused (see the module docstring). Thread-safe.

    >>> import tempfile
    >>> from pathlib import Path
    >>> ring = Ring({"store": "s", "branch": "main", "branch_id": 0, "branch_created": 0.0},
    ...             base=Path(tempfile.mkdtemp()))
    >>> keeper = SealKeeper(ring)
    >>> keeper.settle(7, recoverable=False, checked=None)  # never sealed here: nothing to keep
    True
    >>> keeper.pinned_steps(), keeper.broken
    ([], None)
    >>> ring.close()
    """

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._lock = threading.Lock()
        #: step -> (pool file, whether the seal on disk has CRCs), for every
        #: seal this process wrote and has not removed.
        self._seals: dict[int, tuple[str, bool]] = {}
        #: step -> whether it is committed, for seals whose bytes stay reserved for good.
        self._pinned: dict[int, bool] = {}
        self._kept: set[int] = set()  # steps kept for the next Capture (keep)
        self._dropped: set[str] = set()  # pool files to remove once no seal names them
        #: Why sealing stopped (a seal could be neither removed nor rewritten); None while it works.
        self.broken: str | None = None

    # ------------------------------------------------------------------ sealing

    def seal(self, record: dict[str, Any], *, checked: bool = False) -> None:
        """Write ``record`` as its step's seal (``checked``: it has CRCs).
        Raises RingError (ring.py) if it cannot be written, RuntimeError
        once the ring is retired (:attr:`broken`)."""
        if self.broken is not None:
            raise RuntimeError(f"the staging ring is retired ({self.broken})")
        self.ring.seal(record)
        with self._lock:
            self._seals[int(record["step"])] = (str(record["pool"]), checked)

    def removed(self, step: int) -> None:
        """``step``'s seal was removed by someone else (the capture helper
        after committing it): its bytes may be reused."""
        with self._lock:
            self._forget(step)

    # ------------------------------------------------------------------ the decision

    def settle(self, step: int, *, recoverable: bool, checked: Callable[[], dict[str, Any]] | None) -> bool:
        """Whether the bytes ``step``'s seal names may be reused now (True
        for a step this process never sealed). ``recoverable``: keep the
        step for the next Capture if possible (rewrite its seal with CRCs
        first, remove it only if that fails); else remove it first.
        ``checked`` builds its seal with CRCs (None: it cannot be)."""
        with self._lock:
            known = self._seals.get(step)
            pinned = step in self._pinned
        if known is None:
            return True
        if pinned:
            return False
        if known[1]:  # already checked by CRC: recovery skips it once the bytes change
            return True
        errors: list[Exception] = []
        for attempt in ((self._rewrite, self._remove) if recoverable else (self._remove, self._rewrite)):
            try:
                attempt(step, checked)
                return True
            except Exception as e:  # noqa: BLE001 - the next attempt, or the step is pinned
                errors.append(e)
        why = "; ".join(getattr(e, "brief", str(e)) for e in errors)
        advice = next((ring_advice(e.errno) for e in errors if isinstance(e, RingError)), None)
        self._pin(step, committed=not recoverable, why=why if advice is None else f"{why} ({advice})")
        return False

    def keep(self, step: int) -> None:
        """Keep ``step``'s bytes reserved for good (its seal stays as it is,
        for the next Capture: the capture helper that was to commit it is
        gone, under torch.distributed)."""
        with self._lock:
            if step in self._seals:
                self._pinned[step] = False
                self._kept.add(step)

    def _remove(self, step: int, checked: Callable[[], dict[str, Any]] | None) -> None:
        self.ring.unseal(step, strict=True)
        drop = None
        with self._lock:
            pool = self._forget(step)
            if pool in self._dropped and not any(p == pool for p, _ in self._seals.values()):
                self._dropped.discard(pool)
                drop = pool
        if drop is not None:
            self.ring.drop_pool(drop)

    def _rewrite(self, step: int, checked: Callable[[], dict[str, Any]] | None) -> None:
        if checked is None:
            raise RuntimeError("no record with CRCs can be made for it")
        record = checked()
        self.ring.seal(record)
        with self._lock:
            self._seals[step] = (str(record["pool"]), True)

    def _forget(self, step: int) -> str | None:
        """(under the lock)"""
        pool = self._seals.pop(step, (None, False))[0]
        self._pinned.pop(step, None)
        self._kept.discard(step)
        return pool

    def _pin(self, step: int, *, committed: bool, why: str) -> None:
        with self._lock:
            self._pinned[step] = committed
            first = self.broken is None
            if first:
                self.broken = f"the seal of step {step} could be neither removed nor rewritten with CRCs: {why}"
        log.error("dstt: the seal of step %d in %s could be neither removed nor rewritten with CRCs (%s): the staging "
                  "bytes it describes stay reserved for good%s", step, self.ring.dir, why,
                  "; from now on steps are not sealed (they do not survive the trainer) and are staged elsewhere"
                  if first else "")

    # ------------------------------------------------------------------ pools and the ring

    def drop_pool(self, name: str) -> None:
        """The Capture no longer stages in pool file ``name``: remove it once
        no seal names it. Seals with CRCs naming it (steps that failed) go
        first: their bytes were being reused anyway."""
        with self._lock:
            checked = [s for s, (p, crc) in self._seals.items() if p == name and crc and s not in self._pinned]
        for step in checked:
            try:
                self.ring.unseal(step, strict=True)
                with self._lock:
                    self._forget(step)
            except OSError as e:
                log.warning("dstt: could not remove the seal of failed step %d (%s)", step, e)
        with self._lock:
            if any(p == name for p, _ in self._seals.values()):
                self._dropped.add(name)
                return
        self.ring.drop_pool(name)

    def pinned_steps(self) -> list[int]:
        """Steps whose bytes stay reserved for good."""
        with self._lock:
            return sorted(self._pinned)

    def keeps_uncommitted(self) -> list[int]:
        """Steps not committed whose seal must outlive this Capture (the
        ring is then left for the next Capture or ``dstt gc``): those
        :meth:`keep` kept. (A step that failed and was reported is given up
        with the ring at close, its bytes kept or not, as any failed step.)"""
        with self._lock:
            return sorted(self._kept)


__all__ = ["SealKeeper"]
