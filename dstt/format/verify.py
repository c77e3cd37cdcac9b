"""Integrity verification of a store: every committed step, end to end.

For each committed step :func:`verify` checks, and reports every failure
(naming branch, step and tensor) instead of stopping at the first:

* ``commit.json`` parses and validates;
* ``index.json``, ``names.json`` and ``stats.npy`` exist and match the sha256
  and size recorded in the commit, and parse and agree with each other;
* every tensor the value tree refers to is in the index;
* every chunk the index references exists, its stored CRC-32C trailer
  (zarr's crc32c codec) matches, it decodes to the expected size, the
  CRC-32C of its raw bytes equals the one in the index, and so does its
  sha256 where the index records one;
* a packed chunk's recorded range of its pack (docs/format.md "Packs") is
  read and checked the same way;
* each tensor's checksum equals the sha256 of its chunk CRC-32Cs.
* each tensor's array ``zarr.json`` (what plain zarr-python reads) exists
  and has exactly the bytes its index entry determines.

A chunk shared by several steps (unchanged data is referenced, not
rewritten) is read once. Uncommitted step directories left by a crash are
not errors: they are listed as ``partial`` (``dstt gc`` removes them).

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, {"w": torch.ones(3)})
>>> report = verify(path)
>>> report.ok, report.steps, report.chunks
(True, 1, 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dstt.errors import DsttError, StepNotFoundError
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.chunks import check_chunk, packed_key_of, read_chunk
from dstt.format.codecs.keyframes import read_delta
from dstt.format.codecs.spec import array_metadata, delta_array_metadata, max_stored_bytes
from dstt.format.gc import entry_chunks, entry_packs
from dstt.format.manifest import (
    TensorEntry,
    decode_stats,
    parse_commit,
    parse_index,
    parse_names,
    sha256_hex,
    tensor_checksum,
)
from dstt.format.packs import PACKS, pack_key, parse_pack_key
from dstt.format.root import check_root, committed_steps, list_branches, load_branch
from dstt.format.scan import StoreSpec, groups_by_bytes, opened, run_placed, scan_executor
from dstt.format.valuetree import tensor_refs as tree_refs

#: progress(done, total, description) -- called once per tensor checked.
Progress = Callable[[int, int, str], None]


@dataclass
class Problem:
    """One integrity failure."""

    branch: str
    step: int | None
    tensor: str | None
    kind: str  # commit | index | names | stats | tree | array | chunk | checksum | branch
    message: str

    def __str__(self) -> str:
        where = f"{self.branch}"
        if self.step is not None:
            where += f":{self.step}"
        if self.tensor is not None:
            where += f" {self.tensor}"
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"branch": self.branch, "step": self.step, "tensor": self.tensor,
                "kind": self.kind, "message": self.message}


@dataclass
class VerifyReport:
    """What :func:`verify` checked and what failed."""

    store: str
    branches: list[str] = field(default_factory=list)
    steps: int = 0
    tensors: int = 0
    chunks: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # uncommitted step dirs
    #: Whole-store runs: files under tensors/ no committed step references --
    #: {"chunks", "arrays", "bytes"} (an array counts when none of its chunks
    #: is referenced, its zarr.json included). Left by interrupted (or still
    #: running) writers and by prune; not problems: no committed step reads
    #: them, and ``dstt gc`` removes them. None when not computed (one branch
    #: or step verified, or a step's index unreadable).
    orphans: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "ok": self.ok, "branches": self.branches, "steps": self.steps,
                "tensors": self.tensors, "chunks": self.chunks, "bytes": self.bytes,
                "problems": [p.to_dict() for p in self.problems], "partial": self.partial,
                "orphans": self.orphans}


class _Verifier:
    def __init__(self, backend: Backend, report: VerifyReport, progress: Progress | None) -> None:
        self.b = backend
        self.r = report
        self.progress = progress
        self.seen: dict[tuple[Any, ...], str | None] = {}  # (chunk key, crc, sha256) -> error or None
        self.seen_arrays: dict[str, str | None] = {}  # array path -> error of its zarr.json or None
        #: Chunk files referenced by the steps checked (gc.entry_chunks: the
        #: same definition gc keeps by), so both count the same chunks.
        self.referenced: set[tuple[str, int, tuple[int, ...]]] = set()
        #: Packs referenced by the steps checked (gc.entry_packs), and their ranges.
        self.referenced_packs: set[str] = set()
        self.arrays: set[str] = set()  # arrays of the entries checked (empty tensors' included)
        self.ranges: set[tuple[str, int]] = set()
        self.run: Any = None  # a RunIndex, made for the first predictive chunk: its chain reader

    def problem(self, branch: str, step: int | None, tensor: str | None, kind: str, msg: str) -> None:
        self.r.problems.append(Problem(branch, step, tensor, kind, msg))

    def file(self, branch: str, step: int, where: str, fname: str, commit: dict[str, Any]) -> bytes | None:
        rec = commit["files"][fname]
        try:  # never more than the commit records (a hostile file may be huge)
            data = self.b.get(f"{where}/{fname}", max_bytes=rec["size"])
        except (OSError, DsttError) as exc:
            self.problem(branch, step, None, fname.split(".")[0], f"{fname} is unreadable ({exc})")
            return None
        if data is None:
            self.problem(branch, step, None, fname.split(".")[0], f"{fname} is missing")
            return None
        if len(data) != rec["size"]:
            self.problem(branch, step, None, fname.split(".")[0],
                         f"{fname} has {len(data)} bytes, the commit records {rec['size']} (truncated or altered)")
            return None
        if sha256_hex(data) != rec["sha256"]:
            self.problem(branch, step, None, fname.split(".")[0], f"{fname} sha256 does not match the commit record")
            return None
        return data

    def load_step(self, branch: str, step: int) -> list[TensorEntry] | None:
        where = L.step_dir(branch, step)
        try:
            raw = self.b.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
            if raw is None:
                raise StepNotFoundError(f"{where}: commit.json disappeared")
            commit = parse_commit(raw, where)
        except DsttError as e:
            self.problem(branch, step, None, "commit", str(e))
            return None
        files = {f: self.file(branch, step, where, f, commit) for f in (L.INDEX_FILE, L.NAMES_FILE, L.STATS_FILE)}
        index_data = files[L.INDEX_FILE]
        if index_data is None:
            return None
        try:
            entries, objects = parse_index(index_data, where)
        except DsttError as e:
            self.problem(branch, step, None, "index", str(e))
            return None
        self.check_side_files(branch, step, where, entries, files)
        names = {e.name for e in entries}
        for ref in sorted(set(tree_refs(objects)) - names):
            self.problem(branch, step, ref, "tree", "the value tree refers to a tensor missing from the index")
        if commit.get("n_tensors") != len(entries):
            self.problem(branch, step, None, "commit",
                         f"commit records {commit.get('n_tensors')} tensors, the index has {len(entries)}")
        return entries

    def check_side_files(self, branch: str, step: int, where: str, entries: list[TensorEntry],
                         files: dict[str, bytes | None]) -> None:
        names_data, stats_data = files[L.NAMES_FILE], files[L.STATS_FILE]
        if names_data is not None:
            try:
                if parse_names(names_data, where) != [e.name for e in entries]:
                    self.problem(branch, step, None, "names", "names.json does not match index.json")
            except DsttError as e:
                self.problem(branch, step, None, "names", str(e))
        if stats_data is not None:
            try:
                decode_stats(stats_data, len(entries), where)
            except DsttError as e:
                self.problem(branch, step, None, "stats", str(e))

    @staticmethod
    def cache_key(e: TensorEntry, i: int) -> tuple[Any, ...]:
        """What makes two chunk checks the same check (read once)."""
        packed = packed_key_of(e, i)
        if packed is not None:
            rng = e.pack(i)
            return (packed, rng, e.crcs[i], e.sha256[i], e.codec, e.dtype.itemsize * _prod(e.chunk_shape))
        return (L.chunk_key(e.array, e.slots[i], e.coords(i)), e.keyframe(i), e.crcs[i], e.sha256[i])

    def pred_chunk(self, branch: str, step: int, e: TensorEntry, i: int) -> str | None:
        """The error of predictive chunk i of a tensor, or None: its stored
        residual read and checked, then the chunk decoded through its chain
        end to end (each link checked against its step's index; a failure
        names the link) and compared with the index's CRC-32C and sha256."""
        if self.run is None:
            from dstt.format.index import RunIndex

            self.run = RunIndex(self.b, cache_steps=64)
        p = e.pack(i)
        if p is not None:
            self.ranges.add((pack_key(e.slots[i], p.rank, p.n), p.offset))
            self.r.bytes += p.length
        try:
            self.run.chains.chunk(branch, step, e, i, sha256=True)
        except (OSError, DsttError) as exc:
            return str(exc)
        return None

    def chunk(self, e: TensorEntry, i: int) -> str | None:
        """The error of chunk i of a tensor, or None; cached by key and checksums."""
        packed = packed_key_of(e, i)
        if packed is not None:
            rng = e.pack(i)
            assert rng is not None  # packed_key_of says so
            self.ranges.add((packed, rng.offset))
        cache_key = self.cache_key(e, i)
        if cache_key not in self.seen:
            if packed is not None:
                self.seen[cache_key] = self._read_packed(e, i)
            else:
                self.seen[cache_key] = self._read_chunk(e, i, cache_key[0], e.coords(i))
        return self.seen[cache_key]

    def _read_packed(self, e: TensorEntry, i: int) -> str | None:
        """A packed chunk: its range read and checked (dstt.format.chunks.read_chunk)."""
        try:
            read_chunk(self.b, e, i, sha256=True)
        except (OSError, DsttError) as exc:
            return str(exc)
        rng = e.pack(i)
        self.r.bytes += 0 if rng is None else rng.length
        return None

    def _read_chunk(self, e: TensorEntry, i: int, key: str, coords: tuple[int, ...]) -> str | None:
        if e.keyframe(i) is not None:  # a delta and its keyframe (docs/format.md "Delta chunks")
            try:
                read_delta(self.b, e, i, sha256=True)
            except (OSError, DsttError) as exc:
                return str(exc)
            return None
        where = f"chunk {coords} (slot {e.slots[i]}, {key})"
        try:
            data = self.b.get(key, max_bytes=max_stored_bytes(e.codec, e.dtype.itemsize * _prod(e.chunk_shape)))
        except (OSError, DsttError) as exc:
            return f"{where}: unreadable ({exc})"
        if data is None:
            return f"{where}: missing"
        self.r.bytes += len(data)
        expected = e.dtype.itemsize * _prod(e.chunk_shape)
        try:  # trailer CRC-32C, size, the index's CRC-32C and sha256 (dstt.format.chunks)
            check_chunk(data, e.codec, expected, where, crc=e.crcs[i], sha256=e.sha256[i])
        except DsttError as exc:
            return str(exc)
        return None

    def array_doc(self, e: TensorEntry) -> str | None:
        """The error of a tensor's array ``zarr.json``, or None; checked once per array.

        dstt itself never reads it, but plain zarr-python needs it to read the
        chunks (docs/format.md), and its bytes are fully determined by the
        index entry: exactly what the writer renders (``array_metadata``).
        """
        # The delta array's document matters only to entries with delta chunks
        # (gc removes a delta array no kept step has a chunk in).
        if e.packs is not None and all(p is not None for p in e.packs):
            return None  # every chunk in packs: no zarr array (docs/format.md "Packs")
        uses_delta = e.delta_array is not None and (
            any(k is not None for k in e.keyframes or [])
            or (e.pred is not None and any(c is not None and e.pack(i) is None for i, c in enumerate(e.pred.chunks))))
        cache = f"{e.array}{L.DELTA_SUFFIX}" if uses_delta else e.array
        if cache not in self.seen_arrays:
            docs = [(e.array, array_metadata(e.dtype, e.shape, e.chunk_shape, e.codec, e.name))]
            if uses_delta and e.delta_array is not None:
                docs.append((e.delta_array, delta_array_metadata(e.dtype, e.shape, e.chunk_shape, e.name)))
            err: str | None = None
            for path, want in docs:
                key = f"{path}/zarr.json"
                try:
                    data = self.b.get(key, max_bytes=len(want))
                except (OSError, DsttError) as exc:
                    err = f"array metadata {key}: unreadable ({exc})"
                else:
                    err = (f"array metadata {key} is missing" if data is None else
                           None if data == want else f"array metadata {key} is damaged (not what the index describes)")
                if err is not None:
                    break
            self.seen_arrays[cache] = err
        return self.seen_arrays[cache]

    def tensor(self, branch: str, step: int, e: TensorEntry) -> None:
        self.r.tensors += 1
        self.referenced.update(entry_chunks(e))
        self.referenced_packs.update(entry_packs(e))
        self.arrays.add(e.array)
        err = self.array_doc(e)
        if err is not None:
            self.problem(branch, step, e.name, "array", err)
        for i in range(e.nchunks):
            coded = e.pred is not None and e.pred.chunks[i] is not None
            err = self.pred_chunk(branch, step, e, i) if coded else self.chunk(e, i)
            if err is not None:
                kind = "chunk" if err.endswith("missing") or "unreadable" in err else "checksum"
                self.problem(branch, step, e.name, kind, err)
        if tensor_checksum(e.crcs) != e.checksum:
            self.problem(branch, step, e.name, "checksum", "tensor checksum does not match its chunk CRC-32Cs")


