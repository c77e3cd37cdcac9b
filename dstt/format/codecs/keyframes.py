"""How a chunk is coded against earlier steps: dedup, delta and keyframes
(torch-free; the writer's half and the reader's half of docs/format.md
"Delta chunks").

Writer side. Each planned step gets one :class:`Link` per chunk it owns,
chained to the same chunk's link in the previous *captured* (planned) step
-- not the previous committed one: a pipelined capture flushes step k+1
while step k is still being written, and what a chunk is compared with must
not depend on that timing. A link resolves to a :class:`ChunkRef` (what a
later step needs of the chunk: its CRC, where it is stored, its keyframe)
when its chunk is stored; a step that fails or is skipped passes its
predecessor's value through, so the chain never waits on a step that will
not come. :func:`code_chunk` makes the decision for one chunk:

1. equal to the previous step's chunk (CRC match, then sha256 or a byte
   comparison with what is stored): referenced, nothing written;
2. delta-coded tensors (``compression="delta"``): stored as
   ``zigzag(bits - keyframe bits)`` in the delta array when the previous
   step's keyframe for the chunk is on the same branch, fewer than
   ``keyframe_every`` slots back, and the coded delta is smaller than
   ``DELTA_MAX_RATIO`` × the keyframe's coded size ("star" deltas: any chunk
   reads at most two chunks). The keyframe's bytes are kept in memory from
   when it was written, or read back once (a new writer, ``dstt.save``);
3. otherwise stored whole -- a keyframe for the chunks after it.

Reader side: :func:`read_coded` returns a chunk's raw bytes whatever way it
was stored.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dstt.errors import DsttError
from dstt.format import layout as L
from dstt.format.codecs.delta import undo_delta, zigzag_delta
from dstt.format.codecs.spec import CodecSpec, decode_chunk, encode_chunk, max_stored_bytes
from dstt.format.entries import TensorEntry
from dstt.format.packs import PackFile, PackRange, StepPacks, pack_key, read_range

if TYPE_CHECKING:
    from dstt.format.backends import Backend
    from dstt.format.codecs.predictors import Coding
    from dstt.format.predindex import ChunkPred

#: A delta is kept only if its coded size is below this fraction of the
#: coded size of the keyframe it refers to; else the chunk becomes a keyframe.
DELTA_MAX_RATIO = 0.95
#: Default keyframe spacing: a keyframe and at most ``DEFAULT_KEYFRAME_EVERY - 1``
#: deltas against it (docs/benchmarks.md "Issue 13" has the measurements).
DEFAULT_KEYFRAME_EVERY = 8


@dataclass(frozen=True)
class ChunkRef:
    """What a later step needs to know of one stored chunk."""

    crc: int  # CRC-32C of the raw chunk bytes
    sha256: bytes | None
    slot: int  # where the chunk is stored (its array: keyframe or delta array)
    key_slot: int | None = None  # slot of the keyframe deltas use (itself for a keyframe)
    key_raw: np.ndarray | None = None  # that keyframe's raw bytes (in memory; delta mode)
    key_written: int = 0  # that keyframe's coded size in bytes
    #: A packed chunk (packs.py): its range in pack ``pack_key(slot, *pack[:2])``,
    #: and while that pack may still be unwritten (this writer's), the pack.
    pack: PackRange | None = None
    pack_file: PackFile | None = None
    #: A predictive chunk (docs/format.md "Predictive chunks"): its pred
    #: record and coding, carried by every later step that references it.
    pred: ChunkPred | None = None
    coding: Coding | None = None

    @property
    def keyframe(self) -> int | None:
        """The keyframe slot this chunk is the difference to; None if stored whole."""
        return None if self.key_slot is None or self.key_slot == self.slot else self.key_slot


@dataclass
class Decision:
    """How the step coder (stepcoder.py) stores one chunk of a step:
    ``parts`` (its encoded bytes, the residual for a predictive chunk, else
    the whole chunk) and, for a predictive chunk, its coding and pred record."""

    parts: list[Any]
    coding: Coding | None = None
    rec: ChunkPred | None = None
    exact: int = 0
    #: The chunk's raw bytes (what the coder remembers): a predictive chunk
    #: whose previous step fails is stored whole from them.
    raw: np.ndarray | None = None

    @property
    def size(self) -> int:
        return sum(len(memoryview(p).cast("B")) for p in self.parts)



_LINK_LOCKS = [threading.Lock() for _ in range(64)]


class Link:
    """One chunk of one planned step: resolves (once) to the ChunkRef later
    steps compare with, or to None (nothing to compare with).

    >>> a = Link(None); b = Link(a); got = []
    >>> b.then(got.append); b.pass_through(); got
    []
    >>> a.resolve(ChunkRef(1, None, 7)); got[0].slot
    7
    """

    __slots__ = ("prev", "started", "_done", "_value", "_waiters")

    def __init__(self, prev: Link | None, value: Any = None, done: bool = False) -> None:
        self.prev = prev
        self.started = False  # its chunk's flush has begun (it will resolve the link)
        self._done = done
        self._value: ChunkRef | None = value
        self._waiters: list[Callable[[ChunkRef | None], None]] | None = None  # made on first wait

    @property
    def _lock(self) -> threading.Lock:
        # One of a few shared locks, not one per link: a step plans one link
        # per chunk (tens of thousands of tensors: a lock each cost ~20 us).
        # Sound because no method holds a link's lock while taking another's.
        return _LINK_LOCKS[(id(self) >> 4) % len(_LINK_LOCKS)]

    @classmethod
    def resolved(cls, value: ChunkRef | None) -> Link:
        return cls(None, value, True)

    def resolve(self, value: ChunkRef | None) -> None:
        """Set the value (a second call is ignored) and run the waiters."""
        with self._lock:
            if self._done:
                return
            # _value before _done: peek() reads them without the lock
            self._value, self.prev = value, None  # (drop the chain behind it)
            self._done = True
            waiters, self._waiters = self._waiters, None
        if waiters:
            for fn in waiters:
                fn(value)

    def pass_through(self) -> None:
        """Resolve to the predecessor's value (this step stored nothing here)."""
        prev = self.prev
        if prev is None:
            self.resolve(None)
        else:
            prev.then(self.resolve)

    def then(self, fn: Callable[[ChunkRef | None], None]) -> None:
        """Call ``fn(value)`` once resolved (now, if it is)."""
        with self._lock:
            if not self._done:
                if self._waiters is None:
                    self._waiters = []
                self._waiters.append(fn)
                return
            value = self._value
        fn(value)

    def peek(self) -> tuple[bool, ChunkRef | None]:
        """(resolved, value) now. Without the lock (once per chunk per step):
        ``_done`` is set last, once, after ``_value``, and attribute stores
        are atomic and ordered under the GIL, so ``_done`` read True means
        ``_value`` is final."""
        if self._done:
            return True, self._value
        return False, None


