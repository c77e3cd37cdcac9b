"""The flight recorder (issue 14): every captured step kept in host memory,
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

An incident (:meth:`FlightRecorder.incident`, a non-finite value seen by the
watcher thread, a rewind) stores every step still in the ring -- older ones
after newer ones: the writer *backfills* them (``Writer.relink``) -- and
records the incident in the store (``dstt.format.incidents``).

Invariants (all state under ``Capture._cond``):

* a slot is reused only once no one holds its step: ``job.refs`` counts the
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
import math
import threading
import warnings
from collections import deque
from typing import Any

import torch

from dstt.capture.pipeline import Job
from dstt.capture.ring import seal_record
from dstt.capture.staging import ALIGN, PAGE, PAGE_BLOCK_BYTES, HostPool
from dstt.errors import CaptureError, MemoryTierWarning
from dstt.format.layout import step_ranges
from dstt.store.plan import ChunkTask, StepPlan
from dstt.store.writer import ChunkResult, Writer, batches

log = logging.getLogger("dstt.capture")

#: Slots beyond K: the step being staged, one being written after it left the
#: ring, the step before that one (read for the update statistics), and the
#: one the NaN/Inf watcher is checking (with the K checked steps before it
#: kept: FlightRecorder._tier_evict; a watcher further behind makes the
#: trainer wait for a slot, or check steps itself: _tier_pool).
EXTRA_SLOTS = 4
#: How often a trainer waiting for a slot looks for a staged step the
#: watcher has not checked yet (FlightRecorder._tier_pool).
WATCH_POLL_S = 0.02


def _round(n: int, k: int) -> int:
    return -(-n // k) * k


def slot_bytes_for(plan: StepPlan) -> int:
    """Bytes of one slot holding this rank's share of ``plan`` (blocks are
    aligned like HostPool's, plus one page of slack)."""
    total = 0
    for t in plan.tasks:
        n = math.prod(t.shape) * t.source.dtype.itemsize
        total += _round(n, PAGE) + PAGE if n >= PAGE_BLOCK_BYTES else _round(max(n, 1), ALIGN)
    return _round(total + PAGE, PAGE)


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class SlotPool:
    """``nslots`` slots of ``slot_bytes`` in one host buffer, handed out whole
    and returned in any order (a ring allocator would wait for the oldest
    step, and the oldest may be the one being written).

    >>> master = HostPool(4 * 8192)
    >>> pool = SlotPool(master, 8192)
    >>> a = pool.acquire(); b = pool.acquire()
    >>> pool.free_slots, a.capacity
    (2, 8192)
    >>> pool.release(a); pool.free_slots
    3
    """

    def __init__(self, master: HostPool, slot_bytes: int) -> None:
        if slot_bytes % PAGE or slot_bytes <= 0:
            raise CaptureError(f"slot size {slot_bytes} is not a positive multiple of {PAGE}")
        self.master = master
        self.slot_bytes = slot_bytes
        self.nslots = master.capacity // slot_bytes
        self._free = list(range(self.nslots))[::-1]
        self._cond = threading.Condition()
        self._extra: dict[int, torch.Tensor] = {}  # slots in process memory replacing retired ones (retire)

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> HostPool | None:
        """A free slot (a HostPool over it), waiting while none is free (at
        most ``timeout`` s: then None)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                return None
            i = self._free.pop()
            extra = self._extra.get(i)
        buf = self.master.buffer[i * self.slot_bytes:(i + 1) * self.slot_bytes] if extra is None else extra
        slot = HostPool(self.slot_bytes, buffer=buf)
        slot.pinned = self.master.pinned and extra is None
        slot.slot_index = i  # type: ignore[attr-defined]
        slot.ring_name = self.master.ring_name if extra is None else None  # (a step in it can be sealed)
        return slot

    def retire(self, slot: HostPool) -> None:
        """``slot`` is never handed out again: a seal that could be neither
        removed nor rewritten describes its bytes (capture/keeper.py). A
        slot in process memory takes its place, so the tier keeps its size
        (the keeper stops sealing at the first such seal: this happens at
        most once per slot sealed then)."""
        raw = torch.empty(self.slot_bytes + PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE
        with self._cond:
            i = self.nslots + len(self._extra)
            while i in self._extra:
                i += 1
            self._extra[i] = raw[skip:skip + self.slot_bytes]
            self._free.append(i)
            self._cond.notify_all()

    def release(self, slot: HostPool) -> None:
        with self._cond:
            self._free.append(slot.slot_index)  # type: ignore[attr-defined]
            self._cond.notify_all()

    def wait_free(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a free slot; whether one is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._free), timeout)

    def wait_all_free(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == self.nslots, timeout)


def _took(slot: HostPool | None, into: list[HostPool]) -> bool:
    if slot is not None:
        into.append(slot)
    return slot is not None


class FlightRecorder:
    """The memory tier's methods of :class:`~dstt.capture.engine.Capture`
    (a mixin: the state lives on the Capture, under its ``_cond``)."""

    config: Any
    writer: Writer
    _cond: threading.Condition
    _ring: Any
    _flush: Any
    _pending: int
    _queued_steps: set[int]

    # ------------------------------------------------------------ set-up

    def _tier_init(self) -> None:
        cfg = self.config
        self._tier = cfg.memory_steps is not None
        self._policy = cfg.persist_policy
        self._slots: SlotPool | None = None
        self._held: deque[Job] = deque()  # the ring: the last K staged steps, oldest first
        # Steps that left the ring and are kept for the NaN/Inf watcher: not
        # checked yet, or among the K checked before the oldest unchecked one
        # (_tier_evict); each keeps the ring's ref. Older than the ring, oldest first.
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
        self._watch_q: deque[Job] = deque()  # staged steps the watcher has not checked yet, oldest first
        self._nonfinite_seen = False
        self._watcher: threading.Thread | None = None
        self._ring_writer: Writer | None = None  # the writer whose branch the /dev/shm ring is of
        if self._tier and cfg.host_buffer_bytes is not None:
            avail = available_memory_bytes()
            if avail is not None and cfg.host_buffer_bytes > avail:
                raise CaptureError(
                    f"memory_steps={cfg.memory_steps}: host_buffer_bytes={cfg.host_buffer_bytes} is more than "
                    f"the {avail} bytes of memory available; lower memory_steps or host_buffer_bytes")

    @property
    def memory_bytes(self) -> int | None:
        """Host memory the memory tier holds: (memory_steps + 4) step slots,
        sized at the first snapshot (None before it, and without
        ``memory_steps``). With ``host_buffer_bytes`` it never exceeds that.

        >>> import tempfile, torch, dstt
        >>> with dstt.Capture(tempfile.mkdtemp() + "/r", memory_steps=2) as cap:
        ...     _ = cap.snapshot(0, model=torch.nn.Linear(4, 4))
        ...     cap.memory_bytes == 6 * cap._slots.slot_bytes
        True
        """
        slots = self._slots
        return None if slots is None else slots.nslots * slots.slot_bytes

    def _tier_start(self) -> None:
        """Start the watcher thread (after everything else is set up)."""
        self._ring_writer = self.writer
        if self._tier and self.config.watch_nonfinite:
            self._watcher = threading.Thread(target=self._watch_loop, name="dstt-watch", daemon=True)
            self._watcher.start()

    def _tier_stop(self) -> None:
        """Stop the committer and watcher (everything stored), free the ring."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._await_thread(self._watcher, "the NaN/Inf watcher to stop")  # type: ignore[attr-defined]
        freed: list[Job] = []
        with self._cond:
            for ring in (self._watch_tail, self._held):
                while ring:
                    self._unref(ring.popleft(), freed)
        self._release(freed)

    def _tier_close_last(self) -> None:
        """close(): every step is checked for NaN/Inf (here, not waiting for
        the watcher: an incident may still store the ring), and the last
        captured step is stored whatever the policy."""
        with self._cond:
            self._await_cond(lambda: not self._unstaged, "the queued steps to be staged")  # type: ignore[attr-defined]
        self._watch_all()  # type: ignore[attr-defined]
        with self._cond:
            job = self._latest_job
            if job is not None and job.decision == "memory" and job.slot is not None:
                self._force(job)
                self._cond.notify_all()

    def _tier_pool(self, plan: StepPlan, job: Job) -> None:
        """Give ``job`` a slot (waiting for one: backpressure), making or
        growing the slot pool first where the step does not fit."""
        need = slot_bytes_for(plan)
        pool = self._slots
        if pool is None or need > pool.slot_bytes:
            if pool is not None:
                self._watch_all()  # type: ignore[attr-defined]
                self._tier_drop_ring("the captured state grew")
                self._watch_all()  # type: ignore[attr-defined]  # (steps staged while it drained)
                self._await(pool.wait_all_free, "every memory-tier slot to be freed")  # type: ignore[attr-defined]
            self._slots = self._make_slots(need, pin=any(t.source.is_cuda for t in plan.tasks))
        slots = self._slots
        got: list[HostPool] = []

        def slot_free(t: float) -> bool:
            # The watcher behind (a low-priority thread on a busy machine):
            # the trainer checks the oldest steps itself, which lets the
            # ring's oldest go, rather than wait for the watcher to run. A
            # slot freed by the writer ends the wait at once; a step staged
            # meanwhile is seen within WATCH_POLL_S.
            if _took(slots.acquire(0), got):
                return True
            if self._watch_next():  # type: ignore[attr-defined]
                self._bump()  # type: ignore[attr-defined]  # (progress: checked a step; look again)
                return False
            return _took(slots.acquire(min(t, WATCH_POLL_S)), got)

        self._await(slot_free, f"a free memory-tier slot for step {plan.step} (the writer frees them)")  # type: ignore[attr-defined]
        job.slot = got[0]
        job.pool = job.slot
        job.hold = True

    def _make_slots(self, need: int, pin: bool) -> SlotPool:
        cfg = self.config
        slot = _round(int(need * 1.25), PAGE) if self._slots is not None else need  # room to grow a little
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
        master = self._new_pool(total, pin)  # type: ignore[attr-defined]
        log.info("dstt: memory tier of %d steps: %d slots x %d bytes = %.1f MB (%s)", cfg.memory_steps, nslots,
                 slot, total / 1e6, "/dev/shm ring" if self._pool_in_ring else "process memory")  # type: ignore[attr-defined]
        self.pool = master  # type: ignore[assignment]
        return SlotPool(master, slot)

    # ------------------------------------------------------------ trainer side

    def _tier_enqueue(self, job: Job, lazy: bool) -> None:
        """Queue a planned, eagerly staged job (trainer thread)."""
        with self._cond:
            self._pending += 1
            self._queued_steps.add(job.plan.step)
            self._captured += 1
            self._latest_step = job.plan.step
            policy = self._policy
            if policy == "all" or (isinstance(policy, int) and (self._captured - 1) % policy == 0):
                job.decision = "persist"
                job.refs += 1  # the persist's
            if lazy:
                self._unstaged.append(job)
        if lazy:
            self._queue_lazy(job)  # type: ignore[attr-defined]
        else:
            job.finish_staging()
            self._tier_staged(job)

    def _tier_staged(self, job: Job) -> None:
        """Every copy of ``job`` landed (stager or trainer thread): into the
        ring, evicting the oldest; decide what "newest" passes over."""
        failed = job.error is not None
        # Sealed only in the ring of its own branch: a ring is recovered onto
        # the branch it was made for (after a rewind, the new branch's steps
        # are not sealed in the old branch's ring).
        if not failed and self._ring is not None and self._pool_in_ring and job.writer is self._ring_writer:  # type: ignore[attr-defined]
            self._tier_seal(job)
        freed: list[Job] = []
        with self._cond:
            if job in self._unstaged:
                self._unstaged.remove(job)
            if failed:
                self._tier_fail(job, freed)
            else:
                job.tier_staged = True
                job.refs += 1  # the ring's
                prev = self._held[-1] if self._held else None
                if prev is not None and prev.writer is job.writer and prev.refs > 0:
                    job.prev_job = prev
                    prev.refs += 1  # read by job's flush for the update statistics
                self._held.append(job)
                if self._watcher is not None:  # checked in step order, never skipped
                    job.refs += 1
                    self._watch_q.append(job)
                self._tier_evict(freed)
                self._latest_job = job
                if job.forced and job.decision != "persist":
                    self._force(job)
                elif job.decision == "persist":
                    self._decided.append(job)
                elif self._policy == "newest":
                    if self._candidate is not None:
                        self._pass_over(self._candidate, freed)
                    self._candidate = job
                    job.refs += 1  # the candidate's
                else:
                    self._pass_over(job, freed)
            self._cond.notify_all()
        self._release(freed)

    def _tier_seal(self, job: Job) -> None:
        """Seal a staged step in the ring (a crash is an incident too). No CRC
        pass: a held step's slot is reused only once the keeper said so
        (:meth:`_release`, capture/keeper.py) -- its seal removed, or
        rewritten with CRCs -- so a seal never describes other bytes."""
        keeper = self._keeper  # type: ignore[attr-defined]
        slots = self._slots
        try:
            if slots is None or job.slot is None or job.slot.ring_name is None:
                raise RuntimeError("its slot is in process memory, not in the /dev/shm ring")
            keeper.seal(seal_record(job.plan, slots.master.ring_name, slots.master.buffer, job.views, crc=False))
            job.sealed = True
        except Exception as e:  # noqa: BLE001 - the step is still captured, only not crash-proof
            job.seal_error = str(e)
        self._note_sealing(job)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ bookkeeping (under _cond)

    def _tier_evict(self, freed: list[Job]) -> None:
        """Let the oldest steps leave the ring (the last K staged steps).
        With the NaN/Inf watcher they stay in memory, in ``_watch_tail``,
        until it has checked K steps after them: every step it has not
        checked is kept, and the K checked ones before the oldest of those,
        so a non-finite step's incident stores the K steps before it however
        far behind the watcher is (Incidents._force_all)."""
        held, tail, k = self._held, self._watch_tail, self.config.memory_steps
        while len(held) > k:
            old = held.popleft()
            if self._watcher is None:
                self._unref(old, freed)
            else:
                tail.append(old)
        if not tail:
            return
        checked = 0  # (checked in step order: the checked steps are the oldest ones)
        for job in (*tail, *held):
            if not job.watched:
                break
            checked += 1
        while checked > k and tail:
            self._unref(tail.popleft(), freed)
            checked -= 1

    def _pass_over(self, job: Job, freed: list[Job]) -> None:
        """``job`` stays in memory only (unless an incident forces it later)."""
        job.decision = "memory"
        self._memory_only.setdefault(id(job.writer), []).append(job.plan.step)
        self._pending -= 1
        self._queued_steps.discard(job.plan.step)
        if self._candidate is job:
            self._candidate = None
            self._unref(job, freed)
        if job.prev_job is not None:
            prev, job.prev_job = job.prev_job, None
            self._unref(prev, freed)
        job.done.set()

    def _force(self, job: Job) -> None:
        """Store ``job`` after all (an incident); the caller holds _cond."""
        job.forced = True
        if job.decision in ("persist", "done", "failed") or job in self._forced or not job.tier_staged:
            return  # stored, being stored, or failed: nothing to add
        if job.prev_job is None:  # passed over, it let its predecessor go: take it again if still held
            held = [*self._watch_tail, *self._held]
            i = held.index(job) if job in held else -1
            if i > 0 and held[i - 1].writer is job.writer and held[i - 1].slot is not None:
                job.prev_job = held[i - 1]
                held[i - 1].refs += 1
        if self._candidate is job:
            self._candidate = None  # its candidate ref becomes the persist's
        else:
            job.refs += 1
            if job.decision == "memory":
                self._pending += 1
                self._queued_steps.add(job.plan.step)
                job.done.clear()
        job.decision = "persist"
        self._forced.append(job)
        self._forced.sort(key=lambda j: j.plan.step)

    def _tier_fail(self, job: Job, freed: list[Job]) -> None:
        """A step whose staging failed: reported, its slot freed (it holds at
        most the persist's ref: it never entered the ring)."""
        had_persist = job.decision == "persist"
        job.decision = "failed"
        if not job.reported:
            job.reported = True
            self._fail(job.plan.step, job.error)  # type: ignore[attr-defined,arg-type]
        self._pending -= 1
        self._queued_steps.discard(job.plan.step)
        if had_persist:
            job.refs -= 1
        if job.refs <= 0 and job.slot is not None:
            freed.append(job)
        job.done.set()

    def _unref(self, job: Job, freed: list[Job]) -> None:
        job.refs -= 1
        if job.refs <= 0 and job.slot is not None:
            freed.append(job)

    def _release(self, freed: list[Job]) -> None:
        """Return the slots of jobs no one holds (outside _cond)."""
        for job in freed:
            slot, job.slot = job.slot, None
            if slot is None:
                continue
            slots = self._slots
            keeper = self._keeper  # type: ignore[attr-defined]
            if job.sealed and keeper is not None and slots is not None:
                master = slots.master
                checked = functools.partial(seal_record, job.plan, master.ring_name or "", master.buffer, job.views)
                if not keeper.settle(job.plan.step, recoverable=False, checked=checked):
                    slots.retire(slot)  # its bytes stay as its seal says, for good
                    job.views = []
                    continue
            job.views = []
            if slots is not None:
                slots.release(slot)
                self._bump()  # type: ignore[attr-defined]  # (a waiting snapshot() sees a slot come free)

    def _tier_drop_ring(self, why: str) -> None:
        """Drain what is to be stored, then forget the ring's memory-only steps."""
        self._tier_wait()
        freed: list[Job] = []
        with self._cond:
            dropped = [j.plan.step for j in (*self._watch_tail, *self._held) if j.decision == "memory"]
            for ring in (self._watch_tail, self._held):
                while ring:
                    self._unref(ring.popleft(), freed)
        self._release(freed)
        if dropped:
            warnings.warn(f"dstt: {why}: the memory tier's steps {dropped[0]}..{dropped[-1]} (memory only) are "
                          "dropped", MemoryTierWarning, stacklevel=4)

    def _tier_wait(self) -> None:
        with self._cond:
            self._await_cond(lambda: self._pending == 0, "the steps to be stored")  # type: ignore[attr-defined]

    # ------------------------------------------------------------ the committer

    def _tier_next(self) -> Job | None:
        with self._cond:
            while True:
                if self._forced:
                    return self._forced.pop(0)
                if self._decided and self._decided[0].tier_staged:
                    return self._decided.popleft()
                if self._candidate is not None:
                    job, self._candidate = self._candidate, None
                    job.decision = "persist"  # its candidate ref becomes the persist's
                    return job
                if self._stopping and not self._unstaged and not self._decided:
                    return None
                self._close_retired_locked()
                self._cond.wait()  # unbounded wait: the committer waiting for work; close() wakes it

    def _tier_loop(self) -> None:
        self._lower_priority()  # type: ignore[attr-defined]
        while True:
            job = self._tier_next()
            if job is None:
                self._close_retired_locked(final=True)
                return
            freed: list[Job] = []
            try:
                info = self._tier_persist(job)
                with self._cond:
                    job.info = info
                    self._recent.append(info)  # type: ignore[attr-defined]
                    self.n_committed += 1  # type: ignore[attr-defined]
                    self.bytes_written += info.bytes_written  # type: ignore[attr-defined]
                    if self.last_commit is None or info.step >= self.last_commit.step:  # type: ignore[attr-defined]
                        self.last_commit = info  # type: ignore[attr-defined]
                    job.decision = "done"
            except BaseException as e:
                with self._cond:
                    job.decision = "failed"
                    reported, job.reported = job.reported, True
                if not reported:
                    self._fail(job.plan.step, e)  # type: ignore[attr-defined]
            finally:
                with self._cond:
                    self._pending -= 1
                    self._queued_steps.discard(job.plan.step)
                    self._unref(job, freed)
                    if job.prev_job is not None:
                        prev, job.prev_job = job.prev_job, None
                        self._unref(prev, freed)
                    job.done.set()
                    self._cond.notify_all()
                self._release(freed)
                self._bump()  # type: ignore[attr-defined]

    def _tier_persist(self, job: Job) -> Any:
        """Write and commit one staged step (committer thread)."""
        w: Writer = job.writer
        plan = job.plan
        if job.error is not None:
            raise job.error
        w.relink(plan)  # a step passed over and stored after all (an incident)
        w.settle_before(plan)  # steps passed over before it: compared with what came before them
        prev: dict[tuple[str, int], torch.Tensor] = {}
        if job.prev_job is not None:
            prev = {(t.layout.array, t.index): v for t, v in job.prev_job.views}
        error: BaseException | None = None
        results: list[ChunkResult] = []
        try:
            w.ensure_arrays(plan)
            futures = [self._flush.submit(self._flush_views, w, plan, batch, prev)
                       for batch in batches(job.views, lambda item: item[0].nbytes)]
            for f in futures:
                try:
                    done, err = f.result()  # unbounded wait: a chunk write of this process (its slot is in use)
                    results.extend(done)
                    error = error or err
                except BaseException as e:  # drain every one: no flush outlives its step
                    error = error or e
        except BaseException as e:
            error = error or e
        backfill = w.last_commit is not None and plan.step < w.last_commit[0]
        with self._cond:
            ranges = None if backfill else self._take_memory_only(w, plan.step)
        return w.commit(plan, results, error, memory_only=ranges)

    @staticmethod
    def _flush_views(w: Writer, plan: StepPlan, batch: list[tuple[ChunkTask, torch.Tensor]],
                     prev: dict[tuple[str, int], torch.Tensor]) -> tuple[list[ChunkResult], BaseException | None]:
        # (small chunks in groups: store/batchflush.py; every chunk flushed or failed)
        prevs: list[torch.Tensor | None] = []
        for t, view in batch:
            p = prev.get((t.layout.array, t.index))
            prevs.append(None if p is None or p.shape != view.shape else p)
        return w.flush_chunks(plan, [t for t, _ in batch], [v for _, v in batch], prevs)

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
                if j.decision not in ("done", "failed", "memory")}
        for w in list(self._retired):
            if final or id(w) not in busy:
                self._retired.remove(w)
                try:
                    w.close()
                except Exception as e:  # noqa: BLE001
                    log.warning("dstt: closing the writer of branch %r: %s", w.branch.name, e)


__all__ = ["FlightRecorder", "SlotPool"]
