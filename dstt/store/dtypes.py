"""Bit-exact mapping between torch dtypes and Zarr storage dtypes.

zarr-python has no bfloat16 or float8 (zarr-python #2656, #711), so those are
stored as unsigned integers of the same width holding the raw bits; the
logical dtype is recorded in the step index and the array attributes. A plain
zarr reader still gets the bits and can reinterpret them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dstt.errors import UnsupportedDtypeError


@dataclass(frozen=True)
class DtypeInfo:
    logical: str  # name recorded in the index, e.g. "bfloat16"
    torch_dtype: torch.dtype
    storage: str  # Zarr v3 data_type name, e.g. "uint16"
    itemsize: int

    @property
    def is_bits(self) -> bool:
        """True when the storage dtype only carries the bits of the logical one."""
        return self.storage != self.logical

    @property
    def numpy_storage(self) -> np.dtype:
        return np.dtype(self.storage)

    @property
    def torch_storage(self) -> torch.dtype:
        return _TORCH_BY_STORAGE[self.storage]


_NATIVE = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_BITS = {
    "bfloat16": (torch.bfloat16, "uint16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "uint8"),
    "float8_e5m2": (torch.float8_e5m2, "uint8"),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, "uint8"),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, "uint8"),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, "uint8"),
}

_TORCH_BY_STORAGE = dict(_NATIVE)
_BY_LOGICAL: dict[str, DtypeInfo] = {}
_BY_TORCH: dict[torch.dtype, DtypeInfo] = {}
for _name, _td in _NATIVE.items():
    _info = DtypeInfo(_name, _td, _name, torch.empty((), dtype=_td).element_size())
    _BY_LOGICAL[_name] = _info
    _BY_TORCH[_td] = _info
for _name, (_td, _st) in _BITS.items():
    _info = DtypeInfo(_name, _td, _st, torch.empty((), dtype=_td).element_size())
    _BY_LOGICAL[_name] = _info
    _BY_TORCH[_td] = _info


def info_for_torch(dtype: torch.dtype) -> DtypeInfo:
    """The storage description of a torch dtype, or UnsupportedDtypeError."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        supported = ", ".join(sorted(_BY_LOGICAL))
        raise UnsupportedDtypeError(
            f"cannot store dtype {dtype} bit-exactly; supported: {supported}"
        ) from None


def info_for_name(name: str) -> DtypeInfo:
    """The storage description of a logical dtype name read from a store."""
    if not isinstance(name, str) or name not in _BY_LOGICAL:
        raise UnsupportedDtypeError(f"unknown stored dtype {name!r}")
    return _BY_LOGICAL[name]


def as_storage_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the storage dtype (same bits, no copy)."""
    info = info_for_torch(t.dtype)
    if not info.is_bits:
        return t
    return t.view(info.torch_storage)


def supported_dtypes() -> list[str]:
    return sorted(_BY_LOGICAL)
