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
import operator
from typing import Any

import torch

from dstt.capture import policy
from dstt.capture.committers import Committer
from dstt.capture.hooks import optimizer_storages, storage_key
from dstt.capture.hostpool import HostPool
from dstt.capture.ledger import Ledger
from dstt.capture.pipeline import GuardTripped, Job, check_guard, task_bytes
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
    committer: Committer
    ledger: Ledger
    _flush: Any
    _grouping: tuple[list[ChunkTask], list[StagedGroup], list[ChunkTask]]  # (see _stage_grouped)
    _sizes: tuple[list[ChunkTask], list[int], bool, int]  # (see _task_sizes)
    _split: tuple[list[ChunkTask], Any, list[Any], LazySplit]  # (see _split_lazy)

    def _split_lazy(self, tasks: list[ChunkTask], optimizer: Any) -> LazySplit:
        """The step's tasks split into eager ones and lazy ones (those whose
        storage ``optimizer.step()`` alone mutates: hooks.optimizer_storages),
        kept for the next step that brings the same task list, optimizer and
        parameters (tens of thousands of tensors: ~3 us each per step).

        (A task's source is a plan alias of the storage it had when planned,
        and a reused task list means every one still views it. Should the
        optimizer's state change without the task list changing, the split
        stays safe: a lazy copy is still checked by the mutation guard, and
        an eager one is always right.)"""
        if optimizer is None:
            return LazySplit(tasks, [], [])
        params = [p for g in optimizer.param_groups for p in g["params"]]
        cached: tuple[list[ChunkTask], Any, list[Any], LazySplit] | None = getattr(self, "_split", None)
        if (cached is not None and cached[0] is tasks and cached[1] is optimizer and len(cached[2]) == len(params)
                and all(map(operator.is_, params, cached[2]))):
            return cached[3]
        protected = optimizer_storages(optimizer)
        eager: list[ChunkTask] = []
        lazy: list[ChunkTask] = []
        for t in tasks:
            (lazy if storage_key(t.source) in protected else eager).append(t)
        split = LazySplit(eager if lazy else tasks, lazy, HostPool.blocks_bytes([t.data_nbytes for t in lazy]))
        self._split = (tasks, optimizer, params, split)
        return split

    def _task_sizes(self, tasks: list[ChunkTask]) -> tuple[list[int], bool, int]:
        """The data bytes of each task, whether any source is on a CUDA
        device, and the pool bytes the step takes held whole
        (policy.step_need_bytes); kept for the next step that brings the
        same task list (plan.py hands a step laid out as the previous one
        the same tasks, whose sources keep their device and size)."""
        cached: tuple[list[ChunkTask], list[int], bool, int] | None = getattr(self, "_sizes", None)
        if cached is not None and cached[0] is tasks:
            return cached[1], cached[2], cached[3]
        sizes = [t.data_nbytes for t in tasks]
        cuda = any(t.source.is_cuda for t in tasks)
        held_bytes = policy.step_need_bytes(HostPool.blocks_bytes(sizes))
        self._sizes = (tasks, sizes, cuda, held_bytes)
        return sizes, cuda, held_bytes

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
        a failed step never shrinks the pool. (The blocks of a held step --
        ``job.views`` and ``job.groups`` -- go back when it is settled,
        committed or failed: CrashSafe._settle.)
        """
        pool = job.pool or self.pool
        assert pool is not None
        flush_now = self.committer.needs.flush_now  # (the helper, the memory tier write later, if at all)
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
                    block = self._allocate(pool, nbytes, job)  # backpressure: wait for earlier chunks' writes
                if lazy:
                    with self.ledger.cond:
                        self.ledger.queued_bytes -= pool.block_bytes(nbytes)
                        job.lazy_bytes -= pool.block_bytes(nbytes)
                dst = pool.view_as(block, t.source, t.shape)
                if t.source.device.type == "cuda":
                    self._cuda().copy(dst, t.source, job.ready[t.source.device.index], pool.copy_mode(dst))
                    batch.append((t, dst))
                    block = None
                    check_guard(job, guard, i)  # issued: the copy stream reads the state at snapshot()
                else:
                    dst.copy_(t.source)
                    check_guard(job, guard, i)  # completed: a change before now is in the copy
                    job.views.append((t, dst))
                    if self.committer.needs.keep_spans:
                        job.spans.append(dst)
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
        per-task view into a group is ever made (``job.groups``: the seal
        record takes each group's tasks as back to back from its block's
        start, and the step's settling releases whole blocks); otherwise the
        views go to ``job.views`` (what the flush and the memory tier read)."""
        cached: tuple[list[ChunkTask], list[StagedGroup], list[ChunkTask]] | None = getattr(
            self, "_grouping", None)
        if cached is not None and cached[0] is tasks:
            groups, rest = cached[1], list(cached[2])
        else:
            groups, rest = group_tasks(tasks)
            self._grouping = (tasks, groups, list(rest))
        keep = self._keep_groups()
        for g in groups:
            block = pool.try_allocate(g.nbytes)
            if block is None:
                rest.extend(g.tasks)  # staged one by one, waiting for room
                continue
            try:
                dst = g.fill(block)
            except BaseException:
                pool.release(block)
                raise
            if keep:
                job.groups.append((g, dst))
                continue
            if self.committer.needs.keep_spans:
                job.spans.append(dst)
            dsts = g.views(dst)
            job.views.extend(zip(g.tasks, dsts))
            if flush_now:  # (a held block is released at commit, not by its flush)
                job.futures.append(self._flush.submit(self._flush_many, pool, job, g.tasks, dsts))
        return rest

    def _keep_groups(self) -> bool:
        """Whether a staged group stays whole (``job.groups``), its tasks
        never given views of their own: with the capture helper and no
        memory tier, where only the seal record (ring.seal_record reads
        groups) and the release of the step's blocks need them (issue 16:
        88 views per step of a small loop were ~0.2 ms of the stager's
        Python, which the trainer's own Python waits for)."""
        return self.committer.needs.keep_groups

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
        flush_now = self.committer.needs.flush_now
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
                group = None
                if not grouped:
                    j = i + 1
                elif job.lazy_runs is not None:  # (the runs of the step's LazySplit, made once)
                    j, group = job.lazy_runs[i]
                else:
                    j = _run_end(job.lazy, i)
                job.next_copy = j
            try:
                if j - i == 1 or not self._copy_lazy_run(job, pool, i, j, flush_now, group):
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
                block = self._allocate(pool, nbytes, job)  # backpressure: wait for earlier chunks' writes
            with self.ledger.cond:
                self.ledger.queued_bytes -= pool.block_bytes(nbytes)
                job.lazy_bytes -= pool.block_bytes(nbytes)
            dst = pool.view_as(block, t.source, t.shape)
            dst.copy_(t.source)
            check_guard(job, job.guard, i)  # completed: a change before now is in the copy
            with job.claim:
                job.views.append((t, dst))
                if self.committer.needs.keep_spans:
                    job.spans.append(dst)
                if flush_now:
                    job.futures.append(self._flush.submit(self._flush_one, pool, job, t, dst, None))
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
            with job.claim:
                if dsts is None:
                    job.groups.append((group, dst))
                else:
                    job.views.extend(zip(group.tasks, dsts))
                    if self.committer.needs.keep_spans:
                        job.spans.append(dst)
                    if flush_now:
                        job.futures.append(self._flush.submit(self._flush_many, pool, job, group.tasks, dsts))
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
            if last:
                job.cuda_done = done
                job.issued.set()
            for ev in done.values():
                ev.synchronize()  # unbounded wait: device work of this step (the GPU's own queue)
        else:
            for idx, ev in done.items():
                torch.cuda.current_stream(idx).wait_event(ev)
            job.cuda_eager.extend(done.values())
        while batch:
            t, dst = batch[0]
            job.views.append((t, dst))
            if self.committer.needs.keep_spans:
                job.spans.append(dst)
            ready = None if lazy else done[t.source.device.index]
            if self.committer.needs.flush_now:
                job.futures.append(self._flush.submit(self._flush_one, job.pool, job, t, dst, ready))
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


