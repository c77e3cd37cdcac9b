"""How a :class:`dstt.Capture` stores the steps it plans: one committer
per mode, chosen once by :func:`dstt.capture.modes.make_committer` (no other place of the
capture tests which mode it runs in).

* :class:`InProcessCommitter` (``helper=False``, or no /dev/shm ring):
  the stager hands each staged chunk to a flush thread at once; the
  committer thread waits for a step's chunks and commits it here
  (``Writer.commit``, collective under torch.distributed).
* :class:`HelperCommitter` (the capture helper process, helper.py): the
  stager seals each held step in the /dev/shm ring and hands it over at
  once, without waiting for the previous answer; the committer thread
  takes the answers in order. So while the helper commits one step, the
  next ones queue up in its pipe, and it commits those as a group, with
  one round of syncs (format/groupcommit.py). A step is counted as
  committed only once the helper answered that it is durable. (The stager,
  not a thread of its own, hands steps over: every thread of the trainer's
  process that wakes up per step takes the GIL from the training loop.)
  Once the helper cannot take a step, this process commits it and every
  later one (crashsafe.py, fallback.py).
* :class:`TierCommitter` (``memory_steps``, tier.py): every staged step
  enters the memory tier; the committer thread stores what the persist
  policy and incidents decide.

Phase protocol (who calls what, on which thread):

1. trainer, ``snapshot()``: ``Writer.plan(step, state, track=committer.track_plan)``;
2. trainer: :meth:`Committer.place` -- the step's pool (or memory-tier
   slot), and whether its blocks are held until it is committed;
3. trainer: :meth:`Committer.enqueue` -- counted in the ledger, handed to
   the stager and to the committer thread;
4. stager (and the trainer: eager copies, work stealing in the optimizer
   hook): every copy follows :attr:`Committer.needs`;
5. stager: :meth:`Committer.staged` once every copy of the step landed;
6. committer thread: :meth:`Committer.run` -- every step in order,
   committed, skipped or failed, then settled (:meth:`Committer.settle`);
7. trainer, ``close()``: :meth:`Committer.before_drain`, then
   :meth:`Committer.on_gave_up` if the drain gave up,
   :meth:`Committer.stop_threads`, :meth:`Committer.after_threads`,
   :meth:`Committer.release`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dstt.capture.pipeline import Job
from dstt.capture.tier import MemoryTier
from dstt.capture.tiersize import available_memory_bytes
from dstt.errors import CaptureError
from dstt.format.incidents import Incident
from dstt.format.skips import write_skip

if TYPE_CHECKING:
    from dstt.capture.helper import HelperHandle
    from dstt.format.commit import ChunkResult, CommitInfo
    from dstt.store.writer import Writer

#: The facade (dstt.capture.engine.Capture), typed loosely: engine imports this module.
Capture = Any

log = logging.getLogger("dstt.capture")

#: Held by the stager while it hands a step to the helper, and by the
#: committer while it stops that (CrashSafe.retire_helper): no write to a closed pipe.
HAND_OVER_LOCK = threading.Lock()


@dataclass(frozen=True)
class StagingNeeds:
    """What a mode needs of the stager's copies.

    ``flush_now``: each staged chunk goes to a flush thread at once (the
    in-process commit writes it); ``keep_groups``: a group of small tensors
    staged in one block stays whole, no view per task (the seal record
    describes it: the capture helper reads it there); ``keep_spans``: each
    copy's destination is kept for the NaN/Inf watcher (the memory tier)."""

    flush_now: bool
    keep_groups: bool
    keep_spans: bool


