"""``dstt.Capture``: lazy asynchronous capture of a training run.

Data flow of one step (docs/capture.md has the long version; docs/architecture.md the owners)::

    trainer   snapshot(k): plan (collective) -> eager copies -> queue --+
    stager    lazy copies into the pool (CPU memcpy / CUDA copy stream)  +-> flush / seal
    committer in step order: the step's chunks or the helper's answer -> commit (collective)

The Capture is a facade: its constructor builds the parts once, and
``snapshot()`` below reads top to bottom, naming each one it uses:

* ``ledger`` (ledger.py): the pipeline's bookkeeping and its one lock --
  pending and queued steps, errors, counters, progress, the bounded waits;
* ``crashsafe`` (crashsafe.py): the /dev/shm staging ring, its seals, the
  capture helper's handle, recovery of what a dead trainer sealed;
* ``stager`` (stager.py): the host pool, the eager and lazy copies, the
  optimizer pre-hook, the stager and flush threads;
* ``committer`` (committers.py): one per mode, chosen once by
  ``make_committer`` (modes.py) -- in process, the capture helper, the
  memory tier -- the only place the modes are told apart; its thread
  commits every step in order;
* ``watcher`` (watcher.py): ``incident()``; ``rewinder`` (rewind.py):
  ``rewind()`` and the switch to its branch; ``drain`` (draining.py):
  ``wait_staged``, ``wait``, ``close``, every wait bounded.

Threads: the trainer plans (``Writer.plan`` uses the planning coordinator),
makes eager copies and queues work, blocking only on pool backpressure and,
through the optimizer pre-hook, on the previous step's lazy copies; one
stager thread copies in queue order; flush threads write chunks; one
committer thread commits in order (its own coordinator, so its collectives
never interleave with planning's), passing the step's first error: under
torch.distributed every rank learns the step failed and nobody waits forever.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from dstt.capture import policy
from dstt.capture.committers import Committer
from dstt.capture.config import CaptureConfig, make_config, write_options
from dstt.capture.crashsafe import CrashSafe, after_helpers
from dstt.capture.draining import Drain
from dstt.capture.guard import VersionGuard
from dstt.capture.ledger import Ledger
from dstt.capture.lifecycle import LIVE
from dstt.capture.modes import make_committer
from dstt.capture.parts import Parts
from dstt.capture.pipeline import Job, is_interrupt, lower_priority, lower_thread_priority, task_bytes
from dstt.capture.rewind import Rewinder
from dstt.capture.stager import Stager
from dstt.capture.watcher import Watcher
from dstt.errors import CaptureError, SkippedStepWarning
from dstt.format.codecs.spec import CodecSpec
from dstt.format.commit import CommitInfo
from dstt.format.incidents import Incident
from dstt.format.layout import validate_step
from dstt.format.pygc import paused_gc
from dstt.store.coord import new_coordinator
from dstt.store.plan import ChunkTask
from dstt.store.state import state_of
from dstt.store.writer import Writer

__all__ = ["Capture", "Parts", "lower_thread_priority"]

log = logging.getLogger("dstt.capture")


#: Steps remembered per branch as captured by this Capture (older ones are
#: found in the store: committed, or recorded as memory-only).
CAPTURED_LOG = 4096


class Capture:
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
        cfg = self.config
        self.store_arg = store  # a rewind opens a writer of the new branch on it
        self.ledger = Ledger(branch=lambda: self.config.branch, limit_s=cfg.background_timeout_s)
        self.watcher = Watcher(self)  # incident() (the NaN/Inf watcher is the memory tier's)
        # Two coordinators: planning runs on this thread, commits on the
        # committer thread; sharing one gloo group would interleave them.
        self.plan_coord = new_coordinator()
        self.commit_coord = new_coordinator()
        self.writer: Writer = after_helpers(lambda: Writer(
            store, write_options(
                # the default (None): predictive where the helper codes -- settled below, once it is known
                # (under torch.distributed too: each rank's helper codes that rank's shards)
                cfg, compression=cfg.compression or "auto", threads=1),
            coordinator=self.plan_coord, commit_coordinator=self.commit_coord,
        ), store, cfg.branch)
        self.rank = self.plan_coord.rank
        # The ring, before any thread: recovery commits on this thread.
        self.crashsafe = CrashSafe(self, self.ledger, self.plan_coord,
                                   store_by_name=isinstance(store, (str, os.PathLike)))
        self.recovered: list[int] = self.crashsafe.recovered  # steps sealed by a dead trainer, committed now
        self.stager = Stager(self, self.ledger, self.crashsafe.new_pool)
        #: Where the memory tier runs: "helper" (the capture helper process,
        #: issue 25), "trainer" (this process: no helper can run), None (no tier).
        self.tier_where: str | None = None
        #: The scheme redundancy="auto" chose (at the first snapshot; modes.py), else the one asked for.
        self.redundancy_chosen: str | None = None if cfg.redundancy == "auto" else cfg.redundancy
        self.redundancy_auto: Any = None
        try:
            # The one choice of mode (committers.py): in this process, the capture helper, the memory tier.
            self.committer: Committer = make_committer(self)
            if cfg.compression is None:  # the default: predictive where the helper codes (config.py)
                self._settle_compression("auto" if self.crashsafe.helper is not None else "none")
        except BaseException:
            if self.crashsafe.ring is not None:
                self.crashsafe.ring.close()
            self.writer.close()
            raise
        self.skipped: list[int] = []
        self._pid = os.getpid()  # a forked child holds a copy of this object, never the pipeline
        #: Injection point for tests and tools: called on the stager thread as
        #: ``after_seal(job)`` once a held step is sealed in the ring (before
        #: it is handed to the capture helper); an exception fails the step.
        self.after_seal: Callable[[Job], Any] | None = None
        self.rewinder = Rewinder(self)  # rewind(), and the switch to its branch
        self.commit_q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # the committer thread's work
        self.commit_thread = threading.Thread(target=self.committer.run, name="dstt-committer", daemon=True)
        self.drain = Drain(self, self.ledger, stager=self.stager, crashsafe=self.crashsafe, rewinder=self.rewinder,
                           commit_q=self.commit_q, commit_thread=self.commit_thread,
                           coordinators=(self.plan_coord, self.commit_coord))
        self.stager.start()
        self.commit_thread.start()
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
        self.rewinder.check_step(step)  # (rewind.py: the step after a rewind follows it)
        self.crashsafe.rebuilt = None  # (a restore from rebuilt memory comes before the first step: rebuilt.py)
        if not policy.is_due(step, self.config.every):
            self.raise_pending()
            return False
        self.rewinder.switch_if_forked()  # (a rewind's branch, opened at the next snapshot)
        state = state_of(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng, extra=extra)
        # Planning, splitting and staging build objects per tensor, none in
        # cycles: the cyclic GC, which walks every live object, waits (issue 16).
        with paused_gc():
            # 1. the writer plans the step (collective under torch.distributed; with the
            #    capture helper the helper's writer adopts the plan: no reference chain here)
            job = Job(self.writer.plan(step, state, track=self.committer.track_plan), [], writer=self.writer)
            if self.redundancy_auto is not None:  # redundancy="auto": chosen from the first plan (issue 26)
                self.redundancy_auto.first_plan(job.plan)
            # The step is planned on every rank. Whatever fails from here on, it
            # is queued, so that its (collective) commit runs and fails on every
            # rank instead of leaving a peer waiting. An interrupt (Ctrl-C) fails
            # the step the same way and is raised once the step is queued.
            eager: list[ChunkTask] = []
            try:
                eager = self._prepare(job, optimizer)  # 2. stager: eager/lazy split; committer: its pool
            except BaseException as e:
                job.error = e
            why = self._skip_reason(job) if self.config.on_full == "skip" else None  # (collective)
            if why is not None:
                self._queue_skip(job, why)  # 3'. ledger: counted; committer thread: the skip recorded
                return self._after_queueing(job, queued=False)
            if job.error is None:
                try:
                    self.stager.stage(job, eager, lazy=False)  # 3. stager: the eager copies, now
                except BaseException as e:
                    job.error = e
            self._log_captured(job)  # (watcher: incident(step=) takes the steps captured)
            self.committer.enqueue(job)  # 4. ledger, stager (lazy copies, seal), committer thread
            return self._after_queueing(job, queued=True)

    def _prepare(self, job: Job, optimizer: torch.optim.Optimizer | None) -> list[ChunkTask]:
        """Split the step into lazy and eager tasks, make sure the pool holds
        it, and mark the state's point in each CUDA stream; the eager tasks."""
        stager = self.stager
        if optimizer is not None:
            stager.watch(optimizer)  # the optimizer pre-hook: its step waits for the lazy copies
        # (eager: read-only, a later step's plan and split may bring this list again)
        split = stager.plans.split(job.plan.tasks, optimizer, job.plan.layout_token)
        if split.lazy:
            job.lazy = list(split.lazy)
            job.copies.on_cpu = split.on_cpu
            job.copies.runs = split.runs()
            job.guard = VersionGuard(split.sources, split.names)
        # One pass each over the tasks (tens of thousands of them: issue 16),
        # none for the task list of an earlier step (TaskLists.sizes).
        sizes, cuda, held_bytes = stager.plans.sizes(job.plan.tasks, job.plan.layout_token)
        self.committer.place(job, sizes, cuda, held_bytes)  # the pool (or slot); held until committed?
        job.lazy_bytes = split.lazy_bytes
        devices = {t.source.device for t in job.plan.tasks if t.source.is_cuda} if cuda else set()
        if devices:
            job.ready = stager.after_compute(devices)
        return split.eager

    def _log_captured(self, job: Job) -> None:
        captured = self.watcher.captured
        log_ = captured.get(job.writer.branch.name)
        if log_ is None:
            log_ = captured[job.writer.branch.name] = collections.deque(maxlen=CAPTURED_LOG)
        log_.append(job.plan.step)

    def _after_queueing(self, job: Job, *, queued: bool) -> bool:
        if job.error is not None and is_interrupt(job.error):
            raise job.error
        self.raise_pending()
        return queued

    def _skip_reason(self, job: Job) -> str | None:
        """Why this step cannot be staged without waiting (agreed by all ranks).

        Counted in pool blocks (padding included) plus the largest block: a
        block cannot straddle the ring's wrap, so that much may go unused."""
        pool = self.stager.pool
        why = None
        if pool is not None and job.error is None:
            need = policy.step_need_bytes([pool.block_bytes(task_bytes(t)) for t in job.plan.tasks])
            with self.ledger.cond:
                outstanding = pool.in_use + self.ledger.queued_bytes
            why = policy.skip_reason(capacity_bytes=pool.capacity, outstanding_bytes=outstanding, need_bytes=need)
        if self.plan_coord.distributed:
            reasons = [r for r in self.plan_coord.all_gather(why) if r is not None]
            why = reasons[0] if reasons else None
        return why

    def _queue_skip(self, job: Job, why: str) -> None:
        if job.error is not None and not is_interrupt(job.error):
            self.ledger.fail(job.plan.step, job.error)
        job.skip = why
        warnings.warn(f"dstt: skipped capturing step {job.plan.step}: {why}", SkippedStepWarning, stacklevel=3)
        self.ledger.queued(None)
        self.skipped.append(job.plan.step)
        job.finish_staging()
        self.commit_q.put(job)

    def wait_staged(self) -> None:
        """Block until every queued step is copied to host memory and, where
        the pool is in /dev/shm, sealed there: from then on the step is
        committed even if this process dies (by the next Capture on the
        branch). Call it before mutating captured tensors in place outside
        ``optimizer.step()`` (which waits by itself); raises a pending
        failure (such as the mutation guard's)."""
        self.drain.wait_staged()

    def wait(self, timeout: float | None = None) -> list[CommitInfo]:
        """Block until every queued step is committed and durable; raise the
        first background failure as :class:`CaptureError`. Returns the
        commits so far. ``timeout``: give up after that many seconds; without
        it, after ``background_timeout_s`` in which no step progressed."""
        return self.drain.wait(timeout)

    def raise_pending(self) -> None:
        """Raise the first background failure not yet reported, if any
        (a lazily copied tensor already changed in place counts: the step fails)."""
        self.drain.raise_pending()

    def close(self) -> None:
        """Drain every queued step, stop the threads, release the pool and hooks.

        Raises the first unreported background failure after releasing
        everything. Safe to call twice. Never hangs (draining.py)."""
        if self.drain.closed:
            return
        LIVE.discard(self)
        self.crashsafe.rebuilt = None
        self.drain.close()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self.drain.closed

    @property
    def pool(self) -> Any:
        """The host staging pool (the stager's; None before the first snapshot and after close)."""
        return self.stager.pool

    @property
    def before_copy(self) -> Callable[[int, int, bool], Any] | None:
        """Injection point for tests and tools (the stager's): called as
        ``before_copy(step, index, lazy)`` before each copy into the pool;
        an exception fails the step."""
        return self.stager.before_copy

    @before_copy.setter
    def before_copy(self, hook: Callable[[int, int, bool], Any] | None) -> None:
        self.stager.before_copy = hook

    @property
    def parts(self) -> Parts:
        """The components of this Capture as they are now, for tests and
        tools (a view: a rewind gives the new branch its own ring, helper and
        committer). Read them; inject faults only through their documented
        hooks (``Ring.before_op``, ``Capture.before_copy``, ``Capture.after_seal``,
        ``Stager.before_lazy``)."""
        tier = self.committer.memory_tier
        threads = {"stager": self.stager.thread, "committer": self.commit_thread}
        threads.update((t.name, t) for t in self.stager.flush._threads)
        threads.update(self.committer.threads())
        with self.ledger.cond:
            slots, held = (None, ()) if tier is None else tier.held()
        return Parts(ledger=self.ledger, committer=self.committer, stager=self.stager, crashsafe=self.crashsafe,
                     ring=self.crashsafe.ring, helper=self.crashsafe.helper, pool=self.stager.pool,
                     pool_in_ring=self.stager.pool_in_ring, slots=slots,
                     tier_held=held, last_job=self.stager.last, lazy_split=self.stager.lazy_split,
                     threads=threads, coordinators=(self.plan_coord, self.commit_coord))

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
        check_steps: bool = True,
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

        The new branch continues from ``step``: the next ``snapshot()`` must
        be of ``step + 1`` -- set the loop's step counter back -- else it is
        refused (StepOrderError, nothing captured) instead of mislabelling
        the branch's steps; ``check_steps=False`` accepts any later step (a
        loop that snapshots every N-th step itself).

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
                                    branch=branch, strict=strict, check_steps=check_steps)

    def restore(
        self,
        step: int | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        rng: bool = True,
        strict: bool = True,
    ) -> dict[str, Any]:
        """Restore ``step`` (default: the branch's newest committed step)
        into the live objects, as :func:`dstt.restore` does, and go on
        capturing on this branch (the next ``snapshot()`` follows it);
        returns the step's ``extra``.

        A restarted job after the loss of a node (issue 26): the newest step
        its recovery rebuilt and committed is restored from the parts the
        recovery holds in memory (every rank's, CRC-checked; no chunk read
        from the store), until the first ``snapshot()``; any other step, or
        one whose parts are not all held, from the store. Under
        torch.distributed every rank calls it with the same ``step``."""
        self._check_open()
        return self.rewinder.restore(step, model=model, optimizer=optimizer, scheduler=scheduler, rng=rng,
                                     strict=strict)

    def choose_committer(self) -> Committer:
        """The committer of this Capture's mode, chosen again (a rewind's
        branch: its ring and helper are its own): capture/modes.py."""
        return make_committer(self)

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
        (In the capture helper, the default: the /dev/shm pool of that many
        steps, each with 1 MiB of room for alignment.)

        >>> import tempfile, torch, dstt
        >>> with dstt.Capture(tempfile.mkdtemp() + "/r", memory_steps=2, helper=False) as cap:
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

    # ================================================================ internals

    def _check_open(self) -> None:
        if self._pid != os.getpid():
            raise CaptureError(f"this Capture belongs to process {self._pid}; a forked child cannot use it "
                               "(create its own Capture on another branch)")
        if self.drain.closed:
            raise CaptureError("this Capture is closed")

    def lower_priority(self) -> None:
        """Run on each background thread: let the trainer's threads win the CPU."""
        lower_priority(self.config)

    def _settle_compression(self, compression: str) -> None:
        """Settle the default compression (CaptureConfig.compression None)
        once the helper is decided, before any step is planned."""
        self.config = replace(self.config, compression=compression)
        if self.writer.codec.compression != compression:
            self.writer.codec = CodecSpec(compression, self.config.zstd_level)
            self.writer.coder = None

    def _after_fork_in_child(self) -> None:
        """os.fork() copied this object but none of its threads: the child
        must neither wait for them nor release what the parent holds (the
        branch lock is forgotten by lock.py's own at-fork hook)."""
        self.drain.closed = True
        self.ledger.cond = threading.Condition()
        self.stager.abandon_in_child()  # the parent's hooks stay on the parent's optimizers
        self.committer.abandon_in_child()
        self.crashsafe.helper = None
