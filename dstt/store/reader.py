"""Reading a store: branches, steps, tensor tables with stats, tensor data.

``Run`` never opens a Zarr array through zarr-python: it reads the step
index once per step (cached) and fetches only the chunks a read needs, so
listing thousands of steps touches small index files and reading a slice
touches only the chunks that overlap it.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from dstt.errors import (
    ChecksumMismatchError,
    CorruptStoreError,
    StepNotFoundError,
    TensorNotFoundError,
)
from dstt.store import layout as L
from dstt.store.backends import Backend, LocalBackend, open_backend
from dstt.store.codec import crc32c, decode_chunk
from dstt.store.manifest import (
    TensorEntry,
    decode_stats,
    parse_commit,
    parse_index,
    parse_names,
    sha256_hex,
)
from dstt.store.root import BranchInfo, check_root, committed_steps, list_branches, load_branch
from dstt.store.stats import STATS_COLUMNS
from dstt.store.tree import unflatten

Index = int | slice | type(Ellipsis)


@dataclass
class TensorInfo:
    """One tensor of a step: what ``run.tensors(step)`` lists."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    stats: dict[str, float]
    checksum: str
    written: int  # bytes this step wrote for it (0: unchanged, referenced)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "stats": dict(self.stats),
            "checksum": self.checksum,
            "written": self.written,
        }


@dataclass
class StepRecord:
    """A committed step's parsed index (cached by Run)."""

    branch: str
    step: int
    commit: dict[str, Any]
    entries: list[TensorEntry]
    by_name: dict[str, TensorEntry]
    objects: Any
    stats: np.ndarray
    names: list[str] = field(default_factory=list)