#: Bytes of chunks fetched ahead at once on object stores (see _prefetched_groups).
PREFETCH_BYTES = 64 << 20


def _prefetched_groups(v: _Verifier, entries: list[TensorEntry]) -> Iterator[list[TensorEntry]]:
    """``entries`` in groups of about PREFETCH_BYTES; on backends that can
    (object stores: ``prefetch``), each group's unchecked chunks are fetched
    concurrently before it is checked, instead of one request at a time."""
    prefetch = getattr(v.b, "prefetch", None)
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if size >= PREFETCH_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    for group in groups:
        if prefetch is not None and group:
            prefetch([key for x in group for i in range(x.nchunks)
                      if x.keyframe(i) is None and x.pack(i) is None and (x.pred is None or x.pred.chunks[i] is None)
                      for key in (L.chunk_key(x.array, x.slots[i], x.coords(i)),)
                      if (key, None, x.crcs[i], x.sha256[i]) not in v.seen])
        yield group


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def partial_steps(backend: Backend, branch: str) -> list[int]:
    """Step directories of ``branch`` with no commit marker (left by a crash)."""
    prefix = L.steps_prefix(branch).rstrip("/")
    out = []
    for d in backend.list_dir(prefix):
        if d.isdigit() and len(d) == L.STEP_DIGITS and not backend.exists(f"{prefix}/{d}/{L.COMMIT_FILE}"):
            out.append(int(d))
    return sorted(out)