class Committer(ABC):
    """One mode of storing the planned steps of ``cap`` (see the module
    docstring for the phase protocol)."""

    needs: StagingNeeds
    #: Whether the writer keeps the plan's references (off when another
    #: process, the capture helper, stores the step).
    track_plan = True

    def __init__(self, cap: Capture) -> None:
        self.cap = cap

    def start(self) -> None:
        """The constructor's last act, its threads running: start this mode's own."""

    # ------------------------------------------------------------ trainer

    def place(self, job: Job, sizes: list[int], cuda: bool, held_bytes: int) -> None:
        """Give ``job`` its pool (``sizes``: its tasks' bytes; ``cuda``: a
        source on a GPU; ``held_bytes``: the pool bytes it takes held
        whole), and decide whether its blocks are held until it is committed."""
        cap = self.cap
        cap.stager.ensure_pool(sizes, cuda)
        assert cap.stager.pool is not None
        job.ring.pool = cap.stager.pool
        job.ring.hold = self._holds() and held_bytes <= cap.stager.pool.capacity

    def _holds(self) -> bool:
        """Whether a step that fits the pool whole is held (and sealed)."""
        return bool(self.cap.stager.pool_in_ring)

    def enqueue(self, job: Job) -> None:
        """Count ``job`` and hand it to the stager (held or lazy copies
        left) and to the committer thread, in snapshot order."""
        cap = self.cap
        staged_later = (bool(job.lazy) or job.ring.hold) and job.error is None  # held steps are sealed by the stager
        cap.ledger.queued(job.plan.step, job.lazy_bytes if staged_later else 0)
        if staged_later:
            cap.stager.queue_lazy(job)
        else:
            job.finish_staging()
        cap.commit_q.put(job)

    def rewind_job(self, step: int) -> Job | None:
        """The staged job of ``step`` still in memory, its slot held for the
        rewind until :meth:`rewind_done`; None: read it from the store.
        (Called without the ledger's lock: the memory tier in the capture
        helper waits for its answer, read by another thread.)"""
        return None

    def rewind_done(self, job: Job) -> None:
        """The rewind read ``job`` (from :meth:`rewind_job`): its slot may go."""

    def rewind_incident(self, step: int) -> None:
        """A rewind to ``step`` validated: what it records (the memory tier's incident)."""

    def after_rewind(self) -> None:
        """A rewind decided its new branch: switch to it now (the memory
        tier switches at the next snapshot, after its fork step is stored)."""
        self.cap.rewinder.switch_branch()

    def leave_branch(self) -> None:
        """Before the writer of a rewind's branch opens: everything stored,
        the old branch's ring let go of."""
        self.cap.wait()  # bounded: Capture.wait (background_timeout_s)
        self.release()  # (the helper: per branch)
        self.cap.stager.drop_pool()  # (a pool in the old branch's ring)
        self.cap.crashsafe.leave_branch()

    def joined_branch(self, old: Writer) -> None:
        """The writer of a rewind's branch is open; ``old`` is the previous one.
        The new branch gets its ring and helper, and its committer (chosen again)."""
        cap = self.cap
        old.close()
        cap.crashsafe.rejoin_branch()  # (its ring; make_committer starts its helper)
        cap.committer = cap.choose_committer()  # (capture/modes.py)

    def abandon_in_child(self) -> None:
        """In a forked child: let go of what belongs to the parent."""

    # ------------------------------------------------------------ what it keeps in memory

    #: The memory tier (tier.py) of this mode, if it has one.
    memory_tier: MemoryTier | None = None

    def force_all(self) -> list[int]:
        """An incident: store every step kept in memory (under the ledger's lock); their numbers."""
        return []

    def incident_here(self, reason: str, step: int | None, source: str) -> Incident | None:
        """An incident handled by this mode itself (the memory tier in the
        capture helper: it stores its steps and records the incident); None:
        the watcher records it (Watcher.raise_incident)."""
        return None

    def latest_step(self) -> int | None:
        """The latest step queued, if this mode tracks it (under the ledger's lock)."""
        return None

    def passed_over(self, writer: Writer) -> list[int]:
        """Steps of ``writer``'s branch kept in memory only, not yet recorded in a commit."""
        return []

    def memory_bytes(self) -> int | None:
        """Host memory this mode keeps steps in (the memory tier's slots)."""
        return None

    def threads(self) -> dict[str, threading.Thread]:
        """This mode's own threads by name (besides the stager and committer)."""
        return {}

    # ------------------------------------------------------------ stager

    def staged(self, job: Job) -> None:
        """Every copy of ``job`` landed (stager thread): a held step is sealed."""
        if job.ring.hold and job.error is None:
            self.cap.crashsafe.seal(job)
            hook = self.cap.after_seal
            if hook is not None:
                try:
                    hook(job)
                except BaseException as e:  # (the test's or tool's: the step fails, reported by the committer)
                    job.error = job.error or e

    # ------------------------------------------------------------ committer thread

    def run(self) -> None:
        """The committer thread: every job in order committed (or skipped, or
        failed), then settled. (Each by the committer of the moment: a
        rewind, the queue drained, may choose another for its branch.)"""
        cap = self.cap
        cap.lower_priority()
        while True:
            job = cap.commit_q.get()  # unbounded wait: this thread's work queue; close() sends None
            if job is None:
                return
            cap.committer.finish(job)

    def finish(self, job: Job) -> None:
        """Commit (or skip, or fail) ``job`` and settle it."""
        cap = self.cap
        try:
            if job.skip is not None:
                if cap.rank == 0:
                    write_skip(cap.writer.backend, cap.config.branch, job.plan.step, job.skip)
            else:
                # (bounded: the stager's copies and seal; with the helper, every wait
                # on its answers is bounded by the helper's progress: helper.py)
                cap.ledger.wait_event(job.submitted, lambda: f"step {job.plan.step} to be staged and sealed")
                cap.ledger.committed(self.commit(job))
        except BaseException as e:
            with cap.ledger.cond:
                reported, job.reported = job.reported, True
            if not reported:
                cap.ledger.fail(job.plan.step, e)
        finally:
            self.settle(job)
            cap.ledger.settled(job.plan.step)

    @abstractmethod
    def commit(self, job: Job) -> CommitInfo:
        """Store ``job`` durably (committer thread); its CommitInfo."""

    def settle(self, job: Job) -> None:
        """After ``job``'s commit or failure: its seal and held blocks settled."""
        self.cap.crashsafe.settle(job)

    # ------------------------------------------------------------ close

    def before_drain(self) -> None:
        """close(), before waiting for the queued steps."""

    def on_gave_up(self, why: CaptureError) -> None:
        """close()'s drain gave up: end what the committer may wait for."""

    def stop_threads(self) -> dict[str, threading.Thread]:
        """Tell this mode's own threads to stop; them by name (joined by close())."""
        return {}

    def after_threads(self) -> None:
        """Every thread stopped (or returned later, for the reaper)."""

    def release(self) -> None:
        """Let go of this mode's resources (close() once everything is settled)."""

    def close_notes(self) -> list[str]:
        """What a close() that gave up says about this mode."""
        return []