@dataclass(frozen=True)
class ChunkPlace:
    """Where one chunk of one tensor lives and how it is coded."""

    name: str
    array: str
    delta_array: str | None  # None: the tensor is not delta coded
    codec: CodecSpec
    itemsize: int
    coords: tuple[int, ...]
    #: Predictively coded tensor: ``delta_array`` holds its predictive
    #: chunks (never star deltas).
    pred: bool = False


@dataclass(frozen=True)
class Coded:
    """The outcome of :func:`code_chunk`."""

    ref: ChunkRef
    written: int  # coded bytes written (0: referenced)
    sha256: bytes | None


#: Chunks up to this size get their sha256 when first written (see code_chunk).
HASH_ON_WRITE_BYTES = 64 << 10


def code_chunk(backend: Backend, place: ChunkPlace, slot: int, raw: memoryview, crc: int,
               prev: ChunkRef | None, *, dedup: bool, keyframe_every: int, fast: bool = False,
               packs: StepPacks | None = None, decision: Decision | None = None) -> Coded:
    """Store one chunk of the step at ``slot`` (or reference ``prev``); see
    the module doc. ``fast`` (the writer is behind, ``compression="auto"``):
    no delta, the chunk stored whole without compression -- a keyframe.
    ``packs``: the chunk is appended to this step's packs (packs.py), never
    star-delta coded. ``decision``: the chunk's bytes as the step coder
    encoded them (stepcoder.py: a predictive chunk, or the chunk whole),
    stored unless it equals ``prev``."""
    prev = live_ref(prev)
    sha = None
    # (never a predictive chunk: a reference would depend on the step it was
    # coded against, which a later failure could leave uncommitted)
    if dedup and prev is not None and prev.crc == crc and prev.pred is None:
        sha = hashlib.sha256(raw).digest()
        if proven_equal(backend, prev, raw, sha, lambda: place):
            return Coded(replace(prev, sha256=sha), 0, sha)
    if decision is not None and decision.coding is not None:
        if packs is not None:
            f, rng = packs.add(decision.parts)
            return Coded(ChunkRef(crc, None, slot, pack=rng, pack_file=f, pred=decision.rec,
                                  coding=decision.coding), rng.length, None)
        if place.delta_array is None:
            raise ValueError(f"{place.name}: a predictive chunk of a tensor without a .delta array")
        backend.put(L.chunk_key(place.delta_array, slot, place.coords), decision.parts)
        return Coded(ChunkRef(crc, None, slot, pred=decision.rec, coding=decision.coding), decision.size, None)
    if packs is not None:
        if decision is not None:  # stored whole, as the step coder encoded it
            f, rng = packs.add(decision.parts)
            packed_digest = sha if sha is not None else packed_sha256(raw, prev, crc)
            return Coded(ChunkRef(crc, packed_digest, slot, pack=rng, pack_file=f), rng.length, packed_digest)
        parts = encode_chunk(raw, place.codec, raw_crc=crc, itemsize=place.itemsize, fast=fast)
        f, rng = packs.add(parts)
        packed_digest = sha if sha is not None else packed_sha256(raw, prev, crc)
        return Coded(ChunkRef(crc, packed_digest, slot, pack=rng, pack_file=f), rng.length, packed_digest)
    if place.delta_array is not None and not place.pred:
        key = None if fast else _keyframe_for(backend, place, prev, slot, len(raw), keyframe_every)
        if key is not None:
            z = zigzag_delta(raw, key.key_raw, place.itemsize)
            parts = encode_chunk(z.data.cast("B"), place.codec, itemsize=place.itemsize)
            size = _size(parts)
            if size < DELTA_MAX_RATIO * key.key_written:
                backend.put(L.chunk_key(place.delta_array, slot, place.coords), parts)
                ref = ChunkRef(crc, None, slot, key.key_slot, key.key_raw, key.key_written)
                return Coded(ref, size, None)
        parts = encode_chunk(raw, place.codec, raw_crc=crc, itemsize=place.itemsize, fast=fast)
        backend.put(L.chunk_key(place.array, slot, place.coords), parts)
        size = _size(parts)
        # A copy: ``raw`` may be a staging block that goes back to the pool.
        key_raw = np.frombuffer(raw, dtype=np.uint8).copy()
        return Coded(ChunkRef(crc, None, slot, slot, key_raw, size), size, None)
    parts = decision.parts if decision is not None else encode_chunk(raw, place.codec, raw_crc=crc,
                                                                     itemsize=place.itemsize, fast=fast)
    backend.put(L.chunk_key(place.array, slot, place.coords), parts)
    # A small chunk's sha256 costs less than reading it back: recorded now,
    # the next step's dedup proves equality by hash, not by a read per chunk
    # (tens of thousands of small tensors: issue 16).
    digest = hashlib.sha256(raw).digest() if len(raw) <= HASH_ON_WRITE_BYTES else None
    return Coded(ChunkRef(crc, digest, slot), _size(parts), digest)


