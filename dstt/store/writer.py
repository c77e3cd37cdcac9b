"""The step writer: plan → flush chunks → commit.

:class:`Writer` owns one branch of one store for one process (or one rank).
``write()`` runs the three phases synchronously and is what ``dstt.save``
uses; the asynchronous capture engine calls the phases itself (``plan`` on
the trainer thread, ``flush_chunk`` and ``commit`` in the background).
Opening the branch (store, lock, branch document, the latest step's chunks
read back) is store/branchopen.py's; the flush phase store/flusher.py's; the
commit phase dstt.format.commit's.

Invariants:

* a step is visible only after ``commit.json`` is renamed into place, which
  happens after every rank's chunks and the step's index files are durable;
* every chunk key is written by exactly one rank (see plan.py) and a slot is
  used by one step only (slot = branch id × 2^24 + per-branch sequence);
* a chunk equal to the same chunk of the previous *captured* step (planned
  just before it, committed or not yet) is not rewritten: the index points
  at the old slot. What a chunk is compared with (and, with delta coding,
  coded against) follows the order steps were planned in, never the order
  background threads happen to finish them (keyframes.py), so the same run
  stores the same bytes whatever the timing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from dstt.errors import (
    CaptureError,
    ConfigError,
    DsttError,
    StepExistsError,
    StepOrderError,
)
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.codecs.keyframes import Link
from dstt.format.codecs.stepcoder import StepCoder
from dstt.format.commit import ChunkResult, CommitInfo, CommitPhase, CommitPlan
from dstt.format.groupcommit import commit_group
from dstt.format.heads import latest_committed
from dstt.format.packs import StepPacks
from dstt.format.pygc import paused_gc
from dstt.format.root import BranchInfo, load_branch, raise_root_version
from dstt.format.writeoptions import WriteOptions
from dstt.store import predflush
from dstt.store.arraydocs import ArrayDocs
from dstt.store.branchopen import open_branch, previous_links
from dstt.store.coord import Coordinator, default_coordinator
from dstt.store.flusher import Flusher, batches, chunk_bytes
from dstt.store.plan import AgreedExchange, ChunkTask, StepPlan, plan_step

log = logging.getLogger(__name__)

#: Planned, uncommitted steps a writer tracks references for (see Writer._link).
MAX_OPEN_PLANS = 64
#: compression="auto": steps still being written when the next is planned
#: that make it a fast (uncompressed) step. One is normal pipelining.
AUTO_BEHIND = 2
#: compression="auto": the CPU budget of encoding, in cores (CPU seconds
#: spent coding chunks per second of wall time between two planned steps).
#: Above it the next step is stored fast.
AUTO_CPU_CORES = 0.5


class Writer:
    """Writes committed steps to one branch.

    >>> import tempfile, torch
    >>> w = Writer(tempfile.mkdtemp() + "/run")
    >>> w.write(0, {"model": {"w": torch.ones(3)}}).n_tensors
    1
    >>> w.close()
    """

    def __init__(
        self,
        store: Any,
        options: WriteOptions | None = None,
        *,
        coordinator: Coordinator | None = None,
        commit_coordinator: Coordinator | None = None,
        lock: Any = None,
    ) -> None:
        """``options``: what to store and how (:class:`~dstt.format.writeoptions.WriteOptions`,
        validated when it was made; default: its defaults). ``coordinator``
        (planning's) and ``commit_coordinator`` (the commits', default the
        same): torch.distributed's; ``lock``: a branch lock already held (a
        capture helper inherits its trainer's)."""
        if options is None:
            options = WriteOptions()
        elif not isinstance(options, WriteOptions):
            raise ConfigError(f"options must be a WriteOptions, got {type(options).__name__}")
        self.options = options
        branch, parent = options.branch, options.fork
        self.keyframe_every = options.keyframe_every
        #: Chunks of at most this many raw bytes go into packs (packs.py; 0:
        #: none; default: $DSTT_PACK_CHUNK_BYTES, else 1 MiB).
        self.pack_chunk_bytes = options.packs_below
        self.codec = options.codec
        #: Predictive coding (compression="predictive"/"auto"): what this
        #: writer remembers of the previous step's chunks (store/predflush.py).
        self.coder: StepCoder | None = StepCoder(self.keyframe_every, self.codec) if self.codec.predictive else None
        self.max_chunk_bytes = options.max_chunk_bytes
        self.allow_pickle = options.allow_pickle
        self.dedup = options.dedup
        coord = coordinator or default_coordinator()
        self.rank = coord.rank
        # Rank 0 holds the branch write lock (lock.py): ``lock``, one already
        # held (a capture helper inherits its trainer's), else one it takes.
        self.backend: Backend
        self.backend, self._branch_lock = open_branch(store, branch, parent, coord, given_lock=lock,
                                                      storage_options=options.storage_options)
        self.branch: BranchInfo = load_branch(self.backend, branch)
        #: The commit phase (dstt.format.commit): commits may run on another
        #: thread than planning, with their own coordinator.
        self.commits = CommitPhase(self.backend, self.branch, self.rank, coord, commit_coordinator or coord,
                                   check_lock=self.check_lock, settle_links=self._settle_links)
        #: The zarr.json documents of the arrays and groups steps use (store/arraydocs.py).
        self.docs = ArrayDocs(self.backend)
        # Layouts of the tensors planned so far, reused while unchanged
        # (plan.plan_step); touched only by plan(), on one thread.
        self._layout_cache: dict[Any, Any] = {}
        # (array, chunk index) -> the link of that chunk in the latest planned
        # step (keyframes.py); touched only by plan(), on one thread.
        self._tails: dict[tuple[str, int], Link] = {}
        # Planned steps not yet committed, by seq: commit() settles the links
        # of earlier ones that never will be (a skipped step).
        self._open_plans: dict[int, list[Link]] = {}
        self._open_lock = threading.Lock()
        # compression="auto": (time, CPU seconds the flusher spent coding
        # chunks) at the previous planned step (guarded by _open_lock).
        self._rate_mark = (0.0, 0.0)
        #: compression="auto": the CPU budget of encoding (AUTO_CPU_CORES; the
        #: capture helper, whose threads run below the trainer's priority, has
        #: none), and steps waiting to be stored besides the open plans (the
        #: helper's queue): they count towards AUTO_BEHIND.
        self.auto_cpu_cores = AUTO_CPU_CORES
        self.backlog = 0
        #: The flush phase (store/flusher.py): stats, checksums, dedup, coding, writes of chunks.
        self.flusher = Flusher(self.backend, dedup=self.dedup, keyframe_every=self.keyframe_every,
                               threads=options.threads)
        self._closed = False
        if self.codec.delta and self.rank == 0:
            # Readers that know only format 1 must refuse this store, not
            # misread its delta chunks as zeros.
            raise_root_version(self.backend, L.DELTA_FORMAT_VERSION)
        # The branch head (dstt.format.heads): O(1) where the head record agrees
        # with the commit markers, a listing of the steps otherwise.
        head = latest_committed(self.backend, branch)
        self.last_step: int | None = head.step
        self._stored_latest = head.step  # (predictive coding of the first step: Writer.prepare_pred)
        self._warmed = False
        self.next_seq = 0
        if head.step is not None and head.seq is not None:
            self.last_commit = (head.step, head.seq)
            self.next_seq = head.seq + 1
            self._load_prev(branch, head.step, head.commit)
        elif self.branch.parent is not None:
            self._load_prev(*self.branch.parent)

    def _load_prev(self, branch: str, step: int, commit: dict[str, Any] | None = None) -> None:
        """Dedup against the chunks of ``step`` (store/branchopen.py)."""
        self._tails, known = previous_links(self.backend, branch, step, commit)
        self.docs.known_arrays.update(known)

    # ------------------------------------------------------------------ the commit phase's state

    @property
    def coord(self) -> Coordinator:
        """This writer's coordinator (planning; the commit records its world size)."""
        return cast(Coordinator, self.commits.coord)

    @coord.setter
    def coord(self, value: Coordinator) -> None:
        self.commits.coord = value

    @property
    def commit_coord(self) -> Coordinator:
        """The coordinator commits talk through."""
        return cast(Coordinator, self.commits.exchange)

    @commit_coord.setter
    def commit_coord(self, value: Coordinator) -> None:
        self.commits.exchange = value

    @property
    def last_commit(self) -> tuple[int, int] | None:
        """(step, seq) of the latest step committed on this branch."""
        return self.commits.last_commit

    @last_commit.setter
    def last_commit(self, value: tuple[int, int] | None) -> None:
        self.commits.last_commit = value

    # ------------------------------------------------------------------ setup

    # ------------------------------------------------------------------ phases

    def is_stored(self, step: int) -> bool:
        """Whether ``step`` is committed on this branch (its commit marker exists)."""
        return self.backend.exists(f"{L.step_dir(self.branch.name, step)}/{L.COMMIT_FILE}")

    def check_step(self, step: int) -> None:
        L.validate_step(step)
        if self.last_step is not None and step <= self.last_step and (
                (self.last_commit is not None and step == self.last_commit[0])
                or self.backend.exists(f"{L.step_dir(self.branch.name, step)}/{L.COMMIT_FILE}")):
            raise StepExistsError(
                f"step {step} already exists on branch {self.branch.name!r}; "
                "steps are immutable (restore it and capture on a new branch to diverge)"
            )
        if self.last_step is not None and step <= self.last_step:
            raise StepOrderError(
                f"step {step} is not after the latest step {self.last_step} on branch {self.branch.name!r}"
            )
        fork = self.branch.parent
        if self.last_step is None and fork is not None and step <= fork[1]:
            # A branch's history includes its parent's steps up to the fork
            # point (references resolve them there, Run.lineage lists them):
            # saving one of them would change what an existing reference
            # reads and make the branch's trajectory go back in time.
            cls = StepExistsError if step == fork[1] else StepOrderError
            raise cls(
                f"step {step} of branch {self.branch.name!r} is inherited from {fork[0]}:{fork[1]}, "
                f"where the branch forked; its own steps start after {fork[1]}"
            )

    def plan(self, step: int, state: Any, *, track: bool = True) -> StepPlan:
        """Plan ``step``: validate, flatten, lay out chunks, reserve a slot.

        ``track=False``: this writer will not store the plan's chunks (another
        process adopts it, capture/helper.py), so it keeps no reference chain."""
        self._check_open()
        try:
            self.check_step(step)
            self.check_lock()
        except DsttError as e:
            if self.coord.distributed:  # (a rank refusing alone left the others in the plan exchange)
                AgreedExchange(step, self.coord.all_gather).fail(e)
            raise
        with paused_gc():  # (objects per tensor and per chunk, no cycles: issue 16)
            plan = plan_step(
                step,
                state,
                rank=self.rank,
                exchange=self.coord.all_gather if self.coord.distributed else None,
                codec=self.codec,
                max_chunk_bytes=self.max_chunk_bytes,
                allow_pickle=self.allow_pickle,
                layout_cache=self._layout_cache,
                pack_chunk_bytes=self.pack_chunk_bytes,
            )
            return self._reserve(plan, track=track)

    def adopt(self, plan: StepPlan) -> StepPlan:
        """Take a plan made by another writer of this branch, now gone (a
        step sealed in a staging ring by a trainer that died, replayed by
        capture/ring.py), as this writer's next step: checked and given the
        next slot like a plan of its own.

        A step older than the branch's latest that is not stored (the memory
        tier seals every step it holds: a crash is an incident) is a
        backfill: stored without moving the branch's latest step."""
        self._check_open()
        self.check_lock()
        if self.last_step is not None and plan.step < self.last_step:
            fork = self.branch.parent
            if self.is_stored(plan.step) or (fork is not None and plan.step <= fork[1]):
                self.check_step(plan.step)  # raises: it exists, or is the parent's
            return self._reserve(plan, backfill=True)
        self.check_step(plan.step)
        return self._reserve(plan)

    def _reserve(self, plan: StepPlan, track: bool = True, backfill: bool = False) -> StepPlan:
        plan.seq = self.next_seq
        plan.slot = L.slot_for(self.branch.id, plan.seq)
        plan.packs = StepPacks(self.backend, slot=plan.slot, rank=self.rank)
        self.next_seq += 1
        if backfill:  # compared with the latest chain; later steps do not compare with it
            tails = self._tails
            plan.links = {(t.layout.array, t.index): Link(tails.get((t.layout.array, t.index))) for t in plan.tasks}
            return plan
        self.last_step = plan.step
        if track:
            self._link(plan)
        return plan

    def _encode_rate(self) -> float:
        """Cores' worth of CPU spent coding chunks since the previous planned
        step (caller holds ``_open_lock``); 0 for the first."""
        now = time.perf_counter()
        spent = self.flusher.encode_cpu_s
        used = spent - self._rate_mark[1]
        rate = used / (now - self._rate_mark[0]) if self._rate_mark[0] else 0.0
        self._rate_mark = (now, spent)
        return rate

    def _link(self, plan: StepPlan) -> None:
        """Chain each chunk to the same chunk of the previous planned step."""
        tails = self._tails
        plan.links = {(t.layout.array, t.index): Link(tails.get((t.layout.array, t.index))) for t in plan.tasks}
        self._tails = plan.links
        with self._open_lock:
            # compression="auto": a step planned while AUTO_BEHIND earlier ones
            # are still being written, or while coding uses more than
            # AUTO_CPU_CORES, is stored fast (no compression) instead of making
            # the trainer wait for, or share its CPU with, the encoder
            # (recorded per step in commit.json).
            plan.fast = self.codec.compression == "auto" and (
                len(self._open_plans) + self.backlog >= AUTO_BEHIND or self._encode_rate() > self.auto_cpu_cores)
            self._open_plans[plan.seq] = list(plan.links.values())
            # A safety net for a writer whose plans are stored elsewhere
            # (helper process) or never committed: the oldest open plan is
            # settled, so neither memory nor the chain grows without bound.
            # (A capture pipeline is a few steps deep: never reached there.)
            old = sorted(self._open_plans)[:-MAX_OPEN_PLANS] if len(self._open_plans) > MAX_OPEN_PLANS else []
            stale = [self._open_plans.pop(seq) for seq in old]
        for links in stale:
            for link in links:
                if not link.started:
                    link.pass_through()

    def ensure_arrays(self, plan: StepPlan) -> None:
        """Write the zarr.json of arrays (and groups) first used by this step:
        :meth:`ArrayDocs.ensure <dstt.store.arraydocs.ArrayDocs.ensure>`."""
        self.docs.ensure(plan, groups=self.rank == 0)

    def prepare_pred(self, plan: StepPlan, staged: Callable[[ChunkTask], torch.Tensor | None] | None = None) -> None:
        """Predictively code ``plan``'s chunks before they are flushed
        (store/predflush.py), on this writer's pool; ``staged(task)``: the
        chunk's staged copy, else its source is read. A no-op unless this
        writer codes predictively; a fast step (the writer behind) is only
        remembered (its chunks are stored whole, uncompressed: the next
        step's keyframes). Under torch.distributed each rank codes the
        chunks it writes (its shards: a parameter's chunk and its optimizer
        state's are on the same rank) against its own previous step."""
        if self.coder is None or not plan.tasks:
            return

        def raw_of(task: ChunkTask) -> memoryview:
            return chunk_bytes(task, None if staged is None else staged(task))

        if not self._warmed:  # a new writer of a branch with steps: its latest is the previous step
            self._warmed = True
            latest = self.last_commit[0] if self.last_commit is not None else self._stored_latest
            if latest is None and self.branch.parent is not None:  # a new branch: its fork step
                latest = self.branch.parent[1]
            # (not under torch.distributed: a rank would read every rank's chunks back; keyframes instead)
            if latest is not None and latest < plan.step and not self.coder.memory and self.coord.world == 1:
                try:
                    predflush.warm_start(self.coder, self.backend, self.branch.name, latest)
                    self.commits.committed_recent.add(latest)  # (committed: read back from the store)
                except DsttError as e:  # unreadable: keyframes, as a first step
                    self.coder.forget()
                    log.warning("dstt: step %s not read back for predictive coding (%s): keyframes instead",
                                latest, e)

        if self.coord.world > 1:
            # Under torch.distributed the committing rank cannot store another
            # rank's chunk whole if the step it was coded against failed (the
            # raw bytes are that rank's): a rank codes only against a step it
            # knows is committed, else this step's chunks are keyframes.
            last = self.coder.last_step
            if last is not None and last not in self.commits.committed_recent and not self.is_stored(last):
                self.coder.forget()
        predflush.prepare(self.coder, plan, raw_of, self.flusher.pool, remember_only=plan.fast)

    def flush_chunk(self, plan: StepPlan, task: ChunkTask, staged: torch.Tensor | None = None,
                    prev_staged: torch.Tensor | None = None) -> ChunkResult:
        """Stats, checksum, dedup and write of one chunk (thread-safe;
        :meth:`dstt.store.flusher.Flusher.flush_chunk`)."""
        return self.flusher.flush_chunk(plan, task, staged, prev_staged)

    def flush_chunks(self, plan: StepPlan, tasks: list[ChunkTask], staged: list[torch.Tensor | None] | None = None,
                     prev_staged: list[torch.Tensor | None] | None = None,
                     ) -> tuple[list[ChunkResult], BaseException | None]:
        """Flush several chunks, small ones in groups (thread-safe;
        :meth:`dstt.store.flusher.Flusher.flush_chunks`): the results of the
        chunks flushed and the first error.

        >>> import tempfile, torch
        >>> w = Writer(tempfile.mkdtemp() + "/run")
        >>> plan = w.plan(0, {"a": torch.ones(3), "b": torch.arange(4)}); w.ensure_arrays(plan)
        >>> results, error = w.flush_chunks(plan, plan.tasks); len(results), error
        (2, None)
        >>> w.commit(plan, results).n_tensors
        2
        >>> w.close()
        """
        return self.flusher.flush_chunks(plan, tasks, staged, prev_staged, one=self.flush_chunk)

    def _settle_links(self, plan: CommitPlan, earlier: bool) -> None:
        """Links of ``plan`` (or, ``earlier``: of every open plan before it)
        whose chunk was never flushed -- a failed or skipped step -- pass
        their predecessor's value on, so no later chunk waits for them."""
        with self._open_lock:
            seqs = [seq for seq in self._open_plans if seq < plan.seq] if earlier else [plan.seq]
            settled = [self._open_plans.pop(seq, []) for seq in seqs]
        for links in settled:
            for link in links:
                if not link.started:
                    link.pass_through()

    def settle_before(self, plan: StepPlan) -> None:
        """Steps planned before ``plan`` and not flushed yet will not be
        stored now (the capture's memory tier passed over them): later
        chunks compare with what came before them, without waiting."""
        self._settle_links(plan, True)

    def relink(self, plan: StepPlan) -> None:
        """Prepare a plan passed over earlier (its links settled) to be
        stored after all -- a backfill after an incident: its chunks compare
        with what the chain held at its place, and nothing planned after it
        changes what it compared with."""
        with self._open_lock:
            if plan.seq in self._open_plans:
                return  # still open: its links are live
        plan.links = {k: Link(v) for k, v in plan.links.items()}

    def commit(self, plan: StepPlan, results: list[ChunkResult], error: BaseException | None = None, *,
               memory_only: list[tuple[int, int]] | None = None) -> CommitInfo:
        """Commit a planned step from its chunk results (collective under
        torch.distributed; :meth:`dstt.format.commit.CommitPhase.commit`)."""
        return self.commits.commit(plan, results, error, memory_only=memory_only)

    def commit_group(self, items: list[tuple[StepPlan, list[ChunkResult]]]) -> list[CommitInfo | BaseException]:
        """Commit several planned steps (in step order) with one round of
        syncs where the backend can (:mod:`dstt.format.groupcommit`); each
        step's CommitInfo, or the error that kept it from being committed.

        >>> import tempfile, torch
        >>> w = Writer(tempfile.mkdtemp() + "/run")
        >>> items = []
        >>> for step in range(3):
        ...     plan = w.plan(step, {"w": torch.full((4,), float(step))})
        ...     w.ensure_arrays(plan)
        ...     items.append((plan, [w.flush_chunk(plan, t) for t in plan.tasks]))
        >>> [info.step for info in w.commit_group(items)]
        [0, 1, 2]
        >>> w.close()
        """
        return commit_group(self.commits, items)

    # ------------------------------------------------------------------ sync API

    def write(self, step: int, state: Any) -> CommitInfo:
        """Plan, flush and commit one step synchronously.

        The cyclic GC stays paused for the whole step: its plan, links,
        results and index entries (a few objects per tensor, no cycles)
        otherwise trigger collections between the phases that walk every
        live object, the state included (~1.4 s of a first 100,000-tensor
        step, in ensure_arrays); most of them are freed by reference
        counting when the step ends, before the collector runs again."""
        with paused_gc():
            return self._write(step, state)

    def _write(self, step: int, state: Any) -> CommitInfo:
        plan = self.plan(step, state)
        results: list[ChunkResult] = []
        error: BaseException | None = None
        try:
            self.ensure_arrays(plan)
            self.prepare_pred(plan)
            futures = [self.flusher.pool.submit(self._flush_batch, plan, batch) for batch in batches(plan.tasks)]
            for f in futures:
                try:
                    done, err = f.result()  # unbounded wait: a chunk write of this writer's own threads
                    results.extend(done)
                    error = error or err
                except BaseException as e:  # keep draining so no thread outlives the step
                    error = error or e
        except BaseException as e:
            error = error or e
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error
        # commit() turns a flush error into a CaptureError naming the step.
        return self.commit(plan, results, error)

    def _flush_batch(self, plan: StepPlan, tasks: list[ChunkTask]) -> tuple[list[ChunkResult], BaseException | None]:
        """Flush several chunks on one pool thread: one task per chunk cost
        more than a small chunk's own work (tens of thousands of tensors);
        small ones are flushed in groups (flusher.py)."""
        return self.flush_chunks(plan, tasks)

    @property
    def branch_lock(self) -> Any:
        """The branch write lock this writer holds (rank 0; a capture helper
        shares its trainer's), else None."""
        return self._branch_lock

    @property
    def open_plans(self) -> int:
        """Planned steps whose chunk references this writer still tracks (at most MAX_OPEN_PLANS)."""
        with self._open_lock:
            return len(self._open_plans)

    def check_lock(self) -> None:
        """StoreLockedError if this writer (rank 0) no longer holds its branch lock."""
        if self._branch_lock is not None:
            self._branch_lock.check()

    def _check_open(self) -> None:
        if self._closed:
            raise CaptureError("this writer is closed")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.flusher.close()
            if self._branch_lock is not None:
                self._branch_lock.release()
            self.backend.close()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
