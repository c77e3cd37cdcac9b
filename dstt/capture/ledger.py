"""The pipeline's bookkeeping and its one lock (:class:`Ledger`).

One object of a :class:`dstt.Capture` owns what its threads count and
wait for together: the steps queued and not yet settled (``pending``,
``queued_steps``), the lazy bytes queued for staging (``queued_bytes``),
the failures not yet reported to the trainer (``errors``), the commit
counters and the latest commits, and the *progress* count every bounded
wait watches. All of it is guarded by :attr:`Ledger.cond`, the pipeline's
one lock (the memory tier and the NaN/Inf watcher keep their state under
it too).

Phase protocol (who calls what, on which thread):

1. the trainer, in ``snapshot()``: :meth:`Ledger.queued` once per queued
   step (skipped ones included), before handing it to the stager or the
   committer;
2. the stager and flush threads: ``queued_bytes`` decreases as lazy
   copies land (under ``cond``); :meth:`Ledger.bump` after each staged
   step or written chunk;
3. the committer thread: :meth:`Ledger.committed` for a stored step, then
   :meth:`Ledger.settled` for every step, stored, skipped or failed;
4. any thread: :meth:`Ledger.fail` queues a failure, which the trainer's
   next call raises (:meth:`Ledger.take_errors`);
5. the trainer's waits (``wait``, ``close``, backpressure, the optimizer
   hook...): :meth:`Ledger.wait` and its variants, bounded by
   ``background_timeout_s`` without progress (capture/waits.py).

>>> led = Ledger(branch=lambda: "main", limit_s=1.0)
>>> led.queued(3)
>>> led.pending, led.pending_text()
(1, "1 queued step(s) (3) to be committed on branch 'main'")
>>> led.settled(3); led.pending
0
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dstt.capture.waits import POLL_S, until
from dstt.errors import CaptureError

if TYPE_CHECKING:
    from dstt.format.commit import CommitInfo

log = logging.getLogger("dstt.capture")

#: Commits kept for :attr:`dstt.Capture.committed` (the counters count them all).
RECENT_COMMITS = 1024
#: The trainer's waits give up this much later than the committer's wait on
#: the helper, so the helper's own bound (which names and kills it) fires first.
GRACE_S = 4 * POLL_S


class Ledger:
    """The counts, queued steps, failures and progress of one Capture's
    pipeline, under one lock (:attr:`cond`); the bounded waits on them.

    ``branch()`` names the branch being captured (a rewind changes it);
    ``limit_s`` is ``background_timeout_s``."""

    def __init__(self, *, branch: Callable[[], str], limit_s: float) -> None:
        self.cond = threading.Condition()
        self.pending = 0  # steps queued and not yet settled (committed, skipped or failed)
        self.queued_steps: set[int] = set()  # their numbers (skipped steps not included)
        self.queued_bytes = 0  # lazy bytes queued for staging, not yet allocated
        self.errors: list[CaptureError] = []  # failures not yet raised to the trainer
        self.recent: collections.deque[CommitInfo] = collections.deque(maxlen=RECENT_COMMITS)
        self.n_committed = 0
        self.bytes_written = 0
        self.last_commit: CommitInfo | None = None
        self.progress = 0  # bumped by everything that finishes in the background (see bump)
        self._branch = branch
        self._limit_s = limit_s

    # ------------------------------------------------------------ counting

    def queued(self, step: int | None, lazy_bytes: int = 0) -> None:
        """A step entered the pipeline (``step`` None: a skipped one, not named in the queue)."""
        with self.cond:
            self.pending += 1
            if step is not None:
                self.queued_steps.add(step)
            self.queued_bytes += lazy_bytes

    def committed(self, info: CommitInfo) -> None:
        """A step is durable: count it (under :attr:`cond`, taken here)."""
        with self.cond:
            self.recent.append(info)
            self.n_committed += 1
            self.bytes_written += info.bytes_written
            self.last_commit = info

    def settled(self, step: int) -> None:
        """A step left the pipeline (committed, skipped or failed): wake the waits."""
        with self.cond:
            self.pending -= 1
            self.queued_steps.discard(step)
            self.cond.notify_all()
        self.bump()

    def commits(self) -> list[CommitInfo]:
        """The latest commits (at most :data:`RECENT_COMMITS`)."""
        with self.cond:
            return list(self.recent)

    # ------------------------------------------------------------ failures

    def fail(self, step: int, e: BaseException) -> None:
        """Queue the failure of ``step`` for the trainer (logged now)."""
        err = e if isinstance(e, CaptureError) and f"step {step}" in str(e) else None
        if err is None:
            err = CaptureError(f"capturing step {step} on branch {self._branch()!r} failed: "
                               f"{type(e).__name__}: {e}")
            err.__cause__ = e
        log.error("%s", err)
        with self.cond:
            self.errors.append(err)

    def take_errors(self) -> list[CaptureError]:
        """The failures not yet reported, now reported."""
        with self.cond:
            errors, self.errors = self.errors, []
        return errors

    # ------------------------------------------------------------ bounded waits

    def bump(self) -> None:
        """Something in the background finished: every bounded wait restarts its clock."""
        self.progress += 1

    def wait(self, done: Callable[[float], bool], what: str | Callable[[], str]) -> None:
        """Wait until ``done(t)`` (waiting at most ``t`` s) says so, while the
        capture makes progress; Stalled (a CaptureError) after
        ``background_timeout_s`` (+ :data:`GRACE_S`) without any."""
        until(done, limit_s=self._limit_s + GRACE_S, what=what, progress=lambda: self.progress)

    def wait_event(self, event: threading.Event, what: str | Callable[[], str]) -> None:
        if not event.is_set():
            self.wait(event.wait, what)

    def wait_cond(self, predicate: Callable[[], Any], what: str | Callable[[], str]) -> None:
        """:meth:`wait` for ``predicate`` on :attr:`cond` (held by the caller)."""
        if not predicate():
            self.wait(lambda t: self.cond.wait_for(predicate, t), what)

    def wait_thread(self, thread: threading.Thread | None, what: str) -> None:
        if thread is not None and thread.is_alive():
            self.wait(lambda t: _joined(thread, t), what)

    def pending_text(self) -> str:
        steps = sorted(self.queued_steps)
        return f"{len(steps)} queued step(s) ({steps_text(steps)}) to be committed on branch {self._branch()!r}"


def _joined(thread: threading.Thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


def steps_text(steps: list[int]) -> str:
    """Step numbers for a message (the first 20)."""
    return ", ".join(map(str, steps[:20])) + (f" ... ({len(steps)} in all)" if len(steps) > 20 else "")


__all__ = ["GRACE_S", "RECENT_COMMITS", "Ledger", "steps_text"]
