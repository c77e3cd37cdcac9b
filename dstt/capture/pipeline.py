"""Pieces of the capture pipeline shared by its threads: one step's job,
the mutation-guard check at each copy, and thread priority.

A :class:`Job` travels trainer → stager → flush threads → committer; each
event marks a stage, in this order: ``issued`` (lazy copies enqueued),
``staged`` (they landed in host memory), ``submitted`` (every flush future
exists and, with a ring, the step is sealed).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from dstt.capture.guard import VersionGuard
from dstt.capture.hostpool import HostPool
from dstt.errors import CaptureError
from dstt.store.plan import ChunkTask, StepPlan
from dstt.store.torchthreads import limit_this_thread

log = logging.getLogger("dstt.capture")


@dataclass(eq=False)  # identity: `job in list` never compares tensors (issue 29: a second rewind raised RuntimeError)
class Job:
    """One planned step travelling through the pipeline."""

    plan: StepPlan
    lazy: list[ChunkTask]
    ready: dict[int, Any] = field(default_factory=dict)  # CUDA: compute-stream events at snapshot()
    lazy_bytes: int = 0
    skip: str | None = None  # why the step is skipped (then nothing else is set)
    futures: list[Future[Any]] = field(default_factory=list)
    error: BaseException | None = None
    cuda_done: dict[int, Any] = field(default_factory=dict)  # CUDA: copy-stream events after lazy copies
    issued: threading.Event = field(default_factory=threading.Event)  # lazy copies enqueued
    staged: threading.Event = field(default_factory=threading.Event)  # lazy copies complete in host memory
    submitted: threading.Event = field(default_factory=threading.Event)  # every flush future exists
    guard: VersionGuard | None = None  # versions of the lazy sources at snapshot()
    cuda_eager: list[Any] = field(default_factory=list)  # events after eager CUDA copies
    #: Device staging (devicestage.py): each lazy task's source as copied on
    #: its device inside snapshot(), what the stager copies to the host; None
    #: when the step takes the usual path, or once those copies landed.
    early: Sequence[torch.Tensor] | None = None
    device_staged: bool = False  # (early was set: the optimizer hook does not wait for the stager)
    reported: bool = False  # its failure was already queued for the trainer (under the ledger's lock)
    writer: Any = None  # the Writer that stores it (a rewind switches writers)
    info: Any = None  # its CommitInfo once stored
    # Each copy's destination in the pool (a group's block, or one task's),
    # what the NaN/Inf watcher reads: a few reductions per step, not one per
    # tensor (watcher.py). Appended by whoever copies (under ``claim``), when
    # the mode asks for them (committers.StagingNeeds.keep_spans).
    spans: list[torch.Tensor] = field(default_factory=list)
    tier: TierState = field(default_factory=lambda: TierState())  # the memory tier's part (tier.py)
    ring: RingState = field(default_factory=lambda: RingState())  # its blocks, held and sealed (crashsafe.py)
    copies: LazyCopies = field(default_factory=lambda: LazyCopies())  # the stager's claims of its lazy copies

    @property
    def cpu_lazy(self) -> bool:
        """Every lazy source is in host memory (its copies may be stolen)."""
        copies = self.copies
        if copies.on_cpu is None:
            copies.on_cpu = all(t.source.is_cpu for t in self.lazy)
        return copies.on_cpu

    def finish_staging(self) -> None:
        self.issued.set()
        self.staged.set()
        self.submitted.set()


@dataclass
class RingState:
    """Where a :class:`Job`'s bytes are staged and their life in the ring
    (crashsafe.py: sealed for the capture helper and crash survival;
    committers.py: handed over). Set by the committer's ``place`` (pool,
    hold) and the stager (views, groups); sealed by the stager thread."""

    pool: HostPool | None = None  # the pool (or the memory tier's slot) it is staged in
    hold: bool = False  # its blocks are held until it is committed (then it is sealed in the ring)
    # The staged copies: (task, its block) for each, handed to the flush
    # threads, the memory tier and the seal record.
    views: list[tuple[ChunkTask, torch.Tensor]] = field(default_factory=list)
    # With the capture helper and no memory tier: groups of small tasks
    # staged in one block each, (copygroups.StagedGroup, the block), whose tasks
    # have no view in ``views`` (Stager._keep_groups); sealed and released whole.
    groups: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    sealed: bool = False
    seal_error: str | None = None  # why a held step could not be sealed (CrashSafe.seal)
    sent: bool = False  # handed to the capture helper, its answer not read yet (committers.py)


@dataclass
class LazyCopies:
    """The stager's claims of a :class:`Job`'s lazy CPU copies: each is
    claimed once, by the stager thread or -- when the optimizer would
    otherwise wait for a stager starved of CPU -- by the trainer in the
    optimizer pre-hook (Stager.copy_lazy_cpu)."""

    claim: threading.Lock = field(default_factory=threading.Lock)
    next: int = 0  # the next lazy task no one claimed (under claim)
    left: int = -1  # lazy copies not finished (under claim; -1: not counted yet)
    done: threading.Event = field(default_factory=threading.Event)
    on_cpu: bool | None = None  # Job.cpu_lazy, once known (the lazy tasks do not change)
    #: Runs of small lazy tasks copied together, by first index: (end, StagedGroup or None)
    #: (copygroups.LazySplit.runs; None: found while copying, copygroups.run_end).
    runs: dict[int, tuple[int, Any]] | None = None


@dataclass
class TierState:
    """The memory tier's part of a :class:`Job` (tier.py, watcher.NanWatch;
    all under the ledger's lock). Untouched in the other modes."""

    slot: Any = None  # its slot of the tier's SlotPool
    refs: int = 0  # holders of the slot: the ring, a pending persist, a pinned successor, the watcher, a rewind
    decision: str = ""  # "" undecided, "persist", "memory" (passed over), "done", "failed"
    forced: bool = False  # an incident or rewind wants it stored
    prev_job: Job | None = None  # the step captured just before it, pinned while this one is written
    staged: bool = False  # staged and in the ring
    checking: bool = False  # the NaN/Inf watcher (or the trainer) is checking it
    nonfinite: tuple[str, ...] | None = None  # the check's result: the non-finite tensors
    watched: bool = False  # checked and settled, in step order
    done: threading.Event = field(default_factory=threading.Event)  # stored, failed or passed over


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Make the calling (background) thread yield to the trainer: its torch
    operations single-threaded, its nice value raised to ``nice``, and with
    ``idle`` Linux's SCHED_IDLE policy (Linux, where both are per thread;
    elsewhere they would apply to the whole process). Nothing of the
    process changes: no torch setting, no other thread (issue 23).

    Single-threaded because with the OpenMP backend every thread calling
    into torch runs its own team of ``get_num_threads()`` workers: stats
    and checksums of a background thread then preempt the trainer's own
    team, whose workers spin at each barrier for the one descheduled (an
    optimizer step measured 4x slower beside a background writer on 2
    cores). Only this thread's OpenMP team size is set
    (:func:`dstt.store.torchthreads.limit_this_thread`): ``torch.set_num_threads``
    would also set the count every thread of the trainer adopts at its
    first operation.

    SCHED_IDLE because a nice value only shares the CPU: a thread at nice
    10 keeps a core for the rest of its time slice when one of the
    trainer's OpenMP workers wakes up on it, and the whole parallel region
    waits for that worker. A SCHED_IDLE thread is preempted at once."""
    if not limit_this_thread():
        log.debug("dstt: no OpenMP runtime found: background torch operations use torch's thread count")
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    if nice > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
        except OSError as e:  # a sandbox may refuse; capture works the same, only less politely
            log.debug("could not lower dstt thread priority: %s", e)
    if idle:
        set_idle_policy(tid)


def lower_priority(config: Any) -> None:
    """:func:`lower_thread_priority` as ``config`` (a CaptureConfig) asks:
    run first on each background thread of a Capture."""
    lower_thread_priority(config.background_nice, config.background_idle)


def set_idle_policy(tid: int = 0) -> None:
    """Put thread ``tid`` (0: the caller) under SCHED_IDLE where Linux
    allows it (lowering one's own policy needs no privilege; a sandbox may
    still refuse: then only its nice value applies)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError as e:
        log.debug("could not put a dstt thread under SCHED_IDLE: %s", e)


class GuardTripped(Exception):
    """Internal: a lazy source changed before its copy (carries the CaptureError)."""

    def __init__(self, error: CaptureError) -> None:
        super().__init__(str(error))
        self.error = error


def check_guard(job: Job, guard: VersionGuard | None, i: int, j: int | None = None) -> None:
    """GuardTripped if lazy source ``i`` (or sources ``i..j-1``, copied by
    one call) changed before its copy completed."""
    if guard is None:
        return
    violation = guard.copied(i) if j is None else guard.copied_range(i, j)
    if violation is not None:
        raise GuardTripped(CaptureError(f"step {job.plan.step} not captured: {violation}"))


def is_interrupt(e: BaseException) -> bool:
    return isinstance(e, (KeyboardInterrupt, SystemExit))


def task_bytes(task: ChunkTask) -> int:
    return task.data_nbytes
