"""Chunks of a stored tensor: the ONE place a chunk is read and checked
(torch-free format layer; the chunk grid is :class:`dstt.format.geometry.ChunkGrid`).

Every reader of chunk bytes -- :class:`~dstt.format.index.RunIndex` (and so
``Run.read``, ``state_dict``, diff, export), restore, verify and the writer's
dedup check -- goes through :func:`check_chunk` (usually by way of
:func:`read_chunk_raw` or :func:`read_chunk`), so a chunk is always checked
the same way:

1. its trailing CRC-32C (zarr's ``crc32c`` codec) matches its body;
2. it decodes (compression undone) to exactly the chunk's raw size;
3. the CRC-32C of the raw bytes equals the one the step index records;
4. with ``sha256=True``, its sha256 equals the index's, where one is recorded.

A new codec (delta encoding) plugs into :func:`decode_raw`.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, Callable, cast

import google_crc32c
import numpy as np

from dstt.errors import ChecksumMismatchError, CorruptStoreError
from dstt.format import layout as L
from dstt.format.codecs.keyframes import read_delta
from dstt.format.codecs.spec import CodecSpec, crc32c, decode_chunk, max_stored_bytes
from dstt.format.entries import TensorEntry
from dstt.format.packs import pack_key, read_range

if TYPE_CHECKING:
    from dstt.format.backends import Backend


def chunk_where(e: TensorEntry, i: int) -> str:
    """How errors name chunk ``i`` of ``e``."""
    return f"{e.name} chunk {e.coords(i)} (slot {e.slots[i]})"


def chunk_key_of(e: TensorEntry, i: int) -> str:
    return L.chunk_key(e.array, e.slots[i], e.coords(i))


def decode_raw(data: Any, codec: CodecSpec, nbytes: int, where: str) -> memoryview:
    """Check a stored chunk's trailer CRC-32C and decode it to its ``nbytes``
    raw bytes (CorruptStoreError / ChecksumMismatchError otherwise)."""
    return decode_chunk(data, codec, nbytes, where)


def check_chunk(data: Any, codec: CodecSpec, nbytes: int, where: str, *,
                crc: int | None = None, sha256: str | None = None) -> memoryview:
    """The raw bytes of stored chunk ``data``, checked: trailer CRC, size,
    and (when given) the CRC-32C and sha256 the step index records for it."""
    raw = decode_raw(data, codec, nbytes, where)
    if crc is not None:
        # Uncompressed chunks: the trailer (just checked against the body) is the
        # raw CRC, so comparing it with the index is free and catches a valid
        # chunk in the wrong place.
        got = int.from_bytes(bytes(memoryview(data)[-4:]), "little") if codec.compression == "none" else crc32c(raw)
        if got != crc:
            raise ChecksumMismatchError(f"{where}: CRC-32C does not match the step index")
    if sha256 is not None and hashlib.sha256(raw).hexdigest() != sha256:
        raise ChecksumMismatchError(f"{where}: sha256 does not match the step index")
    return raw


def read_chunk_raw(backend: Backend, key: str, codec: CodecSpec, nbytes: int, where: str, *,
                   crc: int | None = None, sha256: str | None = None) -> memoryview:
    """The raw bytes of the chunk at ``key``, read and checked (:func:`check_chunk`)."""
    data = backend.get(key, max_bytes=max_stored_bytes(codec, nbytes))
    if data is None:
        raise CorruptStoreError(f"{where}: chunk {key} is missing")
    return check_chunk(data, codec, nbytes, where, crc=crc, sha256=sha256)


def packed_key_of(e: TensorEntry, i: int) -> str | None:
    """The key of the pack holding chunk ``i`` of ``e``; None if it is a chunk file."""
    p = e.pack(i)
    return None if p is None else pack_key(e.slots[i], p.rank, p.n)


def read_chunk(backend: Backend, e: TensorEntry, i: int, *, sha256: bool = False) -> memoryview:
    """The raw bytes of chunk ``i`` of ``e``, checked against its trailer and
    the step index (and its recorded sha256 with ``sha256=True``). A
    predictive chunk is decoded through its chain (dstt/format/chains.py)."""
    if e.pred is not None and e.pred.chunks[i] is not None:
        return _read_pred_chunk(e, i, sha256=sha256)
    p = e.pack(i)
    if p is not None:  # a range of a pack (docs/format.md "Packs"): exactly that range read
        nbytes = e.chunk_grid.chunk_numel * e.dtype.itemsize
        where = chunk_where(e, i)
        data = read_range(backend, pack_key(e.slots[i], p.rank, p.n), p, max_stored_bytes(e.codec, nbytes), where)
        return check_chunk(data, e.codec, nbytes, where, crc=e.crcs[i], sha256=e.sha256[i] if sha256 else None)
    if e.keyframe(i) is not None:  # stored as a difference to a keyframe (issue 13)
        return read_delta(backend, e, i, sha256=sha256)
    nbytes = e.chunk_grid.chunk_numel * e.dtype.itemsize
    return read_chunk_raw(backend, chunk_key_of(e, i), e.codec, nbytes, chunk_where(e, i),
                          crc=e.crcs[i], sha256=e.sha256[i] if sha256 else None)


def _read_pred_chunk(e: TensorEntry, i: int, *, sha256: bool = False) -> memoryview:
    """The raw bytes of predictive chunk ``i`` of ``e``, decoded through its
    chain by the chain reader its step's reader attached
    (dstt/format/chains.py ``attach``: ``(reader, branch, step)``)."""
    ctx = e.__dict__.get("_chain")
    if ctx is None:
        raise CorruptStoreError(f"{e.name} chunk {e.coords(i)}: a predictive chunk read without its step "
                                "(open the store with dstt.open to read it)")
    reader, branch, step = ctx
    got: memoryview = reader.chunk(branch, step, e, i, sha256=sha256)
    return got


#: Bytes of adjacent pack ranges read with one request at most (read_packed).
MAX_PACK_RUN_BYTES = 16 << 20
#: Bytes between two ranges of a pack still read with one request (the
#: padding of a gathered pack, packs.py: under two pages between ranges --
#: the rest of a trailer's page and the start of the next header's).
MAX_PACK_GAP_BYTES = 8192


def read_packed(backend: Backend, items: list[tuple[TensorEntry, int]], *,
                sha256: bool = False) -> list[memoryview]:
    """The raw bytes of several packed chunks (``(entry, chunk index)``,
    each ``entry.pack(i)`` set), each checked as :func:`read_chunk` checks
    it. Ranges of one pack that follow each other (as a step writes them;
    at most MAX_PACK_GAP_BYTES apart: a gathered pack's padding) are read
    with one request: those bytes (and the padding between), at most
    MAX_PACK_RUN_BYTES at a time, instead of a request per chunk (a
    state_dict of 100,000 small tensors: issue 16)."""
    by_pack: dict[tuple[int, int, int], list[tuple[int, int, int, int]]] = {}
    out: list[memoryview | None] = [None] * len(items)
    for k, (e, i) in enumerate(items):
        if e.pred is not None and e.pred.chunks[i] is not None:  # decoded through its chain
            out[k] = read_chunk(backend, e, i, sha256=sha256)
            continue
        p = e.pack(i)
        if p is None:
            raise ValueError(f"{chunk_where(e, i)} is not packed")
        nbytes = e.chunk_grid.chunk_numel * e.dtype.itemsize
        if p.length > max_stored_bytes(e.codec, nbytes):
            raise CorruptStoreError(f"{chunk_where(e, i)}: packed range of {p.length} bytes, "
                                    f"at most {max_stored_bytes(e.codec, nbytes)} possible")
        by_pack.setdefault((e.slots[i], p.rank, p.n), []).append((p.offset, p.length, k, nbytes))

    def read_run(key: str, run: list[tuple[int, int, int, int]]) -> None:
        start, end = run[0][0], run[-1][0] + run[-1][1]
        data = backend.get_range(key, start, end - start)
        view = memoryview(b"" if data is None else data).cast("B")
        # (numpy views of the buffer: google_crc32c takes them, not memoryviews)
        arr = np.frombuffer(view, dtype=np.uint8)
        for off, length, k, nbytes in run:
            e, i = items[k]
            lo = off - start
            hi = lo + length
            if data is not None and not sha256 and length == nbytes + 4 and len(view) >= hi \
                    and e.codec.compression == "none":
                # Uncompressed (the common case): one CRC of the body, equal
                # to its trailer and to the index's, is the whole check_chunk.
                crc = e.crcs[i]
                if google_crc32c.extend(0, arr[lo: hi - 4]) == crc and int.from_bytes(view[hi - 4: hi], "little") == crc:
                    out[k] = view[lo: hi - 4]
                    continue
            where = chunk_where(e, i)  # (the slow path says what is wrong)
            if data is None:
                raise CorruptStoreError(f"{where}: pack {key} is missing")
            if len(view) < hi:
                raise CorruptStoreError(f"{where}: pack {key} ends before the recorded range "
                                        f"{off}+{length} (truncated)")
            out[k] = check_chunk(view[lo: hi], e.codec, nbytes, where,
                                 crc=e.crcs[i], sha256=e.sha256[i] if sha256 else None)

    for (slot, rank, n), ranges in by_pack.items():
        key = pack_key(slot, rank, n)
        ranges.sort()
        run: list[tuple[int, int, int, int]] = []
        for r in ranges:
            gap = r[0] - (run[-1][0] + run[-1][1]) if run else 0
            if run and (not 0 <= gap <= MAX_PACK_GAP_BYTES or r[0] + r[1] - run[0][0] > MAX_PACK_RUN_BYTES):
                read_run(key, run)
                run = []
            run.append(r)
        if run:
            read_run(key, run)
    return cast("list[memoryview]", out)


def chunk_array(backend: Backend, e: TensorEntry, i: int, *, sha256: bool = False) -> np.ndarray:
    """Chunk ``i`` as a numpy array of the storage dtype, padded to ``chunk_shape``."""
    arr = np.frombuffer(read_chunk(backend, e, i, sha256=sha256), dtype=e.dtype.numpy_storage)
    return arr.reshape(e.chunk_shape) if e.chunk_shape else arr.reshape(())


def read_box(backend: Backend, e: TensorEntry, off: tuple[int, ...], shape: tuple[int, ...], *,
             sha256: bool = False, fetch: Callable[[TensorEntry, int], np.ndarray] | None = None) -> np.ndarray:
    """The box ``off``/``shape`` of a tensor (storage dtype), reading only
    the chunks that overlap it (each through ``fetch(e, i)``, by default
    :func:`chunk_array`)."""
    try:  # a hostile index may declare a shape no machine can hold
        out = np.empty(shape, dtype=e.dtype.numpy_storage)
    except (MemoryError, ValueError):
        raise CorruptStoreError(
            f"{e.name}: cannot allocate {math.prod(shape) * e.dtype.itemsize} bytes for shape {list(shape)}"
        ) from None
    g = e.chunk_grid
    for coords in g.overlapping(off, shape):
        i = g.index(coords)
        chunk = chunk_array(backend, e, i, sha256=sha256) if fetch is None else fetch(e, i)
        src, dst = g.copy_slices(coords, off, shape)
        out[dst] = chunk[src]
    return out


def read_whole_into(backend: Backend, e: TensorEntry, out: memoryview) -> None:
    """Fill ``out`` (exactly the tensor's bytes, C order) with the whole tensor.

    Where the backend can ``readinto`` (``can_readinto``), chunks are uncompressed and split only
    the first dimension, each chunk file is read straight into its place (one
    copy), its trailer CRC-32C checked and compared with the index's;
    otherwise chunks go through :func:`read_box`."""
    out = memoryview(out).cast("B")
    nbytes = math.prod(e.shape) * e.dtype.itemsize
    if len(out) != nbytes:
        raise ValueError(f"{e.name}: buffer of {len(out)} bytes for a tensor of {nbytes}")
    if nbytes == 0:
        return  # an empty tensor (numpy cannot cast a zero-size view to bytes)
    if (not backend.can_readinto or e.codec.compression != "none" or not e.shape or e.packs is not None
            or tuple(e.chunk_shape[1:]) != tuple(e.shape[1:]) or e.nchunks == 0):
        arr = read_box(backend, e, (0,) * len(e.shape), e.shape)
        out[:] = np.ascontiguousarray(arr).data.cast("B")
        return
    cb = e.chunk_grid.chunk_numel * e.dtype.itemsize
    # The last chunk's zero padding and every chunk's 4-byte CRC trailer land here.
    tail = memoryview(bytearray(e.nchunks * cb - nbytes + 4))
    for i in range(e.nchunks):
        where = chunk_where(e, i)
        lo, hi = i * cb, min((i + 1) * cb, nbytes)
        pad = cb - (hi - lo)
        got = backend.readinto(chunk_key_of(e, i), [out[lo:hi], tail[: pad + 4]])
        if got is None:
            raise CorruptStoreError(f"{where}: chunk is missing")
        if got != cb + 4:
            raise CorruptStoreError(f"{where}: chunk has {got} bytes, expected {cb + 4}")
        crc = crc32c(tail[:pad], crc32c(out[lo:hi]))
        if crc != int.from_bytes(tail[pad: pad + 4], "little"):
            raise ChecksumMismatchError(f"{where}: chunk CRC-32C mismatch (corrupted chunk)")
        if crc != e.crcs[i]:  # a valid chunk, but not the one the step recorded
            raise ChecksumMismatchError(f"{where}: CRC-32C does not match the step index")
