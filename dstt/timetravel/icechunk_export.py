"""Publish chosen steps as an Icechunk repository: ``dstt export REF...
--format icechunk OUT`` (:func:`export_icechunk`; ``pip install
'dstt[icechunk]'``), for teams that share runs through Icechunk.

One Icechunk commit per step, holding the state at that step: every tensor
its own Zarr array at its name, chunked as dstt chunks it (no step axis:
Icechunk's history is the step axis). Icechunk branches mirror dstt's (a
branch starts at the commit of its parent's fork step), and every step's
commit is tagged ``<branch>.<step>``, so ``repo.readonly_session(tag=
"main.1200")`` opens step 1200. A chunk dstt stored as unchanged since the
previous step exported on that branch (the same chunk referenced, not
rewritten) is not written again: Icechunk keeps the previous one.

Exporting into an existing repository adds the steps not yet tagged (a
later export of a branch forked from an exported step continues from it).
Chunks are read and decoded as scan tasks (:mod:`dstt.format.scan`) and
written by this process into the step's session, which is then committed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dstt.errors import ConfigError

if TYPE_CHECKING:
    from dstt.format.index import RunIndex
    from dstt.format.manifest import TensorEntry


@dataclass
class IcechunkExportInfo:
    """What :func:`export_icechunk` committed (``tags``: one per step committed now)."""

    path: str
    format: str
    tags: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already in the repository
    chunks_written: int = 0
    chunks_kept: int = 0  # unchanged since the branch's previous step: not rewritten

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _require() -> Any:
    try:
        import icechunk
    except ImportError:
        raise ConfigError("exporting to Icechunk needs icechunk: pip install 'dstt[icechunk]'") from None
    return icechunk


def tag_of(branch: str, step: int) -> str:
    return f"{branch}.{step}"


def read_chunks(spec: Any, items: list[tuple[str, str, int, tuple[int, ...], tuple[int, ...]]]) -> list[np.ndarray]:
    """A task of an Icechunk export (runs in a worker): each box, decoded."""
    from dstt.format.index import RunIndex
    from dstt.format.scan import opened

    return _read(opened(spec, RunIndex), items)


def _read(run: "RunIndex", items: list[tuple[str, str, int, tuple[int, ...], tuple[int, ...]]]) -> list[np.ndarray]:
    out = []
    for name, b, s, off, shape in items:
        region = tuple(slice(o, o + m) for o, m in zip(off, shape))
        out.append(run.read_array(name, s, branch=b, index=region if region else None))
    return out


def _same_chunk(a: "TensorEntry | None", e: "TensorEntry", i: int) -> bool:
    """Is chunk ``i`` of ``e`` the very chunk ``a`` holds (referenced, not rewritten)?"""
    return (a is not None and a.shape == e.shape and a.dtype == e.dtype and a.chunk_shape == e.chunk_shape
            and a.array == e.array and a.slots[i] == e.slots[i] and a.crcs[i] == e.crcs[i]
            and a.keyframe(i) == e.keyframe(i) and a.pack(i) == e.pack(i))


def _branch_base(repo: Any, run: "RunIndex", branch: str) -> tuple[Any, int | None]:
    """Create Icechunk branch ``branch`` at its dstt fork point's commit,
    if missing; (its head's dstt step, as recorded, or None)."""
    if branch in set(repo.list_branches()):
        snap = repo.lookup_branch(branch)
        return snap, _head_step(repo, branch)
    info = run.branch_info(branch)
    if info.parent is None:
        raise ConfigError(f"the Icechunk repository has no branch {branch!r}")
    pb, ps = info.parent
    tags = set(repo.list_tags())
    base = max((int(t.rsplit(".", 1)[1]) for t in tags if t.rsplit(".", 1)[0] == pb
                and t.rsplit(".", 1)[1].isdigit() and int(t.rsplit(".", 1)[1]) <= ps), default=None)
    if base is None:
        raise ConfigError(f"branch {branch!r} forks from {pb}:{ps}: export a step of {pb!r} at or before "
                          f"{ps} first (or choose steps from the start of its lineage)")
    snap = repo.lookup_tag(tag_of(pb, base))
    repo.create_branch(branch, snap)
    return snap, base


def _head_step(repo: Any, branch: str) -> int | None:
    import zarr

    try:
        g = zarr.open_group(repo.readonly_session(branch=branch).store, mode="r")
    except zarr.errors.GroupNotFoundError:  # a new repository: nothing committed yet
        return None
    step = g.attrs.get("dstt_step")
    return step if isinstance(step, int) else None


def export_icechunk(store: Any, out: str | os.PathLike[str], steps: Any = None, branch: str | None = None, *,
                    points: list[tuple[str | None, Any]] | None = None, names: Any = None, executor: Any = None,
                    workers: int | None = None, progress: Callable[[int, int], None] | None = None,
                    storage_options: dict[str, Any] | None = None) -> IcechunkExportInfo:
    """Commit the chosen steps (as :func:`dstt.timetravel.zarr_export.export_zarr`
    chooses them) into the Icechunk repository at ``out`` (a local
    directory; created when missing), one commit and tag per step."""
    icechunk = _require()
    import zarr

    # (its warning that a local repository takes one writer at a time: this export is that one writer)
    icechunk.set_logs_filter("error")

    from dstt.analysis.select import match_names
    from dstt.format.index import RunIndex
    from dstt.timetravel.zarr_export import _points, check_not_the_store

    run = store if isinstance(store, RunIndex) else RunIndex(store, storage_options=storage_options)
    pts = _points(run, points, steps, branch)
    pats = None if names is None else ([names] if isinstance(names, str) else list(names))
    path = Path(out).absolute()
    check_not_the_store(run, path)
    storage = icechunk.local_filesystem_storage(str(path))
    repo = icechunk.Repository.open_or_create(storage)
    info = IcechunkExportInfo(os.fspath(out), "icechunk")
    heads: dict[str, int | None] = {}
    done_tags = set(repo.list_tags())
    total = sum(run.record(s, branch=b).by_name[n].nbytes for b, s in pts
                for n in match_names(run.record(s, branch=b).names, pats))
    progressed = [0]

    def tick(n: int) -> None:
        progressed[0] += n
        if progress is not None:
            progress(progressed[0], total)

    for b, s in pts:
        if tag_of(b, s) in done_tags:
            info.skipped.append(tag_of(b, s))
            heads[b] = s
            continue
        if b not in heads:
            heads[b] = _branch_base(repo, run, b)[1]
        head = heads[b]
        prev = run.record(head, branch=b) if head is not None else None  # (a step b inherited resolves)
        session = repo.writable_session(b)
        _commit_step(zarr, session, run, b, s, prev, pats, info, executor, workers, tick)
        snap = session.commit(f"dstt {b}:{s}")
        repo.create_tag(tag_of(b, s), snap)
        info.tags.append(tag_of(b, s))
        heads[b] = s
    return info


def _commit_step(zarr: Any, session: Any, run: "RunIndex", b: str, s: int, prev: Any, pats: list[str] | None,
                 info: IcechunkExportInfo, executor: Any, workers: int | None, tick: Callable[[int], None]) -> None:
    """Write step ``s`` into ``session``: arrays made or replaced as the
    step's tensors need, removed for tensors it no longer has, and every
    chunk not already there."""
    from dstt.analysis.select import match_names
    from dstt.format.scan import StoreSpec, groups_by_bytes, iter_placed, scan_executor

    rec = run.record(s, branch=b)
    g = zarr.open_group(session.store, mode="a")
    wanted = match_names(rec.names, pats)
    keep = set(wanted)
    for name, node in list(g.members(max_depth=None)):
        if isinstance(node, zarr.Array) and node.attrs.get("dstt_name") not in (None, *keep):
            del g[name]
    work: list[tuple[str, str, int, tuple[int, ...], tuple[int, ...]]] = []
    sizes: list[int] = []
    for n in wanted:
        e = rec.by_name[n]
        old = prev.by_name.get(n) if prev is not None else None
        same_array = old is not None and old.shape == e.shape and old.dtype == e.dtype and old.chunk_shape == e.chunk_shape
        if not same_array or n not in g:
            g.create_array(n, shape=e.shape, chunks=tuple(max(1, c) for c in e.chunk_shape),
                           dtype=e.dtype.storage, fill_value=0, overwrite=True,
                           attributes={"dtype": e.dtype.logical, "dstt_name": n})
            old = None
        grid = e.chunk_grid
        for i in range(e.nchunks):
            if _same_chunk(old, e, i):
                info.chunks_kept += 1
                tick(grid.valid_numel(i) * e.dtype.itemsize)
                continue
            off, shape = grid.box(grid.coords(i))
            work.append((n, rec.branch, rec.step, off, shape))
            sizes.append(grid.valid_numel(i) * e.dtype.itemsize)
    g.attrs.update({"dstt_store": run.url, "dstt_branch": b, "dstt_step": s})
    groups = groups_by_bytes(sizes)
    spec = StoreSpec.of(run)
    weights = [sum(sizes[x] for x in grp) for grp in groups]
    with scan_executor(executor, workers, total_bytes=sum(sizes), n_tasks=len(groups),
                       portable=spec is not None) as place:
        fn = read_chunks if place.executor is not None else (lambda _spec, items: _read(run, items))
        payloads = [(spec, [work[x] for x in grp]) for grp in groups]
        for k, arrays in iter_placed(place, fn, payloads, weights, tick):
            for (n, _, _, off, shape), data in zip(payloads[k][1], arrays):
                region = tuple(slice(o, o + m) for o, m in zip(off, shape))
                g[n][region if region else ...] = data
                info.chunks_written += 1


__all__ = ["export_icechunk", "IcechunkExportInfo", "tag_of"]
