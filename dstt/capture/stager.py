"""The copies of :class:`dstt.Capture` into its host pool: eager ones on the
trainer's thread inside ``snapshot()``, lazy ones on the stager thread (or,
work stealing, on the trainer's thread in the optimizer hook), CUDA ones on
copy streams. A mixin: the state lives on the Capture (``pool``, ``_flush``,
``_cond``, ``before_copy``...); engine.py calls ``_stage`` and
``_copy_lazy_cpu``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from dstt.capture.pipeline import GuardTripped, Job, check_guard, task_bytes
from dstt.capture.staging import HostPool
from dstt.store.plan import ChunkTask

log = logging.getLogger("dstt.capture")

#: Small eager tensors of a held step are staged in groups of up to this many
#: bytes, one placement and one copy call each (Capture._stage_grouped).
GROUP_BYTES = 1 << 20
GROUP_TASK_BYTES = 64 << 10


class Stager:
    """Staging methods of :class:`~dstt.capture.engine.Capture` (a mixin)."""

    pool: HostPool | None
    before_copy: Any
    _helper: Any
    _tier: bool
    _cond: Any
    _flush: Any
    _queued_bytes: int

    def _stage(self, job: Job, tasks: list[ChunkTask], *, lazy: bool) -> None:
        """Copy ``tasks`` into pool blocks and hand each block to a flush thread.

        Eager tasks (buffers, RNG, extras: no fence protects them) are staged
        on the trainer's thread inside ``snapshot()``; lazy ones on the stager
        thread. CPU copies are handed over one by one. CUDA copies go on the
        copy stream and are handed over in batches: at the end, and whenever
        the pool has no room for the next block -- the batch's copies must
        land and be written to make room, and waiting for blocks only this
        step can free would deadlock.

        A block is this function's until a flush thread owns it: on any
        failure it is released (after the copy stream is done with it), so
        a failed step never shrinks the pool.
        """
        pool = job.pool or self.pool
        assert pool is not None
        flush_now = self._helper is None and not self._tier  # the memory tier writes later, if at all
        if not lazy and job.hold and self.before_copy is None:
            tasks = self._stage_grouped(job, pool, tasks, flush_now)  # small CPU tensors: copied in groups
        batch: list[tuple[ChunkTask, torch.Tensor]] = []  # CUDA copies issued, not handed over
        block: torch.Tensor | None = None
        guard = job.guard if lazy else None
        try:
            for i, t in enumerate(tasks):
                if self.before_copy is not None:
                    self.before_copy(job.plan.step, i, lazy)
                nbytes = task_bytes(t)
                block = pool.try_allocate(nbytes)
                if block is None:
                    if batch:
                        self._hand_over_cuda(job, batch, lazy, last=False)
                    block = pool.allocate(nbytes)  # backpressure: wait for earlier chunks' writes
                if lazy:
                    with self._cond:
                        self._queued_bytes -= pool.block_bytes(nbytes)
                        job.lazy_bytes -= pool.block_bytes(nbytes)
                dst = pool.view_as(block, t.source, t.shape)
                if t.source.device.type == "cuda":
                    self._cuda().copy(dst, t.source, job.ready[t.source.device.index], pool.pinned)
                    batch.append((t, dst))
                    block = None
                    check_guard(job, guard, i)  # issued: the copy stream reads the state at snapshot()
                else:
                    dst.copy_(t.source)
                    check_guard(job, guard, i)  # completed: a change before now is in the copy
                    job.views.append((t, dst))
                    if flush_now:
                        job.futures.append(self._flush.submit(self._flush_one, pool, job, t, dst, None))
                    block = None
            if batch:
                self._hand_over_cuda(job, batch, lazy, last=True)
        except BaseException:
            if block is not None:
                pool.release(block)
            if batch:
                self._release_after_copies(pool, batch)
            raise

    def _stage_grouped(self, job: Job, pool: HostPool, tasks: list[ChunkTask], flush_now: bool) -> list[ChunkTask]:
        """Stage the small eager CPU tasks of a held step (its blocks go back
        only once it is committed) in groups of one dtype: adjacent blocks
        placed at once, one ``torch._foreach_copy_`` per group, instead of an
        allocation and a copy call per tensor (tens of thousands of small
        tensors: issue 16). Returns the tasks left for the general path
        (large, CUDA, empty, or a group the pool has no room for now)."""
        rest: list[ChunkTask] = []
        group: list[ChunkTask] = []
        size = 0

        def copy_group() -> None:
            numels = [math.prod(t.shape) for t in group]
            parts = pool.try_allocate_parts(numels, group[0].source.dtype)
            if parts is None:
                rest.extend(group)  # staged one by one, waiting for room
                return
            dsts = [p if len(t.shape) == 1 else p.view(t.shape) for p, t in zip(parts, group)]
            try:
                torch._foreach_copy_(dsts, [t.source for t in group])
            except BaseException:
                for p in parts:
                    pool.release(p)
                raise
            job.views.extend(zip(group, dsts))
            if flush_now:  # (a held block is released at commit, not by its flush)
                job.futures.append(self._flush.submit(self._flush_many, pool, job, list(group), dsts))

        dtype = None  # the group's
        for t in tasks:
            nbytes = t.data_nbytes
            src = t.source
            if nbytes == 0 or nbytes >= GROUP_TASK_BYTES or not src.is_cpu:
                rest.append(t)
                continue
            if group and (src.dtype is not dtype or size + nbytes > GROUP_BYTES):
                copy_group()
                group, size = [], 0
            if not group:
                dtype = src.dtype
            group.append(t)
            size += nbytes
        if group:
            copy_group()
        return rest

    def _copy_lazy_cpu(self, job: Job) -> None:
        """Copy the lazy CPU tasks of ``job`` no one has claimed yet (the
        stager, or the trainer in the optimizer pre-hook; both may run it at
        once). Never raises: a failure is the step's (``job.error``), the
        guard's is reported at once; ``copies_done`` is set once every
        claimed copy finished. Small tasks of one dtype of a held step are
        claimed and copied in runs (one placement, one copy call; issue 16:
        the optimizer hook made ~66 copies of a small model one by one)."""
        pool = job.pool or self.pool
        assert pool is not None
        flush_now = self._helper is None and not self._tier
        grouped = job.hold and self.before_copy is None
        n = len(job.lazy)
        while True:
            with job.claim:
                i = job.next_copy
                if i >= n:
                    return
                if job.error is not None:  # the step failed: drop the rest unclaimed
                    job.copies_left -= n - i
                    job.next_copy = n
                    if job.copies_left == 0:
                        job.copies_done.set()
                    return
                j = _run_end(job.lazy, i) if grouped else i + 1
                job.next_copy = j
            try:
                if j - i == 1 or not self._copy_lazy_run(job, pool, i, j, flush_now):
                    for k in range(i, j):
                        self._copy_lazy_one(job, pool, k, flush_now)
            except GuardTripped as e:
                with job.claim:
                    job.error = job.error or e.error
                self._report_once(job, e.error)  # the trainer's next call raises it
            except BaseException as e:
                with job.claim:
                    job.error = job.error or e
            finally:
                with job.claim:
                    job.copies_left -= j - i
                    if job.copies_left == 0:
                        job.copies_done.set()

    def _copy_lazy_one(self, job: Job, pool: HostPool, i: int, flush_now: bool) -> None:
        """Copy lazy task ``i`` into a block of its own (waiting for room)."""
        t, block = job.lazy[i], None
        try:
            if self.before_copy is not None:
                self.before_copy(job.plan.step, i, True)
            nbytes = task_bytes(t)
            block = pool.try_allocate(nbytes)
            if block is None:
                block = pool.allocate(nbytes)  # backpressure: wait for earlier chunks' writes
            with self._cond:
                self._queued_bytes -= pool.block_bytes(nbytes)
                job.lazy_bytes -= pool.block_bytes(nbytes)
            dst = pool.view_as(block, t.source, t.shape)
            dst.copy_(t.source)
            check_guard(job, job.guard, i)  # completed: a change before now is in the copy
            with job.claim:
                job.views.append((t, dst))
                if flush_now:
                    job.futures.append(self._flush.submit(self._flush_one, pool, job, t, dst, None))
            block = None
        finally:
            if block is not None:
                pool.release(block)

    def _copy_lazy_run(self, job: Job, pool: HostPool, i: int, j: int, flush_now: bool) -> bool:
        """Copy lazy tasks ``i..j-1`` (small, CPU, one dtype) into adjacent
        blocks with one copy call; False (nothing done) if the pool has no
        room for them at once now."""
        group = job.lazy[i:j]
        numels = [math.prod(t.shape) for t in group]
        parts = pool.try_allocate_parts(numels, group[0].source.dtype)
        if parts is None:
            return False
        handed = False
        try:
            reserved = sum(pool.block_bytes(task_bytes(t)) for t in group)
            with self._cond:
                self._queued_bytes -= reserved
                job.lazy_bytes -= reserved
            dsts = [p if len(t.shape) == 1 else p.view(t.shape) for p, t in zip(parts, group)]
            torch._foreach_copy_(dsts, [t.source for t in group])
            for k in range(i, j):
                check_guard(job, job.guard, k)  # completed: a change before now is in the copy
            with job.claim:
                job.views.extend(zip(group, dsts))
                if flush_now:
                    job.futures.append(self._flush.submit(self._flush_many, pool, job, group, dsts))
            handed = True
        finally:
            if not handed:
                for p in parts:
                    pool.release(p)
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
            if last:
                job.cuda_done = done
                job.issued.set()
            for ev in done.values():
                ev.synchronize()
        else:
            for idx, ev in done.items():
                torch.cuda.current_stream(idx).wait_event(ev)
            job.cuda_eager.extend(done.values())
        while batch:
            t, dst = batch[0]
            job.views.append((t, dst))
            ready = None if lazy else done[t.source.device.index]
            if self._helper is None and not self._tier:
                job.futures.append(self._flush.submit(self._flush_one, job.pool, job, t, dst, ready))
            batch.pop(0)

    def _release_after_copies(self, pool: HostPool, batch: list[tuple[ChunkTask, torch.Tensor]]) -> None:
        """Return the blocks of issued CUDA copies that will not be flushed,
        once the copy stream is done writing into them."""
        try:
            for ev in self._cuda().done({t.source.device for t, _ in batch}).values():
                ev.synchronize()
        except BaseException:  # the device is gone: the blocks cannot be reused safely
            log.exception("dstt: CUDA copies did not finish; %d staging blocks stay reserved", len(batch))
            return
        for _, dst in batch:
            pool.release(dst)


def _run_end(tasks: list[ChunkTask], i: int) -> int:
    """The end of the run of small CPU tasks of one dtype starting at ``i``
    (at most GROUP_BYTES), copied together; ``i + 1`` when task ``i`` is not small."""
    first = tasks[i].source
    nbytes = task_bytes(tasks[i])
    if nbytes == 0 or nbytes >= GROUP_TASK_BYTES or not first.is_cpu:
        return i + 1
    size, j, dtype = nbytes, i + 1, first.dtype
    while j < len(tasks):
        src = tasks[j].source
        nbytes = task_bytes(tasks[j])
        if (nbytes == 0 or nbytes >= GROUP_TASK_BYTES or src.dtype != dtype or size + nbytes > GROUP_BYTES
                or not src.is_cpu):
            break
        size += nbytes
        j += 1
    return j
