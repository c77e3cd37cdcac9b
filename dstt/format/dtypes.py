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
