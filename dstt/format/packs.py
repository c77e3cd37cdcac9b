"""Packs: the small chunks of many tensors stored together in one object
(torch-free format layer; docs/format.md "Packs").

A step of tens of thousands of small tensors used to create a file (and an
array document) per tensor. Chunks up to :func:`dstt.knobs.pack_chunk_bytes`
(``$DSTT_PACK_CHUNK_BYTES``, else 1 MiB; ``WriteOptions(pack_chunk_bytes=)``
overrides it, 0 packs nothing; larger chunks stay chunk files of their zarr
array, readable by plain zarr-python) are instead appended, each encoded exactly as its chunk file would be (codec
body + CRC-32C trailer), to a *pack*: ``packs/p.<slot>.<rank>.<n>``, written
once, whole, by the one rank (one writer) that filled it, sealed at
:data:`PACK_TARGET_BYTES`. So files per step grow with bytes, not with
tensor count (DataStates-LLM's coalescing of fragmented shards).

A *gathered* pack (:attr:`StepPacks.borrow`: the capture helper's memory
tier, whose ring slot outlives the step's write; issue 25) is written from
where its chunks lie, with no copy: each chunk whose bytes are whole pages
on a page boundary has them on a page boundary of the pack, its 4-byte
trailer at the start of a page of zeros after them and its prefix (a fast
Blosc container's 16-byte header), if any, at the end of a page of zeros
before them; the local backend hands the buffers to the device as they
are (O_DIRECT ``writev``, :mod:`dstt.format.localio`). The ranges are
recorded as for any pack; only the padding is new.

The step index records, per packed chunk, where its range lives:
:class:`PackRange` ``(rank, n, offset, length)`` beside the chunk's slot
(the slot of the step that wrote the pack) and CRC-32C, as for any chunk. An
unchanged chunk of a later step references the same range (nothing
rewritten). Readers read exactly the recorded range (bounded by the codec's
largest stored size) and check it like a chunk file (:mod:`dstt.format.chunks`).

>>> pack_key(16777217, 0, 3)
'packs/p.16777217.0.3'
>>> parse_pack_key('packs/p.16777217.0.3')
(16777217, 0, 3)
>>> parse_pack_key('packs/zarr.json') is None
True
"""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from dstt import knobs
from dstt.errors import CaptureError, CorruptStoreError
from dstt.format.layout import PACK_FORMAT_VERSION
from dstt.format.localio import address

if TYPE_CHECKING:
    from dstt.format.backends import Backend

#: Top-level folder of pack objects (a zarr group, so plain zarr listings
#: stay quiet; the packs themselves are not zarr nodes).
PACKS = "packs"
#: The default packing threshold (:func:`dstt.knobs.pack_chunk_bytes`): a
#: new pack has room for its target and one more chunk this large.
PACK_MAX_CHUNK_BYTES = knobs.PACK_CHUNK_BYTES_DEFAULT
#: A pack is sealed (written) once it holds at least this many bytes.
PACK_TARGET_BYTES = 8 << 20


class PackRange(NamedTuple):
    """Where a packed chunk lives: pack ``n`` of ``rank`` of the step whose
    slot the index records for the chunk, bytes ``offset:offset+length``."""

    rank: int
    n: int
    offset: int
    length: int


def pack_key(slot: int, rank: int, n: int) -> str:
    """The key of pack ``n`` written by ``rank`` for the step at ``slot``."""
    return f"{PACKS}/p.{slot}.{rank}.{n}"


def parse_pack_key(key: str) -> tuple[int, int, int] | None:
    """(slot, rank, n) of a pack key; None for anything else."""
    prefix = f"{PACKS}/p."
    if not key.startswith(prefix):
        return None
    fields = key[len(prefix):].split(".")
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
        return None
    return int(fields[0]), int(fields[1]), int(fields[2])


