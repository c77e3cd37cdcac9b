"""Export a step's tensors to a flat file without torch: ``.safetensors``
(written here, byte for byte the format the safetensors package reads) or
``.npz`` (numpy). The torch-free half of :mod:`dstt.timetravel.export`,
which also writes ``.pt`` (torch) and hands these two formats here.

* ``.safetensors`` -- tensors only, flat, named by their dstt path relative
  to ``only``; the stored bits as they are (bfloat16 and float8 included:
  safetensors has those dtypes); metadata records the store, branch and
  step. complex128 and float8_e8m0fnu have no safetensors dtype: refused.
* ``.npz`` -- the same names and tensors as numpy arrays; bfloat16 and
  float8, which numpy lacks, widened to float32 (exact; one note says so).

Non-tensor values are not written (one note counts them).
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Callable

import numpy as np

from dstt.errors import ConfigError, TensorNotFoundError
from dstt.format.dtypes import decode
from dstt.format.index import RunIndex, StepRecord
from dstt.format.outpath import temp_path
from dstt.format.valuetree import TENSOR_TAGS, tensor_refs

#: Flat formats written here: file suffix -> format name.
FLAT_FORMATS = {".safetensors": "safetensors", ".npz": "npz"}
#: dstt logical dtype -> safetensors dtype (the names its readers know).
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "complex64": "C64",
}


@dataclass
class ExportInfo:
    """What an export wrote."""

    path: str
    format: str
    branch: str
    step: int
    n_tensors: int
    nbytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def subtree(rec: StepRecord, only: str | None) -> Any:
    """The value tree of ``rec`` below ``only`` (``"model"``, ``"optim/state"``)."""
    tree = rec.objects
    if only:
        for part in only.strip("/").split("/"):
            if not isinstance(tree, dict) or part not in tree:
                have = ", ".join(sorted(rec.objects)) if isinstance(rec.objects, dict) else "nothing"
                raise TensorNotFoundError(
                    f"no subtree {only!r} at step {rec.step} of branch {rec.branch!r} (top level: {have})"
                )
            tree = tree[part]
    return tree


def count_values(tree: Any) -> int:
    """Leaves of a value tree that are not tensors."""
    if isinstance(tree, list):
        return sum(count_values(x) for x in tree)
    if isinstance(tree, dict):
        if len(tree) == 1:
            (tag, arg), = tree.items()
            if tag in TENSOR_TAGS:
                return 0
            if tag == "$tuple":
                return count_values(arg)
            if isinstance(tag, str) and tag.startswith("$"):
                return 1
        return sum(count_values(x) for x in tree.values())
    return 1


def read_arrays(run: RunIndex, rec: StepRecord, names: list[str], progress: Callable[[int, int], None] | None,
                threads: int = 4) -> dict[str, np.ndarray]:
    """Whole tensors of step ``rec`` as numpy arrays of their storage dtype."""
    total = sum(rec.by_name[n].nbytes for n in names if n in rec.by_name)
    done = 0
    out: dict[str, np.ndarray] = {}

    def one(name: str) -> np.ndarray:
        return run.read_array(name, rec.step, branch=rec.branch)

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dstt-export") as pool:
        for name, arr in zip(names, pool.map(one, names)):
            out[name] = arr
            done += arr.nbytes
            if progress is not None:
                progress(done, total)
    return out


def flat_names(names: list[str], only: str | None) -> dict[str, str]:
    """dstt name -> name in the file (relative to ``only``)."""
    prefix = only.strip("/") + "/" if only else ""
    return {n: n[len(prefix):] if prefix and n.startswith(prefix) else n for n in names}


def export_flat(run: RunIndex, path: str | os.PathLike[str], fmt: str, only: str | None = None, *,
                progress: Callable[[int, int], None] | None = None, threads: int = 4) -> ExportInfo:
    """Write the step ``run`` resolves to (its default reference) to
    ``path`` as ``fmt`` (``"safetensors"`` or ``"npz"``), through a
    temporary file renamed into place (a killed export leaves no partial
    file under ``path``). The caller has checked ``path``
    (:func:`dstt.format.outpath.check_output_file`)."""
    tmp = temp_path(path)  # (removes what a killed export of this path left)
    try:
        info = _write(run, path, fmt, only, tmp, progress, threads)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return info


def _write(run: RunIndex, path: str | os.PathLike[str], fmt: str, only: str | None, tmp: str,
           progress: Callable[[int, int], None] | None, threads: int) -> ExportInfo:
    rec = run.record()
    tree = subtree(rec, only)
    names = list(dict.fromkeys(tensor_refs(tree)))
    entries = {n: rec.by_name[n] for n in names if n in rec.by_name}
    if fmt == "safetensors":
        bad = [f"{n} ({e.dtype.logical})" for n, e in entries.items() if e.dtype.logical not in SAFETENSORS_DTYPES]
        if bad:
            raise ConfigError(f"safetensors has no dtype for {', '.join(bad[:3])}: export as .pt or .npz")
    arrays = read_arrays(run, rec, names, progress, threads)
    info = ExportInfo(os.fspath(path), fmt, rec.branch, rec.step, len(names), sum(a.nbytes for a in arrays.values()))
    n_values = count_values(tree)
    if n_values:
        info.notes.append(f"{n_values} non-tensor leaf value(s) not written ({fmt} holds tensors only)")
    flat = flat_names(names, only)
    meta = {"dstt_store": run.url, "dstt_branch": rec.branch, "dstt_step": str(rec.step)}
    if only:
        meta["dstt_only"] = only
    with open(tmp, "wb") as f:
        if fmt == "safetensors":
            write_safetensors(f, {flat[n]: (SAFETENSORS_DTYPES[entries[n].dtype.logical], arrays[n]) for n in names},
                              meta)
        else:
            widened = sorted({e.dtype.logical for e in entries.values() if e.dtype.is_bits})
            if widened:
                info.notes.append(f"{', '.join(widened)} written as float32 (numpy has no such dtype; exact)")
            arrays_out: dict[str, Any] = {flat[n]: decode(arrays[n], entries[n].dtype) for n in names}
            np.savez(f, **arrays_out)
        f.flush()
        os.fsync(f.fileno())
    return info


def write_safetensors(f: IO[bytes], tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file: an 8-byte little-endian header size, the JSON
    header (padded with spaces to 8 bytes), then each tensor's bytes,
    little-endian, C order, in the order of the header's offsets.

    >>> import io
    >>> buf = io.BytesIO()
    >>> write_safetensors(buf, {"w": ("F32", np.ones(2, np.float32))}, {"k": "v"})
    >>> n = int.from_bytes(buf.getvalue()[:8], "little")
    >>> json.loads(buf.getvalue()[8:8 + n])["w"]
    {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    blobs: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        a = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for a in blobs:
        f.write(a.reshape(-1).view(np.uint8).data)
