"""Export chosen steps as a plain Zarr v3 group: ``dstt export REF...
--format zarr OUT`` (:func:`export_zarr`).

What an outside tool can open alone (zarr-python, xarray, any Zarr v3
reader), with none of dstt's coding left: every tensor is its own array at
its name (``model/layers.0.weight`` is array ``layers.0.weight`` of group
``model``), packed and delta-coded ones included, with the step as the
leading axis and chunked ``(1, *dstt's chunk shape)``. Its
``dimension_names`` are ``("step", "<leaf>.0", ...)``, and every group that
holds tensors also holds ``step`` (the step numbers) and ``time`` (commit
times, seconds since the epoch) arrays, so ``xarray.open_zarr(OUT,
group="model")`` gives a Dataset indexed by step. bfloat16 and float8 are
stored as the unsigned integers holding their bits, as dstt stores them
(attribute ``dtype`` names the logical one). Group attributes record the
store, and per step its branch.

Each output chunk is written by one scan task (:mod:`dstt.format.scan`:
local processes by default, or any executor; the output directory must be
reachable by the workers), reading exactly the stored chunks it covers.
The group is written under a temporary name next to ``OUT`` and renamed
into place when complete: an interrupted or failed export leaves nothing.

>>> import tempfile, torch, zarr, dstt
>>> d = tempfile.mkdtemp()
>>> for s in range(2):
...     _ = dstt.save(d + "/run", s, {"model": {"w": torch.full((2,), float(s))}})
>>> info = export_zarr(d + "/run", d + "/out.zarr")
>>> zarr.open_group(d + "/out.zarr", mode="r")["model/w"][:].tolist(), info.steps
([[0.0, 0.0], [1.0, 1.0]], [0, 1])
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from dstt.errors import ConfigError

if TYPE_CHECKING:
    from dstt.format.index import RunIndex
    from dstt.format.manifest import TensorEntry

#: Names of the coordinate arrays written into every group holding tensors.
COORDS = ("step", "time")


@dataclass
class ZarrExportInfo:
    """What :func:`export_zarr` wrote."""

    path: str
    format: str
    steps: list[int]
    branches: list[str]
    n_tensors: int
    nbytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _points(run: "RunIndex", points: Any, steps: Any, branch: str | None) -> list[tuple[str, int]]:
    if points is not None:
        out = [run.resolve(s, branch=b) for b, s in points]
        return [(r.branch, r.step) for r in out]
    from dstt.analysis.select import lineage_points

    return lineage_points(run, steps, branch)


def _plan(run: "RunIndex", pts: list[tuple[str, int]], patterns: list[str] | None,
          notes: list[str]) -> dict[str, tuple["TensorEntry", list[int]]]:
    """Tensor -> (its entry at the first step holding it, indices of the
    steps holding it with that shape and dtype), in first-seen order."""
    from dstt.analysis.select import match_names

    plan: dict[str, tuple[TensorEntry, list[int]]] = {}
    changed: set[str] = set()
    for k, (b, s) in enumerate(pts):
        rec = run.record(s, branch=b)
        for n in match_names(rec.names, patterns):
            e = rec.by_name[n]
            got = plan.get(n)
            if got is None:
                plan[n] = (e, [k])
            elif got[0].shape == e.shape and got[0].dtype == e.dtype:
                got[1].append(k)
            else:
                changed.add(n)
    for n in sorted(changed):
        notes.append(f"{n}: its shape or dtype changes between the steps; written only where it matches "
                     f"step {pts[plan[n][1][0]][1]} (other steps hold the fill value 0)")
    for n, (_, ks) in plan.items():
        if len(ks) < len(pts) and n not in changed:
            notes.append(f"{n}: present at {len(ks)} of {len(pts)} steps (the others hold the fill value 0)")
    return plan


def export_zarr(store: Any, out: str | os.PathLike[str], steps: Any = None, branch: str | None = None, *,
                points: list[tuple[str | None, Any]] | None = None, names: Any = None, overwrite: bool = False,
                executor: Any = None, workers: int | None = None, progress: Callable[[int, int], None] | None = None,
                storage_options: dict[str, Any] | None = None, compression: str = "zstd") -> ZarrExportInfo:
    """Write the tensors matching ``names`` (globs; all by default) at the
    chosen steps -- ``points`` (``(branch, step)`` pairs, steps as any
    reference accepts) or ``steps`` of ``branch``'s lineage (None: all, a
    list, a ``range`` or a ``slice``) -- as a Zarr v3 group at ``out``
    (a local directory). ``progress(done_bytes, total_bytes)``.
    ``compression``: ``"zstd"`` (zarr-python's default codec) or ``"none"``."""
    from dstt.format.index import RunIndex
    from dstt.format.outpath import temp_path
    from dstt.format.scan import StoreSpec, groups_by_bytes, run_tasks

    try:
        import zarr
    except ImportError:  # pragma: no cover - a dependency of dstt
        raise ConfigError("exporting to zarr needs zarr-python") from None
    if compression not in ("zstd", "none"):
        raise ConfigError(f"compression must be 'zstd' or 'none', got {compression!r}")
    out_path = Path(out).absolute()
    if out_path.exists() and not overwrite:
        raise ConfigError(f"cannot export to {os.fspath(out)!r}: it exists (pass overwrite to replace it)")
    if not out_path.parent.is_dir() or not os.access(out_path.parent, os.W_OK):
        raise ConfigError(f"cannot export to {os.fspath(out)!r}: {out_path.parent} is not a writable directory")
    run = store if isinstance(store, RunIndex) else RunIndex(store, storage_options=storage_options)
    check_not_the_store(run, out_path)
    pts = _points(run, points, steps, branch)
    pats = None if names is None else ([names] if isinstance(names, str) else list(names))
    notes: list[str] = []
    plan = _plan(run, pts, pats, notes)
    if not plan:
        raise ConfigError(f"no tensor matches {pats!r} at the steps chosen")
    tmp = temp_path(out_path)
    try:
        tasks = _create(zarr, tmp, run, pts, plan, None if compression == "none" else "auto")
        spec = StoreSpec.of(run)
        sizes = [t[-1] for t in tasks]
        groups = groups_by_bytes(sizes, min_groups=16)
        payloads = [(spec, tmp, [tasks[x][:-1] for x in g]) for g in groups]
        total, done = sum(sizes), 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        if spec is None:  # a store only this process can open
            for p, g in zip(payloads, groups):
                _write(run, tmp, p[2])
                tick(sum(sizes[x] for x in g))
        else:
            run_tasks(write_chunks, payloads, executor=executor, workers=workers,
                      weights=[sum(sizes[x] for x in g) for g in groups], progress=tick)
        _consolidate(zarr, tmp)
        if out_path.exists():
            shutil.rmtree(out_path) if out_path.is_dir() else out_path.unlink()
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return ZarrExportInfo(os.fspath(out), "zarr", [s for _, s in pts], [b for b, _ in pts], len(plan),
                          sum(math_prod(e.shape) * e.dtype.itemsize * len(ks) for e, ks in plan.values()), notes)


def check_not_the_store(run: "RunIndex", out: Path) -> None:
    """Refuse an output at, inside or around the store being read (an
    ``--overwrite`` there would remove the run)."""
    if "://" in run.url:
        return
    store = Path(run.url).absolute().resolve()
    target = out.resolve()
    if target == store or store in target.parents or target in store.parents:
        raise ConfigError(f"cannot export to {os.fspath(out)!r}: it is, holds or is inside the store {run.url!r}")


def _consolidate(zarr: Any, root: str) -> None:
    """Consolidated metadata in every group (what xarray opens fastest)."""
    import warnings

    with warnings.catch_warnings():  # (zarr-python's extension to Zarr v3: it says so)
        warnings.simplefilter("ignore")
        g = zarr.open_group(root, mode="r+")
        for path, _ in [("", g), *g.groups()]:
            zarr.consolidate_metadata(root, path=path or None)


def math_prod(xs: tuple[int, ...]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _create(zarr: Any, root: str, run: "RunIndex", pts: list[tuple[str, int]],
            plan: dict[str, tuple["TensorEntry", list[int]]], compressors: Any) -> list[tuple[Any, ...]]:
    """Create the group and its arrays; the chunk writes to do: (tensor,
    branch, step, step index, box offset, box shape, bytes), a box being
    one chunk of the output (one of dstt's at the first step)."""
    g = zarr.open_group(root, mode="w-", zarr_format=3)
    g.attrs.update({"dstt_store": run.url, "dstt_branches": [b for b, _ in pts], "dstt_steps": [s for _, s in pts]})
    step_arr = np.array([s for _, s in pts], dtype=np.int64)
    times = np.array([float(run.record(s, branch=b).commit.get("time", np.nan)) for b, s in pts])
    groups_done: set[str] = set()
    tasks = []
    for n, (e, ks) in plan.items():
        parent, _, leaf = n.rpartition("/")
        if parent not in groups_done:
            groups_done.add(parent)
            here = here_names(plan, parent)
            for c, values in zip(COORDS, (step_arr, times)):
                if c not in here:
                    arr = g.create_array(f"{parent}/{c}" if parent else c, shape=values.shape, dtype=values.dtype,
                                         chunks=values.shape or (1,), dimension_names=("step",))
                    arr[...] = values
        chunks = (1, *(max(1, c) for c in e.chunk_shape))
        g.create_array(n, shape=(len(pts), *e.shape), chunks=chunks, dtype=e.dtype.storage, fill_value=0,
                       compressors=compressors,
                       dimension_names=("step", *(f"{leaf}.{k}" for k in range(len(e.shape)))),
                       attributes={"dtype": e.dtype.logical, "dstt_name": n,
                                   **({} if "time" in here_names(plan, parent) else {"coordinates": "time"})})
        grid = e.chunk_grid
        for k in ks:
            b, s = pts[k]
            for i in range(e.nchunks):
                off, shape = grid.box(grid.coords(i))
                tasks.append((n, b, s, k, off, shape, grid.valid_numel(i) * e.dtype.itemsize))
    return tasks


def here_names(plan: dict[str, Any], parent: str) -> set[str]:
    """Leaf names of the tensors in group ``parent``."""
    return {x.rsplit("/", 1)[-1] for x in plan if x.rpartition("/")[0] == parent}


_OUT: dict[tuple[str, str], Any] = {}


def write_chunks(spec: Any, root: str, items: list[tuple[Any, ...]]) -> int:
    """A task of a zarr export (runs in a worker): read and write each chunk; bytes written."""
    from dstt.format.index import RunIndex
    from dstt.format.scan import opened

    return _write(opened(spec, RunIndex), root, items)


def _write(run: "RunIndex", root: str, items: list[tuple[Any, ...]]) -> int:
    import zarr

    n = 0
    for name, b, s, k, off, shape in items:
        arr = _OUT.get((root, name))
        if arr is None:
            if len(_OUT) > 256:
                _OUT.clear()
            arr = _OUT[root, name] = zarr.open_array(root, path=name, mode="r+")
        region = tuple(slice(o, o + m) for o, m in zip(off, shape))
        data = run.read_array(name, s, branch=b, index=region if region else None)
        arr[(k,) + region] = data
        n += data.nbytes
    return n


__all__ = ["export_zarr", "ZarrExportInfo"]