def verify(store: Any, branch: str | None = None, step: int | str | None = None,
           *, progress: Progress | None = None, executor: Any = None, workers: int | None = None) -> VerifyReport:
    """Verify ``store`` (a path, URL, Backend or ``STORE[@BRANCH][:STEP]``
    reference): every committed step of every branch, or only ``branch``,
    or only one ``step`` of it. Problems are collected, never raised; errors
    that prevent opening the store at all (not a store, unknown branch or
    step) are raised as DsttError.
    """
    from dstt.format.refs import Ref, resolve_step

    if isinstance(store, (str, os.PathLike)):
        ref = Ref.parse(os.fspath(store))
        store, branch, step = ref.store, branch or ref.branch, step if step is not None else ref.step
    backend = open_backend(store, create=False)
    check_root(backend)
    report = VerifyReport(backend.url)
    if step is not None and branch is None:
        branch = "main"
    branches = [branch] if branch is not None else list_branches(backend)
    plan: list[tuple[str, int]] = []
    for b in branches:
        load_branch(backend, b)
        if step is not None:
            from dstt.format.index import RunIndex

            plan.append(resolve_step(RunIndex(backend), b, step))
        else:
            plan.extend((b, s) for s in committed_steps(backend, b))
            report.partial.extend(f"{b}:{s}" for s in partial_steps(backend, b))
    report.branches = branches
    v = _Verifier(backend, report, progress)
    loaded = []
    for b, s in plan:
        entries = v.load_step(b, s)
        report.steps += 1
        if entries is not None:
            loaded.append((b, s, entries))
    _check_chunks_on_executor(v, loaded, executor, workers, progress)
    total = sum(len(es) for _, _, es in loaded)
    done = 0
    for b, s, entries in loaded:
        for group in _prefetched_groups(v, entries):
            for e in group:
                v.tensor(b, s, e)
                done += 1
                if progress is not None:
                    progress(done, total, f"{b}:{s}")
    report.chunks = len(v.referenced) + len(v.ranges)
    if branch is None and step is None and len(loaded) == len(plan):
        report.orphans = _orphans(backend, v.referenced, v.referenced_packs, v.arrays)
    return report