def read_range(backend: Backend, key: str, rng: PackRange, max_bytes: int, where: str) -> bytes:
    """Exactly the recorded range of a pack (CorruptStoreError if it is
    missing, short, or longer than any chunk of its size can be)."""
    if rng.length > max_bytes:
        raise CorruptStoreError(f"{where}: packed range of {rng.length} bytes, at most {max_bytes} possible")
    data = backend.get_range(key, rng.offset, rng.length)
    if data is None:
        raise CorruptStoreError(f"{where}: pack {key} is missing")
    if len(data) != rng.length:
        raise CorruptStoreError(f"{where}: pack {key} ends before the recorded range "
                                f"{rng.offset}+{rng.length} (truncated)")
    return data


#: Page size: pack buffers start on a page and grow by whole pages.
_PAGE = mmap.PAGESIZE
#: Bytes of idle pack buffers a process keeps for its next packs (counted
#: as the bytes each buffer ever held: its pages in memory). A capture helper
#: committing a group of queued steps fills a pack per step before writing
#: any: a 1.2 MB step, up to 16 queued, stays well inside.
PACK_BUFFERS_KEEP_BYTES = 32 << 20
#: ... and at most this many buffers.
PACK_BUFFERS_KEPT = 16


class _Buffers:
    """Page-aligned pack buffers, reused from pack to pack and step to step.

    Why (issue 16, a 1.2 MB step captured every 12 ms): a pack filled in a
    new ``bytearray`` and written through the page cache cost the capture
    helper ~2 ms of CPU per 1.2 MB on the reference VM -- the kernel copying
    into fresh page-cache pages that the host backs on first touch -- where
    a page-aligned buffer is written with O_DIRECT (:mod:`dstt.format.localio`:
    large aligned first buffers) for ~0.2 ms, and a reused buffer's pages are
    already backed. A buffer is reused only after :meth:`StepPacks._write`
    returned: every backend's ``put`` has copied or written the bytes by then
    (local files synchronously, object stores and zarr stores via ``bytes``)."""

    def __init__(self, keep_bytes: int, keep: int) -> None:
        self._keep_bytes = keep_bytes
        self._keep = keep
        self._lock = threading.Lock()
        self._free: list[tuple[mmap.mmap, int]] = []  # (buffer, bytes it ever held)

    def take(self, min_bytes: int) -> tuple[mmap.mmap, int]:
        """An idle buffer of at least ``min_bytes`` and the bytes it ever
        held (a new one, 0, if none is idle)."""
        with self._lock:
            for i, (buf, used) in enumerate(self._free):
                if len(buf) >= min_bytes:
                    del self._free[i]
                    return buf, used
        # Anonymous mappings are page-aligned; untouched pages cost nothing.
        return mmap.mmap(-1, max(_PAGE, -(-min_bytes // _PAGE) * _PAGE)), 0

    def give(self, buf: mmap.mmap, used: int) -> None:
        """Keep ``buf`` for a later pack, within the bounds (the rest are
        dropped: unmapped once no view of them is left, never closed under
        a view)."""
        with self._lock:
            self._free.append((buf, used))
            self._free.sort(key=lambda x: x[1])  # the least memory first
            kept, total = [], 0
            for item in self._free[:self._keep]:
                if total + item[1] <= self._keep_bytes:
                    kept.append(item)
                    total += item[1]
            self._free = kept


_BUFFERS = _Buffers(PACK_BUFFERS_KEEP_BYTES, PACK_BUFFERS_KEPT)

#: Chunks of at least this many bytes (whole pages, on a page boundary) go
#: into gathered packs where the writer may borrow them (StepPacks.borrow):
#: the padding to the next page after each is at most 1/16 of the chunk.
GATHER_MIN_BYTES = 64 << 10


def _gatherable(parts: list[Any]) -> tuple[memoryview, memoryview, memoryview] | None:
    """(prefix, body, trailer) of an encoded chunk that can be written
    where it lies: ``[body, trailer]`` (uncompressed) or ``[prefix, body,
    trailer]`` (a Blosc container stored fast: its 16-byte header first),
    the body whole pages (at least GATHER_MIN_BYTES) on a page boundary,
    the trailer its 4-byte CRC-32C; else None."""
    if len(parts) not in (2, 3):
        return None
    views = [memoryview(p).cast("B") for p in parts]
    prefix = views[0] if len(views) == 3 else memoryview(b"")
    body, trailer = views[-2], views[-1]
    if len(trailer) != 4 or len(prefix) >= _PAGE or len(body) < GATHER_MIN_BYTES or len(body) % _PAGE:
        return None
    if not body.contiguous or address(body) % _PAGE:
        return None
    return prefix, body, trailer


class PackFile:
    """One pack being filled in memory, then written once.

    ``state``: ``"open"`` (filling), ``"written"`` (durable once the step
    syncs) or ``"failed"`` (never written: a later step must not reference
    its ranges; see :meth:`StepPacks.check_referenced`). Its bytes are the
    first ``size`` bytes of ``buf``, a page-aligned buffer taken from (and,
    once the pack is written or failed, given back to) a small pool."""

    __slots__ = ("key", "n", "buf", "size", "used", "state", "error", "segments", "pages", "npages")

    def __init__(self, key: str, n: int, capacity: int, *, gather: bool = False) -> None:
        self.key = key
        self.n = n
        self.buf: mmap.mmap | None = None
        self.used = 0
        #: A gathered pack (:meth:`StepPacks.add` with ``borrow``): the
        #: buffers written, in order -- each chunk's body where it lies and
        #: the page holding its CRC-32C trailer -- instead of a copy.
        self.segments: list[memoryview] | None = None
        self.pages: mmap.mmap | None = None  # the pages of zeros around a gathered pack's chunks
        self.npages = 0  # ... used so far
        if gather:
            self.segments = []
            # (zeros, touched as used: a page before and after each chunk at most)
            self.pages = mmap.mmap(-1, 2 * (capacity // GATHER_MIN_BYTES + 2) * _PAGE)
        else:
            self.buf, self.used = _BUFFERS.take(capacity)  # (used: bytes the buffer ever held)
        self.size = 0
        self.state = "open"
        self.error: BaseException | None = None

    def gather(self, prefix: memoryview, body: memoryview, trailer: memoryview) -> int | None:
        """Place a chunk (``body`` page-aligned, whole pages, after a short
        ``prefix`` -- a fast Blosc container's header, or nothing -- and
        before its 4-byte ``trailer``) at the pack's end: the prefix at the
        end of a page of zeros, the body as it lies, the trailer at the
        start of a page of zeros. The range's offset; None (nothing placed)
        when the pack's pages are used up."""
        pages, segments = self.pages, self.segments
        assert pages is not None and segments is not None, "gather() is for a gathered pack"
        need = 2 if len(prefix) else 1
        if self.npages + need > len(pages) // _PAGE:
            return None
        view = memoryview(pages)
        offset = self.size
        if len(prefix):
            page = view[self.npages * _PAGE:(self.npages + 1) * _PAGE]
            page[_PAGE - len(prefix):] = prefix
            segments.append(page)
            self.npages += 1
            offset += _PAGE - len(prefix)
            self.size += _PAGE
        page = view[self.npages * _PAGE:(self.npages + 1) * _PAGE]
        page[:len(trailer)] = trailer
        segments += (body, page)
        self.npages += 1
        self.size += len(body) + _PAGE
        return offset

    def append(self, part: Any) -> None:
        """Copy ``part`` (any C-contiguous buffer) after the bytes so far."""
        view = memoryview(part).cast("B")
        buf, end = self.buf, self.size + len(view)
        assert buf is not None, "a pack is appended to only while open"  # (StepPacks holds its lock)
        if end > len(buf):  # (a chunk larger than the room left: a bigger buffer, the bytes moved)
            bigger, used = _BUFFERS.take(max(end, 2 * len(buf)))
            bigger[:self.size] = buf[:self.size]
            _BUFFERS.give(buf, max(self.used, self.size))
            self.buf, self.used, buf = bigger, used, bigger
        buf[self.size:end] = view
        self.size = end

    def data(self) -> memoryview | list[Any]:
        """The pack's bytes: a view of its buffer, or a gathered pack's
        segments, back to back (valid until it is released)."""
        if self.segments is not None:
            return list(self.segments)
        assert self.buf is not None
        return memoryview(self.buf)[:self.size]

    def release(self) -> None:
        """Give the buffer back (the pack was written or failed); a gathered
        pack lets go of the chunks' memory."""
        buf, self.buf = self.buf, None
        if buf is not None:
            _BUFFERS.give(buf, max(self.used, self.size))
        self.segments, self.pages = None, None  # (the trailer pages: unmapped once no view is left)


class StepPacks:
    """The packs one writer (rank) fills for one step. Thread-safe: chunks
    are added from several flush threads; a full pack is written by the
    thread whose chunk filled it, outside the lock.

    >>> from dstt.format.backends import open_backend
    >>> import tempfile
    >>> b = open_backend(tempfile.mkdtemp() + "/s", create=True)
    >>> packs = StepPacks(b, slot=5, rank=0, target_bytes=4)
    >>> f, r = packs.add([b"abc", b"d"]); r
    PackRange(rank=0, n=0, offset=0, length=4)
    >>> f.state, bytes(b.get("packs/p.5.0.0"))
    ('written', b'abcd')
    """

    def __init__(self, backend: Backend, *, slot: int, rank: int, target_bytes: int | None = None) -> None:
        self.backend = backend
        self.slot = slot
        self.rank = rank
        self.target_bytes = PACK_TARGET_BYTES if target_bytes is None else target_bytes
        self._lock = threading.Lock()
        self._current: PackFile | None = None
        self._count = 0
        self._closed = False
        self.files: list[PackFile] = []
        self._referenced: dict[int, PackFile] = {}  # id -> an earlier step's pack a chunk references
        #: The chunks' buffers stay as they are until :meth:`close` returned
        #: (the memory tier's ring slot, held until its step is stored): a
        #: chunk of whole pages on a page boundary, where the backend writes
        #: such buffers straight to the device (``gather_direct``), goes into
        #: a gathered pack, uncopied (see the module doc: aligned ranges).
        self.borrow = False
        self._gathering: PackFile | None = None  # the gathered pack being filled

    def add(self, parts: list[Any]) -> tuple[PackFile, PackRange]:
        """Append one encoded chunk (its buffers back to back, copied now:
        they may be a staging block that goes back to the pool -- unless
        ``borrow``: see there)."""
        if self.borrow and getattr(self.backend, "gather_direct", False):
            got = _gatherable(parts)
            if got is not None:
                return self._add_gathered(*got)
        full = None
        with self._lock:
            f = self._open_file()
            offset = f.size
            for p in parts:
                f.append(p)
            rng = PackRange(self.rank, f.n, offset, f.size - offset)
            if f.size >= self.target_bytes:
                full, self._current = f, None
        if full is not None:
            self._write(full)
        return f, rng

    def _add_gathered(self, prefix: memoryview, body: memoryview, trailer: memoryview
                      ) -> tuple[PackFile, PackRange]:
        """:meth:`add` of a chunk placed uncopied in a gathered pack."""
        full: list[PackFile] = []
        with self._lock:
            f = self._gathering
            offset = None if f is None else f.gather(prefix, body, trailer)
            if f is None or offset is None:
                if f is not None:  # (its pages used up: sealed as it is)
                    full.append(f)
                f = self._gathering = self._new_file(gather=True)
                offset = f.gather(prefix, body, trailer)
                assert offset is not None, "a new gathered pack has room for a chunk"
            rng = PackRange(self.rank, f.n, offset, len(prefix) + len(body) + len(trailer))
            if f.size >= self.target_bytes:
                full.append(f)
                self._gathering = None
        for x in full:
            self._write(x)
        return f, rng

    def _new_file(self, gather: bool = False) -> PackFile:
        """A new pack, numbered next (caller holds ``_lock``)."""
        if self._closed:
            raise CaptureError(f"packs of slot {self.slot} are already closed")
        # (room for the target and a largest packed chunk, so a pack rarely grows)
        f = PackFile(pack_key(self.slot, self.rank, self._count), self._count,
                     self.target_bytes + PACK_MAX_CHUNK_BYTES + _PAGE, gather=gather)
        self._count += 1
        self.files.append(f)
        return f

    def _open_file(self) -> PackFile:
        """The pack being filled (a new one if none is); caller holds ``_lock``."""
        if self._closed:
            raise CaptureError(f"packs of slot {self.slot} are already closed")
        f = self._current
        if f is None:
            f = self._current = self._new_file()
        return f

    def add_many(self, chunks: list[list[Any]]) -> tuple[list[tuple[PackFile, PackRange]], BaseException | None]:
        """:meth:`add` for many encoded chunks under one lock (a batch of
        small chunks: Writer.flush_chunks). Every chunk is appended (or, if
        the packs are closed, none: CaptureError); the packs they fill are
        written after, outside the lock. Returns each chunk's (pack, range)
        and the first error writing a full pack (that pack's state is then
        ``"failed"``: its chunks are not stored).

        >>> from dstt.format.backends import open_backend
        >>> import tempfile
        >>> packs = StepPacks(open_backend(tempfile.mkdtemp() + "/s", create=True), slot=5, rank=0, target_bytes=4)
        >>> placed, err = packs.add_many([[b"abc"], [b"de", b"f"], [b"g"]]); [r[1:] for _, r in placed], err
        ([(0, 0, 3), (0, 3, 3), (1, 0, 1)], None)
        >>> placed[0][0].state, placed[2][0].state
        ('written', 'open')
        """
        out: list[tuple[PackFile, PackRange]] = []
        full: list[PackFile] = []
        rank, target = self.rank, self.target_bytes
        with self._lock:
            f: PackFile | None = self._open_file()
            for parts in chunks:
                if f is None:
                    f = self._open_file()
                offset = f.size
                for p in parts:
                    f.append(p)  # (any C-contiguous buffer: encode_chunk's parts are)
                out.append((f, PackRange(rank, f.n, offset, f.size - offset)))
                if f.size >= target:
                    full.append(f)
                    f = self._current = None
        error: BaseException | None = None
        for x in full:
            try:
                self._write(x)
            except BaseException as e:  # every full pack is tried: none left unwritten silently
                error = error or e
        return out, error

    def refer(self, f: PackFile) -> None:
        """Note that an unchanged chunk of this step references a range of
        ``f`` (an earlier step's pack, maybe not written yet)."""
        if f.state != "written":
            with self._lock:
                self._referenced[id(f)] = f

    def referenced_files(self) -> list[PackFile]:
        with self._lock:
            return list(self._referenced.values())

    def _write(self, f: PackFile) -> None:
        try:
            self.backend.put(f.key, f.data())
        except BaseException as e:
            f.state, f.error = "failed", e
            raise
        else:
            f.state = "written"
        finally:
            f.release()  # put has copied or written the bytes: the buffer serves the next pack

    def close(self) -> None:
        """Write the last, partly filled pack (idempotent). Raises the error
        of any pack of this step that could not be written."""
        with self._lock:
            last = (self._current, self._gathering)
            self._current, self._gathering, self._closed = None, None, True
        error: BaseException | None = None
        for f in last:
            if f is not None:
                try:
                    self._write(f)
                except BaseException as e:  # both tried: none left unwritten silently
                    error = error or e
        if error is not None:
            raise error
        failed = next((x for x in self.files if x.state == "failed"), None)
        if failed is not None and failed.error is not None:
            raise CaptureError(f"pack {failed.key} could not be written: {failed.error}") from failed.error

    @staticmethod
    def check_referenced(files: list[PackFile]) -> None:
        """CaptureError unless every pack in ``files`` (earlier steps' packs a
        step references: an unchanged chunk) has been written: a step never
        commits a reference to bytes that are not stored."""
        for f in files:
            if f.state != "written":
                raise CaptureError(f"a chunk references pack {f.key} of an earlier step, which was "
                                   f"{'not written' if f.state == 'failed' else 'never completed'}")


__all__ = ["PACKS", "PACK_FORMAT_VERSION", "PACK_MAX_CHUNK_BYTES", "PACK_TARGET_BYTES", "PackFile", "PackRange",
           "StepPacks", "pack_key", "parse_pack_key", "read_range"]
