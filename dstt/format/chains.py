"""Reading predictive chunks: decode a chunk through its chain, each link
once (torch-free; docs/format.md "Predictive chunks").

A predictive chunk of tensor ``N`` at step ``t`` holds ``zigzag(bits -
predicted)``; the prediction reads the same chunk of other tensors (its
``pred.inputs``) at the step that coded it and at the step before
(``pred.chunks[i] = [coding, cur, prev]``), which may be coded the same way:
a *chain*, back to chunks stored whole (keyframes), at most K-1 steps with
a keyframe every K steps. :class:`ChainReader` walks it iteratively
(a damaged store cannot make it recurse or loop: steps strictly decrease
along ``prev``, a cycle within a step is refused, and a walk visits at most
:data:`MAX_WALK` chunks) and keeps the decoded chunks in a bounded cache,
so a reader that walks many steps in order (``history`` with data, a diff
of neighbours, an export of a range, ``verify``) decodes each chunk once.

Each decoded chunk is checked like any chunk (CRC-32C of its raw bytes
against its step's index, sha256 where asked); a failure anywhere along
the chain names the link that broke.

Readers attach a chain reader to the entries of each step they parse
(:func:`attach`); :func:`dstt.format.chunks.read_chunk` then decodes a
predictive chunk through it, so every read path (``Run.read``, restore,
export, diff, verify) reads predictive chunks the same way.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from dstt.errors import ChecksumMismatchError, CorruptStoreError, DsttError
from dstt.format import layout as L
from dstt.format.chunks import read_chunk
from dstt.format.codecs import predictive
from dstt.format.codecs.spec import crc32c, decode_chunk, max_stored_bytes
from dstt.format.packs import pack_key, read_range

if TYPE_CHECKING:
    from dstt.format.backends import Backend
    from dstt.format.manifest import TensorEntry

#: Decoded chunks a chain reader keeps (bytes), least recently used out first.
DEFAULT_CACHE_BYTES = 256 << 20
#: Chunks one walk may decode at most (a damaged store's chain is refused beyond).
MAX_WALK = 1 << 16

#: ``entries_at(branch, step)`` -> (branch that holds the step, step, its entries by name):
#: a step of a branch's ancestry resolves to the ancestor's.
EntriesAt = Callable[[str, int], "tuple[str, int, Mapping[str, TensorEntry]]"]
Node = tuple[str, int, str, int]  # (branch holding the step, step, tensor, chunk index)


def _nbytes(e: TensorEntry) -> int:
    return e.chunk_grid.chunk_numel * e.dtype.itemsize


def where_of(node: Node, e: TensorEntry) -> str:
    return f"step {node[1]} {node[2]} chunk {e.coords(node[3])}"


class ChainReader:
    """Decodes predictive chunks of one store, each at most once while it
    stays in the cache (``cache_bytes``). Thread-safe."""

    def __init__(self, backend: Backend, entries_at: EntriesAt, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.backend = backend
        self.entries_at = entries_at
        self.cache_bytes = cache_bytes
        # Decoded chunks by step (each step's least recently used first); see _put for the policy.
        self._cache: dict[int, OrderedDict[Node, np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()
        #: Chunks decoded through a prediction (not cache hits): for tests and benchmarks.
        self.decoded = 0

    # ----------------------------------------------------------------- cache

    def _get(self, node: Node) -> np.ndarray | None:
        with self._lock:
            at = self._cache.get(node[1])
            if at is None:
                return None
            got = at.get(node)
            if got is not None:
                at.move_to_end(node)
            return got

    def _put(self, node: Node, raw: np.ndarray) -> None:
        """Keep a decoded chunk within ``cache_bytes``: the chunks of the
        lowest step go first (least recently used first within a step).

        Why by step: a read of step t walks each chain from its keyframe up
        to t, so its older links are decoded before the chunks of step t
        that the reader asks for next (a parameter's walk decodes its
        optimizer state at t too); a reader in step order (history, a diff
        of neighbours, export of a range) needs step t-1's chunks for step
        t, never older ones. Plain LRU evicted the requested step's chunks
        of one parameter while the next parameter's chain was walked, so a
        whole-step read (state_dict, restore) decoded chains several times
        once the chains outgrew the cache."""
        if raw.nbytes > self.cache_bytes:
            return
        with self._lock:
            at = self._cache.setdefault(node[1], OrderedDict())
            if node in at:
                return
            at[node] = raw
            self._held += raw.nbytes
            while self._held > self.cache_bytes:
                low = min(self._cache)
                bucket = self._cache[low]
                _, old = bucket.popitem(last=False)
                self._held -= old.nbytes
                if not bucket:
                    del self._cache[low]

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._held = 0

    # ----------------------------------------------------------------- reads

    def _entry(self, branch: str, step: int, name: str, where: str) -> tuple[str, int, TensorEntry]:
        try:
            b, s, by_name = self.entries_at(branch, step)
        except DsttError as exc:
            raise CorruptStoreError(f"{where}: step {step} it is predicted from cannot be read ({exc})") from None
        e = by_name.get(name)
        if e is None:
            raise CorruptStoreError(f"{where}: tensor {name!r} it is predicted from is not in step {step}")
        return b, s, e

    def _deps(self, node: Node, e: TensorEntry) -> list[tuple[tuple[str, str], Node, TensorEntry]]:
        """The inputs chunk ``node`` of entry ``e`` decodes from: ((when,
        role), their node, their entry), checked to cover the same elements."""
        pred = e.pred
        assert pred is not None
        rec = pred.chunks[node[3]]
        assert rec is not None
        coding = pred.codings[rec.coding]
        w = where_of(node, e)
        out = []
        for need in predictive.plan(coding):
            step = rec.prev if need.when == "prev" else rec.cur
            b, s, dep = self._entry(node[0], step, pred.inputs[need.role], w)
            if dep.shape != e.shape or dep.chunk_shape != e.chunk_shape or dep.dtype.logical != need.dtype:
                raise CorruptStoreError(f"{w}: input {dep.name} at step {s} is {dep.dtype.logical} "
                                        f"{list(dep.shape)} in chunks {list(dep.chunk_shape)}, not what "
                                        f"{coding.predictor} {coding.role} reads ({need.dtype} "
                                        f"{list(e.shape)} in chunks {list(e.chunk_shape)})")
            out.append(((need.when, need.role), (b, s, dep.name, node[3]), dep))
        return out

    def chunk(self, branch: str, step: int, e: TensorEntry, i: int, *, sha256: bool = False) -> memoryview:
        """The raw bytes of chunk ``i`` of ``e`` (an entry of ``step`` held by
        ``branch``), decoded through its chain and checked against the index."""
        top: Node = (branch, step, e.name, i)
        got = self._get(top)
        if got is None:
            got = self._walk(top, e)
        if sha256 and e.sha256[i] is not None and hashlib.sha256(got.data).hexdigest() != e.sha256[i]:
            raise ChecksumMismatchError(f"{where_of(top, e)}: sha256 does not match the step index")
        return got.data.cast("B")

    def _walk(self, top: Node, top_entry: TensorEntry) -> np.ndarray:
        work: dict[Node, np.ndarray] = {}
        entries: dict[Node, TensorEntry] = {top: top_entry}
        active: set[Node] = set()
        stack: list[tuple[Node, bool]] = [(top, False)]
        visits = 0
        while stack:
            node, expanded = stack.pop()
            if node in work:
                continue
            e = entries[node]
            if expanded:
                active.discard(node)
                try:
                    work[node] = self._decode_one(node, e, work)
                except DsttError as exc:
                    if node == top:
                        raise
                    raise type(exc)(f"{where_of(top, top_entry)}: its chain breaks at "
                                    f"{where_of(node, e)}: {exc}") from None
                continue
            cached = self._get(node)
            if cached is not None:
                work[node] = cached
                continue
            if node in active:
                raise CorruptStoreError(f"{where_of(top, top_entry)}: the chain of {where_of(node, e)} "
                                        "depends on itself")
            visits += 1
            if visits > MAX_WALK:
                raise CorruptStoreError(f"{where_of(top, top_entry)}: its chain is longer than {MAX_WALK} chunks")
            active.add(node)
            stack.append((node, True))
            if e.pred is not None and e.pred.chunks[node[3]] is not None:
                for _, dep, dep_entry in reversed(self._deps(node, e)):
                    if dep not in work:
                        entries.setdefault(dep, dep_entry)
                        stack.append((dep, False))
        return work[top]

    def _decode_one(self, node: Node, e: TensorEntry, work: Mapping[Node, np.ndarray]) -> np.ndarray:
        """Chunk ``node`` from its stored bytes and its decoded inputs (in ``work``)."""
        i = node[3]
        w = where_of(node, e)
        pred = e.pred
        rec = None if pred is None else pred.chunks[i]
        if rec is None:  # stored whole: the ordinary, checked read
            raw = np.frombuffer(read_chunk(self.backend, e, i), dtype=np.uint8)
            self._put(node, raw)
            return raw
        assert pred is not None
        coding = pred.codings[rec.coding]
        ins = {key: work[dep] for key, dep, _ in self._deps(node, e)}
        z = self._residual(e, i, w)
        n = e.chunk_grid.chunk_numel
        bits = predictive.undo(coding, z, n, ins, w)
        raw = bits.view(np.uint8)
        if crc32c(raw) != e.crcs[i]:
            raise ChecksumMismatchError(f"{w}: CRC-32C of the decoded chunk does not match the step index")
        self.decoded += 1
        self._put(node, raw)
        return raw

    def _residual(self, e: TensorEntry, i: int, where: str) -> np.ndarray:
        """The stored residual of predictive chunk ``i`` (trailer checked, out
        of its container), as a writable byte array."""
        nbytes = _nbytes(e)
        limit = max_stored_bytes(e.codec, nbytes)
        p = e.pack(i)
        pred = e.pred
        assert pred is not None
        if p is not None:
            data = read_range(self.backend, pack_key(e.slots[i], p.rank, p.n), p, limit, where)
        else:
            key = L.chunk_key(pred.array, e.slots[i], e.coords(i))
            got = self.backend.get(key, max_bytes=limit)
            if got is None:
                raise CorruptStoreError(f"{where}: chunk {key} is missing")
            data = got
        z = np.frombuffer(decode_chunk(data, e.codec, nbytes, f"{where}: residual"), dtype=np.uint8)
        return z if z.flags.writeable else z.copy()


def attach(entries: list[TensorEntry], reader: ChainReader, branch: str, step: int) -> list[TensorEntry]:
    """``entries`` of one step (held by ``branch``), its predictive entries
    given the chain reader :func:`dstt.format.chunks.read_chunk` decodes them with. An
    entry another reader holds already (parsed indexes are shared within a
    process: manifest.parse_index_checked) is copied, not taken over."""
    out = entries
    for k, e in enumerate(entries):
        if e.pred is None:
            continue
        held = e.__dict__.get("_chain")
        if held is not None and held != (reader, branch, step):
            if out is entries:
                out = list(entries)
            e = out[k] = copy.copy(e)
        e.__dict__["_chain"] = (reader, branch, step)
    return out


def is_pred_chunk(e: TensorEntry, i: int) -> bool:
    return e.pred is not None and e.pred.chunks[i] is not None


__all__ = ["ChainReader", "DEFAULT_CACHE_BYTES", "MAX_WALK", "attach", "is_pred_chunk"]