def _keyframe_for(backend: Backend, place: ChunkPlace, prev: ChunkRef | None, slot: int, nbytes: int,
                  keyframe_every: int) -> ChunkRef | None:
    """The keyframe a chunk stored at ``slot`` may be a delta against (with
    its raw bytes), or None: then the chunk is stored whole."""
    if prev is None or prev.key_slot is None:
        return None
    key_slot = prev.key_slot
    if key_slot // L.SLOTS_PER_BRANCH != slot // L.SLOTS_PER_BRANCH or not 0 < slot - key_slot < keyframe_every:
        return None  # another branch's keyframe, or too far back: a new keyframe
    if prev.key_raw is not None:
        return prev if len(prev.key_raw) == nbytes else None
    # A writer that did not write the keyframe (dstt.save, a restarted
    # capture) reads it back once; the result carries it forward in memory.
    try:
        data = _get(backend, L.chunk_key(place.array, key_slot, place.coords), place.name, place.codec, nbytes)
        key_raw = np.frombuffer(decode_chunk(data, place.codec, nbytes, place.name), dtype=np.uint8)
    except DsttError:
        return None
    return ChunkRef(prev.crc, None, prev.slot, key_slot, key_raw, len(data))


def _size(parts: list[Any]) -> int:
    return sum(len(memoryview(p).cast("B")) for p in parts)