class LazySplit:
    """A step's tasks copied in ``snapshot()`` (eager) and after it (lazy),
    the lazy sources and names for the mutation guard, and the pool bytes
    the lazy blocks take. Read-only (shared by the steps of one layout)."""

    __slots__ = ("eager", "lazy", "sources", "names", "lazy_bytes", "on_cpu", "_runs")

    def __init__(self, eager: list[ChunkTask], lazy: list[ChunkTask], lazy_blocks: list[int]) -> None:
        self.eager = eager
        self.lazy = lazy
        self.sources = [t.source for t in lazy]
        self.names = [t.layout.name for t in lazy]
        self.lazy_bytes = sum(lazy_blocks)
        self.on_cpu = all(s.is_cpu for s in self.sources)  # (Job.cpu_lazy)
        self._runs: dict[int, tuple[int, StagedGroup | None]] | None = None

    def runs(self) -> dict[int, tuple[int, StagedGroup | None]]:
        """For the first lazy task of each run (_run_end): the run's end,
        and the run as a StagedGroup when it has more than one task. Made
        on first use, then shared by the steps of this split."""
        if self._runs is None:
            runs: dict[int, tuple[int, StagedGroup | None]] = {}
            i = 0
            while i < len(self.lazy):
                j = _run_end(self.lazy, i)
                runs[i] = (j, StagedGroup(self.lazy[i:j]) if j - i > 1 else None)
                i = j
            self._runs = runs
        return self._runs


