"""Retention: ``prune`` removes steps, ``gc`` removes the data nothing uses.

Rules (docs/timetravel.md):

* ``prune`` keeps, on each branch it prunes, the latest step, the last
  ``keep_last`` steps, every step divisible by ``keep_every``, and every step
  that is some branch's parent (fork point). A step is removed by deleting its
  ``commit.json`` first -- from then on it is invisible -- and then its
  directory. It never deletes tensor data: that is gc's job.
* ``gc`` (:func:`dstt.gc`, in api.py: it first commits what dead trainers
  left sealed in staging rings on this host or recorded by every rank in
  the store, capture/salvage.py -- without it their chunks look like a
  crash's leftovers -- then runs :func:`collect_garbage`) removes chunk
  files that no committed step of any branch references
  (a step references chunk (array, slot, coords) through its index; dedup
  makes steps, and branches, share chunks), arrays left with no referenced
  chunk, packs none of whose ranges a committed step references (a pack is
  live while any range in it is), step directories without
  ``commit.json`` (a crashed or pruned step's leftovers), and the memory
  tier's persist decisions and incident requests no helper can still need
  (:func:`dstt.format.tier.collect_records`).

Both take every branch's write lock (:func:`dstt.format.lock.acquire_all`) for
their whole run, so they refuse to run beside a live writer, and gc only
deletes chunks in the slot ranges of the branches it locked (a branch created
while gc runs is left alone).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dstt.errors import ConfigError, DsttError
from dstt.format import layout as L
from dstt.format.backends import Backend, open_backend
from dstt.format.branchops import retired_ids
from dstt.format.localio import pid_alive
from dstt.format.lock import BRANCH_SET, acquire_all
from dstt.format.packs import PACKS, pack_key, parse_pack_key
from dstt.format.root import check_root, committed_steps, list_branches, load_branch
from dstt.format.tier import collect_records


@dataclass
class PruneReport:
    """Steps ``prune`` removed (or would remove, with ``dry_run``) and kept."""

    removed: list[tuple[str, int]] = field(default_factory=list)
    kept: dict[str, list[int]] = field(default_factory=dict)
    dry_run: bool = False
    #: With ``dry_run``: per removed step, the bytes freed by removing it and
    #: then running gc (its documents, and the chunks no kept step of any
    #: branch references; a chunk several removed steps share counts once, at
    #: the first). None without ``dry_run`` (not computed).
    step_bytes: dict[tuple[str, int], int] | None = None
    #: Per branch, steps outside the policy kept because a kept step's
    #: predictive chunks are decoded from them (docs/format.md "Predictive
    #: chunks"): removing them would leave a dangling chain. Also in ``kept``.
    chained: dict[str, list[int]] = field(default_factory=dict)

    @property
    def bytes_freed(self) -> int | None:
        return None if self.step_bytes is None else sum(self.step_bytes.values())

    def to_dict(self) -> dict[str, Any]:
        sb = self.step_bytes
        return {"removed": [{"branch": b, "step": s, **({} if sb is None else {"bytes": sb.get((b, s), 0)})}
                            for b, s in self.removed],
                "kept": self.kept, "chained": self.chained, "dry_run": self.dry_run, "bytes_freed": self.bytes_freed}


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove, with ``dry_run``)."""

    chunks_removed: int = 0
    arrays_removed: int = 0
    partial_steps_removed: list[tuple[str, str]] = field(default_factory=list)
    bytes_freed: int = 0
    chunks_kept: int = 0
    skipped_unlocked: int = 0  # chunks of branches created while gc ran
    #: Temporary files of atomic writes left by killed processes (a killed
    #: ``dstt branch`` in meta/branch_ids, a commit marker's temp file, ...).
    temp_files_removed: int = 0
    dry_run: bool = False
    #: Steps committed first (dry run: that would be), per branch: sealed by
    #: dead trainers in staging rings, or recorded by every rank (salvage.py).
    committed: dict[str, list[int]] = field(default_factory=dict)
    #: Per-rank records removed from committed step directories.
    records_removed: int = 0
    #: The crash incidents recorded for the runs salvaged (dry run: that
    #: would be), one per run, as ``Incident.to_dict`` (capture/crashnote.py).
    incidents: list[dict[str, Any]] = field(default_factory=list)
    #: Memory-tier records (``meta/tier/<branch>/<run>/``: persist decisions,
    #: incident requests) no helper can still need (dstt.format.tier.collect_records).
    tier_records_removed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["partial_steps_removed"] = [{"branch": b, "dir": s} for b, s in self.partial_steps_removed]
        d["committed"] = [{"branch": b, "step": s} for b, steps in self.committed.items() for s in steps]
        return d


