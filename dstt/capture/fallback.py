"""Committing in the trainer's process when the capture helper cannot
(issue 23): :class:`HereCommitter`.

With the capture helper, the trainer's own Writer only plans (its plans
keep no reference chain: the helper's Writer adopts each sealed step). When
the helper can no longer take a step -- it died (SIGKILL, OOM killer), or a
step could not be sealed for it (/dev/shm full, the ring's directory
removed, a pool in process memory) -- the Capture does not fail that step
and every later one, and never lets the pool blocks of sealed,
uncommitted steps be reused: from that step on it commits each held step
here, exactly as recovery commits a sealed one (``ring.recover``, the
helper's ``prepare``): the step's record, rebuilt from its plan and its
blocks in the pool, adopted by a Writer of the branch opened now (it reads
the branch head the helper left), its chunks flushed, committed. A step the
helper had committed before it died (its answer died with it) is
recognised by its commit marker, not committed twice.

That Writer shares the trainer's branch lock (no other writer can slip in)
and never releases it: the trainer's Writer does, at close.
"""

from __future__ import annotations

from typing import Any

from dstt.capture.pipeline import Job
from dstt.capture.sealplan import plan_of
from dstt.capture.seals import encode_record, read_record, seal_record
from dstt.format import layout as L
from dstt.format.commit import CommitInfo
from dstt.format.manifest import parse_commit
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer


class _BorrowedLock:
    """The trainer's branch lock lent to a second Writer of the same
    process: checked like its own, never released by it."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def check(self) -> None:
        if self._lock is not None:
            self._lock.check()

    def release(self) -> None:
        return None

    def fileno(self) -> int | None:
        return None if self._lock is None else self._lock.fileno()


class HereCommitter:
    """Commits held steps in this process, from their records (see the
    module docstring); one thread at a time (the committer's)."""

    def __init__(self, planner: Writer, options: WriteOptions) -> None:
        lock = _BorrowedLock(planner.branch_lock)
        self.writer = Writer(str(planner.backend.url), options, lock=lock)

    def commit(self, job: Job) -> CommitInfo:
        """Commit ``job`` (staged whole in ``job.ring.pool``, held); its CommitInfo,
        or CaptureError (the step failed: nothing of it is committed)."""
        w = self.writer
        step = job.plan.step
        if w.last_step is not None and step <= w.last_step and w.is_stored(step):
            return self._stored(job)
        assert job.ring.pool is not None
        name = getattr(job.ring.pool, "ring_name", None) or "process-memory"
        record = read_record(encode_record(seal_record(job.plan, name, job.ring.pool.buffer, job.ring.views, crc=False,
                                                       groups=job.ring.groups)))
        plan = w.adopt(plan_of(record, job.ring.pool.buffer, verify=False))
        error: BaseException | None = None
        results: list[Any] = []
        try:
            w.ensure_arrays(plan)
            w.prepare_pred(plan)  # (predictive coding: store/predflush.py)
            results, error = w.flush_chunks(plan, plan.tasks)  # (store/batchflush.py: every chunk flushed or failed)
        except BaseException as e:
            error = e
        return w.commit(plan, results, error)

    def _stored(self, job: Job) -> CommitInfo:
        """The CommitInfo of a step the capture helper committed before it
        died (what it wrote is not known here: 0 bytes)."""
        w = self.writer
        where = L.step_dir(w.branch.name, job.plan.step)
        raw = w.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        seq = parse_commit(raw, where)["seq"] if raw is not None else -1
        return CommitInfo(w.branch.name, job.plan.step, int(seq), len(job.plan.layouts), 0, 0)

    def close(self) -> None:
        self.writer.close()


__all__ = ["HereCommitter"]
