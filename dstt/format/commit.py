"""The commit phase: settle a step's chunk results, make them durable, and
(rank 0) write the step's index files, the branch head and the commit
marker -- in that order, so a step is visible only once everything it
references is durable (torch-free format layer).

:class:`CommitPhase` is a component of :class:`dstt.store.writer.Writer`
(and of the group commit, :mod:`dstt.format.groupcommit`); what it needs of
the writer arrives through its constructor: the backend, the branch, the
coordinators, and two callbacks (the branch lock check, the settling of the
open plans' links). The phase protocol, per planned step:

1. the flush threads produce a :class:`ChunkResult` per chunk this rank
   wrote (``Writer.flush_chunk`` / ``flush_chunks``);
2. one thread (the caller's, or a capture's committer) calls
   :meth:`CommitPhase.commit` with them, on every rank, for every planned
   step -- passing its flush error if any, so no rank waits forever on a
   failed peer: the rank's packs are closed and synced, the results
   gathered on rank 0, which writes the index, the head and the marker;
3. the outcome (:class:`CommitInfo`, or the error) is broadcast to every rank.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, cast

from dstt.errors import CaptureError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.codecs.predictors import Coding
from dstt.format.codecs.spec import array_metadata, encode_chunk
from dstt.format.geometry import TensorLayout
from dstt.format.heads import write_head
from dstt.format.manifest import (
    TensorEntry,
    commit_document,
    encode_json,
    encode_stats,
    has_rows,
    index_document,
    remember_index,
    sha256_hex,
    tensor_checksum,
)
from dstt.format.packs import PackRange, StepPacks
from dstt.format.partials import Partial, finalize, merge
from dstt.format.predcommit import PredStep, dangling, decision_raw, pred_info, step_inputs
from dstt.format.predindex import ChunkPred
from dstt.format.pygc import paused_gc
from dstt.format.root import BranchInfo, raise_root_version
from dstt.format.valuetree import has_pickle


class CommitPlan(Protocol):
    """What the commit phase reads of a planned step
    (:class:`dstt.store.plan.StepPlan` is one)."""

    step: int
    seq: int
    tree: Any
    layouts: list[TensorLayout]
    fast: bool
    packs: Any  # this rank's StepPacks of the step, or None
    pred: Any  # the step coder's decisions (format.predcommit.PredStep), or None


class Coordination(Protocol):
    """What the commit phase asks of the ranks' coordinator
    (:class:`dstt.store.coord.Coordinator` is one)."""

    rank: int
    world: int

    @property
    def distributed(self) -> bool: ...

    def gather(self, obj: Any) -> list[Any] | None: ...

    def broadcast(self, obj: Any) -> Any: ...


@dataclass
class ChunkResult:
    name: str
    index: int
    crc: int  # CRC-32C of the raw chunk bytes
    sha256: bytes | None  # computed only to confirm a dedup candidate
    slot: int
    written: int  # encoded bytes written by this step (0 when referenced)
    nbytes: int  # decoded chunk bytes
    partial: list[float]
    keyframe: int | None = None  # delta coded: the keyframe slot it is the difference to
    pack: PackRange | None = None  # packed: its range in a pack of the step at ``slot`` (packs.py)
    #: A predictive chunk: its pred record and coding (docs/format.md "Predictive chunks").
    pred: ChunkPred | None = None
    coding: Coding | None = None
    #: Set while the chunk waits for the previous step's same chunk to be
    #: stored (its flush came first); ``Writer.commit`` waits for it.
    pending: Future[ChunkResult] | None = None

    def settled(self) -> "ChunkResult":
        """The finished result (waiting for a pending one), without its
        Future: results are pickled to rank 0 under torch.distributed, and
        a Future (it holds a lock) cannot be -- a chunk that had waited for
        its predecessor failed the step with "cannot pickle '_thread.RLock'"."""
        if self.pending is None:
            return self
        # unbounded wait: the predecessor chunk's write in this process (Capture's waits on it are bounded)
        return replace(self.pending.result(), pending=None)


@dataclass
class CommitInfo:
    """What a committed step cost."""

    branch: str
    step: int
    seq: int
    n_tensors: int
    bytes_written: int
    bytes_referenced: int


class CommitPhase:
    """``commit``: the commit phase of one writer of one branch (module docstring).

    ``coord``: the writer's coordinator (the commit records its world size);
    ``exchange``: the one commits talk through (another thread than
    planning needs its own group; a capture helper's records); both may be
    replaced between commits. ``check_lock`` raises if the writer lost its
    branch lock; ``settle_links(plan, earlier)`` settles the links of
    ``plan`` (or of the open plans before it) that were never flushed.
    ``last_commit``: (step, seq) of the branch's latest committed step."""

    def __init__(self, backend: Backend, branch: BranchInfo, rank: int, coord: Coordination,
                 exchange: Coordination, *, check_lock: Callable[[], None],
                 settle_links: Callable[[CommitPlan, bool], None],
                 last_commit: tuple[int, int] | None = None) -> None:
        self.backend = backend
        self.branch = branch
        self.rank = rank
        self.coord = coord
        self.exchange = exchange
        self.check_lock = check_lock
        self.settle_links = settle_links
        self.last_commit = last_commit
        self.packs_version_raised = False
        self.pred_version_raised = False
        #: Steps this writer committed lately, and the step a new writer read
        #: back (predictive chunks are coded against those only: predflush.py).
        self.committed_recent: set[int] = set()

    def commit(self, plan: CommitPlan, results: list[ChunkResult], error: BaseException | None = None, *,
               memory_only: list[tuple[int, int]] | None = None) -> CommitInfo:
        """Make this rank's chunks durable, then (rank 0) write the index and
        the commit marker. Collective under torch.distributed: every rank calls
        it for every planned step, passing its flush error if any, so no rank
        waits forever on a failed peer."""
        self.settle_links(plan, True)
        try:
            results, error = self._settled(results, error)
            error = self._close_packs(plan, error)
            return self._commit(plan, results, error, memory_only)
        finally:
            self.settle_links(plan, False)

    def _close_packs(self, plan: CommitPlan, error: BaseException | None) -> BaseException | None:
        """Write this rank's last pack of the step (also when the step failed:
        a later step may reference its ranges), and check that the earlier
        packs the step references were written."""
        packs: StepPacks | None = plan.packs
        if packs is None:
            return error
        try:
            # A writer that lost its branch lock (dstt unlock --force) writes
            # no more: its slot may be another writer's now, and a pack holds
            # many tensors' chunks.
            self.check_lock()
            packs.close()
            StepPacks.check_referenced(packs.referenced_files())
        except BaseException as e:
            error = error or e
        return error

    @staticmethod
    def _settled(results: list[ChunkResult],
                 error: BaseException | None) -> tuple[list[ChunkResult], BaseException | None]:
        out = []
        for r in results:
            try:
                out.append(r.settled())
            except BaseException as e:  # wait for every one: none may outlive its step
                error = error or e
        return out, error

    def _commit(self, plan: CommitPlan, results: list[ChunkResult], error: BaseException | None,
                memory_only: list[tuple[int, int]] | None = None) -> CommitInfo:
        if error is None and (self.exchange.distributed or self.rank != 0):
            # Each rank's chunks are durable before rank 0 may commit them. A
            # single writer needs no sync here: the one in _write_commit
            # (after the index files, before the marker) makes its chunks
            # durable too -- one syncfs per step fewer (issue 16: a small
            # loop commits a step every ~12 ms).
            try:
                self.backend.sync()
            except Exception as e:  # any: raised before the exchange, it left rank 0 waiting forever
                error = e
        payload = (results if error is None else None, None if error is None else _describe(error))
        gathered = self._gather(plan.step, payload) if self.exchange.distributed else [payload]
        outcome: Any = None
        if self.rank == 0:
            assert gathered is not None
            failures = [f"rank {r}: {err}" for r, (_, err) in enumerate(gathered) if err is not None]
            if failures:
                outcome = ("error", f"step {plan.step} on branch {self.branch.name!r} not committed: " + "; ".join(failures))
            else:
                try:
                    all_results = [r for res, _ in gathered for r in (res or [])]
                    with paused_gc():  # (a container or more per tensor, no cycles)
                        outcome = ("ok", self._write_commit(plan, all_results, memory_only))
                except Exception as e:  # reported to every rank below
                    outcome = ("error", f"step {plan.step} on branch {self.branch.name!r} not committed: {_describe(e)}")
                    error = error or e
        if self.exchange.distributed:
            outcome = self.exchange.broadcast(outcome)
        kind, value = outcome
        if kind != "ok":
            if error is not None:
                raise CaptureError(value) from error
            raise CaptureError(value)
        if self.last_commit is None or plan.step > self.last_commit[0]:  # (a backfill leaves the head)
            self.last_commit = (plan.step, plan.seq)
        self.committed_recent.add(plan.step)
        if len(self.committed_recent) > 4096:  # (a chain reaches back keyframe_every steps)
            self.committed_recent.discard(min(self.committed_recent))
        return cast(CommitInfo, value)

    def _gather(self, step: int, payload: tuple[list[ChunkResult] | None, str | None]) -> list[Any] | None:
        """Every rank's ``payload`` on rank 0 (None elsewhere), reached by
        this rank whatever happens: a payload that cannot be sent (it does
        not pickle, its rank record cannot be written) is replaced by the
        reason, so the step fails on every rank instead of leaving rank 0
        waiting for this one. Each payload names its step: a rank that
        commits another step at the same time (the ranks out of step) fails
        the step instead of mixing two steps' chunks in one index."""
        try:
            gathered = self.exchange.gather((step, payload))
        except Exception as e:  # noqa: BLE001 - sent on as this rank's failure
            # (gather_object pickles before it communicates; a rank record is
            # encoded before it is written: nothing was sent yet)
            why = f"this rank's part could not be sent: {_describe(e)}"
            gathered = self.exchange.gather((step, (None, why)))
        if gathered is None:
            return None
        return [got if at == step else (None, f"it committed step {at} meanwhile (the ranks are out of step)")
                for at, got in gathered]

    def _store_dangling(self, plan: CommitPlan, results: list[ChunkResult]) -> None:
        """Store whole the predictive chunks of ``plan`` coded against a step
        that is not committed (it failed after this one was coded): a
        chunk file of the tensor's array, from the raw bytes the step coder
        kept, so no committed step depends on a missing one (predflush.py)."""
        bad = dangling(results, plan.step, self._committed_cached())
        if not bad:
            return
        layouts = {lay.name: lay for lay in plan.layouts}
        for r in bad:
            layout = layouts[r.name]
            raw = decision_raw(plan.pred, layout.array, r.index)
            if raw is None:
                raise CaptureError(f"{r.name} chunk {r.index}: coded against step {r.pred and r.pred.prev}, "
                                   "which was not committed, and its bytes are gone")
            if layout.packed:  # its first chunk file: the array's document
                self._ensure_array_doc(layout)
            parts = encode_chunk(raw.data, layout.codec, raw_crc=r.crc, itemsize=layout.dtype.itemsize)
            self.backend.put(L.chunk_key(layout.array, r.slot, layout.coords(r.index)), parts)
            r.pred = r.coding = r.pack = None
            r.written = sum(len(memoryview(p).cast("B")) for p in parts)

    def _committed_cached(self) -> Callable[[int], bool]:
        """Whether a step a chunk was coded against is committed: one this
        writer committed (or read back), else one whose commit marker is in
        the store -- a writer that commits steps another process coded (the
        salvage of every rank's records by ``dstt gc``, a restarted helper)
        has committed none of them itself. (The fork step of a new branch
        is on its parent.) One look-up per step, for the call."""
        known: dict[int, bool] = {}
        parent = self.branch.parent

        def committed(step: int) -> bool:
            if step in self.committed_recent:
                return True
            if step not in known:
                where = self.branch.name if parent is None or step != parent[1] else parent[0]
                known[step] = self.backend.exists(f"{L.step_dir(where, step)}/{L.COMMIT_FILE}")
            return known[step]

        return committed

    def _ensure_array_doc(self, layout: TensorLayout) -> None:
        """The array document of a tensor whose chunks are packed (it has
        none), for a chunk stored as a file after all."""
        doc = array_metadata(layout.dtype, layout.shape, layout.chunk_shape, layout.codec, layout.name)
        key = f"{layout.array}/zarr.json"
        if self.backend.get(key, max_bytes=len(doc)) != doc:
            self.backend.put(key, doc)

    def _write_commit(self, plan: CommitPlan, results: list[ChunkResult],
                      memory_only: list[tuple[int, int]] | None = None) -> CommitInfo:
        self._store_dangling(plan, results)
        pred = plan.pred
        if pred is None and any(r.pred is not None for r in results):  # coded elsewhere (a salvage)
            pred = step_inputs(plan.tree, plan.layouts)
        tensors, names, rows, (written, referenced, bytes_total) = _entries(plan, results, pred)
        where = L.step_dir(self.branch.name, plan.step)
        # Format 2 only where a step uses delta coding: other steps stay
        # readable by format-1 readers.
        version = L.DELTA_FORMAT_VERSION if any(l.delta for l in plan.layouts) else L.FORMAT_VERSION
        if any(t.packs is not None for t in tensors):
            # Format 3 where a step has packed chunks, 4 where it writes index
            # rows (packed one-chunk tensors, manifest.has_rows), and the
            # store raised to 4 with the first (once per writer): older
            # readers refuse it, never misread it.
            version = L.ROWS_FORMAT_VERSION if has_rows(tensors) else L.PACK_FORMAT_VERSION
            if not self.packs_version_raised:
                raise_root_version(self.backend, L.ROWS_FORMAT_VERSION)
                self.packs_version_raised = True
        if any(t.pred is not None for t in tensors):
            # Format 5 where a step has predictive chunks, the store raised
            # with the first: older readers refuse it, never misread it.
            version = L.PRED_FORMAT_VERSION
            if not self.pred_version_raised:
                raise_root_version(self.backend, L.PRED_FORMAT_VERSION)
                self.pred_version_raised = True
        index = index_document(version, self.branch.name, plan.step, tensors, plan.tree)
        names_b = encode_json(names)
        stats_b = encode_stats(rows)
        files: dict[str, dict[str, Any]] = {}
        for fname, data in ((L.INDEX_FILE, index), (L.NAMES_FILE, names_b), (L.STATS_FILE, stats_b)):
            self.backend.put(f"{where}/{fname}", data)
            files[fname] = {"sha256": sha256_hex(data), "size": len(data)}
        # The next writer's (dstt.save: a new one per call) and a reader's
        # parse of this index reuse these entries (manifest.parse_index_checked).
        # (plan.tree is what JSON gives back: tree.flatten emits only dicts
        # with str keys, lists, str, int, finite floats, bools and None, and
        # no one changes a plan's tree.)
        remember_index(files[L.INDEX_FILE]["sha256"], tensors, plan.tree)
        # The head names this step before its marker exists, made durable by
        # the sync below: a reader finding no marker for it falls back to
        # last_commit, recorded as its predecessor (dstt.format.heads).
        head = self.last_commit
        if head is not None and plan.step < head[0]:
            # A backfill (a step planned earlier, stored after a later one:
            # the capture's memory tier after an incident): the head stays the
            # later step; rewritten only to record the new step directory.
            write_head(self.backend, self.branch.name, head[0], head[1], None)
        else:
            write_head(self.backend, self.branch.name, plan.step, plan.seq, head)
        self.backend.sync()
        commit = commit_document(
            version=version, branch=self.branch.name, step=plan.step, seq=plan.seq, time=time.time(),
            world_size=self.coord.world, n_tensors=len(tensors), bytes_total=bytes_total,
            bytes_written=written, bytes_referenced=referenced, has_pickle=has_pickle(plan.tree), files=files,
            coding="fast" if plan.fast else None, memory_only=memory_only or None)
        # The lock may have been broken while this step was written (dstt
        # unlock --force, a lease lost while paused): then another writer may
        # own the branch and this step must not become visible.
        self.check_lock()
        self.backend.put_atomic(f"{where}/{L.COMMIT_FILE}", commit)
        return CommitInfo(self.branch.name, plan.step, plan.seq, len(tensors), written, referenced)


def _entries(plan: CommitPlan, results: list[ChunkResult], pred: PredStep | None
             ) -> tuple[list[TensorEntry], list[str], list[list[float]], tuple[int, int, int]]:
    """The index entries, names and stats rows of a step from its chunk
    results (CaptureError for a missing, repeated or out-of-grid chunk),
    and its (bytes written, bytes referenced, bytes total). ``pred``: the
    step's predictive coding (its groups' inputs, for the ``pred`` records)."""
    # One dict keyed by (tensor, chunk index): a dict per tensor cost
    # more than the rest of a one-chunk tensor's entry (issue 16).
    by_chunk = {(r.name, r.index): r for r in results}
    if len(by_chunk) != len(results):
        seen: set[tuple[str, int]] = set()
        for r in results:
            if (r.name, r.index) in seen:
                raise CaptureError(f"chunk {r.index} of {r.name} was written twice")
            seen.add((r.name, r.index))
    tensors: list[TensorEntry] = []
    names: list[str] = []
    rows: list[list[float]] = []
    written = referenced = bytes_total = expected = 0
    get = by_chunk.get
    for layout in plan.layouts:
        n = layout.nchunks
        name = layout.name
        expected += n
        if n == 1:  # the common case by far (tens of thousands of small tensors: issue 16)
            c = get((name, 0))
            if c is None:
                raise CaptureError(f"{name}: 0 of 1 chunks were written")
            nbytes = layout.nbytes
            bytes_total += nbytes
            tensors.append(_one_chunk_entry(layout, c))
            if c.pred is not None:
                tensors[-1].pred = pred_info(pred, layout.name, layout.delta_array, [c])
                tensors[-1].delta_array = layout.delta_array
            written += c.written
            if c.written == 0:
                referenced += nbytes if layout.chunk_shape == layout.shape else layout.valid_bytes(0)
            p = Partial.from_list(c.partial)
            rows.append(finalize(p if p.n else merge([p])))  # (merge of one part: itself)
            names.append(name)
            continue
        ordered = [get((name, i)) for i in range(n)]
        if None in ordered:
            got = sum(1 for (nm, _) in by_chunk if nm == name)
            raise CaptureError(f"{name}: {got} of {n} chunks were written")
        bytes_total += layout.nbytes
        chunks = cast("list[ChunkResult]", ordered)
        crcs = [c.crc for c in chunks]
        for c in chunks:
            written += c.written
            if c.written == 0:  # the tensor's bytes in that chunk, not the edge padding
                referenced += layout.valid_bytes(c.index)
        rows.append(finalize(merge([Partial.from_list(c.partial) for c in chunks])))
        tensors.append(TensorEntry(
            name, layout.kind, layout.dtype, tuple(layout.shape), tuple(layout.chunk_shape),
            layout.codec, layout.array, [c.slot for c in chunks], crcs,
            [None if c.sha256 is None else c.sha256.hex() for c in chunks], tensor_checksum(crcs),
            sum(c.written for c in chunks),
            keyframes=[c.keyframe for c in chunks] if layout.delta else None,
            delta_array=layout.delta_array if layout.delta else None,
            packs=[c.pack for c in chunks] if any(c.pack is not None for c in chunks) else None,
            pred=pred_info(pred, layout.name, layout.delta_array, chunks),
        ))
        if tensors[-1].pred is not None:
            tensors[-1].delta_array = layout.delta_array
        names.append(name)
    if len(by_chunk) != expected:  # chunks past a planned tensor's grid (others' are ignored)
        planned = {layout.name: layout.nchunks for layout in plan.layouts}
        for nm, i in by_chunk:
            size = planned.get(nm)
            if size is not None and not 0 <= i < size:
                got = sum(1 for (other, _) in by_chunk if other == nm)
                raise CaptureError(f"{nm}: {got} of {size} chunks were written")
    return tensors, names, rows, (written, referenced, bytes_total)


def _one_chunk_entry(layout: TensorLayout, c: ChunkResult) -> TensorEntry:
    """The index entry of a one-chunk tensor (what the general path builds, cheaper)."""
    delta = layout.delta
    e = TensorEntry(layout.name, layout.kind, layout.dtype, tuple(layout.shape), tuple(layout.chunk_shape),
                    layout.codec, layout.array, [c.slot], [c.crc], [None if c.sha256 is None else c.sha256.hex()],
                    tensor_checksum([c.crc]), c.written, [c.keyframe] if delta else None,
                    layout.delta_array if delta else None, None if c.pack is None else [c.pack])
    e.share_grid(layout.chunk_grid)  # (equal shapes: the same grid)
    return e


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
