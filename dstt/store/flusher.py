"""The flush phase of :class:`~dstt.store.writer.Writer`: stats, checksum,
dedup, coding and write of each chunk of a planned step (:class:`Flusher`,
a component the writer holds; thread-safe), chunk by chunk
(:meth:`Flusher.flush_chunk`) or small chunks in groups
(:meth:`Flusher.flush_chunks`; issue 16: tens of thousands of tensors).

``flush_chunk`` costs ~40 us of Python and torch calls per chunk
whatever its size (~6 torch reductions for the stats, a numpy view for the
bytes, a ChunkRef, a pack append under a lock): for 100,000 1-KiB tensors
that is seconds, for a step whose data is 100 MB. :meth:`Flusher.flush_chunks`
flushes a batch of chunks with the same result per chunk as ``flush_chunk``
(same stats within float rounding, same bytes, same links, dedup and pack
references), grouping the small CPU chunks of one dtype:

* their values are concatenated into one private buffer (one ``torch.cat``);
  the stats of every chunk come from a few vectorized passes over it
  (:func:`dstt.store.stats.batch_partials`), and each chunk's raw bytes are a
  slice of it (the buffer is this batch's own: a chunk waiting for the
  previous step's same chunk keeps its slice, no copy);
* CRC-32C, dedup against the link's previous ref, sha256 and encoding run in
  one tight loop, and the packed chunks go into the step's packs under one
  lock (:meth:`dstt.format.packs.StepPacks.add_many`).

Anything else -- padded edge chunks, complex or float8 values, non-CPU
tensors, large chunks -- takes ``flush_chunk`` itself; unpacked chunks of a
group take ``Flusher._store`` (delta coding, chunk files).

Invariants kept from ``flush_chunk``: every chunk of the batch is flushed,
waits for its predecessor (``ChunkResult.pending``), or failed -- a failed
chunk's link passes its predecessor's value on, so no later step waits for
it -- and the first error is returned, never swallowed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, TypeVar

import google_crc32c
import numpy as np
import torch

from dstt.format.backends import Backend
from dstt.format.codecs.keyframes import (
    ChunkPlace,
    ChunkRef,
    Link,
    code_chunk,
    live_ref,
    packed_sha256,
    proven_equal,
)
from dstt.format.codecs.spec import crc32c, encode_chunk
from dstt.format.commit import ChunkResult
from dstt.format.packs import StepPacks
from dstt.format.pygc import paused_gc
from dstt.store.plan import ChunkTask, StepPlan
from dstt.store.predflush import decision_of, pred_layout
from dstt.store.prevvalues import PrevValues, default_budget
from dstt.store.stats import BATCH_DTYPES, batch_partials, chunk_partial
from dstt.store.torch_dtypes import as_storage_view
from dstt.store.torchthreads import single_threaded


def chunk_bytes(task: ChunkTask, staged: torch.Tensor | None = None) -> memoryview:
    """The chunk as stored before encoding: C-order bytes of the full chunk
    shape in the storage dtype, edge chunks zero-padded."""
    src = staged if staged is not None else task.source
    if src.device.type != "cpu":
        src = src.cpu()
    # A conjugate or negative view (complex .conj()) is lazy: materialize the
    # values it stands for; numpy refuses such tensors.
    src = as_storage_view(src.detach().resolve_conj().resolve_neg())
    if task.padded:
        full = torch.zeros(task.layout.chunk_shape, dtype=src.dtype)
        full[tuple(slice(0, n) for n in task.shape)] = src
        src = full
    elif not src.is_contiguous():
        src = src.contiguous()
    if src.dim() == 0:
        src = src.reshape(1)
    return src.numpy().data.cast("B")


#: Flushes one chunk: ``(plan, task, staged, prev_staged) -> result`` (:meth:`Flusher.flush_chunk`).
FlushOne = Callable[[StepPlan, ChunkTask, "torch.Tensor | None", "torch.Tensor | None"], ChunkResult]

#: Chunks of at most this many bytes are flushed in groups. Larger ones
#: cost less alone (issue 25, the capture helper's persist path): their
#: stats are a few float32 passes over the chunk where it lies (a ring
#: slot), where a group copies every chunk into its buffer, and the
#: previous step's too, and widens both to float64 -- 1.3 GB/s against
#: 2.4 GB/s alone at 64 KiB, 5.3 GB/s alone at 663 KiB (one core);
#: below ~32 KiB the per-chunk calls cost more than the group's copies.
BATCH_CHUNK_BYTES = 32 << 10
#: Bytes of values concatenated at once (bounds the float64 temporaries of
#: the stats: about 4x this).
GROUP_BYTES = 8 << 20


def batchable(task: ChunkTask, src: torch.Tensor) -> bool:
    """Whether a chunk is flushed in a group: not padded (so its bytes are
    ``src``'s), of a dtype the vectorized stats take, on the CPU, not a lazy
    negative view, small and not empty."""
    return (task.shape == task.layout.chunk_shape and src.dtype in BATCH_DTYPES and src.is_cpu
            and not src.is_neg() and 0 < src.nbytes <= BATCH_CHUNK_BYTES)


def chunk_place(task: ChunkTask) -> ChunkPlace:
    """Where ``task``'s chunk is stored (keyframes.ChunkPlace)."""
    layout = task.layout
    pred = pred_layout(layout)
    return ChunkPlace(layout.name, layout.array, layout.delta_array if layout.delta or pred else None,
                      layout.codec, layout.dtype.itemsize, task.coords, pred)


class Flusher:
    """Flushes the chunks of planned steps to ``backend`` (module docstring).

    ``dedup``: a chunk equal to the same chunk of the previous planned step
    is referenced, not rewritten; ``keyframe_every``: delta coding's
    keyframe interval; ``threads``: the pool a chunk waiting for its
    predecessor finishes on (the writer's ``write()`` flushes on it too)."""

    def __init__(self, backend: Backend, *, dedup: bool, keyframe_every: int, threads: int) -> None:
        self.backend = backend
        self.dedup = dedup
        self.keyframe_every = keyframe_every
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dstt-flush")
        self._lock = threading.Lock()
        self._encode_cpu_s = 0.0  # CPU seconds spent coding chunks (guarded by _lock)
        #: The previous step's chunks, for the update statistics where the
        #: caller gives none (dstt.store.prevvalues).
        self.prev_values = PrevValues(default_budget())

    @property
    def encode_cpu_s(self) -> float:
        """CPU seconds spent coding chunks so far (compression="auto" paces by it)."""
        with self._lock:
            return self._encode_cpu_s

    def close(self) -> None:
        """Wait for the pool's threads (a waiting chunk's finish included) and stop them."""
        self.pool.shutdown(wait=True)  # unbounded wait: this writer's own flush threads, drained by then

    def flush_chunk(self, plan: StepPlan, task: ChunkTask, staged: torch.Tensor | None = None,
                    prev_staged: torch.Tensor | None = None) -> ChunkResult:
        """Stats, checksum, dedup and write of one chunk. Thread-safe.

        ``prev_staged``: the same chunk of the previous captured step, still in host
        memory (the capture's memory tier), for the update statistics
        (``update_norm``/``update_ratio``; NaN without it).

        Dedup costs nothing for changed chunks: their CRC-32C (needed anyway
        for the chunk trailer) differs from the previous step's. Only on a CRC
        match is equality proven exactly -- by sha256 when the previous chunk
        has one, else by comparing with the stored bytes -- and the sha256 is
        recorded so a frozen tensor is proven by hash from then on.
        """
        key = (task.layout.array, task.index)
        link = plan.links.get(key) or Link(None)
        link.started = True
        try:
            src = staged if staged is not None else task.source
            host = src if src.device.type == "cpu" else src.cpu()
            if not plan.prev_told:
                prev_staged = self.prev_values.take(key, link)
            partial = chunk_partial(host, prev_staged).to_list()
            if not plan.prev_told and self.prev_values.room(host.nbytes):
                self.prev_values.keep(key, link, plan.step, host.detach().clone() if host is src else host,
                                      settled=_settled(link, prev_staged))
            raw = chunk_bytes(task, src)
            crc = crc32c(raw)
            result = ChunkResult(task.layout.name, task.index, crc, None, plan.slot, 0, len(raw), partial)
            prev = link.prev
            done, value = (True, None) if prev is None else prev.peek()
            if prev is None or done:
                return self._store(plan, task, raw, result, link, value)
            # The same chunk of the previous planned step is not stored yet
            # (its flush was queued after this one): finish when it is, on
            # this writer's own thread, from a private copy of the bytes --
            # the staging block goes back to the pool now. commit() waits.
            self._wait_for(plan, task, np.frombuffer(raw, dtype=np.uint8).copy().data, result, link, prev)
            return result
        except BaseException:
            link.pass_through()  # later steps compare with what was there before
            raise

    def _store(self, plan: StepPlan, task: ChunkTask, raw: memoryview, result: ChunkResult, link: Link,
               prev: ChunkRef | None) -> ChunkResult:
        """Dedup, delta code or write one chunk against ``prev``; resolves ``link``."""
        cpu = time.thread_time()
        try:
            packs = plan.packs if task.layout.packed else None
            coded = code_chunk(self.backend, chunk_place(task), plan.slot, raw, result.crc, prev,
                               dedup=self.dedup, keyframe_every=self.keyframe_every, fast=plan.fast, packs=packs,
                               decision=decision_of(plan, task))
            if coded.written == 0 and coded.ref.pack_file is not None and plan.packs is not None:
                plan.packs.refer(coded.ref.pack_file)  # commit checks it was written
        except BaseException:
            link.pass_through()
            raise
        with self._lock:
            self._encode_cpu_s += time.thread_time() - cpu
        link.resolve(coded.ref)
        result.slot, result.keyframe, result.pack = coded.ref.slot, coded.ref.keyframe, coded.ref.pack
        result.pred, result.coding = coded.ref.pred, coded.ref.coding
        result.written, result.sha256 = coded.written, coded.sha256
        return result

    def flush_chunks(self, plan: StepPlan, tasks: list[ChunkTask], staged: list[torch.Tensor | None] | None = None,
                     prev_staged: list[torch.Tensor | None] | None = None, *, one: FlushOne | None = None,
                     ) -> tuple[list[ChunkResult], BaseException | None]:
        """Flush ``tasks`` (``staged[i]``: task i's staged copy, else its
        source; ``prev_staged[i]``: the same chunk at the previous captured
        step, for the update stats). Returns the results of the chunks
        flushed and the first error; a chunk that failed has no result.
        Thread-safe like ``flush_chunk``; never raises for a chunk's error.

        ``one``: what flushes a chunk that is not grouped (default
        :meth:`flush_chunk`); the writer passes its own ``flush_chunk``, so
        a hook there sees every chunk flushed alone, whichever way it came.

        (``Writer.flush_chunks`` shows it.)
        """
        # The collector paused: the few objects per chunk (results, refs,
        # ranges, rows) hold no cycles, and their burst would trigger full
        # collections that walk every live object -- ~1 s of a 100,000-tensor step.
        if prev_staged is not None:
            plan.prev_told = True  # (the memory tier: it gives every chunk's, or None)
        with paused_gc():
            return self._flush_chunks(plan, tasks, staged, prev_staged, one or self.flush_chunk)

    def _flush_chunks(self, plan: StepPlan, tasks: list[ChunkTask], staged: list[torch.Tensor | None] | None,
                      prev_staged: list[torch.Tensor | None] | None, one: FlushOne,
                      ) -> tuple[list[ChunkResult], BaseException | None]:
        results: list[ChunkResult] = []
        error: BaseException | None = None
        groups: dict[torch.dtype, list[tuple[int, int]]] = {}  # dtype -> (task index, chunk bytes)
        srcs: list[torch.Tensor] = []
        for i, t in enumerate(tasks):
            s = staged[i] if staged is not None else None
            src = t.source if s is None else s
            srcs.append(src)
            if batchable(t, src):
                groups.setdefault(src.dtype, []).append((i, src.nbytes))
                continue
            try:
                results.append(one(plan, t, s, None if prev_staged is None else prev_staged[i]))
            except BaseException as e:  # every chunk flushed or failed: none left running
                error = error or e
        for members in groups.values():
            for part in _split(members):
                err = self._flush_group(plan, [tasks[i] for i in part], [srcs[i] for i in part],
                                        None if prev_staged is None else [prev_staged[i] for i in part], results)
                error = error or err
        return results, error

    def _flush_group(self, plan: StepPlan, tasks: list[ChunkTask], srcs: list[torch.Tensor],
                     prevs: list[torch.Tensor | None] | None, out: list[ChunkResult]) -> BaseException | None:
        """Flush small CPU chunks of one dtype (see the module doc), appending
        their results to ``out``; returns the first error."""
        links = [plan.links.get((t.layout.array, t.index)) or Link(None) for t in tasks]
        for link in links:
            link.started = True
        if not plan.prev_told:
            prevs = [self.prev_values.take((t.layout.array, t.index), link) for t, link in zip(tasks, links)]
        settled = [False] * len(tasks)  # each link is resolved, waits, or passes through exactly once
        # Single-threaded torch for this batch's small operations: an OpenMP
        # team per call costs more than it saves on 64K values, and its
        # spinning workers preempt the trainer's. Only this thread's team
        # size, put back after (this may be the trainer's own thread, in
        # dstt.save): never torch.set_num_threads, which every thread of
        # the process adopts (issue 23).
        try:
            with single_threaded():
                return self._code_group(plan, tasks, srcs, prevs, links, settled, out)
        except BaseException as e:
            return e
        finally:
            for j, link in enumerate(links):
                if not settled[j]:
                    link.pass_through()  # later steps compare with what was there before

    def _code_group(self, plan: StepPlan, tasks: list[ChunkTask], srcs: list[torch.Tensor],
                    prevs: list[torch.Tensor | None] | None, links: list[Link], settled: list[bool],
                    out: list[ChunkResult]) -> BaseException | None:
        """The body of :meth:`_flush_group`: ``settled[j]`` set once chunk j's
        link is resolved, waits for its predecessor, or was passed through."""
        with torch.no_grad():
            flats = [s if s.dim() == 1 else s.reshape(-1) for s in srcs]
            counts = [f.numel() for f in flats]
            block = _GROUP_BUFFERS.take(flats[0].dtype, sum(counts))
            buf = torch.cat(flats, out=block[:sum(counts)])  # private: the bytes of every chunk, stats read it too
            if not plan.prev_told and self.prev_values.room(buf.nbytes):
                self._keep_group(plan, tasks, links, buf.clone(), counts, prevs)
        waits = [False]
        try:
            return self._code_buffer(plan, tasks, buf, counts, prevs, links, settled, out, waits)
        finally:
            if not waits[0]:  # no chunk keeps a slice of it (_wait_for): the next group's
                _GROUP_BUFFERS.give(block)

    def _keep_group(self, plan: StepPlan, tasks: list[ChunkTask], links: list[Link], held: torch.Tensor,
                    counts: list[int], prevs: list[torch.Tensor | None] | None) -> None:
        """Hold a group's values (one copy, a view per chunk) for the next
        step's update statistics."""
        at = 0
        for j, (t, link, c) in enumerate(zip(tasks, links, counts)):
            self.prev_values.keep((t.layout.array, t.index), link, plan.step, held[at:at + c],
                                  settled=_settled(link, None if prevs is None else prevs[j]))
            at += c

    def _code_buffer(self, plan: StepPlan, tasks: list[ChunkTask], buf: torch.Tensor, counts: list[int],
                     prevs: list[torch.Tensor | None] | None, links: list[Link], settled: list[bool],
                     out: list[ChunkResult], waits: list[bool]) -> BaseException | None:
        """:meth:`_code_group` once the chunks' values are in ``buf``
        (``counts[j]`` values each); ``waits[0]`` set if a chunk keeps a
        slice of ``buf`` past the call."""
        error: BaseException | None = None
        rows = batch_partials(buf, counts, prevs)
        arr = as_storage_view(buf).numpy().view(np.uint8)
        mv = arr.data
        itemsize = buf.element_size()
        offs = [0]
        for c in counts:
            offs.append(offs[-1] + c * itemsize)
        later: list[tuple[int, ChunkResult, ChunkRef | None]] = []
        packed: list[tuple[int, ChunkResult, list[Any]]] = []
        cpu = time.thread_time()
        packs, slot, extend = plan.packs, plan.slot, google_crc32c.extend
        for j, t in enumerate(tasks):
            a, b = offs[j], offs[j + 1]
            raw = mv[a:b]
            layout = t.layout
            result = ChunkResult(layout.name, t.index, int(extend(0, arr[a:b])), None, slot, 0, b - a, rows[j])
            link = links[j]
            prev: Link | None = link.prev
            done, value = (True, None) if prev is None else prev.peek()
            if prev is not None and not done:
                waits[0] = True
                self._wait_for(plan, t, raw, result, link, prev)
                settled[j] = True
                out.append(result)
                continue
            if not (layout.packed and packs is not None):
                later.append((j, result, value))  # a chunk file: _store
                continue
            ref, parts = self._code_packed(plan, t, raw, result, value)
            if ref is not None:  # unchanged: references the previous step's bytes
                link.resolve(ref)
                settled[j] = True
                out.append(result)
            else:
                packed.append((j, result, parts))
        if packed:
            error = self._add_packed(plan, packed, links, settled, out)
        with self._lock:
            self._encode_cpu_s += time.thread_time() - cpu
        for j, result, value in later:
            settled[j] = True  # _store resolves the link or passes it through (or we do, below)
            try:
                out.append(self._store(plan, tasks[j], mv[offs[j]:offs[j + 1]], result, links[j], value))
            except BaseException as e:
                links[j].pass_through()  # (a no-op if _store resolved it)
                error = error or e
        return error

    def _code_packed(self, plan: StepPlan, t: ChunkTask, raw: memoryview, result: ChunkResult,
                     value: ChunkRef | None) -> tuple[ChunkRef | None, list[Any]]:
        """keyframes.code_chunk for a packed chunk, up to the pack append:
        (the ref to resolve its link to, []) if it equals ``value`` (result
        filled in, the pack referenced), else (None, its encoded parts).

        ``result.sha256`` is keyframes.packed_sha256's (a changed chunk gets
        none: sha256 was ~0.6 ms per 1.2 MB step of the capture helper's
        CPU, issue 16). A chunk equal to a changed predecessor (no sha256)
        is proven equal by reading that range back (keyframes.proven_equal)
        or, its pack not written yet, stored anew with its hash."""
        value = live_ref(value)
        candidate = value is not None and value.crc == result.crc and value.pred is None
        sha = packed_sha256(raw, value, result.crc)
        result.sha256 = sha
        if (self.dedup and candidate and value is not None and sha is not None
                and proven_equal(self.backend, value, raw, sha, lambda: chunk_place(t))):
            if value.pack_file is not None:
                plan.packs.refer(value.pack_file)  # commit checks it was written
            result.slot, result.keyframe, result.pack = value.slot, value.keyframe, value.pack
            return (value if value.sha256 == sha else replace(value, sha256=sha)), []
        decision = decision_of(plan, t)
        if decision is not None:  # predflush.prepare encoded it: a residual, or the chunk whole
            result.pred, result.coding = decision.rec, decision.coding
            return None, decision.parts
        layout = t.layout
        return None, encode_chunk(raw, layout.codec, raw_crc=result.crc, itemsize=layout.dtype.itemsize, fast=plan.fast)

    @staticmethod
    def _add_packed(plan: StepPlan, packed: list[tuple[int, ChunkResult, list[Any]]], links: list[Link],
                    settled: list[bool], out: list[ChunkResult]) -> BaseException | None:
        """Append the encoded chunks to the step's packs at once; resolve
        their links. A chunk in a pack that could not be written fails."""
        packs: StepPacks = plan.packs
        placed, error = packs.add_many([parts for _, _, parts in packed])
        slot = plan.slot
        for (j, result, _), (f, rng) in zip(packed, placed):
            if f.state == "failed":
                continue  # passed through by the caller; the error is returned
            links[j].resolve(ChunkRef(result.crc, result.sha256, slot, pack=rng, pack_file=f,
                                      pred=result.pred, coding=result.coding))
            settled[j] = True
            result.pack, result.written = rng, rng.length
            out.append(result)
        return error

    def _wait_for(self, plan: StepPlan, task: ChunkTask, raw: memoryview, result: ChunkResult, link: Link,
                  prev: Link) -> None:
        """The same chunk of the previous planned step is not stored yet (its
        flush was queued after this one): finish when it is, on this writer's
        pool, from ``raw`` (private bytes: a slice of the batch's own buffer,
        or flush_chunk's copy of a staging block). commit() waits for ``result.pending``."""
        pending: Future[ChunkResult] = Future()
        result.pending = pending

        def finish(value: ChunkRef | None) -> None:
            def run() -> None:
                try:
                    self._late_update(plan, task, result, link)
                    pending.set_result(self._store(plan, task, raw, result, link, value))
                except BaseException as e:
                    pending.set_exception(e)
            self.pool.submit(run)

        prev.then(finish)


    def _late_update(self, plan: StepPlan, task: ChunkTask, result: ChunkResult, link: Link) -> None:
        """The update sum of a chunk flushed before its predecessor's flush
        began (its stats found no previous values then), now that the
        predecessor is stored and both steps' values are held."""
        if plan.prev_told or len(result.partial) < 8 or result.partial[7] == result.partial[7]:
            return
        key = (task.layout.array, task.index)
        got = self.prev_values.update_sumsq(key, link)
        if got is not None:
            result.partial[7] = got
        self.prev_values.settle(key, plan.step)


def _settled(link: Link, prev: torch.Tensor | None) -> bool:
    """Whether a chunk's update is computed at its flush (its predecessor's
    values were at hand), or never will be (no predecessor, or one already
    stored without them): then earlier steps' values need not be held."""
    if prev is not None or link.prev is None:
        return True
    done, _ = link.prev.peek()
    return bool(done)


class _Blocks:
    """1-d tensors a group's values are concatenated into, reused from group
    to group (by dtype): a new 1.2 MB block per step cost the capture helper
    its page faults every step (issue 16). At most ``keep_bytes`` are kept
    idle; a block a waiting chunk still slices is never given back."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        with self._lock:
            for i, t in enumerate(self._free):
                if t.dtype == dtype and t.numel() >= numel:
                    return self._free.pop(i)
        return torch.empty(numel, dtype=dtype)

    def give(self, block: torch.Tensor) -> None:
        with self._lock:
            self._free.insert(0, block)  # the most recent first: its pages are warm
            total = 0
            for i, t in enumerate(self._free):
                total += t.nbytes
                if total > self._keep_bytes:
                    del self._free[i:]
                    break


#: Blocks kept idle: two groups' worth (the capture helper flushes a step's
#: batches on two threads).
_GROUP_BUFFERS = _Blocks(2 * GROUP_BYTES)


def _split(members: list[tuple[int, int]]) -> list[list[int]]:
    """Task indices of (index, chunk bytes) pairs in runs of at most GROUP_BYTES."""
    out: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, n in members:
        if run and size + n > GROUP_BYTES:
            out.append(run)
            run, size = [], 0
        run.append(i)
        size += n
    if run:
        out.append(run)
    return out


T = TypeVar("T")

#: Chunks below this size are flushed in batches (Writer._flush_batch, the capture helper).
SMALL_CHUNK_BYTES = 1 << 20
#: Bytes of small chunks handed to one pool task.
BATCH_BYTES = 4 << 20


def _nbytes(item: Any) -> int:
    return int(item.nbytes)


def batches(items: list[T], nbytes: Callable[[T], int] = _nbytes) -> list[list[T]]:
    """Items (chunks, or chunks with their staged views) for flush tasks:
    large ones one per task (the pool writes them in parallel), small ones
    grouped up to BATCH_BYTES, in order (one task per chunk costs more than
    a small chunk's own work)."""
    out: list[list[T]] = []
    batch: list[T] = []
    size = 0
    for t in items:
        n = nbytes(t)
        if n >= SMALL_CHUNK_BYTES:
            out.append([t])
            continue
        batch.append(t)
        size += n
        if size >= BATCH_BYTES:
            out.append(batch)
            batch, size = [], 0
    if batch:
        out.append(batch)
    return out


__all__ = ["BATCH_CHUNK_BYTES", "Flusher", "GROUP_BYTES", "batchable", "batches", "chunk_bytes", "chunk_place"]
