"""The Stager of a :class:`dstt.Capture`: its host pool and every copy into
it -- eager ones on the trainer's thread inside ``snapshot()``, lazy ones on
the stager thread (or, work stealing, on the trainer's thread in the
optimizer pre-hook), CUDA ones on copy streams -- and the flush threads
that write staged chunks in the in-process mode.

A component built once by the Capture, with what it uses: the Capture's
``config``/``writer``/``committer`` as they are now (:class:`~dstt.capture.current.Current`:
a rewind replaces them), the :class:`~dstt.capture.ledger.Ledger`, and the
crash-safe part's pool maker (a pool in the /dev/shm ring where it can be).

Phase protocol (who calls what, on which thread):

1. trainer, ``snapshot()``: :meth:`Stager.watch` (the optimizer pre-hook),
   :meth:`Stager.split_lazy`, :meth:`Stager.task_sizes`, then (the
   committer's ``place``) :meth:`Stager.ensure_pool`; eager copies by
   :meth:`Stager.stage`; a step with lazy copies or held whole goes to
   :meth:`Stager.queue_lazy` (the committer's ``enqueue``);
2. stager thread: each queued job's lazy copies (:meth:`Stager.stage`,
   :meth:`Stager.copy_lazy_cpu`), then ``Committer.staged(job)``;
3. trainer, the optimizer pre-hook: :meth:`Stager.before_optimizer_step`
   makes (or waits for) the previous step's lazy copies;
4. trainer, ``close()`` (draining.py): :meth:`Stager.stop`, then
   :meth:`Stager.release`.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dstt.capture import policy
from dstt.capture.copygroups import LazySplit, StagedGroup, TaskLists, run_end
from dstt.capture.cudacopy import CudaCopier
from dstt.capture.current import Current
from dstt.capture.devicestage import DeviceStaging
from dstt.capture.hooks import StepFence
from dstt.capture.hostpool import HostPool
from dstt.capture.ledger import Ledger
from dstt.capture.pipeline import GuardTripped, Job, check_guard, lower_priority, task_bytes
from dstt.errors import CaptureError
from dstt.format.commit import ChunkResult
from dstt.store.plan import ChunkTask

log = logging.getLogger("dstt.capture")

#: Makes a pool of ``capacity`` bytes (``pin``: for CUDA sources) replacing
#: ``old``: in the /dev/shm ring where it can be (CrashSafe.new_pool).
PoolMaker = Callable[[int, bool, "HostPool | None"], HostPool]


class Stager:
    """The host pool, the copies into it and the stager and flush threads
    of a :class:`~dstt.capture.engine.Capture` (see the module docstring)."""

    def __init__(self, current: Current, ledger: Ledger, new_pool: PoolMaker) -> None:
        self.current = current
        self.ledger = ledger
        self._new_pool = new_pool
        self.pool: HostPool | None = None  # allocated at the first snapshot (ensure_pool)
        #: Injection points for tests and tools (an exception fails the step):
        #: ``before_copy(step, index, lazy)`` before each copy into the pool (on
        #: the stager thread for lazy copies, or the trainer's when it steals
        #: them); ``before_lazy(job)`` on the stager thread before it starts on
        #: a queued job's lazy copies (a slow or starved stager).
        self.before_copy: Callable[[int, int, bool], Any] | None = None
        self.before_lazy: Callable[[Job], Any] | None = None
        cfg = current.config
        self.flush = ThreadPoolExecutor(cfg.flush_threads, thread_name_prefix="dstt-flush",
                                        initializer=lambda: lower_priority(self.current.config))
        # (SimpleQueue: put and get in C; queue.Queue's Python condition
        # variables cost the trainer tens of microseconds per step: issue 16)
        self.queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.last: Job | None = None  # the latest job with lazy copies (or held)
        self._copying: collections.deque[Job] = collections.deque()  # lazy CPU jobs not yet copied, in order
        self._copier: CudaCopier | None = None
        self.device_staging = DeviceStaging(self.after_compute)  # GPU sources copied on the GPU first
        self._fence = StepFence(self.before_optimizer_step)
        self._pid = os.getpid()  # a forked child holds a copy of this object, never the stager thread
        #: What is worked out once per task list (its split, sizes and groups), kept for the next step.
        self.plans = TaskLists()
        self.thread = threading.Thread(target=self._loop, name="dstt-stager", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the stager thread (the Capture's constructor, once its committer is chosen)."""
        self.thread.start()

    @property
    def pool_in_ring(self) -> bool:
        """Whether the pool lives in a /dev/shm file of the ring (its blocks can be sealed)."""
        return self.pool is not None and self.pool.ring_name is not None

    @property
    def lazy_split(self) -> LazySplit | None:
        """The latest step's split into eager and lazy copies (Capture.parts)."""
        return self.plans.latest_split

    def stop(self) -> None:
        """Tell the stager thread to stop once the jobs queued before are staged."""
        self.queue.put(None)

    def remove_fence(self) -> None:
        """The optimizer must not wait for this stager any more (close())."""
        self._fence.remove()

    def abandon_in_child(self) -> None:
        """In a forked child: the parent's hooks stay on the parent's optimizers."""
        self._fence = StepFence(lambda: None)

    def drop_pool(self) -> None:
        """Let go of the pool (close(), or a rewind leaving the branch's ring)."""
        pool = self.pool
        if pool is not None and pool.ring_name is not None:
            pool.unregister()
        self.pool = None

    def release(self) -> None:
        """Everything is settled (close()): the pool, the CUDA copier and the last job go."""
        self.drop_pool()
        self._copier = None
        self.last = None

    # ------------------------------------------------------------ trainer

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait for the lazy copies of the latest step (its pre-hook)."""
        self._fence.watch(optimizer)

    def ensure_pool(self, sizes: list[int], pin: bool) -> None:
        """Allocate the pool on first use; grow it (once idle) if one step
        (its tasks' ``sizes`` in bytes) no longer fits and the limit allows;
        ``pin``: the step has CUDA sources."""
        need = sum(sizes)
        limit = self.current.config.host_buffer_bytes
        biggest = max(sizes, default=0)
        pool = self.pool
        if pool is not None:
            grow = policy.should_grow(need_bytes=need, capacity_bytes=pool.capacity, limit_bytes=limit)
            if not grow and not (pin and not pool.wants_pin) and pool.retired is None:
                return
            job = self.last
            if job is not None:
                self.ledger.wait_event(job.staged, f"step {job.plan.step} to be staged before the pool grows")
            self.ledger.wait(pool.wait_idle, "every staging block to be freed before the pool grows")
        want = policy.pool_bytes(need_bytes=need, biggest_bytes=biggest, limit_bytes=limit)
        self.replace_pool(want, pin)

    def replace_pool(self, capacity: int, pin: bool) -> HostPool:
        """A new pool of ``capacity`` bytes in place of the current one (idle)."""
        self.pool = self._new_pool(capacity, pin, self.pool)
        return self.pool

    def queue_lazy(self, job: Job) -> None:
        """Hand a job with lazy copies (or held whole) to the stager, in queue order."""
        self.last = job
        if job.lazy and not job.cpu_lazy and self._pid == os.getpid():
            self.device_staging.take(job)  # (the GPU copies now; the host copies on the stager thread)
        if self.pool is not None:
            self.pool.register_go.set()  # (the pool's registration with CUDA may take the driver's lock now)
        if job.lazy and job.cpu_lazy:
            job.copies.left = len(job.lazy)
            with self.ledger.cond:
                self._copying.append(job)
        else:
            job.copies.done.set()
        self.queue.put(job)

    def after_compute(self, devices: set[torch.device]) -> dict[int, Any]:
        """Mark the state's point in each CUDA stream of ``devices`` (the copies wait for it)."""
        return self._cuda().after_compute(devices)

    def scan_guard(self) -> None:
        """The trainer's side of the mutation guard: a lazy source whose
        version moved before its copy ran fails its step, reported now."""
        job = self.last
        if job is None or job.guard is None or job.staged.is_set():
            return
        violation = job.guard.scan()
        if violation is not None:
            self.report_once(job, CaptureError(f"step {job.plan.step} not captured: {violation}"))

    def report_once(self, job: Job, e: BaseException) -> None:
        """Queue ``job``'s failure for the trainer, once."""
        with self.ledger.cond:
            if job.reported:
                return
            job.reported = True
        self.ledger.fail(job.plan.step, e)

    def before_optimizer_step(self) -> None:
        """The optimizer step pre-hook: params and optimizer state may change
        only once the previous snapshot's lazy copies have read them.

        Lazy CPU copies the stager has not made yet are made here, on the
        trainer's thread (work stealing): the stager runs at low priority and
        a loaded machine may not schedule it for a long time, while the copies
        themselves take one memcpy."""
        job = self.last
        if job is None or job.staged.is_set() or self._pid != os.getpid():
            return  # (in a forked child the stager does not exist: never wait for it)
        with self.ledger.cond:
            copying = list(self._copying)
        if copying and all(j.cpu_lazy for j in copying) and job in copying:
            for j in copying:  # in queue order: an earlier step's sources change too
                self.copy_lazy_cpu(j)
                # (a copy the stager claimed may still be running)
                self.ledger.wait_event(j.copies.done, functools.partial(_copies_text, j))
                j.issued.set()
                j.staged.set()  # the stager seals and hands it on when it runs
            return
        self.ledger.wait_event(job.issued, lambda: _copies_text(job))
        if job.device_staged:
            return  # copied on the GPU inside snapshot(): the update kernels queue behind in stream order
        if job.cuda_done and job.error is None:
            # GPU-side ordering: the update kernels queue behind the copies;
            # the host does not wait for the device.
            for idx, ev in job.cuda_done.items():
                torch.cuda.current_stream(idx).wait_event(ev)
        else:
            self.ledger.wait_event(job.staged, lambda: _copies_text(job))

    # ------------------------------------------------------------ the stager thread

    def _loop(self) -> None:
        lower_priority(self.current.config)
        while True:
            job = self.queue.get()  # unbounded wait: this thread's work queue; stop() sends None
            if job is None:
                return
            try:
                if job.lazy and self.before_lazy is not None:
                    self.before_lazy(job)
                if job.copies.left >= 0:  # lazy CPU copies: claimed, shared with the trainer
                    self.copy_lazy_cpu(job)
                    self.ledger.wait_event(job.copies.done, functools.partial(_copies_text, job))
                    if job.error is not None and not isinstance(job.error, CaptureError):
                        raise job.error
                else:
                    self.stage(job, job.lazy, lazy=True)
            except GuardTripped as e:
                job.error = job.error or e.error
                self.report_once(job, e.error)  # the trainer's next call raises it
            except BaseException as e:
                job.error = job.error or e
            finally:
                with self.ledger.cond:
                    if job in self._copying:
                        self._copying.remove(job)
                if job.guard is not None:
                    job.guard.release()
                self.device_staging.done(job)  # (its host copies landed, or failed: the scratch goes)
                job.issued.set()
                job.staged.set()  # copies landed: the optimizer may update the sources
                with self.ledger.cond:
                    self.ledger.queued_bytes -= job.lazy_bytes
                    job.lazy_bytes = 0
                self.current.committer.staged(job)  # sealed, or into the memory tier; then wait_staged() returns
                job.finish_staging()
                self.ledger.bump()

    # ------------------------------------------------------------ the flush threads (in-process mode)

    def _flush_one(self, pool: HostPool, job: Job, task: ChunkTask, staged: torch.Tensor, ready: Any) -> ChunkResult:
        try:
            if ready is not None:
                ready.synchronize()  # unbounded wait: this step's copies on the GPU (device work, no other party)
            if job.error is not None:  # the step already failed: do not spend I/O on it
                raise CaptureError(f"step {job.plan.step}: not written after an earlier failure")
            return self.current.writer.flush_chunk(job.plan, task, staged)
        finally:
            if not job.ring.hold:  # a held block is the ring's copy until the step is committed
                pool.release(staged)
            self.ledger.bump()

    def _flush_many(self, pool: HostPool, job: Job, tasks: list[ChunkTask], staged: list[torch.Tensor],
                    ) -> tuple[list[ChunkResult], BaseException | None]:
        """:meth:`_flush_one` for a group of staged CPU chunks: one pool task,
        small chunks flushed together (Writer.flush_chunks: every chunk
        flushed or failed; its results and first error)."""
        try:
            if job.error is not None:  # the step already failed: do not spend I/O on it
                raise CaptureError(f"step {job.plan.step}: not written after an earlier failure")
            return self.current.writer.flush_chunks(job.plan, tasks, list(staged))
        finally:
            if not job.ring.hold:  # a held block is the ring's copy until the step is committed
                for s in staged:
                    pool.release(s)
            self.ledger.bump()

    def _cuda(self) -> CudaCopier:
        if self._copier is None:
            self._copier = CudaCopier()
        return self._copier

    # ------------------------------------------------------------ copies

    def stage(self, job: Job, tasks: list[ChunkTask], *, lazy: bool) -> None:
        """Copy ``tasks`` into pool blocks and hand each block to a flush thread.

        Eager tasks (buffers, RNG, extras: no fence protects them) are staged
        on the trainer's thread inside ``snapshot()``; lazy ones on the stager
        thread (from ``job.early`` where the GPU copied them first). CPU copies
        are handed over one by one; CUDA copies, on the copy stream, in
        batches: at the end, and whenever the pool has no room for the next
        block (waiting for blocks only this step can free would deadlock).

        A block is this function's until a flush thread owns it: on any
        failure it is released (after the copy stream is done with it), so
        a failed step never shrinks the pool. (The blocks of a held step --
        ``job.ring.views`` and ``job.ring.groups`` -- go back when it is settled,
        committed or failed: CrashSafe.settle.)
        """
        pool = job.ring.pool or self.pool
        assert pool is not None
        flush_now = self.current.committer.needs.flush_now  # (the helper, the memory tier write later, if at all)
        if not lazy and job.ring.hold and self.before_copy is None:
            tasks = self._stage_grouped(job, pool, tasks, flush_now)  # small CPU tensors: copied in groups
        batch: list[tuple[ChunkTask, torch.Tensor]] = []  # CUDA copies issued, not handed over
        block: torch.Tensor | None = None
        guard = job.guard if lazy else None
        early = job.early if lazy else None  # (copied on the device inside snapshot(): devicestage.py)
        try:
            for i, t in enumerate(tasks):
                if self.before_copy is not None:
                    self.before_copy(job.plan.step, i, lazy)
                nbytes = task_bytes(t)
                block = pool.try_allocate(nbytes)
                if block is None:
                    if batch:
                        self._hand_over_cuda(job, batch, lazy, last=False)
                    block = self._allocate(pool, nbytes, job)  # backpressure: wait for earlier chunks' writes
                if lazy:
                    with self.ledger.cond:
                        self.ledger.queued_bytes -= pool.block_bytes(nbytes)
                        job.lazy_bytes -= pool.block_bytes(nbytes)
                src = t.source if early is None else early[i]
                dst = pool.view_as(block, src, t.shape)
                if src.device.type == "cuda":
                    self._cuda().copy(dst, src, job.ready[src.device.index], pool.copy_mode(dst))
                    batch.append((t, dst))
                    block = None
                    check_guard(job, guard, i)  # issued: the copy stream reads the state at snapshot()
                else:
                    dst.copy_(src)
                    check_guard(job, guard, i)  # completed: a change before now is in the copy
                    job.ring.views.append((t, dst))
                    if self.current.committer.needs.keep_spans:
                        job.spans.append(dst)
                    if flush_now:
                        job.futures.append(self.flush.submit(self._flush_one, pool, job, t, dst, None))
                    block = None
            if batch:
                self._hand_over_cuda(job, batch, lazy, last=True)
        except BaseException:
            if block is not None:
                pool.release(block)
            if batch:
                self._release_after_copies(pool, batch)
            raise

    def _allocate(self, pool: HostPool, nbytes: int, job: Job) -> torch.Tensor:
        """A block of ``nbytes``, waiting while earlier steps are written and
        committed (backpressure) -- bounded: a CaptureError (the step fails)
        once nothing was written, committed or freed for background_timeout_s."""
        got: list[torch.Tensor] = []

        def placed(t: float) -> bool:
            block = pool.allocate_within(nbytes, t)
            if block is not None:
                got.append(block)
            return block is not None

        self.ledger.wait(placed, lambda: f"{nbytes} bytes of staging pool for step {job.plan.step} (freed as earlier "
                    f"steps are written and committed; {pool.in_use} of {pool.capacity} bytes in use)")
        return got[0]

    def _stage_grouped(self, job: Job, pool: HostPool, tasks: list[ChunkTask], flush_now: bool) -> list[ChunkTask]:
        """Stage the small eager CPU tasks of a held step (its blocks go back
        only once it is committed) in groups of one dtype: one pool block
        and one copy call per group (``torch.cat`` into the block), instead
        of an allocation and a copy call per tensor (tens of thousands of
        small tensors: issue 16). Returns the tasks left for the general
        path (large, CUDA, empty, or a group the pool has no room for now).

        The grouping of a task list is kept for the next step that brings
        the same list (plan.py reuses a step's plan when its tensors are laid
        out as before). With the capture helper and no memory tier, no
        per-task view into a group is ever made (``job.ring.groups``: the seal
        record takes each group's tasks as back to back from its block's
        start, and the step's settling releases whole blocks); otherwise the
        views go to ``job.ring.views`` (what the flush and the memory tier read)."""
        groups, rest = self.plans.groups(tasks)
        keep = self._keep_groups()
        for g in groups:
            block = pool.try_allocate(g.nbytes)
            if block is None and pool.reserving(g.nbytes):  # (the first step: its bytes being reserved, reserve.py)
                block = self._allocate(pool, g.nbytes, job)
            if block is None:
                rest.extend(g.tasks)  # staged one by one, waiting for room
                continue
            try:
                dst = g.fill(block)
            except BaseException:
                pool.release(block)
                raise
            if keep:
                job.ring.groups.append((g, dst))
                continue
            if self.current.committer.needs.keep_spans:
                job.spans.append(dst)
            dsts = g.views(dst)
            job.ring.views.extend(zip(g.tasks, dsts))
            if flush_now:  # (a held block is released at commit, not by its flush)
                job.futures.append(self.flush.submit(self._flush_many, pool, job, g.tasks, dsts))
        return rest

    def _keep_groups(self) -> bool:
        """Whether a staged group stays whole (``job.ring.groups``), its tasks
        never given views of their own: with the capture helper and no
        memory tier, where only the seal record (ring.seal_record reads
        groups) and the release of the step's blocks need them (issue 16:
        88 views per step of a small loop were ~0.2 ms of the stager's
        Python, which the trainer's own Python waits for)."""
        return self.current.committer.needs.keep_groups

    def copy_lazy_cpu(self, job: Job) -> None:
        """Copy the lazy CPU tasks of ``job`` no one has claimed yet (the
        stager, or the trainer in the optimizer pre-hook; both may run it at
        once). Never raises: a failure is the step's (``job.error``), the
        guard's is reported at once; ``job.copies.done`` is set once every
        claimed copy finished. Small tasks of one dtype of a held step are
        claimed and copied in runs (one placement, one copy call; issue 16:
        the optimizer hook made ~66 copies of a small model one by one)."""
        pool = job.ring.pool or self.pool
        assert pool is not None
        copies = job.copies
        flush_now = self.current.committer.needs.flush_now
        grouped = job.ring.hold and self.before_copy is None
        n = len(job.lazy)
        while True:
            with copies.claim:
                i = copies.next
                if i >= n:
                    return
                if job.error is not None:  # the step failed: drop the rest unclaimed
                    copies.left -= n - i
                    copies.next = n
                    if copies.left == 0:
                        copies.done.set()
                    return
                group = None
                if not grouped:
                    j = i + 1
                elif copies.runs is not None:  # (the runs of the step's LazySplit, made once)
                    j, group = copies.runs[i]
                else:
                    j = run_end(job.lazy, i)
                copies.next = j
            try:
                if j - i == 1 or not self._copy_lazy_run(job, pool, i, j, flush_now, group):
                    for k in range(i, j):
                        self._copy_lazy_one(job, pool, k, flush_now)
            except GuardTripped as e:
                with copies.claim:
                    job.error = job.error or e.error
                self.report_once(job, e.error)  # the trainer's next call raises it
            except BaseException as e:
                with copies.claim:
                    job.error = job.error or e
            finally:
                with copies.claim:
                    copies.left -= j - i
                    if copies.left == 0:
                        copies.done.set()

    def _copy_lazy_one(self, job: Job, pool: HostPool, i: int, flush_now: bool) -> None:
        """Copy lazy task ``i`` into a block of its own (waiting for room)."""
        t, block = job.lazy[i], None
        try:
            if self.before_copy is not None:
                self.before_copy(job.plan.step, i, True)
            nbytes = task_bytes(t)
            block = pool.try_allocate(nbytes)
            if block is None:
                block = self._allocate(pool, nbytes, job)  # backpressure: wait for earlier chunks' writes
            with self.ledger.cond:
                self.ledger.queued_bytes -= pool.block_bytes(nbytes)
                job.lazy_bytes -= pool.block_bytes(nbytes)
            dst = pool.view_as(block, t.source, t.shape)
            dst.copy_(t.source)
            check_guard(job, job.guard, i)  # completed: a change before now is in the copy
            with job.copies.claim:
                job.ring.views.append((t, dst))
                if self.current.committer.needs.keep_spans:
                    job.spans.append(dst)
                if flush_now:
                    job.futures.append(self.flush.submit(self._flush_one, pool, job, t, dst, None))
            block = None
        finally:
            if block is not None:
                pool.release(block)

    def _copy_lazy_run(self, job: Job, pool: HostPool, i: int, j: int, flush_now: bool,
                       group: StagedGroup | None = None) -> bool:
        """Copy lazy tasks ``i..j-1`` (small, CPU, one dtype; ``group``: them
        as a StagedGroup, None: made here) into one pool block with one copy
        call; False (nothing done) if the pool has no room for them at once
        now. With the capture helper (and no memory tier) no view per task
        is made (:meth:`_keep_groups`)."""
        if group is None:
            group = StagedGroup(job.lazy[i:j])
        block = pool.try_allocate(group.nbytes)
        if block is None and pool.reserving(group.nbytes):  # (the first step: its bytes being reserved, reserve.py)
            block = self._allocate(pool, group.nbytes, job)
        if block is None:
            return False
        handed = False
        try:
            with self.ledger.cond:
                self.ledger.queued_bytes -= group.block_bytes
                job.lazy_bytes -= group.block_bytes
            dst = group.fill(block)
            check_guard(job, job.guard, i, j)  # completed: a change before now is in the copy
            dsts = None if self._keep_groups() else group.views(dst)
            with job.copies.claim:
                if dsts is None:
                    job.ring.groups.append((group, dst))
                else:
                    job.ring.views.extend(zip(group.tasks, dsts))
                    if self.current.committer.needs.keep_spans:
                        job.spans.append(dst)
                    if flush_now:
                        job.futures.append(self.flush.submit(self._flush_many, pool, job, group.tasks, dsts))
            handed = True
        finally:
            if not handed:
                pool.release(block)
        return True

    def _hand_over_cuda(self, job: Job, batch: list[tuple[ChunkTask, torch.Tensor]], lazy: bool,
                        last: bool) -> None:
        """Flush a batch of issued CUDA copies once they land (emptying ``batch``).

        Eager: the compute stream waits for them on the GPU (the next forward
        may change BatchNorm buffers) and the flush threads wait for the
        event. Lazy: the last batch's events tell the optimizer hook what
        the update kernels must wait for; this (stager) thread waits for
        the device, never the trainer's."""
        done = self._cuda().done({t.source.device for t, _ in batch})
        if lazy:
            if last and not job.device_staged:  # (a device-staged step's hook waits for nothing)
                job.cuda_done = done
                job.issued.set()
            for ev in done.values():
                ev.synchronize()  # unbounded wait: device work of this step (the GPU's own queue)
        else:
            for idx, ev in done.items():
                torch.cuda.current_stream(idx).wait_event(ev)
            job.cuda_eager.extend(done.values())
        pool = job.ring.pool
        assert pool is not None
        while batch:
            t, dst = batch[0]
            job.ring.views.append((t, dst))
            if self.current.committer.needs.keep_spans:
                job.spans.append(dst)
            ready = None if lazy else done[t.source.device.index]
            if self.current.committer.needs.flush_now:
                job.futures.append(self.flush.submit(self._flush_one, pool, job, t, dst, ready))
            batch.pop(0)

    def _release_after_copies(self, pool: HostPool, batch: list[tuple[ChunkTask, torch.Tensor]]) -> None:
        """Return the blocks of issued CUDA copies that will not be flushed,
        once the copy stream is done writing into them."""
        try:
            for ev in self._cuda().done({t.source.device for t, _ in batch}).values():
                ev.synchronize()  # unbounded wait: device work of this step (the GPU's own queue)
        except BaseException:  # the device is gone: the blocks cannot be reused safely
            log.exception("dstt: CUDA copies did not finish; %d staging blocks stay reserved", len(batch))
            return
        for _, dst in batch:
            pool.release(dst)


def _copies_text(job: Job) -> str:
    return (f"the lazy copies of step {job.plan.step} (the optimizer step would change what they read; "
            "it is not run)")


__all__ = ["PoolMaker", "Stager"]