def packed_sha256(raw: memoryview, prev: ChunkRef | None, crc: int) -> bytes | None:
    """The sha256 recorded for a packed chunk of CRC ``crc`` whose previous
    step's chunk is ``prev`` (live): that of a dedup candidate (the same
    CRC) and of a chunk with no predecessor (a first step: frozen weights
    are then deduplicated by hash from the next step on); None for a changed
    chunk -- every chunk of a training loop's step -- which costs no hash
    (issue 16). A later chunk equal to an unhashed one is proven equal by
    reading its range back (proven_equal), never aliased unproven."""
    if prev is None or prev.crc == crc:
        return hashlib.sha256(raw).digest()
    return None


def live_ref(prev: ChunkRef | None) -> ChunkRef | None:
    """``prev``, or None if it lies in a pack that failed: its bytes were
    never stored, so there is nothing to reference or compare with."""
    if prev is not None and prev.pack_file is not None and prev.pack_file.state == "failed":
        return None
    return prev


def proven_equal(backend: Backend, prev: ChunkRef, raw: memoryview, sha: bytes,
                 place: Callable[[], ChunkPlace]) -> bool:
    """Whether ``raw`` (whose CRC equals ``prev.crc``, its sha256 ``sha``)
    holds exactly ``prev``'s bytes: by sha256 when ``prev`` has one, else by
    reading the stored chunk back (``place()`` says where). Equal CRCs alone
    never prove equal bytes."""
    if prev.sha256 is not None:
        return prev.sha256 == sha
    if prev.pred is not None:  # its stored bytes are a residual: equal only by hash
        return False
    return _equals_stored(backend, place(), prev, raw)


def _equals_stored(backend: Backend, place: ChunkPlace, prev: ChunkRef, raw: memoryview) -> bool:
    """Exact byte comparison with the chunk ``prev`` describes, as stored."""
    try:
        if prev.pack is not None:
            if prev.pack_file is not None and prev.pack_file.state != "written":
                return False  # not on disk yet (and not worth waiting for): stored anew
            key = pack_key(prev.slot, prev.pack.rank, prev.pack.n)
            data = read_range(backend, key, prev.pack, max_stored_bytes(place.codec, len(raw)), place.name)
            stored = decode_chunk(data, place.codec, len(raw), place.name)
            return bool(np.array_equal(np.frombuffer(stored, np.uint8), np.frombuffer(raw, np.uint8)))
        stored = read_coded(backend, place, prev.slot, prev.keyframe, len(raw), place.name,
                            key_raw=prev.key_raw if prev.keyframe is not None else None)
    except DsttError:
        return False
    return bool(np.array_equal(np.frombuffer(stored, np.uint8), np.frombuffer(raw, np.uint8)))


def read_coded(backend: Backend, place: ChunkPlace, slot: int, keyframe: int | None, nbytes: int,
               where: str, *, key_raw: Any = None) -> memoryview:
    """The raw bytes of a chunk stored at ``slot``: whole (``keyframe`` None)
    in ``place.array``, else as a delta in ``place.delta_array`` against the
    keyframe at slot ``keyframe`` of ``place.array`` (``key_raw``: its raw
    bytes, if the caller has them). Each stored chunk's trailer CRC-32C and
    decoded size are checked; the caller compares the result with the
    index's CRC-32C."""
    if keyframe is None:
        data = _get(backend, L.chunk_key(place.array, slot, place.coords), where, place.codec, nbytes)
        return decode_chunk(data, place.codec, nbytes, where)
    if place.delta_array is None:
        from dstt.errors import CorruptStoreError

        raise CorruptStoreError(f"{where}: a keyframe reference on a tensor that is not delta coded")
    if key_raw is None:
        kwhere = f"{where}: its keyframe (slot {keyframe})"
        kdata = _get(backend, L.chunk_key(place.array, keyframe, place.coords), kwhere, place.codec, nbytes)
        key_raw = decode_chunk(kdata, place.codec, nbytes, kwhere)
    data = _get(backend, L.chunk_key(place.delta_array, slot, place.coords), f"{where}: delta", place.codec, nbytes)
    z = decode_chunk(data, place.codec, nbytes, f"{where}: delta")
    return undo_delta(key_raw, z, place.itemsize).data.cast("B")


