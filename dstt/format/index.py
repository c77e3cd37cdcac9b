"""A run's committed steps and their step indexes, read torch-free.

:class:`RunIndex` is what every read-only command needs: branches, steps,
references, the parsed and verified step index of a step (tensor table,
stats, value tree) and chunk data as numpy arrays of the storage dtype. It
never opens a Zarr array through zarr-python: it reads the step index once
per step (cached) and fetches only the chunks a read needs, so listing
thousands of steps touches small index files and reading a slice touches
only the chunks that overlap it. Torch tensors come from
:class:`dstt.store.reader.TensorReader`, built on this class.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 3, {"model": {"w": torch.arange(4.0)}})
>>> idx = RunIndex(path)
>>> idx.resolve(), idx.read_array("model/w", 3).tolist()
(StepRef(branch='main', step=3), [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Iterator, TypeAlias

import numpy as np

from dstt.errors import (
    ChecksumMismatchError,
    CorruptStoreError,
    InvalidReferenceError,
    StepNotFoundError,
    TensorNotFoundError,
)
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.chains import ChainReader, attach
from dstt.format.chunks import chunk_array, read_box
from dstt.format.manifest import (
    TensorEntry,
    decode_stats,
    memory_only_of,
    parse_commit,
    parse_index_checked,
    parse_names,
    parse_objects,
    sha256_hex,
    stats_columns_of,
)
from dstt.format.refs import Ref, StepRef, resolve_step
from dstt.format.root import BranchInfo, check_root, committed_steps, list_branches, load_branch

#: One index of a basic selection: an int, a slice or ``...``.
Index: TypeAlias = "int | slice | EllipsisType"


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


def suggest(name: str, choices: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class RunIndex:
    """A captured run's steps and step indexes, opened read-only (no torch)."""

    def __init__(self, store: Any, *, cache_steps: int = 64, storage_options: dict[str, Any] | None = None) -> None:
        ref = Ref.parse(os.fspath(store)) if isinstance(store, (str, os.PathLike)) else None
        #: Branch and step named by the reference this run was opened with;
        #: the defaults of every method that takes ``branch``/``step``.
        self.default_branch: str = (ref.branch if ref else None) or "main"
        self.default_step: Any = ref.step if ref else None
        self.backend: Backend = open_backend(ref.store if ref else store, create=False,
                                             storage_options=storage_options)
        self.attrs = check_root(self.backend)
        if ref is not None and ref.branch is not None:
            load_branch(self.backend, ref.branch)  # fail early on an unknown branch
        self._cache: OrderedDict[tuple[str, int], StepRecord] = OrderedDict()
        self._cache_size = cache_steps
        self._names_cache: tuple[str, list[str]] | None = None  # (sha256 of names.json, names)
        self._lock = threading.Lock()
        #: Decodes predictive chunks (format version 5), each once while cached.
        self.chains = ChainReader(self.backend, self._entries_at)

    @property
    def url(self) -> str:
        return self.backend.url

    def resolve(self, step: Any = None, *, branch: str | None = None) -> StepRef:
        """(branch, step) of the committed step a spec names (number,
        'latest', '~N', None = the reference's step or latest) on ``branch``
        (None = the reference's), following the branch's lineage: a step the
        branch inherited from its parent (at or before the fork) resolves to
        the parent's step, like a git branch's history includes its base."""
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
        return self.resolve("latest", branch=branch)[1]

    def commit_info(self, step: Any = None, *, branch: str | None = None) -> dict[str, Any]:
        """The commit document of a step (time, bytes written/referenced, ...)."""
        branch, step = self.resolve(step, branch=branch)
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is None:
            raise StepNotFoundError(f"step {step} of branch {branch!r} disappeared while reading it")
        return parse_commit(raw, where)

    def _inherited(self, step: int, branch: str) -> tuple[str, int]:
        """Where ``step``, not committed on ``branch`` itself, lives: the
        ancestor it was inherited from, else StepNotFoundError."""
        load_branch(self.backend, branch)
        b, s = self.resolve(step, branch=branch)
        if b == branch:  # listed but gone (pruned meanwhile)
            raise StepNotFoundError(f"step {step} of branch {branch!r} disappeared while reading it")
        return b, s

    def _file(self, where: str, fname: str, commit: dict[str, Any]) -> bytes:
        rec = commit["files"][fname]
        with self.removed_meanwhile(commit["branch"], commit["step"]):
            data = self.backend.get(f"{where}/{fname}", max_bytes=rec["size"])
            if data is None:
                raise CorruptStoreError(f"{where}: committed step is missing {fname}")
        if len(data) != rec["size"] or sha256_hex(data) != rec["sha256"]:
            raise ChecksumMismatchError(f"{where}/{fname}: checksum does not match the commit record")
        return data

    def record(self, step: Any = None, *, branch: str | None = None) -> StepRecord:
        """The parsed, verified index of a committed step (cached)."""
        branch = branch or self.default_branch
        if not isinstance(step, int) or isinstance(step, bool):
            branch, step = self.resolve(step, branch=branch)
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
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is None:
            b, s = self._inherited(step, branch)
            return self.record(s, branch=b)
        commit = parse_commit(raw, where)
        # (_file checked the bytes against the commit's sha256)
        entries, objects = parse_index_checked(self._file(where, L.INDEX_FILE, commit), where,
                                               commit["files"][L.INDEX_FILE]["sha256"])
        names = parse_names(self._file(where, L.NAMES_FILE, commit), where)
        if names != [e.name for e in entries]:
            raise CorruptStoreError(f"{where}: names.json does not match index.json")
        stats = decode_stats(self._file(where, L.STATS_FILE, commit), len(entries), where,
                             stats_columns_of(commit))
        for e, row in zip(entries, stats):
            e.set_stats_row(row)  # (the dict is built when asked for)
        entries = attach(entries, self.chains, branch, step)
        rec = StepRecord(branch, step, commit, entries, {e.name: e for e in entries}, objects, stats, names)
        with self._lock:
            self._cache[key] = rec
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return rec

    def value_tree(self, step: Any = None, *, branch: str | None = None) -> Any:
        """The value tree of a committed step (``record(...).objects``)
        without building its tensor entries: what reads of values (``show
        VALUE``, ``history extra/loss``, ``find``'s value checks) need. The
        same checks: commit marker, index.json's sha256, the tree's depth."""
        branch = branch or self.default_branch
        if not isinstance(step, int) or isinstance(step, bool):
            branch, step = self.resolve(step, branch=branch)
        with self._lock:
            rec = self._cache.get((branch, step))
        if rec is not None:
            return rec.objects
        if step < 0:
            raise StepNotFoundError(f"step must be a non-negative integer, got {step!r}")
        L.validate_branch(branch)
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is None:
            b, s = self._inherited(step, branch)
            return self.value_tree(s, branch=b)
        return parse_objects(self._file(where, L.INDEX_FILE, parse_commit(raw, where)), where)

    def _entries_at(self, branch: str, step: int) -> tuple[str, int, dict[str, TensorEntry]]:
        """(branch holding it, step, entries by name) of a step of ``branch``'s
        lineage: what a predictive chunk's chain reads its inputs from."""
        rec = self.record(step, branch=branch)
        return rec.branch, rec.step, rec.by_name

    def step_stats(self, step: int, *, branch: str | None = None) -> tuple[list[str], np.ndarray]:
        """Names and the raw stats table of a step, reading only names.json
        and stats.npy (what ``history`` needs over thousands of steps)."""
        branch = branch or self.default_branch
        where = L.step_dir(branch, step)
        raw = self.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        if raw is None:
            b, s = self._inherited(step, branch)
            return self.step_stats(s, branch=b)
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
        stats = decode_stats(self._file(where, L.STATS_FILE, commit), len(names), where,
                             stats_columns_of(commit))
        return names, stats

    def captured(self, branch: str | None = None) -> tuple[list[tuple[int, int]], list[int]]:
        """What ``branch`` captured, from its commit documents (no tensor
        data read): (captured spans as inclusive ``(first, last)`` ranges,
        persisted steps). With ``Capture(memory_steps=K)`` a step may be
        captured into memory only; each commit records those since the
        previous persisted step (``memory_only``). See :func:`captured_spans`.

        >>> import tempfile, torch, dstt
        >>> path = tempfile.mkdtemp() + "/run"
        >>> for s in (100, 108):
        ...     _ = dstt.save(path, s, {"w": torch.ones(1)})
        >>> RunIndex(path).captured()
        ([(100, 100), (108, 108)], [100, 108])
        """
        branch = branch or self.default_branch
        commits = []
        for s in self.steps(branch):
            where = L.step_dir(branch, s)
            raw = self.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
            if raw is not None:  # (None: pruned since the listing)
                commits.append((s, memory_only_of(parse_commit(raw, where))))
        spans, persisted, _ = captured_spans(commits)
        return spans, persisted

    # ------------------------------------------------------------------ tensors

    def tensors(self, step: Any = None, *, branch: str | None = None) -> list[TensorInfo]:
        """Every tensor of a step with shape, dtype, size and stats (no tensor data read)."""
        rec = self.record(step, branch=branch)
        return [
            TensorInfo(e.name, e.shape, e.dtype.logical, e.nbytes, dict(e.stats), e.checksum, e.written)
            for e in rec.entries
        ]

    def entry(self, name: str, step: Any = None, *, branch: str | None = None) -> TensorEntry:
        rec = self.record(step, branch=branch)
        step, branch = rec.step, rec.branch
        e = rec.by_name.get(name)
        if e is None:
            raise TensorNotFoundError(
                f"no tensor {name!r} at step {step} of branch {branch!r}{suggest(name, rec.by_name)}"
            )
        return e

    def read_array(
        self,
        name: str,
        step: Any = None,
        *,
        branch: str | None = None,
        index: Index | tuple[Index, ...] | None = None,
        verify: bool = False,
    ) -> np.ndarray:
        """A tensor (or the part ``index`` selects) as a numpy array of its
        storage dtype (bfloat16 and float8 as their unsigned-integer bits);
        reads only the chunks that overlap the selection. ``verify=True``
        also checks each chunk's sha256 (CRC-32Cs are always checked)."""
        rec = self.record(step, branch=branch)
        e = self.entry(name, rec.step, branch=rec.branch)
        with self.removed_meanwhile(rec.branch, rec.step):
            if index is None:
                return self._read_box(e, (0,) * len(e.shape), e.shape, verify)
            box_off, box_shape, post = normalize_index(index, e.shape, name)
            block = self._read_box(e, box_off, box_shape, verify)
            return block[post] if post else block

    @contextlib.contextmanager
    def removed_meanwhile(self, branch: Any, step: Any) -> Iterator[None]:
        """Turn a missing or damaged file of a step that ``prune`` removed
        while it was being read (its commit marker is gone; gc may have taken
        its chunks) into StepNotFoundError: the step is gone, the store is fine."""
        try:
            yield
        except CorruptStoreError as e:
            if (isinstance(branch, str) and isinstance(step, int)
                    and not self.backend.exists(f"{L.step_dir(branch, step)}/{L.COMMIT_FILE}")):
                raise StepNotFoundError(
                    f"step {step} of branch {branch!r} was removed (pruned) while it was being read") from e
            raise

    def _read_box(self, e: TensorEntry, off: tuple[int, ...], shape: tuple[int, ...], verify: bool) -> np.ndarray:
        """The box ``off``/``shape`` of ``e`` (storage dtype), chunk by chunk
        through :meth:`_chunk` (:func:`dstt.format.chunks.read_box`)."""

        def fetch(e: TensorEntry, i: int) -> np.ndarray:
            return self._chunk(e, i, verify)

        return read_box(self.backend, e, off, shape, fetch=fetch)

    def _chunk(self, e: TensorEntry, i: int, verify: bool) -> np.ndarray:
        """Chunk ``i`` of ``e`` (storage dtype, padded): every tensor-data read
        of this reader goes through here (:func:`dstt.format.chunks.chunk_array`)."""
        return chunk_array(self.backend, e, i, sha256=verify)

    def iter_chunk_arrays(self, name: str, step: Any = None, *,
                          branch: str | None = None) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
        """(global region, storage-dtype values) of each chunk of a tensor,
        edge chunks trimmed: streaming access with memory bounded by one chunk."""
        rec = self.record(step, branch=branch)
        e = self.entry(name, rec.step, branch=rec.branch)
        g = e.chunk_grid
        for i in range(e.nchunks):
            region = g.region(i)
            with self.removed_meanwhile(rec.branch, rec.step):
                arr = self._chunk(e, i, False)[tuple(slice(0, r.stop - r.start) for r in region)]
            yield region, arr

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "RunIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def captured_spans(commits: Iterable[tuple[int, list[tuple[int, int]]]]
                   ) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
    """(captured spans, persisted steps, memory-only ranges) of a branch
    from its commits' ``(step, memory_only ranges)``.

    Persisted steps are the committed ones. A memory-only range that a
    later persisted step covers (a backfill after an incident) is split
    around it: commit markers win. A captured span joins each commit's
    memory-only ranges to the persisted step before them (they were recorded
    as "since the previous persisted step") and to the commit itself;
    adjacent or overlapping spans merge.

    >>> captured_spans([(100, []), (108, [(101, 107)]), (116, [(109, 115)]), (200, [])])
    ([(100, 116), (200, 200)], [100, 108, 116, 200], [(101, 107), (109, 115)])
    >>> captured_spans([(100, []), (108, [(101, 107)]), (104, [])])[2]
    [(101, 103), (105, 107)]
    """
    import bisect

    points = sorted(commits)
    persisted = sorted({s for s, _ in points})
    spans: list[tuple[int, int]] = []
    raw_ranges: list[tuple[int, int]] = []
    prev: int | None = None
    for step, ranges in points:
        if ranges:
            raw_ranges.extend(ranges)
            spans.append((min(ranges[0][0], step) if prev is None else min(prev, ranges[0][0]), step))
        spans.append((step, step))
        prev = step
    merged: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    memory: list[tuple[int, int]] = []
    for first, last in sorted(raw_ranges):
        lo = bisect.bisect_left(persisted, first)
        hi = bisect.bisect_right(persisted, last)
        cur = first
        for p in persisted[lo:hi]:
            if cur <= p - 1:
                memory.append((cur, p - 1))
            cur = p + 1
        if cur <= last:
            memory.append((cur, last))
    out: list[tuple[int, int]] = []
    for first, last in memory:  # ranges of different commits may overlap (a hostile or odd store)
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return merged, persisted, out


