"""Reading tensors of a store as torch tensors (a torch adapter over the
torch-free :class:`~dstt.format.index.RunIndex`).

:class:`TensorReader` adds what needs torch: ``read`` (a tensor in its
logical dtype, bfloat16 and float8 included), ``iter_chunks`` and
``state_dict`` (the nested state as saved). :class:`dstt.Run`, what
``dstt.open`` returns, adds the analysis queries (diff, history, find).

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, {"model": {"w": torch.arange(4.0)}})
>>> TensorReader(path).read("model/w", 0)
tensor([0., 1., 2., 3.])
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from dstt.errors import CorruptStoreError, TensorNotFoundError
from dstt.format.chunks import read_packed
from dstt.format.index import Index, RunIndex, StepRecord, TensorInfo
from dstt.format.manifest import TensorEntry
from dstt.format.packs import pack_key
from dstt.format.pygc import paused_gc
from dstt.store.torch_dtypes import from_storage
from dstt.store.tree import tensor_names, unflatten


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor over ``arr``, copied only if it is not C-contiguous
    (``np.ascontiguousarray`` would turn a 0-d array into a 1-d one)."""
    return torch.from_numpy(arr if arr.flags.c_contiguous else arr.copy(order="C"))


def packed_groups(rec: StepRecord, names: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """``names`` (each once, order kept) split into one-chunk packed tensors
    grouped by pack key, and the others."""
    packed: dict[str, list[str]] = {}
    others: list[str] = []
    get = rec.by_name.get
    for n in dict.fromkeys(names):
        e = get(n)
        # (one pack item per chunk: one item, one chunk)
        if e is not None and e.packs is not None and len(e.packs) == 1 and e.chunk_shape == e.shape:
            p = e.packs[0]
            if p is not None:
                packed.setdefault(pack_key(e.slots[0], p.rank, p.n), []).append(n)
                continue
        others.append(n)
    return packed, others


def _from_raw(e: TensorEntry, raw: memoryview) -> torch.Tensor:
    """A one-chunk tensor from its checked raw bytes (a copy: ``raw`` may
    view a read buffer shared by many tensors, or be read-only)."""
    arr = np.frombuffer(raw, dtype=e.dtype.numpy_storage).reshape(e.shape).copy()
    return from_storage(torch.from_numpy(arr), e.dtype)


class TensorReader(RunIndex):
    """A captured run opened read-only, with tensors as torch tensors."""

    def read(
        self,
        name: str,
        step: Any = None,
        *,
        branch: str | None = None,
        index: Index | tuple[Index, ...] | None = None,
        verify: bool = False,
    ) -> torch.Tensor:
        """A tensor at a step, in its original dtype.

        ``index`` selects a part (ints, slices, Ellipsis) and reads only the
        chunks that overlap it. ``verify=True`` also checks the sha256 of
        every chunk read (the CRC-32C of each chunk is always checked).
        """
        rec = self.record(step, branch=branch)
        e = self.entry(name, rec.step, branch=rec.branch)
        arr = self.read_array(name, rec.step, branch=rec.branch, index=index, verify=verify)
        return from_storage(_tensor(arr), e.dtype)

    def state_dict(
        self,
        step: Any = None,
        *,
        branch: str | None = None,
        allow_pickle: bool = False,
        prefix: str | None = None,
        verify: bool = False,
        threads: int = 4,
    ) -> Any:
        """The nested state exactly as saved (tensors, numpy arrays, values).

        ``prefix`` (e.g. ``"model"``) returns only that subtree.
        """
        with paused_gc():  # (objects per tensor, no cycles: issue 16)
            return self._state_dict(step, branch, allow_pickle, prefix, verify, threads)

    def _state_dict(self, step: Any, branch: str | None, allow_pickle: bool, prefix: str | None,
                    verify: bool, threads: int) -> Any:
        rec = self.record(step, branch=branch)
        step, branch = rec.step, rec.branch
        tree = rec.objects
        if prefix:
            for part in prefix.strip("/").split("/"):
                if not isinstance(tree, dict) or part not in tree:
                    raise TensorNotFoundError(f"no subtree {prefix!r} at step {step} of branch {branch!r}")
                tree = tree[part]
        wanted = tensor_names(tree, allow_pickle=allow_pickle)
        for n in wanted:
            if n not in rec.by_name:
                raise CorruptStoreError(f"step {step}: value tree refers to missing tensor {n!r}")
        # One-chunk packed tensors are read pack by pack, adjacent ranges in
        # one request (chunks.read_packed); the others by name, in groups:
        # one pool task per tensor cost more than reading a small tensor
        # (tens of thousands: issue 16).
        packed, others = packed_groups(rec, wanted)
        per_task = max(1, min(256, len(others) // (4 * max(1, threads))))
        groups = [others[i:i + per_task] for i in range(0, len(others), per_task)]

        def read_group(names: list[str]) -> list[torch.Tensor]:
            return [self.read(n, step, branch=branch, verify=verify) for n in names]

        def read_pack(names: list[str]) -> list[torch.Tensor]:
            return self.read_packed_tensors(rec, names, verify=verify)

        loaded: dict[str, torch.Tensor] = {}
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for names, ts in zip(groups, pool.map(read_group, groups)):
                loaded.update(zip(names, ts))
            for names, ts in zip(packed.values(), pool.map(read_pack, packed.values())):
                loaded.update(zip(names, ts))

        def load(name: str, kind: str) -> Any:
            t = loaded[name]
            return t.numpy() if kind == "ndarray" else t

        # (rec.objects: depth checked by parse_index, or written by this process)
        return unflatten(tree, load, allow_pickle=allow_pickle, depth_checked=True)

    def read_packed_tensors(self, rec: StepRecord, names: list[str], *, verify: bool = False) -> list[torch.Tensor]:
        """Whole one-chunk packed tensors of step ``rec`` (names from one
        group of :func:`packed_groups`), adjacent pack ranges read with one
        request (:func:`dstt.format.chunks.read_packed`); each tensor owns
        its bytes."""
        entries = [rec.by_name[n] for n in names]
        with self.removed_meanwhile(rec.branch, rec.step):
            raws = read_packed(self.backend, [(e, 0) for e in entries], sha256=verify)
        return [_from_raw(e, raw) for e, raw in zip(entries, raws)]

    def iter_chunks(self, name: str, step: Any = None, *,
                    branch: str | None = None) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
        """(global region, values) of each chunk of a tensor, edge chunks trimmed:
        streaming access with memory bounded by one chunk."""
        e = self.entry(name, step, branch=branch)
        for region, arr in self.iter_chunk_arrays(name, step, branch=branch):
            yield region, from_storage(_tensor(arr), e.dtype)


__all__ = ["TensorReader", "TensorInfo", "StepRecord", "packed_groups"]