def read_delta(backend: Backend, e: TensorEntry, i: int, *, sha256: bool = False) -> memoryview:
    """The raw bytes of chunk ``i`` of a delta-coded entry, stored as a
    difference (``e.keyframe(i)`` is not None): the keyframe and the delta
    chunk read and checked, the sum checked against the step index's CRC-32C
    (and sha256, with ``sha256=True``). What chunks.read_chunk calls."""
    from dstt.errors import ChecksumMismatchError
    from dstt.format.codecs.spec import crc32c

    coords = e.coords(i)
    where = f"{e.name} chunk {coords} (slot {e.slots[i]}, keyframe {e.keyframe(i)})"
    place = ChunkPlace(e.name, e.array, e.delta_array, e.codec, e.dtype.itemsize, coords)
    nbytes = math.prod(e.chunk_shape) * e.dtype.itemsize
    raw = read_coded(backend, place, e.slots[i], e.keyframe(i), nbytes, where)
    if crc32c(raw) != e.crcs[i]:
        raise ChecksumMismatchError(f"{where}: CRC-32C does not match the step index")
    if sha256 and e.sha256[i] is not None and hashlib.sha256(raw).hexdigest() != e.sha256[i]:
        raise ChecksumMismatchError(f"{where}: sha256 does not match the step index")
    return raw


def _get(backend: Backend, key: str, where: str, codec: CodecSpec, nbytes: int) -> bytes | bytearray:
    """A stored chunk's bytes, read no further than its codec allows (untrusted store)."""
    data = backend.get(key, max_bytes=max_stored_bytes(codec, nbytes))
    if data is None:
        from dstt.errors import CorruptStoreError

        raise CorruptStoreError(f"{where}: chunk {key} is missing")
    return data


def resolved_tails(entries: list[TensorEntry]) -> dict[tuple[str, int], Link]:
    """Resolved links to the chunks of a stored step's ``entries``, by
    (array, chunk index): what the next step dedups against (Writer._load_prev). One-chunk
    tensors (most of them, by count) take a shorter path."""
    out: dict[tuple[str, int], Link] = {}
    for e in entries:
        kf, packs = e.keyframes, e.packs
        if e.pred is not None:  # predictive chunks: their records travel with them
            pred = e.pred
            for i, (c, h, s) in enumerate(zip(e.crcs, e.sha256, e.slots)):
                out[(e.array, i)] = Link.resolved(ChunkRef(
                    c, None if h is None else bytes.fromhex(h), s, pack=None if packs is None else packs[i],
                    pred=pred.chunks[i], coding=pred.coding(i)))
            continue
        if kf is None and len(e.slots) == 1:
            h = e.sha256[0]
            out[(e.array, 0)] = Link(None, ChunkRef(e.crcs[0], None if h is None else bytes.fromhex(h), e.slots[0],
                                                    None, None, 0, None if packs is None else packs[0]), True)
            continue
        for i, (c, h, s) in enumerate(zip(e.crcs, e.sha256, e.slots)):
            out[(e.array, i)] = Link.resolved(ChunkRef(
                c, None if h is None else bytes.fromhex(h), s,
                None if kf is None else (s if kf[i] is None else kf[i]), pack=None if packs is None else packs[i]))
    return out


__all__ = ["ChunkPlace", "ChunkRef", "Coded", "DEFAULT_KEYFRAME_EVERY", "DELTA_MAX_RATIO", "Link",
           "code_chunk", "read_coded", "read_delta", "resolved_tails"]