class StagedGroup:
    """Small CPU tasks of one dtype staged in one pool block, back to back
    (the block holds ``nbytes``; task ``k`` its ``numels[k]`` elements)."""

    __slots__ = ("tasks", "dtype", "nbytes", "numels", "flat", "flat_views", "block_bytes")

    def __init__(self, tasks: list[ChunkTask]) -> None:
        self.tasks = tasks
        self.dtype = tasks[0].source.dtype
        self.numels = [math.prod(t.shape) for t in tasks]
        self.nbytes = sum(self.numels) * tasks[0].source.element_size()
        #: The pool bytes these tasks count for one by one (Capture._queued_bytes, Job.lazy_bytes).
        self.block_bytes = sum(HostPool.blocks_bytes([t.data_nbytes for t in tasks]))
        #: Each task's view is its part of the block as is (1-D parts).
        self.flat_views = all(len(t.shape) == 1 for t in tasks)
        #: The sources as 1-D tensors for one torch.cat into the block, or
        #: None (some source is not contiguous or needs autograd: copied
        #: with _foreach_copy_ into per-task views). The sources are the
        #: plan's detached aliases: their layout never changes.
        self.flat: list[torch.Tensor] | None = None
        if all(t.source.is_contiguous() and not t.source.requires_grad for t in tasks):
            self.flat = [s if s.dim() == 1 else s.view(-1) for s in (t.source for t in tasks)]

    def fill(self, block: torch.Tensor) -> torch.Tensor:
        """Copy the tasks' sources into ``block`` (a pool block of
        ``nbytes``) with one call; the block as the group's dtype."""
        dst = block.view(self.dtype)
        if self.flat is not None:
            torch.cat(self.flat, out=dst)
        else:
            torch._foreach_copy_(self.views(dst), [t.source for t in self.tasks])
        return dst

    def views(self, dst: torch.Tensor) -> list[torch.Tensor]:
        """Each task's view into ``dst`` (the group's block, as its dtype)."""
        parts = list(dst.split(self.numels))
        if self.flat_views:
            return parts
        return [p if len(t.shape) == 1 else p.view(t.shape) for p, t in zip(parts, self.tasks)]


def group_tasks(tasks: list[ChunkTask]) -> tuple[list[StagedGroup], list[ChunkTask]]:
    """Runs of small CPU tasks of one dtype (at most GROUP_BYTES each), and
    the tasks staged one by one (empty, large or not on the CPU)."""
    rest: list[ChunkTask] = []
    groups: list[StagedGroup] = []
    group: list[ChunkTask] = []
    size = 0
    dtype = None  # the group's
    for t in tasks:
        nbytes = t.data_nbytes
        src = t.source
        if not _groupable(nbytes, src):
            rest.append(t)
            continue
        if group and (src.dtype is not dtype or size + nbytes > GROUP_BYTES):
            groups.append(StagedGroup(group))
            group, size = [], 0
        if not group:
            dtype = src.dtype
        group.append(t)
        size += nbytes
    if group:
        groups.append(StagedGroup(group))
    return groups, rest


def _groupable(nbytes: int, src: torch.Tensor) -> bool:
    """A task of ``nbytes`` from ``src`` may be copied in a group of small
    CPU tasks (group_tasks, _run_end): not empty, small, in host memory."""
    return 0 < nbytes < GROUP_TASK_BYTES and src.is_cpu


def _run_end(tasks: list[ChunkTask], i: int) -> int:
    """The end of the run of small CPU tasks of one dtype starting at ``i``
    (at most GROUP_BYTES), copied together; ``i + 1`` when task ``i`` is not small."""
    first = tasks[i].source
    nbytes = task_bytes(tasks[i])
    if not _groupable(nbytes, first):
        return i + 1
    size, j, dtype = nbytes, i + 1, first.dtype
    while j < len(tasks):
        src = tasks[j].source
        nbytes = task_bytes(tasks[j])
        if not _groupable(nbytes, src) or src.dtype != dtype or size + nbytes > GROUP_BYTES:
            break
        size += nbytes
        j += 1
    return j
