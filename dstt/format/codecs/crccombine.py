"""CRC-32C of two buffers back to back from the CRC-32C of each (zlib's
``crc32_combine``, for the Castagnoli polynomial): a chunk's stored body
that is a short header followed by the raw bytes (a Blosc container stored
fast) gets its trailer without a second pass over the raw bytes, whose
CRC-32C the flush computed once already (issue 25).

The operator that appends ``n`` zero bytes to a CRC is a 32x32 matrix over
GF(2), built once per length (chunk sizes repeat: an LRU cache); applying
it is 32 XORs at most.

>>> import google_crc32c
>>> a, b = b"a header", bytes(range(256)) * 5
>>> combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == google_crc32c.value(a + b)
True
"""

from __future__ import annotations

import functools

#: CRC-32C's polynomial, reflected.
POLY = 0x82F63B78


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@functools.lru_cache(maxsize=64)
def _zeros(nbytes: int) -> tuple[int, ...]:
    """The operator appending ``nbytes`` zero bytes to a (raw) CRC register."""
    one_bit = (POLY, *(1 << n for n in range(31)))
    op = _square(_square(_square(one_bit)))  # one zero byte
    out = tuple(1 << n for n in range(32))  # the identity
    while nbytes:
        if nbytes & 1:
            out = tuple(_times(op, out[n]) for n in range(32))
        nbytes >>= 1
        if nbytes:
            op = _square(op)
    return out


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and ``len(B)``."""
    if len2 <= 0:
        return crc1
    return _times(_zeros(len2), crc1) ^ crc2


__all__ = ["POLY", "combine"]