def resolve_parent(backend: Backend, parent: Any) -> StepRef | None:
    """The fork point ``parent=`` names: a :class:`StepRef` or ``(branch,
    step)`` pair (taken as given), or a reference inside the store being
    written (``"main:1200"``, ``"@main:latest"``, ``"~3"``; see
    :func:`dstt.format.refs.split_in_store`), resolved to a committed step.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> for s in (1, 2, 3):
    ...     _ = dstt.save(path, s, {"w": torch.ones(1)})
    >>> b = open_backend(path)
    >>> resolve_parent(b, "main:2"), resolve_parent(b, "~1"), resolve_parent(b, ("main", 3))
    (StepRef(branch='main', step=2), StepRef(branch='main', step=2), StepRef(branch='main', step=3))
    """
    if parent is None:
        return None
    if isinstance(parent, str):
        from dstt.format.refs import split_in_store

        rel = split_in_store(parent)
        if rel is None:
            raise InvalidReferenceError(
                f"parent {parent!r} is not a step of this store: use 'BRANCH:STEP', '@BRANCH[:STEP]', "
                "':STEP', '~N' or a StepRef")
        branch, step = rel
        return RunIndex(backend).resolve("latest" if step is None else step, branch=branch or "main")
    if isinstance(parent, tuple) and len(parent) == 2 and isinstance(parent[0], str):
        return StepRef(parent[0], parent[1])
    raise InvalidReferenceError(f"parent must be a reference string, a StepRef or (branch, step), got {parent!r}")


def normalize_index(index: Any, shape: tuple[int, ...], name: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """Bounding box of a basic index and the index to apply inside the box."""
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
    off: list[int] = []
    box: list[int] = []
    post: list[Any] = []
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


