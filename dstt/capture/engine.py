"""``dstt.Capture``: lazy asynchronous capture of a training run.

Data flow of one step (docs/capture.md has the long version)::

    trainer   snapshot(k): plan (collective) → eager copies → queue ─┐
    stager    lazy copies into the pool (CPU memcpy / CUDA copy stream) ├→ flush pool
    flush     stats + sha256 + dedup + encode + write, release block  ─┘
    committer in step order: wait the step's chunks → Writer.commit (collective)

Threads and what they may touch:

* the trainer thread plans (``Writer.plan`` uses the planning coordinator),
  performs eager copies and queues work; it blocks only on pool backpressure
  and, through the optimizer pre-hook, on the previous step's lazy copies;
* one stager thread performs lazy copies in queue order, so "the last
  queued job is staged" implies every earlier one is;
* flush threads run ``Writer.flush_chunk`` (thread-safe) and return blocks;
* one committer thread calls ``Writer.commit`` (its own coordinator, so its
  collectives never interleave with planning's) for every planned step in
  order, passing the step's first error: under torch.distributed every rank
  then learns the step failed and nobody waits forever.

The parts, built once by the constructor (``Capture.parts`` shows them):

* ``ledger`` (ledger.py): the pipeline's bookkeeping and its one lock --
  pending and queued steps, errors, counters, progress, the bounded waits;
* ``committer`` (committers.py): one per mode, chosen once by
  ``make_committer`` -- in process, the capture helper, the memory tier
  (which owns ``MemoryTier``, tier.py, and its ``NanWatch``) -- the only
  place the modes are told apart;
* the crash-safe ring and helper (crashsafe.py: ``_ring``, ``_helper``,
  the seal keeper), the stager's pool and copies (stager.py, hostpool.py)
  -- still mixins of this class;
* ``watcher`` (watcher.py): ``incident()``; ``rewinder`` (rewind.py):
  ``rewind()`` and the switch to its branch.

One ``snapshot()`` reads top to bottom in :meth:`Capture.snapshot`,
:meth:`Capture._snapshot_state` and :meth:`Capture._prepare` here, then
``Committer.place``/``enqueue``/``staged``/``run`` of its mode.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dstt.capture import policy
from dstt.capture.committers import Committer, make_committer
from dstt.capture.config import CaptureConfig, make_config
from dstt.capture.crashsafe import CrashSafe, after_helpers
from dstt.capture.draining import Draining
from dstt.capture.guard import VersionGuard
from dstt.capture.helper import HelperHandle
from dstt.capture.hooks import StepFence
from dstt.capture.hostpool import CudaCopier, HostPool
from dstt.capture.ledger import Ledger
from dstt.capture.lifecycle import LIVE
from dstt.capture.parts import Parts
from dstt.capture.pipeline import (
    GuardTripped,
    Job,
    is_interrupt,
    lower_thread_priority,
    task_bytes,
)
from dstt.capture.rewind import Rewinder
from dstt.capture.stager import Stager
from dstt.capture.watcher import Watcher
from dstt.errors import CaptureError, ConfigError, SkippedStepWarning
from dstt.format.incidents import Incident
from dstt.format.layout import validate_step
from dstt.format.pygc import paused_gc
from dstt.store.coord import new_coordinator
from dstt.store.plan import ChunkTask
from dstt.store.state import state_of
from dstt.store.writer import ChunkResult, CommitInfo, Writer

__all__ = ["Capture", "Parts", "lower_thread_priority"]

log = logging.getLogger("dstt.capture")


#: Steps remembered per branch as captured by this Capture (older ones are
#: found in the store: committed, or recorded as memory-only).
CAPTURED_LOG = 4096


class Capture(Draining, Stager, CrashSafe):
    """Capture a training run's state at nearly every iteration, in the background.

    Call ``snapshot(step, ...)`` right after ``optimizer.step()``. It plans the
    step and returns; the copy overlaps the next forward and backward, and the
    optimizer's next step waits only if that copy is unfinished. Writing
    happens in background threads. ``wait()`` returns when everything queued
    is durable; ``close()`` drains and releases. A background failure is raised
    as :class:`dstt.CaptureError` (naming the step) by the next ``snapshot``,
    ``wait`` or ``close``.

    >>> import tempfile, torch, dstt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.Adam(model.parameters())
    >>> path = tempfile.mkdtemp() + "/run"
    >>> with dstt.Capture(path, every=1) as cap:
    ...     for step in range(3):
    ...         model(torch.randn(8, 4)).sum().backward()
    ...         opt.step(); opt.zero_grad()
    ...         _ = cap.snapshot(step, model=model, optimizer=opt)
    >>> run = dstt.open(path)
    >>> run.steps(), torch.equal(run.state_dict(2)["model"]["weight"], model.weight)
    ([0, 1, 2], True)
    """

    def __init__(self, store: Any, config: CaptureConfig | None = None, **overrides: Any) -> None:
        self.config = make_config(config, overrides)
        self._store_by_name = isinstance(store, (str, os.PathLike))
        self._store_arg = store  # a rewind opens a writer of the new branch on it
        cfg = self.config
        self.ledger = Ledger(branch=lambda: self.config.branch, limit_s=cfg.background_timeout_s)
        self.watcher = Watcher(self)  # incident() (the NaN/Inf watcher is the memory tier's)
        # Two coordinators: planning runs on this thread, commits on the
        # committer thread; sharing one gloo group would interleave them.
        self._plan_coord = new_coordinator()
        self._commit_coord = new_coordinator()
        if cfg.memory_steps is not None and self._plan_coord.distributed:
            # Each rank would choose its own steps to store (persist="newest",
            # its own NaN incidents) while commits are collective.
            self._plan_coord.close()
            self._commit_coord.close()
            raise ConfigError("memory_steps: the flight recorder runs in a single process for now; under "
                              "torch.distributed capture with persist='all' (no memory_steps)")
        self.writer = after_helpers(lambda: Writer(
            store, branch=cfg.branch, parent=cfg.parent,
            # the default (None): predictive where the helper codes -- settled below, once it is known;
            # under torch.distributed steps are stored whole (no shared chain yet): no compression
            compression=cfg.compression or ("none" if self._plan_coord.distributed else "auto"),
            zstd_level=cfg.zstd_level, keyframe_every=cfg.keyframe_every, max_chunk_bytes=cfg.max_chunk_bytes,
            allow_pickle=cfg.allow_pickle, dedup=cfg.dedup, threads=1,
            coordinator=self._plan_coord, commit_coordinator=self._commit_coord,
            storage_options=cfg.storage_options,
        ), store, cfg.branch)
        self.rank = self._plan_coord.rank
        self.pool: HostPool | None = None
        self._pool_in_ring = False
        self.recovered: list[int] = []  # steps sealed by a dead trainer, committed at construction
        self._ring = self._open_ring()  # before any thread: recovery commits on this thread
        try:
            self._helper: HelperHandle | None = None  # started by make_committer where it can run
            # The one choice of mode (committers.py): in this process, the capture helper, the memory tier.
            self.committer: Committer = make_committer(self)
            if cfg.compression is None:  # the default: predictive where the helper codes (config.py)
                self._default_compression("auto" if self._helper is not None and not self._plan_coord.distributed
                                          else "none")
        except BaseException:
            if self._ring is not None:
                self._ring.close()
            self.writer.close()
            raise
        self._copier: CudaCopier | None = None
        self._fence = StepFence(self._before_optimizer_step)
        self._flush = ThreadPoolExecutor(cfg.flush_threads, thread_name_prefix="dstt-flush",
                                         initializer=self._lower_priority)
        # (SimpleQueue: put and get in C; queue.Queue's Python condition
        # variables cost the trainer tens of microseconds per step: issue 16)
        self._stage_q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._commit_q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._last: Job | None = None  # the latest job with lazy copies
        self._copying: collections.deque[Job] = collections.deque()  # lazy CPU jobs not yet copied, in order
        self.skipped: list[int] = []
        self._closed = False
        self._pid = os.getpid()  # a forked child holds a copy of this object, never the pipeline
        #: Injection point for tests and tools: called on the stager thread as
        #: ``before_copy(step, index, lazy)`` before each copy into the pool
        #: (on the stager thread for lazy copies); an exception fails the step.
        self.before_copy: Callable[[int, int, bool], Any] | None = None
        #: Injection point for tests and tools: called on the stager thread as
        #: ``after_seal(job)`` once a held step is sealed in the ring (before
        #: it is handed to the capture helper); an exception fails the step.
        self.after_seal: Callable[[Job], Any] | None = None
        self._stager = threading.Thread(target=self._stage_loop, name="dstt-stager", daemon=True)
        self.rewinder = Rewinder(self)  # rewind(), and the switch to its branch
        self._committer = threading.Thread(target=self.committer.run, name="dstt-committer", daemon=True)
        self._stager.start()
        self._committer.start()
        self.committer.start()
        LIVE.add(self)

    # ================================================================ trainer API

    def snapshot(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        rng: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Queue the capture of ``step`` (what :func:`dstt.state_of` builds).

        Returns True if the step was queued, False if ``every`` skips it or
        the skip policy dropped it. Under torch.distributed every rank calls
        it for the same steps. See the class docstring for an example.
        """
        self._check_open()
        validate_step(step)  # before `every`: a bad step is refused, never silently skipped
        if not policy.is_due(step, self.config.every):
            self.raise_pending()
            return False
        self.rewinder.switch_if_forked()  # (a rewind's branch, opened at the next snapshot)
        state = state_of(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng, extra=extra)
        # Planning, splitting and staging build objects per tensor, none in
        # cycles: the cyclic GC, which walks every live object, waits (issue 16).
        with paused_gc():
            return self._snapshot_state(step, state, optimizer)

    def _snapshot_state(self, step: int, state: Any, optimizer: torch.optim.Optimizer | None) -> bool:
        # With the capture helper the step is stored by the helper's writer
        # (it adopts the plan): this one keeps no reference chain for it.
        plan = self.writer.plan(step, state, track=self.committer.track_plan)  # collective under torch.distributed
        # The step is planned on every rank. Whatever fails from here on, it
        # is queued, so that its (collective) commit runs and fails on every
        # rank instead of leaving a peer waiting. An interrupt (Ctrl-C) fails
        # the step the same way and is raised once the step is queued.
        job = Job(plan, [], writer=self.writer)
        eager: list[ChunkTask] = []
        try:
            eager = self._prepare(job, optimizer)
        except BaseException as e:
            job.error = e
        if self.config.on_full == "skip":
            why = self._skip_reason(job)  # collective under torch.distributed
            if why is not None:
                if job.error is not None and not is_interrupt(job.error):
                    self.ledger.fail(step, job.error)
                self._queue_skip(job, why)
                return self._after_queueing(job, queued=False)
        if job.error is None:
            try:
                self._stage(job, eager, lazy=False)
            except BaseException as e:
                job.error = e
        self._enqueue(job)
        return self._after_queueing(job, queued=True)

    def _prepare(self, job: Job, optimizer: torch.optim.Optimizer | None) -> list[ChunkTask]:
        """Split the step into lazy and eager tasks, make sure the pool holds
        it, and mark the state's point in each CUDA stream; the eager tasks."""
        if optimizer is not None:
            self._fence.watch(optimizer)
        # (eager: read-only, a later step's plan and split may bring this list again)
        split = self._split_lazy(job.plan.tasks, optimizer)
        eager = split.eager
        if split.lazy:
            job.lazy = list(split.lazy)
            job.lazy_on_cpu = split.on_cpu
            job.lazy_runs = split.runs()
            job.guard = VersionGuard(split.sources, split.names)
        # One pass each over the tasks (tens of thousands of them: issue 16),
        # none for the task list of an earlier step (Stager._task_sizes).
        sizes, cuda, held_bytes = self._task_sizes(job.plan.tasks)
        self.committer.place(job, sizes, cuda, held_bytes)  # the pool (or slot); held until committed?
        job.lazy_bytes = split.lazy_bytes
        devices = {t.source.device for t in job.plan.tasks if t.source.is_cuda} if cuda else set()
        if devices:
            job.ready = self._cuda().after_compute(devices)
        return eager

    def _enqueue(self, job: Job) -> None:
        captured = self.watcher.captured  # (incident(step=) takes the steps captured)
        log_ = captured.get(job.writer.branch.name)
        if log_ is None:
            log_ = captured[job.writer.branch.name] = collections.deque(maxlen=CAPTURED_LOG)
        log_.append(job.plan.step)
        self.committer.enqueue(job)

    def _queue_lazy(self, job: Job) -> None:
        """Hand a job with lazy copies to the stager (in queue order)."""
        self._last = job
        if job.lazy and job.cpu_lazy:
            job.copies_left = len(job.lazy)
            with self.ledger.cond:
                self._copying.append(job)
        else:
            job.copies_done.set()
        self._stage_q.put(job)

    def _after_queueing(self, job: Job, *, queued: bool) -> bool:
        if job.error is not None and is_interrupt(job.error):
            raise job.error
        self.raise_pending()
        return queued

    @property
    def parts(self) -> Parts:
        """The components of this Capture as they are now, for tests and
        tools (a view: a rewind gives the new branch its own ring, helper and
        committer). Read them; inject faults only through their documented
        hooks (``Ring.before_op``, ``Capture.before_copy``, ``Capture.after_seal``)."""
        tier = self.committer.memory_tier
        threads = {"stager": self._stager, "committer": self._committer}
        threads.update((t.name, t) for t in self._flush._threads)
        threads.update(self.committer.threads())
        split = getattr(self, "_split", None)
        with self.ledger.cond:
            held = () if tier is None else tuple(tier._held)
        slots = None if tier is None else tier._slots
        return Parts(ledger=self.ledger, committer=self.committer, ring=self._ring, helper=self._helper,
                     pool=self.pool, pool_in_ring=self._pool_in_ring, slots=slots, tier_held=held,
                     last_job=self._last, lazy_split=None if split is None else split[3], threads=threads,
                     coordinators=(self._plan_coord, self._commit_coord))

    @property
    def committed(self) -> list[CommitInfo]:
        """The latest commits (at most :data:`RECENT_COMMITS`; ``n_committed``
        counts them all, ``last_commit`` is the newest)."""
        return self.ledger.commits()

    def rewind(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        rng: bool = True,
        branch: str | None = None,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Restore ``model``/``optimizer``/``scheduler``/RNG to captured
        ``step`` and continue on a new branch forked there (``branch``, or
        ``<branch>-rewind-<step>``); returns the step's ``extra`` (where the
        trainer keeps its data position, to skip the batches that caused a
        spike). Validated all or nothing like :func:`dstt.restore`, and every
        argument before anything changes: a refused rewind (a bad argument,
        ``branch`` the one being captured or one that exists --
        BranchExistsError --, a step neither in the memory tier nor stored,
        a step that does not fit the live objects) leaves the live objects,
        the store and the memory tier as they were and records no incident.

        From the memory tier when the step is still there (milliseconds),
        else from the store. The ring's steps are stored on the old branch
        (an incident, source "rewind").

        >>> import tempfile, torch, dstt
        >>> m = torch.nn.Linear(2, 1)
        >>> path = tempfile.mkdtemp() + "/run"
        >>> with dstt.Capture(path, memory_steps=4) as cap:
        ...     for s in range(3):
        ...         with torch.no_grad(): m.weight += 1
        ...         _ = cap.snapshot(s, model=m, extra={"batch": s})
        ...     cap.rewind(1, model=m, branch="retry")
        ...     _ = cap.snapshot(2, model=m)
        {'batch': 1}
        >>> dstt.open(path).branch_info("retry").parent
        StepRef(branch='main', step=1)
        """
        self._check_open()
        return self.rewinder.rewind(step, model=model, optimizer=optimizer, scheduler=scheduler, rng=rng,
                                    branch=branch, strict=strict)

    def incident(self, reason: str, *, step: int | None = None) -> Incident:
        """Something went wrong (a loss spike, a bad batch): store every step
        still in the memory tier -- the steps that led up to it -- and record
        the incident (``dstt ls``, ``dstt find`` and the report show it).

        ``step``: the step it concerns (default: the latest captured one): a
        step this branch captured -- queued, in the memory tier, stored, or
        passed over as memory-only -- else StepNotFoundError, and nothing is
        recorded or stored. Returns the recorded
        :class:`~dstt.format.incidents.Incident`. Without ``memory_steps``
        only the record is written.

        >>> import tempfile, torch, dstt
        >>> m = torch.nn.Linear(2, 2)
        >>> path = tempfile.mkdtemp() + "/run"
        >>> with dstt.Capture(path, memory_steps=4, persist=2) as cap:
        ...     for s in range(4):
        ...         _ = cap.snapshot(s, model=m)
        ...     cap.wait_staged()
        ...     print(cap.incident("loss spike").steps)
        (0, 1, 2, 3)
        >>> dstt.open(path).steps()
        [0, 1, 2, 3]
        """
        self._check_open()
        return self.watcher.incident(reason, step)

    @property
    def memory_bytes(self) -> int | None:
        """Host memory the memory tier holds: (memory_steps + 4) step slots,
        sized at the first snapshot (None before it, and without
        ``memory_steps``). With ``host_buffer_bytes`` it never exceeds that.

        >>> import tempfile, torch, dstt
        >>> with dstt.Capture(tempfile.mkdtemp() + "/r", memory_steps=2) as cap:
        ...     _ = cap.snapshot(0, model=torch.nn.Linear(4, 4))
        ...     cap.memory_bytes == 6 * cap.parts.slots.slot_bytes
        True
        """
        return self.committer.memory_bytes()

    @property
    def n_committed(self) -> int:
        """Steps committed by this Capture."""
        return self.ledger.n_committed

    @property
    def bytes_written(self) -> int:
        """Encoded bytes this Capture's commits wrote."""
        return self.ledger.bytes_written

    @property
    def last_commit(self) -> CommitInfo | None:
        """The newest commit of this Capture."""
        return self.ledger.last_commit

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not hide the exception already propagating
            self.close()
        except CaptureError as e:
            log.error("dstt capture failed while handling another exception: %s", e)

    # ================================================================ trainer internals

    def _check_open(self) -> None:
        if self._pid != os.getpid():
            raise CaptureError(f"this Capture belongs to process {self._pid}; a forked child cannot use it "
                               "(create its own Capture on another branch)")
        if self._closed:
            raise CaptureError("this Capture is closed")

    def _scan_guard(self) -> None:
        """The trainer's side of the mutation guard: a lazy source whose
        version moved before its copy ran fails its step, reported now."""
        job = self._last
        if job is None or job.guard is None or job.staged.is_set():
            return
        violation = job.guard.scan()
        if violation is not None:
            self._report_once(job, CaptureError(f"step {job.plan.step} not captured: {violation}"))

    def _report_once(self, job: Job, e: BaseException) -> None:
        with self.ledger.cond:
            if job.reported:
                return
            job.reported = True
        self.ledger.fail(job.plan.step, e)

    def _after_fork_in_child(self) -> None:
        """os.fork() copied this object but none of its threads: the child
        must neither wait for them nor release what the parent holds (the
        branch lock is forgotten by lock.py's own at-fork hook)."""
        self._closed = True
        self.ledger.cond = threading.Condition()
        self._fence = StepFence(lambda: None)  # the parent's hooks stay on the parent's optimizers
        self.committer.abandon_in_child()
        self._helper = None

    def _cuda(self) -> CudaCopier:
        if self._copier is None:
            self._copier = CudaCopier()
        return self._copier

    def _before_optimizer_step(self) -> None:
        """The optimizer step pre-hook: params and optimizer state may change
        only once the previous snapshot's lazy copies have read them.

        Lazy CPU copies the stager has not made yet are made here, on the
        trainer's thread (work stealing): the stager runs at low priority and
        a loaded machine may not schedule it for a long time, while the copies
        themselves take one memcpy."""
        job = self._last
        if job is None or job.staged.is_set() or self._pid != os.getpid():
            return  # (in a forked child the stager does not exist: never wait for it)
        with self.ledger.cond:
            copying = list(self._copying)
        if copying and all(j.cpu_lazy for j in copying) and job in copying:
            for j in copying:  # in queue order: an earlier step's sources change too
                self._copy_lazy_cpu(j)
                # (a copy the stager claimed may still be running)
                self.ledger.wait_event(j.copies_done, lambda j=j: self._copies_text(j))
                j.issued.set()
                j.staged.set()  # the stager seals and hands it on when it runs
            return
        self.ledger.wait_event(job.issued, lambda: self._copies_text(job))
        if job.cuda_done and job.error is None:
            # GPU-side ordering: the update kernels queue behind the copies;
            # the host does not wait for the device.
            for idx, ev in job.cuda_done.items():
                torch.cuda.current_stream(idx).wait_event(ev)
        else:
            self.ledger.wait_event(job.staged, lambda: self._copies_text(job))

    @staticmethod
    def _copies_text(job: Job) -> str:
        return (f"the lazy copies of step {job.plan.step} (the optimizer step would change what they read; "
                "it is not run)")

    def _ensure_pool(self, sizes: list[int], pin: bool) -> None:
        """Allocate the pool on first use; grow it (once idle) if one step
        (its tasks' ``sizes`` in bytes) no longer fits and the limit allows;
        ``pin``: the step has CUDA sources."""
        need = sum(sizes)
        limit = self.config.host_buffer_bytes
        biggest = max(sizes, default=0)
        pool = self.pool
        if pool is not None:
            grow = policy.should_grow(need_bytes=need, capacity_bytes=pool.capacity, limit_bytes=limit)
            if not grow and not (pin and not pool.wants_pin) and pool.retired is None:
                return
            job = self._last
            if job is not None:
                self.ledger.wait_event(job.staged, f"step {job.plan.step} to be staged before the pool grows")
            self.ledger.wait(pool.wait_idle, "every staging block to be freed before the pool grows")
        want = policy.pool_bytes(need_bytes=need, biggest_bytes=biggest, limit_bytes=limit)
        self.pool = self._new_pool(want, pin)

    def _skip_reason(self, job: Job) -> str | None:
        """Why this step cannot be staged without waiting (agreed by all ranks).

        Counted in pool blocks (padding included) plus the largest block: a
        block cannot straddle the ring's wrap, so that much may go unused."""
        pool = self.pool
        why = None
        if pool is not None and job.error is None:
            need = policy.step_need_bytes([pool.block_bytes(task_bytes(t)) for t in job.plan.tasks])
            with self.ledger.cond:
                outstanding = pool.in_use + self.ledger.queued_bytes
            why = policy.skip_reason(capacity_bytes=pool.capacity, outstanding_bytes=outstanding, need_bytes=need)
        if self._plan_coord.distributed:
            reasons = [r for r in self._plan_coord.all_gather(why) if r is not None]
            why = reasons[0] if reasons else None
        return why

    def _queue_skip(self, job: Job, why: str) -> None:
        job.skip = why
        warnings.warn(f"dstt: skipped capturing step {job.plan.step}: {why}", SkippedStepWarning, stacklevel=3)
        self.ledger.queued(None)
        self.skipped.append(job.plan.step)
        job.finish_staging()
        self._commit_q.put(job)

    # ================================================================ background

    def _lower_priority(self) -> None:
        """Run on each background thread: let the trainer's threads win the CPU."""
        lower_thread_priority(self.config.background_nice, self.config.background_idle)

    def _stage_loop(self) -> None:
        self._lower_priority()
        while True:
            job = self._stage_q.get()  # unbounded wait: this thread's work queue; close() sends None
            if job is None:
                return
            try:
                if job.copies_left >= 0:  # lazy CPU copies: claimed, shared with the trainer
                    self._copy_lazy_cpu(job)
                    self.ledger.wait_event(job.copies_done, lambda job=job: self._copies_text(job))
                    if job.error is not None and not isinstance(job.error, CaptureError):
                        raise job.error
                else:
                    self._stage(job, job.lazy, lazy=True)
            except GuardTripped as e:
                job.error = job.error or e.error
                self._report_once(job, e.error)  # the trainer's next call raises it
            except BaseException as e:
                job.error = job.error or e
            finally:
                with self.ledger.cond:
                    if job in self._copying:
                        self._copying.remove(job)
                if job.guard is not None:
                    job.guard.release()
                job.issued.set()
                job.staged.set()  # copies landed: the optimizer may update the sources
                with self.ledger.cond:
                    self.ledger.queued_bytes -= job.lazy_bytes
                    job.lazy_bytes = 0
                self.committer.staged(job)  # sealed, or into the memory tier; then wait_staged() returns
                job.finish_staging()
                self.ledger.bump()

    def _flush_one(
        self, pool: HostPool, job: Job, task: ChunkTask, staged: torch.Tensor, ready: Any
    ) -> ChunkResult:
        try:
            if ready is not None:
                ready.synchronize()  # unbounded wait: this step's copies on the GPU (device work, no other party)
            if job.error is not None:  # the step already failed: do not spend I/O on it
                raise CaptureError(f"step {job.plan.step}: not written after an earlier failure")
            return self.writer.flush_chunk(job.plan, task, staged)
        finally:
            if not job.hold:  # a held block is the ring's copy until the step is committed
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
            return self.writer.flush_chunks(job.plan, tasks, list(staged))
        finally:
            if not job.hold:  # a held block is the ring's copy until the step is committed
                for s in staged:
                    pool.release(s)
            self.ledger.bump()