# ----------------------------------------------------------------------------- prune


def keep_set(steps: list[int], keep_last: int | None, keep_every: int | None, protected: set[int]) -> set[int]:
    """The steps of one branch that prune keeps.

    >>> sorted(keep_set(list(range(10)), keep_last=2, keep_every=4, protected={5}))
    [0, 4, 5, 8, 9]
    """
    keep = set(protected) & set(steps)
    if steps:
        keep.add(steps[-1])
    if keep_last:
        keep.update(steps[-keep_last:])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    return keep


def branch_parents(backend: Backend) -> dict[str, set[int]]:
    """Steps that are some branch's fork point, by branch."""
    out: dict[str, set[int]] = defaultdict(set)
    for name in list_branches(backend):
        parent = load_branch(backend, name).parent
        if parent is not None:
            out[parent[0]].add(parent[1])
    return out


def prune(
    store: Any,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    branch: str | None = None,
    dry_run: bool = False,
) -> PruneReport:
    """Remove steps outside the retention policy (all branches, or ``branch``).

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> for s in range(6):
    ...     _ = dstt.save(path, s, {"w": torch.full((2,), float(s))})
    >>> prune(path, keep_last=2, keep_every=3).removed
    [('main', 1), ('main', 2)]
    >>> dstt.open(path).steps()
    [0, 3, 4, 5]
    """
    for opt, v in (("keep_last", keep_last), ("keep_every", keep_every)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{opt} must be a positive integer, got {v!r}")
    if keep_last is None and keep_every is None:
        raise ConfigError("say what to keep: --keep-last N and/or --keep-every K")
    backend = open_backend(store, create=False)
    check_root(backend)
    branches = [branch] if branch else list_branches(backend)
    for b in branches:
        load_branch(backend, b)
    report = PruneReport(dry_run=dry_run)
    # Every branch's lock and the branch-set lock: no writer runs and no
    # branch can fork from a step while it is being deleted.
    with acquire_all(backend):
        parents = branch_parents(backend)
        doomed = []
        for b in branches:
            steps = committed_steps(backend, b)
            keep = keep_set(steps, keep_last, keep_every, parents.get(b, set()))
            chained = chain_closure(backend, b, keep) - keep
            if chained:
                report.chained[b] = sorted(chained)
            keep |= chained
            report.kept[b] = sorted(keep)
            doomed += [(b, s) for s in steps if s not in keep]
        if dry_run:
            report.step_bytes = freed_bytes(backend, doomed)
        else:
            for b, s in doomed:
                remove_step(backend, b, s)
        report.removed = doomed
    return report


def chain_closure(backend: Backend, branch: str, keep: set[int]) -> set[int]:
    """The steps of ``branch`` the predictive chunks of the steps ``keep``
    are decoded from, transitively (``keep`` included): the steps each
    chunk's ``pred`` record names (``cur`` and ``prev``), theirs, and so on
    back to keyframes. Steps a branch inherited from its parent are the
    parent's to keep (a fork point is always kept, and so its chain)."""
    from dstt.format.index import RunIndex

    run = RunIndex(backend, cache_steps=1)
    seen = set(keep)
    own = set(keep)
    todo = sorted(keep)
    while todo:
        s = todo.pop()
        try:
            rec = run.record(s, branch=branch)
        except DsttError:  # a chain already broken (verify names it): nothing to keep there
            continue
        if rec.branch != branch:
            continue
        own.add(s)
        for e in rec.entries:
            if e.pred is None:
                continue
            for c in e.pred.chunks:
                if c is None:
                    continue
                for dep in (c.cur, c.prev):
                    if dep not in seen:
                        seen.add(dep)
                        todo.append(dep)
    return own


def entry_chunks(e: Any) -> Iterator[tuple[str, int, tuple[int, ...]]]:
    """(array, slot, coords) of every chunk file a tensor entry of a step
    references: its chunks, and for a delta chunk its keyframe too. The one
    definition of "referenced" that gc (what it keeps) and verify (what it
    counts and what it calls an orphan) share."""
    pred = e.pred
    for i, slot in enumerate(e.slots):
        if e.pack(i) is not None:
            continue  # in a pack: entry_packs
        if pred is not None and pred.chunks[i] is not None:  # a predictive chunk: its inputs are
            yield pred.array, slot, e.coords(i)            # kept by the steps prune keeps for it
            continue
        key = e.keyframe(i)
        if key is None:
            yield e.array, slot, e.coords(i)
        else:  # a delta chunk keeps its keyframe alive too
            yield e.delta_array or "", slot, e.coords(i)
            yield e.array, key, e.coords(i)


def entry_packs(e: Any) -> Iterator[str]:
    """Keys of the packs holding packed chunks of a tensor entry (with
    repeats): a pack is live while a committed step references any range in it."""
    if e.packs is None:
        return
    for slot, p in zip(e.slots, e.packs):
        if p is not None:
            yield pack_key(slot, p.rank, p.n)


def _step_refs(run: Any, branch: str, step: int) -> set[str]:
    """Keys of every chunk file and pack a committed step references."""
    out: set[str] = set()
    for e in run.record(step, branch=branch).entries:
        out.update(L.chunk_key(a, slot, c) for a, slot, c in entry_chunks(e))
        out.update(entry_packs(e))
    return out


def freed_bytes(backend: Backend, doomed: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Bytes each of ``doomed`` would free once removed and collected: its
    step documents and the chunks no other (kept) step of any branch uses."""
    from dstt.format.index import RunIndex

    run = RunIndex(backend, cache_steps=1)
    gone = set(doomed)
    kept: set[str] = set()
    for b in list_branches(backend):
        for s in committed_steps(backend, b):
            if (b, s) not in gone:
                kept |= _step_refs(run, b, s)
    counted: set[str] = set()
    out = {}
    for b, s in doomed:
        own = _step_refs(run, b, s) - kept - counted
        counted |= own
        docs = sum(backend.size(k) or 0 for k in backend.list_prefix(L.step_dir(b, s)))
        out[(b, s)] = docs + sum(backend.size(k) or 0 for k in own)
    return out


def remove_step(backend: Backend, branch: str, step: int) -> None:
    """Make a step invisible (commit marker first), then delete its files."""
    where = L.step_dir(branch, step)
    backend.delete(f"{where}/{L.COMMIT_FILE}")
    backend.sync()
    backend.delete_prefix(where)


# ----------------------------------------------------------------------------- gc


def referenced_chunks(backend: Backend, branches: list[str]) -> dict[str, set[tuple[int, tuple[int, ...]]]]:
    """(slot, chunk coords) referenced per array by every committed step;
    under the key ``PACKS``: (slot, (rank, n)) of every referenced pack."""
    from dstt.format.index import RunIndex

    run = RunIndex(backend, cache_steps=1)
    refs: dict[str, set[tuple[int, tuple[int, ...]]]] = defaultdict(set)
    for b in branches:
        for s in committed_steps(backend, b):
            for e in run.record(s, branch=b).entries:
                # An array is live while a step has an entry for it, even one
                # with no chunk (an empty tensor): its zarr.json stays.
                refs.setdefault(e.array, set())
                for array, slot, coords in entry_chunks(e):
                    refs[array].add((slot, coords))
                if e.packs is not None:
                    refs[PACKS].update((slot, (p.rank, p.n)) for slot, p in zip(e.slots, e.packs) if p is not None)
    return refs


def parse_chunk_key(key: str) -> tuple[str, int, tuple[int, ...]] | None:
    """(array, slot, coords) of a chunk key; None for anything else."""
    parts = key.split("/")
    for i, p in enumerate(parts):
        if p.startswith("@"):
            rest = parts[i + 1:]
            fields = rest[0].split(L.CHUNK_SEPARATOR) if len(rest) == 1 else []
            if len(fields) >= 2 and fields[0] == "c" and all(x.isdigit() for x in fields[1:]):
                return "/".join(parts[: i + 1]), int(fields[1]), tuple(int(x) for x in fields[2:])
            return None
    return None


def array_of(key: str) -> str | None:
    parts = key.split("/")
    for i, p in enumerate(parts):
        if p.startswith("@"):
            return "/".join(parts[: i + 1])
    return None


def collect_garbage(store: Any, *, dry_run: bool = False, progress: Callable[[str], None] | None = None
                    ) -> GcReport:
    """Remove unreferenced chunks and arrays and uncommitted step
    directories: gc's second half, alone. Call :func:`dstt.gc` (what ``dstt
    gc`` runs), which first commits what dead trainers left sealed or
    recorded (capture/salvage.py): alone, this takes a step every rank
    recorded, not yet committed, for a crash's leftovers and deletes it.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> for s in range(3):
    ...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s))})
    >>> _ = prune(path, keep_last=1)
    >>> collect_garbage(path).chunks_removed
    2
    """
    backend = open_backend(store, create=False)
    check_root(backend)
    report = GcReport(dry_run=dry_run)
    with acquire_all(backend) as locks:
        branches = [lk.branch for lk in locks if lk.branch != BRANCH_SET]
        # (and deleted branches' ids: no writer adds chunks in their slots; format/branchops.py)
        locked_ids = {load_branch(backend, b).id for b in branches} | retired_ids(backend)
        for b in branches:
            _collect_partial_steps(backend, b, report, dry_run)
        if progress:
            progress("reading step indexes")
        refs = referenced_chunks(backend, branches)
        if progress:
            progress("scanning chunks")
        # Reading every index takes a while: if a lock was broken meanwhile
        # (dstt unlock --force), a writer may be adding chunks this gc would
        # take for garbage. Stop before deleting anything more.
        for lk in locks:
            lk.check()
        _collect_chunks(backend, refs, locked_ids, report, dry_run)
        _collect_packs(backend, refs.get(PACKS, set()), locked_ids, report, dry_run)
        _collect_temp_files(backend, report, dry_run)
        _collect_tier_records(backend, branches, report, dry_run)
        if not dry_run and backend.directories:
            # still under the locks: a writer starting now could lose a directory it just made
            backend.remove_empty_dirs(L.TENSORS)
            backend.remove_empty_dirs(f"{L.META}/steps")
    return report


def _collect_tier_records(backend: Backend, branches: list[str], report: GcReport, dry_run: bool) -> None:
    """The memory tier's decisions and incident requests whose steps are
    committed (format/tier.py :func:`~dstt.format.tier.collect_records`
    says why no helper can still need them), on the locked branches."""
    for b in branches:
        n, nbytes = collect_records(backend, b, set(committed_steps(backend, b)), dry_run=dry_run)
        report.tier_records_removed += n
        report.bytes_freed += nbytes


def _collect_partial_steps(backend: Backend, branch: str, report: GcReport, dry_run: bool) -> None:
    prefix = L.steps_prefix(branch).rstrip("/")
    for d in backend.list_dir(prefix):
        if backend.exists(f"{prefix}/{d}/{L.COMMIT_FILE}"):
            continue
        keys = backend.list_prefix(f"{prefix}/{d}")
        report.bytes_freed += sum(backend.size(k) or 0 for k in keys)
        report.partial_steps_removed.append((branch, d))
        if not dry_run:
            backend.delete_prefix(f"{prefix}/{d}")


def _collect_chunks(backend: Backend, refs: dict[str, set[tuple[int, tuple[int, ...]]]], locked_ids: set[int],
                    report: GcReport, dry_run: bool) -> None:
    by_array: dict[str, list[str]] = defaultdict(list)
    for key in backend.list_prefix(L.TENSORS):
        array = array_of(key)
        if array is not None:
            by_array[array].append(key)
    for array, keys in by_array.items():
        live = refs.get(array, set())
        doomed, unlocked = [], 0
        for key in keys:
            parsed = parse_chunk_key(key)
            if parsed is None:
                continue
            _arr, slot, coords = parsed
            if (slot, coords) in live:
                report.chunks_kept += 1
            elif slot // L.SLOTS_PER_BRANCH not in locked_ids:
                unlocked += 1
            else:
                doomed.append(key)
        report.skipped_unlocked += unlocked
        # Nothing references the array: its metadata goes too -- also when it
        # has no chunk at all (a writer killed between an array's zarr.json
        # and its first chunk leaves just the document).
        whole = array not in refs and not unlocked
        if whole:
            doomed = [k for k in keys]
            report.arrays_removed += 1
        report.chunks_removed += sum(1 for k in doomed if parse_chunk_key(k) is not None)
        report.bytes_freed += sum(backend.size(k) or 0 for k in doomed)
        if dry_run:
            continue
        if whole:
            backend.delete_prefix(array)
        else:
            for k in doomed:
                backend.delete(k)


def _collect_packs(backend: Backend, live: set[tuple[int, tuple[int, ...]]], locked_ids: set[int],
                   report: GcReport, dry_run: bool) -> None:
    """Remove packs no committed step references a range of (counted as
    chunks removed), in the slot ranges of the locked branches only."""
    for key in backend.list_prefix(PACKS):
        parsed = parse_pack_key(key)
        if parsed is None:
            continue
        slot, rank, n = parsed
        if (slot, (rank, n)) in live:
            report.chunks_kept += 1
        elif slot // L.SLOTS_PER_BRANCH not in locked_ids:
            report.skipped_unlocked += 1
        else:
            report.chunks_removed += 1
            report.bytes_freed += backend.size(key) or 0
            if not dry_run:
                backend.delete(key)


#: A temporary file older than this is stale whoever made it (a writer on
#: another host included); younger ones only when their process is gone.
TEMP_STALE_AGE_S = 3600.0
#: ...and never younger than this (a process could be between creating it
#: and renaming it, on another host with a reused pid).
TEMP_MIN_AGE_S = 60.0


def is_stale_temp(name: str, age_s: float, alive: Callable[[int], bool]) -> bool:
    """Whether a file named like dstt's atomic-write temporaries
    (``<name>.tmp-<pid>-<hex>``) can be removed: older than TEMP_STALE_AGE_S,
    or older than TEMP_MIN_AGE_S with its process no longer running here.

    >>> is_stale_temp("commit.json.tmp-123-ab12cd34", 120.0, lambda pid: False)
    True
    >>> is_stale_temp("commit.json.tmp-123-ab12cd34", 120.0, lambda pid: True)
    False
    >>> is_stale_temp("commit.json", 1e9, lambda pid: False)
    False
    """
    base, sep, tail = name.rpartition(".tmp-")
    pid_text = tail.split("-", 1)[0]
    if not sep or not base or not pid_text.isdigit():
        return False
    if age_s >= TEMP_STALE_AGE_S:
        return True
    return age_s >= TEMP_MIN_AGE_S and not alive(int(pid_text))



def _collect_temp_files(backend: Backend, report: GcReport, dry_run: bool) -> None:
    """Remove stale temporaries of atomic writes (put_atomic, put_if_absent)
    anywhere in the store. Runs under every branch lock and the branch-set
    lock, so no dstt writer of this store is between its temp and its rename
    (store creation aside: the age and pid checks cover it)."""
    temp_files = getattr(backend, "temp_files", None)
    if temp_files is None:  # object stores put atomically: no temporaries
        return
    now = time.time()
    for key, mtime in temp_files():
        if is_stale_temp(key.rsplit("/", 1)[-1], now - mtime, pid_alive):
            report.temp_files_removed += 1
            report.bytes_freed += backend.size(key) or 0
            if not dry_run:
                backend.delete(key)


def leftover_records(backend: Any, branch: str, dry_run: bool) -> int:
    """Remove per-rank records (``rank-*.json``, left by a capture helper
    killed between the commit marker and their removal) from committed step
    directories; how many (gc, through dstt.capture.collect)."""
    prefix = L.steps_prefix(branch).rstrip("/")
    n = 0
    for d in backend.list_dir(prefix):
        where = f"{prefix}/{d}"
        names = backend.list_dir(where)
        if L.COMMIT_FILE not in names:
            continue  # uncommitted: gc removes the directory whole
        for name in names:
            if name.startswith("rank-") and name.endswith(".json"):
                n += 1
                if not dry_run:
                    backend.delete(f"{where}/{name}")
    return n


__all__ = ["prune", "collect_garbage", "keep_set", "entry_chunks", "entry_packs", "PruneReport", "GcReport", "remove_step", "branch_parents",
           "leftover_records"]