def _check_chunks_on_executor(v: _Verifier, loaded: list[tuple[str, int, list[TensorEntry]]], executor: Any,
                              workers: int | None, progress: Progress | None) -> None:
    """Check every distinct chunk of the loaded steps as tasks (each chunk
    once: the same definition as :meth:`_Verifier.chunk`), filling
    ``v.seen`` so that the per-tensor pass that follows reads nothing but
    the predictive chunks: those are left to it, each decoded through its
    chain by :meth:`_Verifier.pred_chunk` (its stored residual alone does
    not match the index's checksums of the decoded chunk)."""
    work: dict[tuple[Any, ...], tuple[TensorEntry, int]] = {}
    for _, _, entries in loaded:
        for e in entries:
            for i in range(e.nchunks):
                if e.pred is None or e.pred.chunks[i] is None:
                    work.setdefault(v.cache_key(e, i), (e, i))
    if not work:
        return
    items = list(work.values())
    sizes = [e.dtype.itemsize * _prod(e.chunk_shape) for e, _ in items]
    spec = StoreSpec.of(v.b)
    with scan_executor(executor, workers, total_bytes=sum(sizes), n_tasks=len(items),
                       portable=spec is not None) as place:
        if place.executor is None:
            return  # the per-tensor pass reads them here
        assert spec is not None
        groups = groups_by_bytes(sizes, min_groups=4 * max(1, place.inflight // 4))
        payloads = [(spec, _by_entry([items[k] for k in g])) for g in groups]
        weights = [sum(sizes[k] for k in g) for g in groups]
        total, done = sum(weights), 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total, "chunks")

        for results in run_placed(place, check_chunks, payloads, weights, tick):
            for key, err, nbytes in results:
                v.seen[key] = err
                v.r.bytes += nbytes


def _by_entry(items: list[tuple[TensorEntry, int]]) -> list[tuple[TensorEntry, list[int]]]:
    """(entry, chunk indices) pairs, consecutive chunks of one entry together (each entry pickled once)."""
    out: list[tuple[TensorEntry, list[int]]] = []
    for e, i in items:
        if out and out[-1][0] is e:
            out[-1][1].append(i)
        else:
            out.append((e, [i]))
    return out


def _open_backend(url: str, storage_options: dict[str, Any] | None = None) -> Backend:
    return open_backend(url, create=False, storage_options=storage_options)


def check_chunks(spec: StoreSpec, items: list[tuple[TensorEntry, list[int]]]
                 ) -> list[tuple[tuple[Any, ...], str | None, int]]:
    """A task of a verify scan (runs in a worker): (check key, error or
    None, bytes read) of each chunk, checked exactly as :meth:`_Verifier.chunk`."""
    backend = opened(spec, _open_backend)
    v = _Verifier(backend, VerifyReport(spec.url), None)
    out = []
    for e, indices in items:
        for i in indices:
            before = v.r.bytes
            err = v.chunk(e, i)
            out.append((v.cache_key(e, i), err, v.r.bytes - before))
    return out


def _orphans(backend: Backend, referenced: set[tuple[str, int, tuple[int, ...]]],
             packs: set[str] | None = None, entry_arrays: set[str] | None = None) -> dict[str, int]:
    """Chunk files and arrays under tensors/, and packs, that no committed
    step references (an unreferenced pack counts as a chunk)."""
    from dstt.format.gc import array_of, parse_chunk_key

    live_arrays = {a for a, _, _ in referenced} | (entry_arrays or set())
    out = {"chunks": 0, "arrays": 0, "bytes": 0}
    arrays: set[str] = set()
    for key in backend.list_prefix(L.TENSORS):
        array = array_of(key)
        if array is None:
            continue
        parsed = parse_chunk_key(key)
        orphan = array not in live_arrays if parsed is None else parsed not in referenced
        if orphan:
            out["chunks"] += parsed is not None
            out["bytes"] += backend.size(key) or 0
            if array not in live_arrays:
                arrays.add(array)
    out["arrays"] = len(arrays)
    for key in backend.list_prefix(PACKS):
        if parse_pack_key(key) is not None and key not in (packs or set()):
            out["chunks"] += 1
            out["bytes"] += backend.size(key) or 0
    return out


__all__ = ["verify", "VerifyReport", "Problem", "partial_steps", "tree_refs"]
