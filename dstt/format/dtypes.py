"""Bit-exact mapping between logical dtypes and Zarr storage dtypes (torch-free).

zarr-python has no bfloat16 or float8 (zarr-python #2656, #711), so those are
stored as unsigned integers of the same width holding the raw bits; the
logical dtype is recorded in the step index and the array attributes. A plain
zarr reader still gets the bits and can reinterpret them.

This module is part of the torch-free format layer; the torch side of the
mapping (``torch.dtype`` <-> :class:`DtypeInfo`) is in
:mod:`dstt.store.torch_dtypes`.

>>> info_for_name("bfloat16").storage, info_for_name("bfloat16").is_bits
('uint16', True)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dstt.errors import UnsupportedDtypeError


@dataclass(frozen=True)
class DtypeInfo:
    logical: str  # name recorded in the index, e.g. "bfloat16"
    storage: str  # Zarr v3 data_type name, e.g. "uint16"
    itemsize: int

    @property
    def is_bits(self) -> bool:
        """True when the storage dtype only carries the bits of the logical one."""
        return self.storage != self.logical

    @property
    def numpy_storage(self) -> np.dtype:
        return np.dtype(self.storage)


#: Logical dtypes numpy and Zarr hold natively: name -> itemsize (bytes).
NATIVE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
#: Logical dtypes stored as the bits of an unsigned integer: name -> storage.
BITS_STORAGE: dict[str, str] = {
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
}

_BY_LOGICAL: dict[str, DtypeInfo] = {n: DtypeInfo(n, n, size) for n, size in NATIVE_ITEMSIZE.items()}
_BY_LOGICAL.update({n: DtypeInfo(n, st, NATIVE_ITEMSIZE[st]) for n, st in BITS_STORAGE.items()})


def info_for_name(name: str) -> DtypeInfo:
    """The storage description of a logical dtype name read from a store."""
    if not isinstance(name, str) or name not in _BY_LOGICAL:
        raise UnsupportedDtypeError(f"unknown stored dtype {name!r}")
    return _BY_LOGICAL[name]


def supported_dtypes() -> list[str]:
    return sorted(_BY_LOGICAL)


# ----------------------------------------------------------------------------- values without torch
#
# bfloat16 and float8 decoded with numpy bit operations (no ml_dtypes: it is
# not a dependency of torch, zarr or numcodecs, and reading needs only the
# widening, which is exact: every bfloat16 and float8 value is a float32).

#: float8 layouts: name -> (exponent bits, mantissa bits, bias, kind). kind:
#: "ieee" (all-ones exponent: inf/NaN), "fn" (no inf; all-ones exponent and
#: mantissa: NaN), "fnuz" (no inf, no -0; 0x80 alone is NaN), "e8m0" (an
#: exponent only, unsigned; 0xFF is NaN).
_FLOAT8: dict[str, tuple[int, int, int, str]] = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),
}
_F8_TABLES: dict[str, np.ndarray] = {}


def float8_table(name: str) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of a float8 dtype.

    >>> float8_table("float8_e4m3fn")[[0x00, 0x38, 0x7E, 0x7F, 0x01]].tolist()
    [0.0, 1.0, 448.0, nan, 0.001953125]
    >>> float8_table("float8_e5m2")[[0x3C, 0x7C, 0xFC]].tolist()
    [1.0, inf, -inf]
    """
    table = _F8_TABLES.get(name)
    if table is not None:
        return table
    ebits, mbits, bias, kind = _FLOAT8[name]
    out = np.empty(256, dtype=np.float64)
    for b in range(256):
        if kind == "e8m0":
            out[b] = np.nan if b == 0xFF else 2.0 ** (b - bias)
            continue
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> mbits) & ((1 << ebits) - 1), b & ((1 << mbits) - 1)
        top = (1 << ebits) - 1
        if kind == "fnuz" and b == 0x80:
            out[b] = np.nan
        elif kind == "ieee" and e == top:
            out[b] = sign * np.inf if m == 0 else np.nan
        elif kind == "fn" and e == top and m == (1 << mbits) - 1:
            out[b] = np.nan
        elif e == 0:
            out[b] = sign * (m / (1 << mbits)) * 2.0 ** (1 - bias)
        else:
            out[b] = sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
    table = out.astype(np.float32)
    table.setflags(write=False)
    _F8_TABLES[name] = table
    return table


def decode(arr: np.ndarray, info: DtypeInfo) -> np.ndarray:
    """The values of storage-dtype ``arr`` as numpy numbers: a native dtype
    as is; bfloat16 and float8 widened to float32 (exact, NaN payloads
    aside).

    >>> decode(np.array([0x3F80, 0xC040], dtype=np.uint16), info_for_name("bfloat16")).tolist()
    [1.0, -3.0]
    """
    if not info.is_bits:
        return arr
    if info.logical == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    out: np.ndarray = float8_table(info.logical)[arr]
    return out