class InProcessCommitter(Committer):
    """Commits in this process, from the flush threads' results."""

    needs = StagingNeeds(flush_now=True, keep_groups=False, keep_spans=False)

    def commit(self, job: Job) -> CommitInfo:
        cap = self.cap
        error = job.error
        results: list[ChunkResult] = []
        try:
            cap.writer.ensure_arrays(job.plan)
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
        info: CommitInfo = cap.writer.commit(job.plan, results, error)
        job.info = info  # (its seal, if any, is removed in settle)
        return info


class HelperCommitter(Committer):
    """The capture helper process commits the sealed steps (helper.py)."""

    needs = StagingNeeds(flush_now=False, keep_groups=True, keep_spans=False)
    track_plan = False

    def __init__(self, cap: Capture, helper: HelperHandle) -> None:
        super().__init__(cap)
        self.helper = helper

    def place(self, job: Job, sizes: list[int], cuda: bool, held_bytes: int) -> None:
        self.cap.crashsafe.refuse_without_helper(self.helper, job.plan.step)
        super().place(job, sizes, cuda, held_bytes)
        if not job.ring.hold:
            assert job.ring.pool is not None
            raise CaptureError(
                f"step {job.plan.step} does not fit the {job.ring.pool.capacity}-byte staging pool whole, and the "
                "capture helper takes whole sealed steps only: raise host_buffer_bytes, or use helper=False "
                "to stage larger steps in parts")

    def _holds(self) -> bool:
        # (also with the pool in process memory: a step the helper cannot
        # take is committed here from its blocks, CrashSafe.commit_by_helper)
        return True

    def staged(self, job: Job) -> None:
        """Sealed, then handed to the helper at once, in stage order -- the
        order of the commit queue -- its answer read by the committer."""
        cap = self.cap
        super().staged(job)
        if not job.ring.hold or job.error is not None or cap.plan_coord.distributed:
            return  # (under torch.distributed each rank's helper reads its ring by itself: ranks.py)
        if not job.ring.sealed:
            cap.crashsafe.hand_over = False  # in stage order: no later step reaches the helper before this one
        helper = self.helper
        with HAND_OVER_LOCK, contextlib.suppress(CaptureError):  # (gone: the committer finds out, commits here)
            if job.ring.sealed and cap.crashsafe.hand_over and not helper.lost:
                helper.send(job.plan.step)
                job.ring.sent = True

    def commit(self, job: Job) -> CommitInfo:
        info: CommitInfo = self.cap.crashsafe.commit_by_helper(job)
        return info

    def settle(self, job: Job) -> None:
        # Under torch.distributed a step its lost helper did not commit stays
        # sealed for the next Capture (never reused: _commit_by_helper said so).
        helper = self.helper
        self.cap.crashsafe.settle(job, keep=job.info is None and helper.lost and self.cap.plan_coord.distributed)

    def abandon_in_child(self) -> None:
        self.helper.abandon()  # the helper must see end-of-file when the parent dies

    def on_gave_up(self, why: CaptureError) -> None:
        if not self.helper.lost:  # the committer may be waiting for its answer
            self.helper.kill(f"did not finish the steps handed to it before close() gave up ({why})")

    def release(self) -> None:
        self.helper.close()

    def close_notes(self) -> list[str]:
        helper = self.helper
        if not helper.lost:
            return []
        return [f"the capture helper (pid {helper.pid}) {'was killed' if helper.killed_why is not None else 'is gone'}"]