def suggest(name: str, choices: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class Run:
    """A captured run, opened read-only.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 0, {"model": {"w": torch.arange(4.0)}})
    >>> run = dstt.open(path)
    >>> run.steps()
    [0]
    >>> run.read("model/w", 0)
    tensor([0., 1., 2., 3.])
    """

    def __init__(self, store: Any, *, cache_steps: int = 64) -> None:
        from dstt.refs import Ref

        ref = Ref.parse(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else None
        #: Branch and step named by the reference this run was opened with;
        #: the defaults of every method that takes ``branch``/``step``.
        self.default_branch: str = (ref.branch if ref else None) or "main"
        self.default_step: Any = ref.step if ref else None
        self.backend: Backend = open_backend(ref.store if ref else store, create=False)
        self.attrs = check_root(self.backend)
        if ref is not None and ref.branch is not None:
            load_branch(self.backend, ref.branch)  # fail early on an unknown branch
        self._cache: OrderedDict[tuple[str, int], StepRecord] = OrderedDict()
        self._cache_size = cache_steps
        self._names_cache: tuple[str, list[str]] | None = None  # (sha256 of names.json, names)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.backend.url

    def resolve(self, step: Any = None, branch: str | None = None) -> tuple[str, int]:
        """(branch, step) of the committed step a spec names (number,
        'latest', '~N', None = the reference's step or latest) on ``branch``
        (None = the reference's), following the branch's lineage: a step the
        branch inherited from its parent (at or before the fork) resolves to
        the parent's step, like a git branch's history includes its base."""
        from dstt.refs import resolve_step

        return resolve_step(self, branch or self.default_branch, self.default_step if step is None else step)

    # ------------------------------------------------------------------ branches & steps

    def branches(self) -> list[str]:
        """Branch names, sorted."""
        return list_branches(self.backend)

    def branch_info(self, branch: str | None = None) -> BranchInfo:
        return load_branch(self.backend, branch or self.default_branch)

    def steps(self, branch: str | None = None) -> list[int]:
        """Committed steps of ``branch``, ascending."""
        branch = branch or self.default_branch
        load_branch(self.backend, branch)
        return committed_steps(self.backend, branch)

    def lineage(self, branch: str | None = None, ancestry: bool = True) -> list[tuple[str, list[int]]]:
        """The trajectory leading to ``branch``'s latest step: (branch, steps)
        segments, oldest first -- each ancestor's steps up to its fork point,
        then the branch's own steps (only those with ``ancestry=False``)."""
        segs: list[tuple[str, list[int]]] = []
        b: str | None = branch or self.default_branch
        limit: int | None = None
        seen: set[str] = set()
        while b is not None and b not in seen:  # (a hostile store could loop)
            seen.add(b)
            steps = self.steps(b)
            if limit is not None:
                steps = [s for s in steps if s <= limit]
            segs.append((b, steps))
            parent = self.branch_info(b).parent
            if not ancestry or parent is None:
                break
            b, limit = parent
        return segs[::-1]

    def latest(self, branch: str | None = None) -> int:
        """The latest step of ``branch``'s trajectory (its fork point while
        it has no steps of its own)."""
        return self.resolve("latest", branch)[1]

    def commit_info(self, step: Any = None, branch: str | None = None) -> dict[str, Any]:
        """The commit document of a step (time, bytes written/referenced, ...)."""
        branch, step = self.resolve(step, branch)
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}")
        if raw is None:
            raise StepNotFoundError(f"step {step} of branch {branch!r} disappeared while reading it")
        return parse_commit(raw, where)

    def _inherited(self, step: int, branch: str) -> tuple[str, int]:
        """Where ``step``, not committed on ``branch`` itself, lives: the
        ancestor it was inherited from, else StepNotFoundError."""
        load_branch(self.backend, branch)
        b, s = self.resolve(step, branch)
        if b == branch:  # listed but gone (pruned meanwhile)
            raise StepNotFoundError(f"step {step} of branch {branch!r} disappeared while reading it")
        return b, s

    def _file(self, where: str, fname: str, commit: dict[str, Any]) -> bytes:
        data = self.backend.get(f"{where}/{fname}")
        if data is None:
            raise CorruptStoreError(f"{where}: committed step is missing {fname}")
        rec = commit["files"][fname]
        if len(data) != rec["size"] or sha256_hex(data) != rec["sha256"]:
            raise ChecksumMismatchError(f"{where}/{fname}: checksum does not match the commit record")
        return data

    def record(self, step: Any = None, branch: str | None = None) -> StepRecord:
        """The parsed, verified index of a committed step (cached)."""
        branch = branch or self.default_branch
        if not isinstance(step, int) or isinstance(step, bool):
            branch, step = self.resolve(step, branch)
        if step < 0:
            raise StepNotFoundError(f"step must be a non-negative integer, got {step!r}")
        key = (branch, step)
        with self._lock:
            rec = self._cache.get(key)
            if rec is not None:
                self._cache.move_to_end(key)
                return rec
        L.validate_branch(branch)
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}")
        if raw is None:
            b, s = self._inherited(step, branch)
            return self.record(s, b)
        commit = parse_commit(raw, where)
        entries, objects = parse_index(self._file(where, L.INDEX_FILE, commit), where)
        names = parse_names(self._file(where, L.NAMES_FILE, commit), where)
        if names != [e.name for e in entries]:
            raise CorruptStoreError(f"{where}: names.json does not match index.json")
        stats = decode_stats(self._file(where, L.STATS_FILE, commit), len(entries), where)
        for e, row in zip(entries, stats):
            e.stats = dict(zip(STATS_COLUMNS, (float(x) for x in row)))
        rec = StepRecord(branch, step, commit, entries, {e.name: e for e in entries}, objects, stats, names)
        with self._lock:
            self._cache[key] = rec
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return rec

    def step_stats(self, step: int, branch: str | None = None) -> tuple[list[str], np.ndarray]:
        """Names and the raw stats table of a step, reading only names.json
        and stats.npy (what ``history`` needs over thousands of steps)."""
        branch = branch or self.default_branch
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}")
        if raw is None:
            return self.step_stats(*reversed(self._inherited(step, branch)))
        commit = parse_commit(raw, where)
        # Consecutive steps nearly always hold the same tensors: a names.json
        # whose recorded sha256 matches the last one read is not read again.
        digest = commit["files"][L.NAMES_FILE]["sha256"]
        cached = self._names_cache
        if cached is not None and cached[0] == digest:
            names = cached[1]
        else:
            names = parse_names(self._file(where, L.NAMES_FILE, commit), where)
            self._names_cache = (digest, names)
        stats = decode_stats(self._file(where, L.STATS_FILE, commit), len(names), where)
        return names, stats

    # ------------------------------------------------------------------ tensors

    def tensors(self, step: Any = None, branch: str | None = None) -> list[TensorInfo]:
        """Every tensor of a step with shape, dtype, size and stats (no tensor data read)."""
        rec = self.record(step, branch)
        return [
            TensorInfo(e.name, e.shape, e.dtype.logical, e.nbytes, dict(e.stats), e.checksum, e.written)
            for e in rec.entries
        ]

    def entry(self, name: str, step: Any = None, branch: str | None = None) -> TensorEntry:
        rec = self.record(step, branch)
        step, branch = rec.step, rec.branch
        e = rec.by_name.get(name)
        if e is None:
            raise TensorNotFoundError(
                f"no tensor {name!r} at step {step} of branch {branch!r}{suggest(name, rec.by_name)}"
            )
        return e

    def read(
        self,
        name: str,
        step: Any = None,
        branch: str | None = None,
        index: Index | tuple[Index, ...] | None = None,
        *,
        verify: bool = False,
    ) -> torch.Tensor:
        """A tensor at a step, in its original dtype.

        ``index`` selects a part (ints, slices, Ellipsis) and reads only the
        chunks that overlap it. ``verify=True`` also checks the sha256 of
        every chunk read (the CRC-32C of each chunk is always checked).
        """
        rec = self.record(step, branch)
        e = self.entry(name, rec.step, rec.branch)
        if index is None:
            return self._read_box(e, (0,) * len(e.shape), e.shape, verify)
        box_off, box_shape, post = _normalize_index(index, e.shape, name)
        block = self._read_box(e, box_off, box_shape, verify)
        return block[post] if post else block

    def _chunk(self, e: TensorEntry, i: int, verify: bool) -> np.ndarray:
        coords = e.coords(i)
        key = L.chunk_key(e.array, e.slots[i], coords)
        where = f"{e.name} chunk {coords} (slot {e.slots[i]})"
        expected = math.prod(e.chunk_shape) * e.dtype.itemsize
        data = self.backend.get(key)
        if data is None:
            raise CorruptStoreError(f"{where}: chunk {key} is missing")
        raw = decode_chunk(data, e.codec, expected, where)
        # Uncompressed chunks: the trailer (just checked against the body) is the
        # raw CRC, so comparing it with the index is free and catches a valid
        # chunk in the wrong place.
        crc = int.from_bytes(bytes(data[-4:]), "little") if e.codec.compression == "none" else crc32c(raw)
        if crc != e.crcs[i]:
            raise ChecksumMismatchError(f"{where}: CRC-32C does not match the step index")
        if verify and e.sha256[i] is not None and sha256_hex(raw) != e.sha256[i]:
            raise ChecksumMismatchError(f"{where}: sha256 does not match the step index")
        arr = np.frombuffer(raw, dtype=e.dtype.numpy_storage)
        return arr.reshape(e.chunk_shape) if e.chunk_shape else arr.reshape(())

    def _read_box(self, e: TensorEntry, off: tuple[int, ...], shape: tuple[int, ...], verify: bool) -> torch.Tensor:
        try:  # a hostile index may declare a shape no machine can hold
            out = np.empty(shape, dtype=e.dtype.numpy_storage)
        except (MemoryError, ValueError):
            raise CorruptStoreError(
                f"{e.name}: cannot allocate {math.prod(shape) * e.dtype.itemsize} bytes for shape {list(shape)}"
            ) from None
        if math.prod(shape) > 0 and e.nchunks > 0:
            ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(off, shape, e.chunk_shape)]
            for coords in _product(ranges):
                i = 0
                for c, g in zip(coords, e.grid):
                    i = i * g + c
                chunk = self._chunk(e, i, verify)
                src, dst = [], []
                for c, k, o, n, s in zip(coords, e.chunk_shape, off, shape, e.shape):
                    lo = max(c * k, o)
                    hi = min((c + 1) * k, o + n, s)
                    src.append(slice(lo - c * k, hi - c * k))
                    dst.append(slice(lo - o, hi - o))
                out[tuple(dst)] = chunk[tuple(src)]
        t = torch.from_numpy(out)
        if e.dtype.is_bits:
            t = t.view(e.dtype.torch_dtype)
        return t

    def state_dict(
        self,
        step: Any = None,
        branch: str | None = None,
        *,
        allow_pickle: bool = False,
        prefix: str | None = None,
        verify: bool = False,
        threads: int = 4,
    ) -> Any:
        """The nested state exactly as saved (tensors, numpy arrays, values).

        ``prefix`` (e.g. ``"model"``) returns only that subtree.
        """
        rec = self.record(step, branch)
        step, branch = rec.step, rec.branch
        tree = rec.objects
        if prefix:
            for part in prefix.strip("/").split("/"):
                if not isinstance(tree, dict) or part not in tree:
                    raise TensorNotFoundError(f"no subtree {prefix!r} at step {step} of branch {branch!r}")
                tree = tree[part]
        wanted: list[str] = []

        def collect(name: str, kind: str) -> None:
            wanted.append(name)

        unflatten(tree, lambda n, k: collect(n, k), allow_pickle=allow_pickle)
        for n in wanted:
            if n not in rec.by_name:
                raise CorruptStoreError(f"step {step}: value tree refers to missing tensor {n!r}")
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            loaded = dict(zip(wanted, pool.map(lambda n: self.read(n, step, branch, verify=verify), wanted)))

        def load(name: str, kind: str) -> Any:
            t = loaded[name]
            return t.numpy() if kind == "ndarray" else t

        return unflatten(tree, load, allow_pickle=allow_pickle)

    def iter_chunks(self, name: str, step: Any = None, branch: str | None = None) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
        """(global region, values) of each chunk of a tensor, edge chunks trimmed:
        streaming access with memory bounded by one chunk."""
        e = self.entry(name, step, branch)
        for i in range(e.nchunks):
            coords = e.coords(i)
            region = tuple(slice(c * k, min((c + 1) * k, s)) for c, k, s in zip(coords, e.chunk_shape, e.shape))
            arr = self._chunk(e, i, False)[tuple(slice(0, r.stop - r.start) for r in region)]
            t = torch.from_numpy(np.ascontiguousarray(arr))
            yield region, (t.view(e.dtype.torch_dtype) if e.dtype.is_bits else t)

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Run({self.url!r})"

    # ------------------------------------------------------------------ analysis (dstt.analysis)

    def diff(self, a: Any, b: Any, patterns: Any = None, **kw: Any) -> list[dict[str, Any]]:
        """Per-tensor diff rows between two points; see :func:`dstt.analysis.diff.diff`."""
        from dstt.analysis.diff import diff

        return diff(self, a, b, patterns, **kw)

    def history(self, names: Any, stat: str = "norm", branch: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        """A stat across steps from the step index; see :func:`dstt.analysis.history.history`."""
        from dstt.analysis.history import history

        return history(self, names, stat=stat, branch=branch, **kw)

    def find(self, patterns: Any = None, branch: str | None = None, **kw: Any) -> list[dict[str, Any]]:
        """The first step where something went wrong (NaN/Inf, a norm jump, a stat threshold),
        from the step index; see :func:`dstt.analysis.anomaly.find`."""
        from dstt.analysis.anomaly import find

        return find(self, patterns, branch, **kw)


def _product(ranges: list[range]) -> Iterator[tuple[int, ...]]:
    from itertools import product

    return product(*ranges)


def _normalize_index(index: Any, shape: tuple[int, ...], name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """Bounding box of a basic index and the index to apply inside the box."""
    from dstt.errors import InvalidReferenceError

    idx = index if isinstance(index, tuple) else (index,)
    if sum(1 for x in idx if x is Ellipsis) > 1:
        raise InvalidReferenceError(f"{name}: at most one '...' in an index")
    if Ellipsis in idx:
        pos = idx.index(Ellipsis)
        fill = len(shape) - (len(idx) - 1)
        idx = idx[:pos] + (slice(None),) * fill + idx[pos + 1 :]
    if len(idx) > len(shape):
        raise InvalidReferenceError(f"{name}: index has {len(idx)} dimensions, tensor has {len(shape)}")
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    off, box, post = [], [], []
    for d, (x, n) in enumerate(zip(idx, shape)):
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
            i = int(x) + (n if x < 0 else 0)
            if not 0 <= i < n:
                raise InvalidReferenceError(f"{name}: index {x} out of range for dimension {d} of size {n}")
            off.append(i)
            box.append(1)
            post.append(0)
        elif isinstance(x, slice):
            if x.step is not None and x.step <= 0:  # checked first: indices() raises a bare ValueError for 0
                raise InvalidReferenceError(f"{name}: slice steps must be positive, got {x.step}")
            start, stop, step = x.indices(n)
            stop = max(stop, start)
            off.append(start)
            box.append(stop - start)
            post.append(slice(None, None, step))
        else:
            raise InvalidReferenceError(f"{name}: unsupported index {x!r} (use ints and slices)")
    return tuple(off), tuple(box), tuple(post)


def open_run(store: Any) -> Run:
    return Run(store)


__all__ = ["Run", "TensorInfo", "StepRecord", "open_run", "LocalBackend"]
