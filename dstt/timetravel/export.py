"""Export a captured step to a standalone file: ``.pt``, ``.safetensors`` or ``.npz``.

* ``.pt`` -- ``torch.save`` of the nested state as captured, tensors as
  CPU tensors in their original dtype; the optimizer state (``optim``) in
  ``optimizer.state_dict()``'s own form (integer ids in the parameter order
  recorded at capture), so ``optimizer.load_state_dict(torch.load(f)["optim"])``
  takes it. It is written so that
  ``torch.load(path, weights_only=True)`` reads it: numpy arrays (e.g. the
  numpy RNG state) become tensors and numpy scalars Python numbers; anything
  else weights_only would refuse is dropped and reported.
* ``.safetensors`` and ``.npz`` -- tensors only, flat, named by their dstt
  path relative to ``only`` (``model/layers.0.weight``, or
  ``layers.0.weight`` with ``only="model"``), written without torch by
  :mod:`dstt.format.flatexport`. Non-tensor values are dropped (reported as
  one note); safetensors metadata records the store, branch and step.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dstt.errors import ConfigError
from dstt.format.flatexport import FLAT_FORMATS, ExportInfo, export_flat, subtree
from dstt.format.index import StepRecord
from dstt.format.outpath import check_output_file, temp_path
from dstt.store.reader import TensorReader as Run
from dstt.store.reader import packed_groups
from dstt.store.state import PARAM_GROUPS, indexed_optimizer_state
from dstt.store.tree import unflatten
from dstt.timetravel.restore import read_whole

FORMATS = {".pt": "pt", ".pth": "pt", **FLAT_FORMATS}
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype)


def export(
    ref: Any,
    path: str | os.PathLike[str],
    only: str | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    threads: int = 4,
) -> ExportInfo:
    """Write step ``ref`` (``STORE[@BRANCH][:STEP]`` or an open Run) to
    ``path`` (``.pt`` or ``.safetensors``), optionally only the subtree
    ``only`` (e.g. ``"model"``). ``progress(done_bytes, total_bytes)`` is
    called as tensors are read.

    >>> import tempfile, torch, dstt
    >>> d = tempfile.mkdtemp()
    >>> _ = dstt.save(d + "/run", 1, {"model": {"w": torch.ones(2, dtype=torch.bfloat16)}})
    >>> info = dstt.export(d + "/run:1", d + "/w.pt", only="model")
    >>> torch.load(d + "/w.pt", weights_only=True)
    {'w': tensor([1., 1.], dtype=torch.bfloat16)}
    """
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot export to {os.fspath(path)!r}: the name must end in "
                          f"{', '.join(FORMATS)}")
    check_output_file(path, "export")
    run = ref if isinstance(ref, Run) else Run(os.fspath(ref))
    if fmt in FLAT_FORMATS.values():
        return export_flat(run, path, fmt, only, progress=progress, threads=threads)
    rec = run.record()
    tree = subtree(rec, only)
    names: list[str] = []
    unflatten(tree, lambda n, k: names.append(n))
    tensors = _read_tensors(run, rec, names, progress, threads)
    info = ExportInfo(os.fspath(path), fmt, rec.branch, rec.step, len(names),
                      sum(t.numel() * t.element_size() for t in tensors.values()))
    tmp = temp_path(path)  # (removes what a killed export of this path left)
    try:
        state = _torch_optimizer_form(unflatten(tree, lambda n, k: tensors[n]), only)
        state = _weights_only_safe(state, info.notes, only or "")
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return info


def _read_tensors(run: Run, rec: StepRecord, names: list[str], progress: Callable[[int, int], None] | None,
                  threads: int) -> dict[str, torch.Tensor]:
    total = sum(rec.by_name[n].nbytes for n in names if n in rec.by_name)
    done = 0
    # One-chunk packed tensors pack by pack (adjacent ranges in one request),
    # the others one by one (issue 16).
    packed, others = packed_groups(rec, names)

    def one(name: str) -> list[tuple[str, torch.Tensor]]:
        return [(name, read_whole(run, rec, name))]

    def pack(group: list[str]) -> list[tuple[str, torch.Tensor]]:
        return list(zip(group, run.read_packed_tensors(rec, group)))

    out: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dstt-export") as pool:
        results = itertools.chain(pool.map(one, others), pool.map(pack, packed.values()))
        for got in results:
            for name, t in got:
                out[name] = t
                done += t.numel() * t.element_size()
            if progress is not None:
                progress(done, total)
    return out


def _torch_optimizer_form(state: Any, only: str | None) -> Any:
    """``state`` with its optimizer state (``optim``, or the whole state
    when ``only`` is ``"optim"``) re-keyed as ``optimizer.state_dict()`` is."""
    def is_optim(v: Any) -> bool:
        return isinstance(v, dict) and isinstance(v.get(PARAM_GROUPS), list)

    if (only or "").strip("/") == "optim":
        return indexed_optimizer_state(state) if is_optim(state) else state
    if not only and isinstance(state, dict) and is_optim(state.get("optim")):
        return {**state, "optim": indexed_optimizer_state(state["optim"])}
    return state


def _weights_only_safe(v: Any, notes: list[str], path: str) -> Any:
    """Make the state loadable by ``torch.load(weights_only=True)``."""
    if isinstance(v, torch.Tensor) or isinstance(v, _PLAIN):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if isinstance(k, _PLAIN) or isinstance(k, np.generic):
                out[k.item() if isinstance(k, np.generic) else k] = _weights_only_safe(x, notes, f"{path}/{k!s}")
            else:
                notes.append(f"dropped {path}/{k!r}: key type {type(k).__name__} is not weights_only-loadable")
        return out
    if isinstance(v, (list, tuple)):
        items = [_weights_only_safe(x, notes, f"{path}/{i}") for i, x in enumerate(v)]
        return items if isinstance(v, list) else tuple(items)
    notes.append(f"dropped {path}: a {type(v).__name__} is not weights_only-loadable")
    return None


__all__ = ["export", "ExportInfo", "FORMATS"]