class TierCommitter(Committer):
    """The memory tier (tier.py): every step staged into it, stored as the
    persist policy and incidents decide (its own commit loop)."""

    needs = StagingNeeds(flush_now=False, keep_groups=False, keep_spans=True)

    def __init__(self, cap: Capture) -> None:
        super().__init__(cap)
        cfg = cap.config
        if cfg.host_buffer_bytes is not None:
            avail = available_memory_bytes()
            if avail is not None and cfg.host_buffer_bytes > avail:
                raise CaptureError(
                    f"memory_steps={cfg.memory_steps}: host_buffer_bytes={cfg.host_buffer_bytes} is more than "
                    f"the {avail} bytes of memory available; lower memory_steps or host_buffer_bytes")
        self.tier = self.memory_tier = MemoryTier(cap)

    def start(self) -> None:
        self.tier.start()  # the NaN/Inf watcher

    def place(self, job: Job, sizes: list[int], cuda: bool, held_bytes: int) -> None:
        self.tier.place(job.plan, job)  # a whole slot, held until no one needs the step

    def enqueue(self, job: Job) -> None:
        self.tier.enqueue(job, lazy=bool(job.lazy) and job.error is None)

    def staged(self, job: Job) -> None:
        self.tier.staged(job)  # into the ring, sealed; then wait_staged() returns

    def run(self) -> None:
        self.tier.run()

    def commit(self, job: Job) -> CommitInfo:
        raise AssertionError("the memory tier stores its steps in its own loop (MemoryTier.run)")

    def force_all(self) -> list[int]:
        return self.tier.force_all()

    def latest_step(self) -> int | None:
        return self.tier._latest_step

    def passed_over(self, writer: Writer) -> list[int]:
        return self.tier.passed_over(writer)

    def memory_bytes(self) -> int | None:
        return self.tier.memory_bytes

    def rewind_job(self, step: int) -> Job | None:
        tier = self.tier
        with self.cap.ledger.cond:
            self.cap.ledger.wait_cond(lambda: not tier._unstaged, "the steps queued before the rewind to be staged")
            job = tier.ring_job(step)
            if job is not None:
                job.tier.refs += 1  # the rewind's: the slot stays while it is read
        return job

    def rewind_done(self, job: Job) -> None:
        freed: list[Job] = []
        with self.cap.ledger.cond:
            self.tier.unref(job, freed)
        self.tier.release(freed)

    def rewind_incident(self, step: int) -> None:
        # (the tier's steps are stored on the old branch)
        self.cap.watcher.raise_incident(f"rewind to step {step}", step, "rewind")

    def after_rewind(self) -> None:
        """(The branch switches at the next snapshot, once the fork step is stored.)"""

    def leave_branch(self) -> None:
        """(The old branch's steps are still being stored: nothing is let go of.)"""

    def joined_branch(self, old: Writer) -> None:
        with self.cap.ledger.cond:
            self.tier._retired.append(old)  # closed by the committer once drained
            self.cap.ledger.cond.notify_all()

    def before_drain(self) -> None:
        self.tier.close_last()

    def stop_threads(self) -> dict[str, threading.Thread]:
        tier = self.tier
        with self.cap.ledger.cond:
            tier._stopping = True
            self.cap.ledger.cond.notify_all()
        return self.threads()

    def threads(self) -> dict[str, threading.Thread]:
        watch = self.tier.watch
        return {} if watch is None or watch.thread is None else {"NaN/Inf watcher": watch.thread}

    def after_threads(self) -> None:
        self.tier.stop()  # (its threads are gone: frees the ring's slots)


__all__ = ["HAND_OVER_LOCK", "Committer", "HelperCommitter", "InProcessCommitter", "StagingNeeds", "TierCommitter"]
