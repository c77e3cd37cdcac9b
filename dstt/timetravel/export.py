"""Export a captured step to a standalone file: ``.pt`` or ``.safetensors``.

* ``.pt`` -- ``torch.save`` of the nested state exactly as captured, tensors as
  CPU tensors in their original dtype. It is written so that
  ``torch.load(path, weights_only=True)`` reads it: numpy arrays (e.g. the
  numpy RNG state) become tensors and numpy scalars Python numbers; anything
  else weights_only would refuse is dropped and reported.
* ``.safetensors`` -- tensors only, flat, named by their dstt path relative to
  ``only`` (``model/layers.0.weight``, or ``layers.0.weight`` with
  ``only="model"``). Non-tensor values are dropped (reported as one note); the
  file metadata records the store, branch and step.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dstt.errors import ConfigError, TensorNotFoundError
from dstt.format.index import StepRecord
from dstt.format.outpath import check_output_file, temp_path
from dstt.store.reader import TensorReader as Run
from dstt.store.reader import packed_groups
from dstt.store.tree import unflatten
from dstt.timetravel.restore import read_whole

FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype)


@dataclass
class ExportInfo:
    """What :func:`export` wrote."""

    path: str
    format: str
    branch: str
    step: int
    n_tensors: int
    nbytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
        raise ConfigError(f"cannot export to {os.fspath(path)!r}: the name must end in .pt, .pth or .safetensors")
    check_output_file(path, "export")
    run = ref if isinstance(ref, Run) else Run(os.fspath(ref))
    rec = run.record()
    tree = _subtree(rec, only)
    names: list[str] = []
    unflatten(tree, lambda n, k: names.append(n))
    tensors = _read_tensors(run, rec, names, progress, threads)
    info = ExportInfo(os.fspath(path), fmt, rec.branch, rec.step, len(names),
                      sum(t.numel() * t.element_size() for t in tensors.values()))
    tmp = temp_path(path)  # (removes what a killed export of this path left)
    try:
        if fmt == "pt":
            state = _weights_only_safe(unflatten(tree, lambda n, k: tensors[n]), info.notes, only or "")
            torch.save(state, tmp)
        else:
            _save_safetensors(tensors, tree, only, tmp, run, rec, info.notes)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return info


def _subtree(rec: StepRecord, only: str | None) -> Any:
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


def _save_safetensors(tensors: dict[str, torch.Tensor], tree: Any, only: str | None, path: str, run: Run,
                      rec: StepRecord, notes: list[str]) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:  # pragma: no cover - declared in the export extra
        raise ConfigError("exporting .safetensors needs the safetensors package: pip install 'dstt[export]'") from None
    prefix = only.strip("/") + "/" if only else ""
    flat = {n[len(prefix):] if n.startswith(prefix) else n: t.contiguous() for n, t in tensors.items()}
    n_values = _count_values(tree)
    if n_values:
        notes.append(f"{n_values} non-tensor leaf value(s) not written (safetensors holds tensors only)")
    meta = {"dstt_store": run.url, "dstt_branch": rec.branch, "dstt_step": str(rec.step)}
    if only:
        meta["dstt_only"] = only
    save_file(flat, path, metadata=meta)


def _count_values(tree: Any) -> int:
    if isinstance(tree, list):
        return sum(_count_values(x) for x in tree)
    if isinstance(tree, dict):
        if len(tree) == 1:
            (tag, arg), = tree.items()
            if tag in ("$tensor", "$ndarray"):
                return 0
            if tag in ("$tuple",):
                return _count_values(arg)
            if tag.startswith("$"):
                return 1
        return sum(_count_values(x) for x in tree.values())
    return 1


__all__ = ["export", "ExportInfo", "FORMATS"]
