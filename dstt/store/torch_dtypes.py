"""The torch side of :mod:`dstt.format.dtypes`: torch dtypes <-> storage
descriptions, and bit views between them (a torch adapter above the
torch-free format layer).

>>> import torch
>>> info_for_torch(torch.bfloat16).storage
'uint16'
>>> torch_dtype(info_for_torch(torch.bfloat16))
torch.bfloat16
"""

from __future__ import annotations

import torch

from dstt.errors import UnsupportedDtypeError
from dstt.format.dtypes import BITS_STORAGE, NATIVE_ITEMSIZE, DtypeInfo, info_for_name, supported_dtypes

_BITS_TORCH = {
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}
_TORCH_BY_NAME: dict[str, torch.dtype] = {n: getattr(torch, n) for n in NATIVE_ITEMSIZE}
_TORCH_BY_NAME.update(_BITS_TORCH)
_BY_TORCH: dict[torch.dtype, DtypeInfo] = {td: info_for_name(n) for n, td in _TORCH_BY_NAME.items()}

assert set(_BITS_TORCH) == set(BITS_STORAGE)  # internal invariant: both tables name the same dtypes
for _n, _td in _TORCH_BY_NAME.items():  # internal invariant: itemsizes agree with torch's
    assert torch.empty((), dtype=_td).element_size() == info_for_name(_n).itemsize, _n


def info_for_torch(dtype: torch.dtype) -> DtypeInfo:
    """The storage description of a torch dtype, or UnsupportedDtypeError."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"cannot store dtype {dtype} bit-exactly; supported: {', '.join(supported_dtypes())}"
        ) from None


def torch_dtype(info: DtypeInfo) -> torch.dtype:
    """The torch dtype of a logical dtype (``bfloat16`` -> ``torch.bfloat16``)."""
    return _TORCH_BY_NAME[info.logical]


def torch_storage(info: DtypeInfo) -> torch.dtype:
    """The torch dtype of the storage dtype (``bfloat16`` -> ``torch.uint16``)."""
    return _TORCH_BY_NAME[info.storage]


def as_storage_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the storage dtype (same bits, no copy)."""
    info = info_for_torch(t.dtype)
    if not info.is_bits:
        return t
    return t.view(torch_storage(info))


def from_storage(t: torch.Tensor, info: DtypeInfo) -> torch.Tensor:
    """A view of storage-dtype ``t`` as its logical dtype (same bits, no copy)."""
    return t.view(torch_dtype(info)) if info.is_bits else t
