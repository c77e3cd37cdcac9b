"""Lossless delta coding of chunks between steps (numpy and numcodecs only).

Training moves every value a little per step, so the raw bits of a chunk
minus the raw bits of the same chunk some steps earlier are small integers:
after a zigzag (sign into the low bit) their high bytes are mostly zero,
and a byte-shuffle puts those zeros together where zstd finds them. This
module holds the two transforms and the one compressed container dstt uses
for them; docs/format.md ("Delta chunks") specifies the bytes.

* :func:`zigzag_delta` -- ``zigzag(bits(new) - bits(key))``, integers of
  the chunk's itemsize, subtraction wrapping (so every bit pattern, NaN
  payloads and ``-0.0`` included, round-trips);
* :func:`undo_delta` -- its exact inverse;
* :func:`blosc_encode` / :func:`blosc_decode` -- byte-shuffle + zstd level 1
  in a Blosc container with an explicit block size: Zarr v3's core
  ``blosc`` codec, so plain zarr-python decodes keyframes and delta chunks
  alike. Blosc's automatic block size (a few hundred KiB for zstd) costs
  ~5 points of ratio on fp32 training state; 1 MiB blocks match a single
  shuffle + zstd-1 pass over the whole chunk (measured, docs/benchmarks.md).

>>> import numpy as np
>>> key = np.array([1.0, -0.0, np.nan, 3.5], np.float32)
>>> new = np.array([1.0000001, 0.0, np.inf, 3.25], np.float32)
>>> z = zigzag_delta(new, key, 4)
>>> z.dtype, bool(np.array_equal(undo_delta(key, z, 4).view(np.float32), new, equal_nan=True))
(dtype('uint32'), True)
>>> blob = blosc_encode(z, 4)
>>> bool(np.array_equal(np.frombuffer(blosc_decode(blob, z.nbytes, "doc"), np.uint32), z))
True
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

from dstt.errors import CorruptStoreError

#: Blosc block size dstt writes (bytes). Recorded in every array's codec
#: configuration, so readers need not know it.
BLOCK_BYTES = 1 << 20
#: Blosc compressor and level dstt writes.
CNAME = "zstd"
CLEVEL = 1
#: The container of *noise* chunks (predictive coding's keyframes, and the
#: residuals of ``exp_avg`` and ``momentum_buffer``: mantissa and gradient
#: noise, ~0.8 of raw under any entropy coder): bit-shuffle + lz4 (Blosc
#: level 1), ~2.3x the bytes per CPU second of shuffle + zstd-1 for ~0.03-0.05
#: more of the chunk (measured on benchmarks/bench_delta.py's trajectory,
#: issue 27). The compressor and
#: shuffle are recorded in every Blosc container's header, so every Blosc
#: reader (zarr-python with the array's ``blosc`` codec, any dstt version)
#: decodes it as it decodes the rest: no new format.
NOISE_CNAME = "lz4"
#: Item sizes delta coding handles (the unsigned integer of that size).
DELTA_ITEMSIZES = (1, 2, 4, 8)

_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes


def uint_dtype(itemsize: int) -> np.dtype:
    """The little-endian unsigned integer dtype of ``itemsize`` bytes.

    >>> uint_dtype(2)
    dtype('uint16')
    """
    if itemsize not in DELTA_ITEMSIZES:
        raise ValueError(f"no delta coding for {itemsize}-byte items")
    return np.dtype(f"<u{itemsize}")


def _as_uint(data: Any, itemsize: int) -> np.ndarray:
    return np.frombuffer(memoryview(data).cast("B"), dtype=uint_dtype(itemsize))


def zigzag_delta(new: Any, key: Any, itemsize: int) -> np.ndarray:
    """``zigzag(bits(new) - bits(key))`` as unsigned integers of ``itemsize``
    bytes: the difference wraps, zigzag maps ``d`` to ``2d`` (``d >= 0``)
    or ``-2d - 1`` (``d < 0``), so small changes of either sign give small
    values. ``new`` and ``key`` are buffers of equal length."""
    u, k = _as_uint(new, itemsize), _as_uint(key, itemsize)
    if u.shape != k.shape:
        raise ValueError(f"delta of {u.nbytes} bytes against a keyframe of {k.nbytes}")
    d = np.subtract(u, k)  # unsigned: wraps modulo 2**bits, never raises
    s = d.view(f"<i{itemsize}")
    sign = s >> (8 * itemsize - 1)  # arithmetic shift: all ones where negative
    np.left_shift(s, 1, out=s)
    np.bitwise_xor(s, sign, out=s)
    out: np.ndarray = d
    return out


def undo_delta(key: Any, z: Any, itemsize: int) -> np.ndarray:
    """The raw bits ``key + unzigzag(z)`` (wrapping): inverse of :func:`zigzag_delta`."""
    k, zz = _as_uint(key, itemsize), _as_uint(z, itemsize)
    if k.shape != zz.shape:
        raise CorruptStoreError(f"delta of {zz.nbytes} bytes against a keyframe of {k.nbytes}")
    d = np.right_shift(zz, 1)
    low = np.bitwise_and(zz, 1)
    np.negative(low, out=low)  # 0 or all ones (unsigned negation wraps)
    np.bitwise_xor(d, low, out=d)
    np.add(d, k, out=d)
    out: np.ndarray = d
    return out


def blosc_config(itemsize: int) -> dict[str, Any]:
    """The Zarr v3 ``blosc`` codec configuration dstt writes for ``itemsize``-byte items."""
    return {"typesize": itemsize, "cname": CNAME, "clevel": CLEVEL,
            "shuffle": "shuffle" if itemsize > 1 else "noshuffle", "blocksize": BLOCK_BYTES}


def blosc_encode(data: Any, itemsize: int, *, stored: bool = False, noise: bool = False) -> bytes:
    """Byte-shuffle + zstd-1 of ``data`` in a Blosc container (what zarr's
    ``blosc`` codec with :func:`blosc_config` writes, byte for byte).
    ``stored=True``: the bytes as they are (Blosc level 0, ~memcpy speed) in
    the same container, which every Blosc reader decodes the same way;
    ``noise=True``: bit-shuffle + lz4 (:data:`NOISE_CNAME`), likewise."""
    from numcodecs import blosc

    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if stored:
        cname, level, shuffle = CNAME, 0, blosc.NOSHUFFLE
    elif noise:
        cname, level, shuffle = NOISE_CNAME, CLEVEL, blosc.BITSHUFFLE
    else:
        cname, level, shuffle = CNAME, CLEVEL, blosc.SHUFFLE if itemsize > 1 else blosc.NOSHUFFLE
    out: bytes = blosc.compress(buf, cname.encode(), level, shuffle, BLOCK_BYTES, typesize=itemsize)
    return out


#: Blosc's header flag of a container whose data is its input as it is.
MEMCPYED = 0x02


@functools.lru_cache(maxsize=256)
def stored_header(nbytes: int, itemsize: int) -> bytes | None:
    """The 16-byte header :func:`blosc_encode` with ``stored=True`` writes
    before ``nbytes`` bytes of typesize ``itemsize``: its container is this
    header and the bytes as they are, so a chunk stored fast can be written
    as the two, with no copy (issue 25). None where Blosc would not lay the
    container out so (then :func:`blosc_encode` makes it). The header does
    not depend on the bytes (a level-0 container is a copy of them): made
    once per size from zeros."""
    if nbytes <= 0:
        return None
    out = blosc_encode(np.zeros(nbytes, dtype=np.uint8), itemsize, stored=True)
    header = out[:_HEADER.size]
    flags, cbytes = _HEADER.unpack(header)[2], _HEADER.unpack(header)[6]
    if len(out) != _HEADER.size + nbytes or cbytes != len(out) or not flags & MEMCPYED:
        return None
    return bytes(header)


def blosc_decode(body: Any, nbytes: int, where: str) -> memoryview:
    """Decode a Blosc container that must hold exactly ``nbytes`` bytes.

    The header is checked before anything is allocated or decompressed: a
    hostile chunk cannot make dstt allocate more than the chunk's known size.
    """
    from numcodecs import blosc

    view = memoryview(body).cast("B")
    if len(view) < _HEADER.size:
        raise CorruptStoreError(f"{where}: blosc chunk truncated to {len(view)} bytes")
    _version, _vlz, _flags, _typesize, raw_n, _block, cbytes = _HEADER.unpack(view[: _HEADER.size])
    if raw_n != nbytes:
        raise CorruptStoreError(f"{where}: blosc chunk holds {raw_n} bytes, expected {nbytes}")
    if cbytes != len(view):
        raise CorruptStoreError(f"{where}: blosc chunk records {cbytes} bytes, has {len(view)}")
    out = np.empty(nbytes, dtype=np.uint8)
    if nbytes == 0:
        return out.data
    try:
        blosc.decompress(view, out)
    except Exception as e:  # numcodecs raises RuntimeError/ValueError variants
        raise CorruptStoreError(f"{where}: cannot decompress chunk: {e}") from None
    return out.data


__all__ = ["MEMCPYED", "stored_header", "BLOCK_BYTES", "DELTA_ITEMSIZES", "NOISE_CNAME", "blosc_config", "blosc_decode", "blosc_encode",
           "undo_delta", "uint_dtype", "zigzag_delta"]
