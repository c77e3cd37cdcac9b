"""The memory tier of the flight recorder (issue 14): every captured step kept in host memory,
persisted at the pace the disk allows, the ring dumped on incidents.

With ``Capture(memory_steps=K)`` the staging pool becomes a :class:`SlotPool`
of ``K + 4`` step-sized slots (in the /dev/shm ring where it fits, so a
crash is an incident too: the next Capture commits the sealed steps). A
staged step enters *the ring* (the last K staged steps); the ``persist``
policy decides which steps the writer stores:

* ``"all"``: every step (the trainer waits for free slots: backpressure);
* ``"newest"``: whenever the writer is free it takes the newest staged step;
  a step passed over stays in memory only until it is evicted;
* ``N``: every N-th captured step (waiting for those, like "all").

An incident (:meth:`MemoryTier.incident`, a non-finite value seen by the
watcher thread, a rewind) stores every step still in the ring -- older ones
after newer ones: the writer *backfills* them (``Writer.relink``) -- and
records the incident in the store (``dstt.format.incidents``).

Invariants (all state under ``Capture._cond``):

* a slot is reused only once no one holds its step: ``job.tier.refs`` counts the
  ring, a decided-but-unwritten persist, the watcher, a successor being
  written (which reads it for the update statistics) and a rewind;
* the committer thread is the only one that writes: one step at a time,
  forced (incident) steps first and oldest first, then decided ones in
  order, then the newest candidate; so a rewind's fork step is stored
  before anything captured after the rewind;
* a step passed over (``decision == "memory"``) is recorded in the next
  stored step's commit document (``memory_only`` ranges), so ``dstt ls``
  can tell captured from persisted steps.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections import deque
from typing import Any

from dstt.capture.hostpool import PAGE, HostPool, SlotPool
from dstt.capture.pipeline import Job
from dstt.capture.ring import seal_record
from dstt.capture.tiersize import EXTRA_SLOTS, available_memory_bytes, round_up, slot_bytes_for
from dstt.capture.tierwrite import persist_step
from dstt.capture.watcher import NanWatch
from dstt.errors import CaptureError, MemoryTierWarning
from dstt.format.layout import step_ranges
from dstt.store.plan import StepPlan
from dstt.store.writer import Writer

#: The facade (dstt.capture.engine.Capture), typed loosely: engine imports this module.
Capture = Any

log = logging.getLogger("dstt.capture")

#: How often a trainer waiting for a slot looks for a staged step the
#: watcher has not checked yet (MemoryTier.place).
WATCH_POLL_S = 0.02


def _took(slot: HostPool | None, into: list[HostPool]) -> bool:
    if slot is not None:
        into.append(slot)
    return slot is not None


class MemoryTier:
    """The memory tier of a :class:`~dstt.capture.engine.Capture` with
    ``memory_steps`` (owned by its TierCommitter, committers.py): the slots,
    the ring of the last K staged steps, the persist decisions, the commit
    loop; and, with ``watch_nonfinite``, the NaN/Inf watcher
    (watcher.NanWatch). Its state is under the ledger's lock.

    ``cap`` is the facade: its ``config`` and ``writer`` change with a
    rewind; its ring, keeper and pool are the crash-safe part's."""

    def __init__(self, cap: Capture) -> None:
        self.cap = cap
        self.ledger = cap.ledger
        cfg = cap.config
        self._policy = cfg.persist_policy
        self._slots: SlotPool | None = None
        self._held: deque[Job] = deque()  # the ring: the last K staged steps, oldest first
        # Steps that left the ring and are kept for the NaN/Inf watcher: not
        # checked yet, or among the K checked before the oldest unchecked one
        # (evict); each keeps the ring's ref. Older than the ring, oldest first.
        self._watch_tail: deque[Job] = deque()
        self._candidate: Job | None = None  # persist="newest": the newest staged, undecided step
        self._decided: deque[Job] = deque()  # to be stored, in step order
        self._forced: list[Job] = []  # incidents' steps, stored first (oldest first)
        self._unstaged: list[Job] = []  # queued, not yet staged
        self._memory_only: dict[int, list[int]] = {}  # id(writer) -> steps passed over, not yet recorded
        self._captured = 0  # steps captured (persist=N counts them)
        self._latest_job: Job | None = None  # the latest staged job
        self._latest_step: int | None = None  # the latest captured (queued) step
        self._stopping = False
        self._retired: list[Writer] = []  # writers of branches left by a rewind, closed once drained
        self.watch = NanWatch(self) if cfg.watch_nonfinite else None  # the NaN/Inf watcher
        self._ring_writer: Writer | None = None  # the writer whose branch the /dev/shm ring is of

    @property
    def memory_bytes(self) -> int | None:
        """Host memory the slots hold (None before the first snapshot sized them)."""
        slots = self._slots
        return None if slots is None else slots.nslots * slots.slot_bytes

    def held(self) -> tuple[SlotPool | None, tuple[Job, ...]]:
        """The slots and the ring (the last K staged steps, oldest first; under the ledger's lock)."""
        return self._slots, tuple(self._held)

    def start(self) -> None:
        """Start the watcher thread (after everything else is set up)."""
        self._ring_writer = self.cap.writer
        if self.watch is not None:
            self.watch.start()

    def stop(self) -> None:
        """Stop the committer and watcher (everything stored), free the ring."""
        with self.ledger.cond:
            self._stopping = True
            self.ledger.cond.notify_all()
        self.ledger.wait_thread(None if self.watch is None else self.watch.thread, "the NaN/Inf watcher to stop")
        freed: list[Job] = []
        with self.ledger.cond:
            for ring in (self._watch_tail, self._held):
                while ring:
                    self.unref(ring.popleft(), freed)
        self.release(freed)

    def close_last(self) -> None:
        """close(): every step is checked for NaN/Inf (here, not waiting for
        the watcher: an incident may still store the ring), and the last
        captured step is stored whatever the policy."""
        with self.ledger.cond:
            self.ledger.wait_cond(lambda: not self._unstaged, "the queued steps to be staged")
        self.check_all()
        with self.ledger.cond:
            job = self._latest_job
            if job is not None and job.tier.decision == "memory" and job.tier.slot is not None:
                self.force(job)
                self.ledger.cond.notify_all()

    def place(self, plan: StepPlan, job: Job) -> None:
        """Give ``job`` a slot (waiting for one: backpressure), making or
        growing the slot pool first where the step does not fit."""
        need = slot_bytes_for(plan)
        pool = self._slots
        if pool is None or need > pool.slot_bytes:
            if pool is not None:
                self.check_all()
                self._drop_ring("the captured state grew")
                self.check_all()  # (steps staged while it drained)
                self.ledger.wait(pool.wait_all_free, "every memory-tier slot to be freed")
            self._slots = self._make_slots(need, pin=any(t.source.is_cuda for t in plan.tasks))
        slots = self._slots
        assert slots is not None
        got: list[HostPool] = []

        def slot_free(t: float) -> bool:
            # The watcher behind (a low-priority thread on a busy machine):
            # the trainer checks the oldest steps itself, which lets the
            # ring's oldest go, rather than wait for the watcher to run. A
            # slot freed by the writer ends the wait at once; a step staged
            # meanwhile is seen within WATCH_POLL_S.
            if _took(slots.acquire(0), got):
                return True
            if self.watch is not None and self.watch.next():
                self.ledger.bump()  # (progress: checked a step; look again)
                return False
            return _took(slots.acquire(min(t, WATCH_POLL_S)), got)

        self.ledger.wait(slot_free, f"a free memory-tier slot for step {plan.step} (the writer frees them)")
        job.tier.slot = got[0]
        job.ring.pool = job.tier.slot
        job.ring.hold = True

    def check_all(self) -> None:
        """Check every staged step not checked yet for NaN/Inf, on this thread (without a watcher: none)."""
        if self.watch is not None:
            self.watch.check_all()

    def _make_slots(self, need: int, pin: bool) -> SlotPool:
        cfg = self.cap.config
        slot = round_up(int(need * 1.25), PAGE) if self._slots is not None else need  # room to grow a little
        nslots = cfg.memory_steps + EXTRA_SLOTS
        total = slot * nslots
        if cfg.host_buffer_bytes is not None and total > cfg.host_buffer_bytes:
            raise CaptureError(
                f"memory_steps={cfg.memory_steps} needs {nslots} slots x {slot} bytes = {total} bytes of host "
                f"memory for this state, more than host_buffer_bytes={cfg.host_buffer_bytes}; lower memory_steps "
                "or raise host_buffer_bytes")
        avail = available_memory_bytes()
        if avail is not None and total > avail:
            raise CaptureError(
                f"memory_steps={cfg.memory_steps} needs {nslots} slots x {slot} bytes = {total} bytes of host "
                f"memory for this state; {avail} bytes are available: lower memory_steps")
        master = self.cap.stager.replace_pool(total, pin)
        log.info("dstt: memory tier of %d steps: %d slots x %d bytes = %.1f MB (%s)", cfg.memory_steps, nslots,
                 slot, total / 1e6, "/dev/shm ring" if self.cap.stager.pool_in_ring else "process memory")
        return SlotPool(master, slot)

    # ------------------------------------------------------------ trainer side

    def enqueue(self, job: Job, lazy: bool) -> None:
        """Queue a planned, eagerly staged job (trainer thread)."""
        with self.ledger.cond:
            self.ledger.pending += 1
            self.ledger.queued_steps.add(job.plan.step)
            self._captured += 1
            self._latest_step = job.plan.step
            policy = self._policy
            if policy == "all" or (isinstance(policy, int) and (self._captured - 1) % policy == 0):
                job.tier.decision = "persist"
                job.tier.refs += 1  # the persist's
            if lazy:
                self._unstaged.append(job)
        if lazy:
            self.cap.stager.queue_lazy(job)
        else:
            job.finish_staging()
            self.staged(job)

    def staged(self, job: Job) -> None:
        """Every copy of ``job`` landed (stager or trainer thread): into the
        ring, evicting the oldest; decide what "newest" passes over."""
        failed = job.error is not None
        # Sealed only in the ring of its own branch: a ring is recovered onto
        # the branch it was made for (after a rewind, the new branch's steps
        # are not sealed in the old branch's ring).
        if not failed and self.cap.crashsafe.ring is not None and self.cap.stager.pool_in_ring and job.writer is self._ring_writer:
            self._seal(job)
        freed: list[Job] = []
        with self.ledger.cond:
            if job in self._unstaged:
                self._unstaged.remove(job)
            if failed:
                self._fail_step(job, freed)
            else:
                job.tier.staged = True
                job.tier.refs += 1  # the ring's
                prev = self._held[-1] if self._held else None
                if prev is not None and prev.writer is job.writer and prev.tier.refs > 0:
                    job.tier.prev_job = prev
                    prev.tier.refs += 1  # read by job's flush for the update statistics
                self._held.append(job)
                if self.watch is not None:  # checked in step order, never skipped
                    job.tier.refs += 1
                    self.watch.queue.append(job)
                self.evict(freed)
                self._latest_job = job
                if job.tier.forced and job.tier.decision != "persist":
                    self.force(job)
                elif job.tier.decision == "persist":
                    self._decided.append(job)
                elif self._policy == "newest":
                    if self._candidate is not None:
                        self._pass_over(self._candidate, freed)
                    self._candidate = job
                    job.tier.refs += 1  # the candidate's
                else:
                    self._pass_over(job, freed)
            self.ledger.cond.notify_all()
        self.release(freed)

    def _seal(self, job: Job) -> None:
        """Seal a staged step in the ring (a crash is an incident too). No CRC
        pass: a held step's slot is reused only once the keeper said so
        (:meth:`release`, capture/keeper.py) -- its seal removed, or
        rewritten with CRCs -- so a seal never describes other bytes."""
        keeper = self.cap.crashsafe.keeper
        slots = self._slots
        try:
            if slots is None or job.tier.slot is None or job.tier.slot.ring_name is None:
                raise RuntimeError("its slot is in process memory, not in the /dev/shm ring")
            name = slots.master.ring_name
            # (sealed only with a ring, whose keeper exists; a slot's ring_name is its master's)
            assert keeper is not None and name is not None
            keeper.seal(seal_record(job.plan, name, slots.master.buffer[:slots.master.file_bytes], job.ring.views, crc=False))
            job.ring.sealed = True
        except Exception as e:  # noqa: BLE001 - the step is still captured, only not crash-proof
            job.ring.seal_error = str(e)
        self.cap.crashsafe.note_sealing(job)

    # ------------------------------------------------------------ bookkeeping (under _cond)

    def evict(self, freed: list[Job]) -> None:
        """Let the oldest steps leave the ring (the last K staged steps).
        With the NaN/Inf watcher they stay in memory, in ``_watch_tail``,
        until it has checked K steps after them: every step it has not
        checked is kept, and the K checked ones before the oldest of those,
        so a non-finite step's incident stores the K steps before it however
        far behind the watcher is (Watcher._force_all)."""
        held, tail, k = self._held, self._watch_tail, self.cap.config.memory_steps
        while len(held) > k:
            old = held.popleft()
            if self.watch is None:
                self.unref(old, freed)
            else:
                tail.append(old)
        if not tail:
            return
        checked = 0  # (checked in step order: the checked steps are the oldest ones)
        for job in (*tail, *held):
            if not job.tier.watched:
                break
            checked += 1
        while checked > k and tail:
            self.unref(tail.popleft(), freed)
            checked -= 1

    def force_all(self, at: Job | None = None) -> list[int]:
        """Force every step in the ring (the last K staged) -- with ``at``,
        the watcher's non-finite step, the K before it and every later one,
        from the steps kept for the watcher (:meth:`evict`) -- and every
        queued one (under the ledger's lock); their numbers."""
        kept = [*self._watch_tail, *self._held]  # (in step order)
        i = next((n for n, job in enumerate(kept) if job is at), None)
        ring = list(self._held) if i is None else kept[max(0, i - self.cap.config.memory_steps):]
        steps = []
        for job in [*ring, *self._unstaged]:
            if job.writer is not self.cap.writer or job.tier.decision == "failed":
                continue
            if job.tier.staged:
                self.force(job)
            else:
                job.tier.forced = True
            steps.append(job.plan.step)
        return sorted(set(steps))

    def ring_job(self, step: int) -> Job | None:
        """The staged job of ``step`` on the current branch still in the ring (under the ledger's lock)."""
        for job in reversed(self._held):
            if job.plan.step == step and job.writer is self.cap.writer and job.tier.slot is not None \
                    and job.error is None and job.tier.decision != "failed":
                return job
        return None

    def passed_over(self, writer: Writer) -> list[int]:
        """Steps of ``writer``'s branch passed over, not yet recorded in a commit (under the ledger's lock)."""
        return self._memory_only.get(id(writer), [])

    def _pass_over(self, job: Job, freed: list[Job]) -> None:
        """``job`` stays in memory only (unless an incident forces it later)."""
        job.tier.decision = "memory"
        self._memory_only.setdefault(id(job.writer), []).append(job.plan.step)
        self.ledger.pending -= 1
        self.ledger.queued_steps.discard(job.plan.step)
        if self._candidate is job:
            self._candidate = None
            self.unref(job, freed)
        if job.tier.prev_job is not None:
            prev, job.tier.prev_job = job.tier.prev_job, None
            self.unref(prev, freed)
        job.tier.done.set()

    def force(self, job: Job) -> None:
        """Store ``job`` after all (an incident); the caller holds _cond."""
        job.tier.forced = True
        if job.tier.decision in ("persist", "done", "failed") or job in self._forced or not job.tier.staged:
            return  # stored, being stored, or failed: nothing to add
        if job.tier.prev_job is None:  # passed over, it let its predecessor go: take it again if still held
            held = [*self._watch_tail, *self._held]
            i = held.index(job) if job in held else -1
            if i > 0 and held[i - 1].writer is job.writer and held[i - 1].tier.slot is not None:
                job.tier.prev_job = held[i - 1]
                held[i - 1].tier.refs += 1
        if self._candidate is job:
            self._candidate = None  # its candidate ref becomes the persist's
        else:
            job.tier.refs += 1
            if job.tier.decision == "memory":
                self.ledger.pending += 1
                self.ledger.queued_steps.add(job.plan.step)
                job.tier.done.clear()
        job.tier.decision = "persist"
        self._forced.append(job)
        self._forced.sort(key=lambda j: j.plan.step)

    def _fail_step(self, job: Job, freed: list[Job]) -> None:
        """A step whose staging failed: reported, its slot freed (it holds at
        most the persist's ref: it never entered the ring)."""
        had_persist = job.tier.decision == "persist"
        job.tier.decision = "failed"
        if not job.reported:
            job.reported = True
            assert job.error is not None  # (staged() calls it for a failed step only)
            self.ledger.fail(job.plan.step, job.error)
        self.ledger.pending -= 1
        self.ledger.queued_steps.discard(job.plan.step)
        if had_persist:
            job.tier.refs -= 1
        if job.tier.refs <= 0 and job.tier.slot is not None:
            freed.append(job)
        job.tier.done.set()

    def unref(self, job: Job, freed: list[Job]) -> None:
        job.tier.refs -= 1
        if job.tier.refs <= 0 and job.tier.slot is not None:
            freed.append(job)

    def release(self, freed: list[Job]) -> None:
        """Return the slots of jobs no one holds (outside _cond)."""
        for job in freed:
            slot, job.tier.slot = job.tier.slot, None
            if slot is None:
                continue
            slots = self._slots
            keeper = self.cap.crashsafe.keeper
            if job.ring.sealed and keeper is not None and slots is not None:
                master = slots.master
                checked = functools.partial(seal_record, job.plan, master.ring_name or "", master.buffer, job.ring.views)
                if not keeper.settle(job.plan.step, recoverable=False, checked=checked):
                    slots.retire(slot)  # its bytes stay as its seal says, for good
                    job.ring.views = []
                    continue
            job.ring.views = []
            if slots is not None:
                slots.release(slot)
                self.ledger.bump()  # (a waiting snapshot() sees a slot come free)

    def _drop_ring(self, why: str) -> None:
        """Drain what is to be stored, then forget the ring's memory-only steps."""
        self._wait_stored()
        freed: list[Job] = []
        with self.ledger.cond:
            dropped = [j.plan.step for j in (*self._watch_tail, *self._held) if j.tier.decision == "memory"]
            for ring in (self._watch_tail, self._held):
                while ring:
                    self.unref(ring.popleft(), freed)
        self.release(freed)
        if dropped:
            warnings.warn(f"dstt: {why}: the memory tier's steps {dropped[0]}..{dropped[-1]} (memory only) are "
                          "dropped", MemoryTierWarning, stacklevel=4)

    def _wait_stored(self) -> None:
        with self.ledger.cond:
            self.ledger.wait_cond(lambda: self.ledger.pending == 0, "the steps to be stored")

    # ------------------------------------------------------------ the committer

    def _next(self) -> Job | None:
        with self.ledger.cond:
            while True:
                if self._forced:
                    return self._forced.pop(0)
                if self._decided and self._decided[0].tier.staged:
                    return self._decided.popleft()
                if self._candidate is not None:
                    job, self._candidate = self._candidate, None
                    job.tier.decision = "persist"  # its candidate ref becomes the persist's
                    return job
                if self._stopping and not self._unstaged and not self._decided:
                    return None
                self._close_retired_locked()
                self.ledger.cond.wait()  # unbounded wait: the committer waiting for work; close() wakes it

    def run(self) -> None:
        self.cap.lower_priority()
        while True:
            job = self._next()
            if job is None:
                self._close_retired_locked(final=True)
                return
            freed: list[Job] = []
            try:
                info = self._persist(job)
                with self.ledger.cond:
                    job.info = info
                    self.ledger.recent.append(info)
                    self.ledger.n_committed += 1
                    self.ledger.bytes_written += info.bytes_written
                    if self.ledger.last_commit is None or info.step >= self.ledger.last_commit.step:
                        self.ledger.last_commit = info
                    job.tier.decision = "done"
            except BaseException as e:
                with self.ledger.cond:
                    job.tier.decision = "failed"
                    reported, job.reported = job.reported, True
                if not reported:
                    self.ledger.fail(job.plan.step, e)
            finally:
                with self.ledger.cond:
                    self.ledger.pending -= 1
                    self.ledger.queued_steps.discard(job.plan.step)
                    self.unref(job, freed)
                    if job.tier.prev_job is not None:
                        prev, job.tier.prev_job = job.tier.prev_job, None
                        self.unref(prev, freed)
                    job.tier.done.set()
                    self.ledger.cond.notify_all()
                self.release(freed)
                self.ledger.bump()

    def _persist(self, job: Job) -> Any:
        """Write and commit one staged step (committer thread: tierwrite.py)."""
        def memory_only(w: Writer, step: int) -> list[tuple[int, int]]:
            with self.ledger.cond:
                return self._take_memory_only(w, step)

        return persist_step(job, self.cap.stager.flush, memory_only)

    def _take_memory_only(self, w: Writer, step: int) -> list[tuple[int, int]]:
        steps = self._memory_only.get(id(w), [])
        self._memory_only[id(w)] = [s for s in steps if s >= step]
        return step_ranges(sorted(s for s in steps if s < step))

    def _close_retired_locked(self, final: bool = False) -> None:
        """Close writers of branches a rewind left, once nothing of theirs is
        queued (called with or without _cond: only the committer calls it)."""
        if not self._retired:
            return
        busy = {id(j.writer) for j in [*self._forced, *self._decided, *self._unstaged]
                if j.tier.decision not in ("done", "failed", "memory")}
        for w in list(self._retired):
            if final or id(w) not in busy:
                self._retired.remove(w)
                try:
                    w.close()
                except Exception as e:  # noqa: BLE001
                    log.warning("dstt: closing the writer of branch %r: %s", w.branch.name, e)


__all__ = ["MemoryTier"]
