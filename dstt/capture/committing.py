"""The committer side of :class:`dstt.Capture`: every planned step, in
order, committed (in this process, or by the capture helper) or failed, and
the trainer's counters and pending count settled. A mixin: the state lives
on the Capture (``writer``, ``_commit_q``, ``_cond``, ``_helper``...).

With the capture helper (single process), commits are pipelined: the
stager hands each step to the helper as soon as it has sealed it
(CrashSafe._seal), without waiting for the previous step's answer, and the
committer thread takes the answers in order. So while the helper commits
one step, the next ones queue up in its pipe, and it commits those as a
group, with one round of syncs (format/groupcommit.py): a loop faster than
one commit's syncs no longer runs at the commit rate. A step is counted as
committed only once the helper answered that it is durable. (The stager,
not a thread of its own, hands steps over: every thread of the trainer's
process that wakes up per step takes the GIL from the training loop.)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from dstt.capture.pipeline import Job
from dstt.errors import CaptureError
from dstt.format.skips import write_skip
from dstt.store.writer import ChunkResult, CommitInfo

log = logging.getLogger("dstt.capture")


class Committing:
    """The commit loop of :class:`~dstt.capture.engine.Capture` (a mixin)."""

    config: Any
    writer: Any
    rank: int
    _helper: Any
    _plan_coord: Any
    _commit_q: queue.SimpleQueue[Job | None]
    _cond: threading.Condition
    _errors: list[CaptureError]
    _recent: Any
    _pending: int
    _queued_steps: set[int]
    n_committed: int
    bytes_written: int
    last_commit: CommitInfo | None

    # (also used: _lower_priority (engine.py), _settle and _commit_by_helper
    # (crashsafe.py), _bump and _await_event (draining.py); not declared
    # here, so no stub shadows them in the MRO)
    _lower_priority: Callable[[], None]
    _settle: Callable[[Job], None]
    _commit_by_helper: Callable[[Job], CommitInfo]
    _bump: Callable[[], None]
    _await_event: Callable[..., None]

    def _commit_loop(self) -> None:
        """Every job in order: committed (with the helper: its answer read,
        the step handed over when sealed), skipped or failed; then settled."""
        self._lower_priority()
        while True:
            job = self._commit_q.get()  # unbounded wait: this thread's work queue; close() sends None
            if job is None:
                return
            self._finish(job, self._commit)

    def _finish(self, job: Job, commit: Callable[[Job], None]) -> None:
        """Commit (or skip, or fail) ``job`` and settle it."""
        try:
            if job.skip is not None:
                if self.rank == 0:
                    write_skip(self.writer.backend, self.config.branch, job.plan.step, job.skip)
            else:
                commit(job)
        except BaseException as e:
            with self._cond:
                reported, job.reported = job.reported, True
            if not reported:
                self._fail(job.plan.step, e)
        finally:
            self._settle(job)
            with self._cond:
                self._pending -= 1
                self._queued_steps.discard(job.plan.step)
                self._cond.notify_all()
            self._bump()

    def _commit(self, job: Job) -> None:
        # (bounded: the stager's copies and seal; with the helper, every wait
        # on its answers is bounded by the helper's progress: helper.py)
        self._await_event(job.submitted, lambda: f"step {job.plan.step} to be staged and sealed")
        if self._helper is not None:
            info = self._commit_by_helper(job)
        else:
            info = self._commit_here(job)
            job.info = info  # (its seal, if any, is removed in _settle)
        with self._cond:
            self._recent.append(info)
            self.n_committed += 1
            self.bytes_written += info.bytes_written
            self.last_commit = info

    def _commit_here(self, job: Job) -> CommitInfo:
        error = job.error
        results: list[ChunkResult] = []
        try:
            self.writer.ensure_arrays(job.plan)
        except BaseException as e:
            error = error or e
        for f in job.futures:
            try:
                # unbounded wait: a chunk write of this process, whose block must not be reused before it
                # returns; every wait of the trainer on this thread is bounded (close() leaves it to a reaper)
                got = f.result()  # a ChunkResult, or (results, error) of a group (_flush_many)
                if isinstance(got, tuple):
                    results.extend(got[0])
                    error = error or got[1]
                else:
                    results.append(got)
            except BaseException as e:  # drain all: no flush may outlive its step
                error = error or e
        # Collective: called for every planned step, with its error, so that
        # no step is committed with missing data and no peer waits forever.
        return self.writer.commit(job.plan, results, error)

    def _fail(self, step: int, e: BaseException) -> None:
        err = e if isinstance(e, CaptureError) and f"step {step}" in str(e) else None
        if err is None:
            err = CaptureError(f"capturing step {step} on branch {self.config.branch!r} failed: "
                               f"{type(e).__name__}: {e}")
            err.__cause__ = e
        log.error("%s", err)
        with self._cond:
            self._errors.append(err)
