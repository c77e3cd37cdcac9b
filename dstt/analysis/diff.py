"""Per-tensor difference between two points of one run or of two runs.

Metrics per tensor (A = old, B = new; sums over cache-sized blocks,
accumulated in float64 across blocks; float32 data without NaN/Inf is
differenced in float32, everything else in float64):

* ``l2_delta`` ‖B−A‖₂, ``max_abs_delta`` max|B−A|;
* ``rel_change`` ‖B−A‖₂ / ‖A‖₂ (0 when both are 0, inf when only A is 0);
* ``cosine`` A·B / (‖A‖₂‖B‖₂) (NaN when either norm is 0);
* ``frac_changed`` the fraction of elements whose *stored bits* differ.

Comparison is **bitwise**: an element is unchanged iff its bits are
identical, so a NaN that stays the same NaN is unchanged and +0.0 → −0.0 is a
change. Unchanged elements contribute exactly 0 to every delta (even NaN or
Inf ones); NaN/Inf in changed elements propagate into the metrics. When the
dtypes differ (``status: dtype_changed``) values are compared after
conversion to float64 instead, NaN equal to NaN.

Torch-free: chunks are compared as numpy arrays (bfloat16 and float8
widened exactly by :func:`dstt.format.dtypes.decode`, their bits compared
as stored), so ``dstt diff`` never imports torch.

Data is streamed chunk pair by chunk pair (or, when the two sides were
chunked differently, by aligned blocks of leading-axis rows), so memory is a
few chunks, never a tensor. A chunk whose slot and array are the same on both
sides (the store references it rather than rewrote it), or whose recorded
sha256 digests match, is known identical and never read (equal CRC-32Cs
alone prove nothing and are not used);
‖A‖ for those parts comes from the step index's stats.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, {"w": torch.tensor([3.0, 4.0]), "b": torch.zeros(2)})
>>> _ = dstt.save(path, 1, {"w": torch.tensor([3.0, 5.0]), "b": torch.zeros(2)})
>>> rows = dstt.open(path).diff(0, 1)
>>> [(r["name"], r["status"], r["l2_delta"], r["frac_changed"]) for r in rows]
[('b', 'unchanged', 0.0, 0.0), ('w', 'changed', 1.0, 0.5)]
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from dstt.analysis.select import match_names, resolve_point
from dstt.format.dtypes import DtypeInfo, decode

if TYPE_CHECKING:
    from dstt.format.index import RunIndex as Run
    from dstt.format.manifest import TensorEntry

#: A point of a run to compare: (reader with tensors, branch, step).
Point = tuple["Run", str, int]

#: Diff row keys, in output order.
DIFF_KEYS = ("name", "status", "l2_delta", "rel_change", "cosine", "max_abs_delta", "frac_changed")
#: Sortable metrics and whether "most different first" means descending.
SORT_KEYS = {"l2_delta": True, "rel_change": True, "max_abs_delta": True, "frac_changed": True,
             "cosine": False, "name": False, "status": False}
#: Elements per computation block: temporaries stay in L2 cache, so the
#: several passes per block cost little more than one.
BLOCK = 1 << 15
#: Upper bound on an aligned row block when the two sides' chunk shapes differ.
MAX_BLOCK_BYTES = 256 << 20
NAN = float("nan")

Progress = Callable[[int], None]


@dataclass
class _Acc:
    """Running sums over the changed elements of one tensor."""

    n: int = 0            # elements compared (read or known identical)
    changed: int = 0      # elements whose bits differ
    dd: float = 0.0       # Σ d², d = b − a
    ad: float = 0.0       # Σ a·d
    aa_read: float = 0.0  # Σ a² over the parts read
    n_read: int = 0       # elements read
    max_abs: float = 0.0
    nan: bool = False

    def add(self, other: "_Acc") -> None:
        self.changed += other.changed
        self.dd += other.dd
        self.ad += other.ad
        self.aa_read += other.aa_read
        self.n_read += other.n_read
        self.nan = self.nan or other.nan
        self.max_abs = max(self.max_abs, other.max_abs)


def _bits_ne(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element: do the stored bits differ? (same storage dtype, flat inputs)"""
    if a.dtype == np.bool_:
        return np.asarray(a != b)
    size = a.dtype.itemsize
    if size == 16:  # complex128: two int64 words per element
        return np.asarray((a.view(np.int64) != b.view(np.int64)).reshape(-1, 2).any(axis=1))
    ints = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[size]
    return np.asarray(a.view(ints) != b.view(ints))


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """Σ x·y without BLAS (BLAS dot may spin up its own threads): a
    cache-sized multiply and a pairwise sum, on this thread."""
    return float(np.multiply(x, y).sum(dtype=x.dtype))


#: float32 block sums of squares below this may have lost terms to underflow
#: (each lost term is < 2^-126; 2^15 of them are < 2^-111, a 2^-31 share);
#: such blocks, and any with an overflowed (non-finite) sum, are redone in float64.
F32_TINY = 2.0 ** -80


def compare_block(a: np.ndarray, b: np.ndarray, same_dtype: bool = True, finite: bool = False,
                  info_a: DtypeInfo | None = None, info_b: DtypeInfo | None = None) -> _Acc:
    """Sums of one aligned block pair (same shape; arrays of the storage
    dtypes ``info_a``/``info_b``, native when None), in sub-blocks small
    enough that the passes over them stay in cache.

    ``finite=True`` (both tensors' stats say: no NaN/Inf) takes the fast
    path: there, equal bits already give a zero difference, so no masking.
    float32 data is compared in float32 on the fast path: the difference of
    two float32 values is exact within a factor of 2 of each other (and
    correctly rounded otherwise); a sub-block whose float32 sums under- or
    overflowed is redone in float64. Sums are accumulated in float64 across
    sub-blocks.
    """
    acc = _Acc(n=a.size, n_read=a.size)
    a, b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    cplx = np.iscomplexobj(a) or np.iscomplexobj(b)
    fast = finite and same_dtype and not cplx
    f32 = fast and a.dtype == np.float32 and (info_a is None or not info_a.is_bits)
    with np.errstate(all="ignore"):  # inf - inf, NaN compares: the metrics carry them
        for lo in range(0, a.size, BLOCK):
            sa, sb = a[lo:lo + BLOCK], b[lo:lo + BLOCK]
            work = np.float32 if f32 else np.float64
            part = _sub_block(sa, sb, work, same_dtype, cplx, fast, info_a, info_b)
            if f32 and not _f32_exact_enough(part):
                part = _sub_block(sa, sb, np.float64, same_dtype, cplx, fast, info_a, info_b)
            acc.add(part)
    return acc


def _f32_exact_enough(p: _Acc) -> bool:
    """Did a float32 sub-block's sums neither underflow nor overflow?"""
    sums = (p.aa_read, p.dd, p.ad, p.max_abs) if p.changed else (p.aa_read,)
    if not all(math.isfinite(x) for x in sums) or p.nan:
        return False
    return p.aa_read >= F32_TINY and (not p.changed or p.dd >= F32_TINY)


def _sub_block(sa: np.ndarray, sb: np.ndarray, work: Any, same_dtype: bool, cplx: bool,
               fast: bool, info_a: DtypeInfo | None, info_b: DtypeInfo | None) -> _Acc:
    """Sums of one cache-sized flat sub-block pair, computed in ``work``."""
    acc = _Acc()

    def vals(t: np.ndarray, info: DtypeInfo | None) -> np.ndarray:
        v = decode(t, info) if info is not None else t
        if cplx:  # (re, im) pairs, flattened
            return np.ascontiguousarray(v.astype(np.complex128)).view(np.float64).reshape(-1)
        return v.astype(work)

    fa, fb = vals(sa, info_a), None
    if same_dtype:
        ne = _bits_ne(sa, sb)
    else:
        fb = vals(sb, info_b)
        ne = (fa != fb) & ~(np.isnan(fa) & np.isnan(fb))
        if cplx:
            ne = ne.reshape(-1, 2).any(axis=1)
    acc.aa_read = _dot(fa, fa)
    acc.changed = int(np.count_nonzero(ne))
    if acc.changed == 0:
        return acc
    fb = vals(sb, info_b) if fb is None else fb
    if fast:
        d = fb - fa
    else:
        mask = np.repeat(ne, 2) if cplx else ne
        zero = np.zeros((), dtype=fa.dtype)
        d = np.where(mask, fb - fa, zero)
        fa = np.where(mask, fa, zero)
    acc.dd = _dot(d, d)
    acc.ad = _dot(fa, d)
    if cplx:
        pairs = d.reshape(-1, 2)
        m = float(np.hypot(pairs[:, 0], pairs[:, 1]).max())
    else:
        m = max(-float(d.min()), float(d.max()))
    if m != m:
        acc.nan = True
    else:
        acc.max_abs = m
    return acc


def _metrics(acc: _Acc, norm_a: float, numel: int) -> dict[str, float]:
    """Final metrics from the sums; ``norm_a`` (index stats) fills ‖A‖ for
    the parts that were not read."""
    if acc.n_read >= numel:
        aa = acc.aa_read
    else:
        aa = max(norm_a * norm_a, acc.aa_read) if norm_a == norm_a else NAN  # skipped parts: index stats
    l2 = math.sqrt(acc.dd) if acc.dd == acc.dd else NAN
    bb = aa + 2 * acc.ad + acc.dd
    na, nb = math.sqrt(aa) if aa == aa and aa >= 0 else NAN, math.sqrt(max(bb, 0.0)) if bb == bb else NAN
    if l2 != l2 or na != na:
        rel = NAN
    elif na == 0:
        rel = 0.0 if l2 == 0 else math.inf
    else:
        rel = l2 / na
    if acc.changed == 0 and na == na and na > 0:
        cos = 1.0
    elif na == 0 or nb == 0 or na != na or nb != nb:
        cos = NAN
    else:  # NaN when a norm is infinite (inf/inf); never clamped into [-1, 1]
        cos = (aa + acc.ad) / (na * nb)
        cos = max(-1.0, min(1.0, cos)) if cos == cos else NAN
    return {
        "l2_delta": l2,
        "rel_change": rel,
        "cosine": cos,
        "max_abs_delta": NAN if acc.nan else acc.max_abs,
        "frac_changed": acc.changed / numel if numel else 0.0,
    }


def _row(name: str, status: str, ea: "TensorEntry | None", eb: "TensorEntry | None",
         metrics: dict[str, float] | None) -> dict[str, Any]:
    none = {"l2_delta": None, "rel_change": None, "cosine": None, "max_abs_delta": None, "frac_changed": None}
    row: dict[str, Any] = {"name": name, "status": status, **(metrics or none)}
    row["shape_a"] = list(ea.shape) if ea else None
    row["shape_b"] = list(eb.shape) if eb else None
    row["dtype_a"] = ea.dtype.logical if ea else None
    row["dtype_b"] = eb.dtype.logical if eb else None
    return row


# --------------------------------------------------------------------------- streaming


def _chunk(run: "Run", e: "TensorEntry", i: int) -> np.ndarray:
    """Chunk ``i`` of an entry, edge padding trimmed, in its storage dtype."""
    from dstt.format.chunks import chunk_array

    region = tuple(slice(0, n) for n in e.chunk_grid.box(e.coords(i))[1])
    arr = chunk_array(run.backend, e, i)
    return arr[region] if region else arr


def _digests(e: "TensorEntry") -> list[str | None] | None:
    """Per-chunk sha256 hex digests where the writer recorded them."""
    return getattr(e, "sha256", None) or getattr(e, "digests", None)


def _known_same(pa: Point, pb: Point, ea: "TensorEntry", eb: "TensorEntry") -> list[bool]:
    """Per chunk: identical without reading? (same array and slot in one
    store, i.e. referenced rather than rewritten; or equal recorded sha256)"""
    same_store = pa[0] is pb[0]
    da, db = _digests(ea), _digests(eb)
    return [
        (same_store and ea.array == eb.array and ea.slots[i] == eb.slots[i])
        or (da is not None and db is not None and da[i] is not None and da[i] == db[i])
        for i in range(ea.nchunks)
    ]


@dataclass
class _Job:
    """One tensor present on both sides with the same shape."""

    name: str
    ea: "TensorEntry"
    eb: "TensorEntry"
    acc: _Acc

    @property
    def same_dtype(self) -> bool:
        return self.ea.dtype.logical == self.eb.dtype.logical

    @property
    def finite(self) -> bool:
        return self.ea.stats.get("nonfinite", 1) == 0 and self.eb.stats.get("nonfinite", 1) == 0

    @property
    def aligned(self) -> bool:
        return self.same_dtype and self.ea.chunk_shape == self.eb.chunk_shape


def _run_aligned(pa: Point, pb: Point, jobs: list[_Job], pool: ThreadPoolExecutor, depth: int,
                 progress: Progress | None) -> None:
    """Compare every chunk pair of chunk-aligned jobs, reading up to
    ``depth`` pairs ahead (across tensors) while comparing the current one:
    memory is ``depth + 1`` chunk pairs."""
    from collections import deque

    tasks: list[tuple[_Job, int]] = []
    for job in jobs:
        for i, same in enumerate(_known_same(pa, pb, job.ea, job.eb)):
            if same:
                n = job.ea.chunk_grid.valid_numel(i)
                job.acc.n += n
                if progress is not None:
                    progress(n * job.ea.dtype.itemsize)
            else:
                tasks.append((job, i))

    def load(t: tuple[_Job, int]) -> tuple[np.ndarray, np.ndarray]:
        job, i = t
        return _chunk(pa[0], job.ea, i), _chunk(pb[0], job.eb, i)

    ahead: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
    nxt = 0
    for k in range(len(tasks)):
        while nxt < len(tasks) and len(ahead) <= depth:
            ahead.append(pool.submit(load, tasks[nxt]))
            nxt += 1
        a, b = ahead.popleft().result()
        job = tasks[k][0]
        job.acc.n += a.size
        job.acc.add(compare_block(a, b, True, job.finite, job.ea.dtype, job.eb.dtype))
        del a, b
        if progress is not None:
            progress(job.ea.chunk_grid.valid_numel(tasks[k][1]) * job.ea.dtype.itemsize)


def _run_aligned_tasks(pa: Point, pb: Point, jobs: list[_Job], progress: Progress | None, executor: Any,
                       workers: int | None) -> bool:
    """Compare the chunk pairs of chunk-aligned jobs as scan tasks; False
    (nothing done) when the scan runs inline (then :func:`_run_aligned`)."""
    from dstt.format.scan import StoreSpec, groups_by_bytes, run_placed, scan_executor

    work: list[tuple[int, int]] = []  # (job, chunk) pairs to read
    skipped: list[tuple[int, int]] = []
    for k, job in enumerate(jobs):
        for i, same in enumerate(_known_same(pa, pb, job.ea, job.eb)):
            (skipped if same else work).append((k, i))
    sizes = [jobs[k].ea.chunk_grid.valid_numel(i) * jobs[k].ea.dtype.itemsize for k, i in work]
    sa, sb = StoreSpec.of(pa[0]), StoreSpec.of(pb[0])
    with scan_executor(executor, workers, total_bytes=sum(sizes), n_tasks=len(work),
                       portable=sa is not None and sb is not None) as place:
        if place.executor is None:
            return False
        assert sa is not None and sb is not None
        for k, i in skipped:
            n = jobs[k].ea.chunk_grid.valid_numel(i)
            jobs[k].acc.n += n
            if progress is not None:
                progress(n * jobs[k].ea.dtype.itemsize)
        groups = groups_by_bytes(sizes, min_groups=place.inflight)
        payloads = []
        for g in groups:
            items: list[tuple["TensorEntry", "TensorEntry", bool, list[int]]] = []
            last = -1
            for k, i in (work[x] for x in g):
                if k != last:
                    items.append((_unattached(jobs[k].ea), _unattached(jobs[k].eb), jobs[k].finite, []))
                    last = k
                items[-1][3].append(i)
            payloads.append((sa, pa[1], pa[2], sb, pb[1], pb[2], items))
        results = run_placed(place, compare_chunks, payloads, [sum(sizes[x] for x in g) for g in groups],
                             progress)
    got: dict[tuple[int, int], tuple[int, _Acc]] = {}
    for g, res in zip(groups, results):
        for x, r in zip(g, res):
            got[work[x]] = r
    for k, i in sorted(got):  # each tensor's sums in chunk order: the inline order
        n, acc = got[k, i]
        jobs[k].acc.n += n
        jobs[k].acc.add(acc)
    return True


def _unattached(e: "TensorEntry") -> "TensorEntry":
    """``e`` without the chain reader its step's reader attached to a
    predictive entry (a reader of this process: neither picklable nor the
    worker's; the task attaches its own)."""
    if "_chain" not in e.__dict__:
        return e
    import copy

    e = copy.copy(e)
    del e.__dict__["_chain"]
    return e


def compare_chunks(sa: Any, branch_a: str, step_a: int, sb: Any, branch_b: str, step_b: int,
                   items: list[tuple["TensorEntry", "TensorEntry", bool, list[int]]]) -> list[tuple[int, _Acc]]:
    """A task of a diff scan (runs in a worker): (elements, sums) of each
    chunk pair, read and compared exactly as :func:`_run_aligned` does."""
    from dstt.format.chains import attach
    from dstt.format.index import RunIndex
    from dstt.format.scan import opened

    ra, rb = opened(sa, RunIndex), opened(sb, RunIndex)
    out = []
    for ea, eb, finite, indices in items:
        # predictive chunks decode through this process's chain readers
        (ea,), (eb,) = attach([ea], ra.chains, branch_a, step_a), attach([eb], rb.chains, branch_b, step_b)
        for i in indices:
            with ra.removed_meanwhile(branch_a, step_a):
                a = _chunk(ra, ea, i)
            with rb.removed_meanwhile(branch_b, step_b):
                b = _chunk(rb, eb, i)
            out.append((a.size, compare_block(a, b, True, finite, ea.dtype, eb.dtype)))
    return out


def _pairs_rows(pa: Point, pb: Point, ea: "TensorEntry", eb: "TensorEntry") -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Aligned blocks of leading-axis rows when the chunk shapes differ."""
    if not ea.shape:
        a, b = pa[0].read_array(ea.name, pa[2], branch=pa[1]), pb[0].read_array(eb.name, pb[2], branch=pb[1])
        yield 1, a, b
        return
    rows = ea.shape[0]
    row_bytes = max(1, math.prod(ea.shape[1:]) * max(ea.dtype.itemsize, eb.dtype.itemsize))
    ca, cb = ea.chunk_shape[0], eb.chunk_shape[0]
    step = math.lcm(ca, cb)
    if step * row_bytes > MAX_BLOCK_BYTES:
        step = max(ca, cb)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        a = pa[0].read_array(ea.name, pa[2], branch=pa[1], index=(slice(lo, hi),))
        b = pb[0].read_array(eb.name, pb[2], branch=pb[1], index=(slice(lo, hi),))
        yield a.size, a, b


def _run_rows(pa: Point, pb: Point, job: _Job, progress: Progress | None) -> None:
    """Compare a tensor whose sides differ in chunking or dtype, by aligned row blocks."""
    for n, a, b in _pairs_rows(pa, pb, job.ea, job.eb):
        job.acc.n += n
        job.acc.add(compare_block(a, b, job.same_dtype, job.finite, job.ea.dtype, job.eb.dtype))
        if progress is not None:
            progress(n * job.ea.dtype.itemsize)


def bytes_to_read(pa: Point, pb: Point, patterns: Iterable[str] | None = None) -> int:
    """Bytes of side A a diff with these name globs will stream (for progress
    bars): every byte of tensors present on both sides, skipped chunks included."""
    ra, rb = pa[0].record(pa[2], branch=pa[1]), pb[0].record(pb[2], branch=pb[1])
    wanted = set(match_names(ra.names, patterns))
    total = 0
    for e in ra.entries:
        if e.name in wanted and e.name in rb.by_name and rb.by_name[e.name].shape == e.shape:
            total += e.nbytes
    return total


def diff(run: "Run", a: Any, b: Any, patterns: Iterable[str] | None = None, *,
         other: "Run | None" = None, progress: Progress | None = None,
         threads: int = 2, executor: Any = None, workers: int | None = None) -> list[dict[str, Any]]:
    """Per-tensor diff rows (see the module docstring), in A's tensor order
    followed by tensors only B has.

    ``a`` and ``b`` are anything :func:`dstt.analysis.select.resolve_point`
    accepts (a step, ``(branch, step)``, a reference, ``":STEP"``); ``b`` is
    resolved against ``other`` when given. ``patterns`` are name globs.
    ``progress(nbytes)`` is called as data is compared. Chunk pairs are
    compared as tasks on ``executor`` with ``workers``
    (:mod:`dstt.format.scan`); the rows are the same bit for bit whichever
    ran them (each tensor's sums are added in chunk order).
    """
    pa = resolve_point(run, a)
    pb = resolve_point(other or run, b)
    return diff_points(pa, pb, patterns, progress=progress, threads=threads, executor=executor, workers=workers)


def diff_points(pa: Point, pb: Point, patterns: Iterable[str] | None = None, *,
                progress: Progress | None = None, threads: int = 2, executor: Any = None,
                workers: int | None = None) -> list[dict[str, Any]]:
    """:func:`diff` between two resolved ``(run, branch, step)`` points."""
    ra, rb = pa[0].record(pa[2], branch=pa[1]), pb[0].record(pb[2], branch=pb[1])
    names = ra.names + [n for n in rb.names if n not in ra.by_name]
    names = match_names(names, patterns)
    rows: list[dict[str, Any] | _Job] = []  # a job: its row once its chunks are compared
    jobs: list[_Job] = []
    for name in names:
        ea, eb = ra.by_name.get(name), rb.by_name.get(name)
        if ea is None or eb is None:
            rows.append(_row(name, "added" if ea is None else "removed", ea, eb, None))
        elif ea.shape != eb.shape:
            rows.append(_row(name, "shape_changed", ea, eb, None))
        else:
            job = _Job(name, ea, eb, _Acc())
            jobs.append(job)
            rows.append(job)
    aligned = [j for j in jobs if j.aligned]
    if not _run_aligned_tasks(pa, pb, aligned, progress, executor, workers):
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dstt-diff") as pool:
            _run_aligned(pa, pb, aligned, pool, max(1, threads), progress)
    for j in jobs:
        if not j.aligned:
            _run_rows(pa, pb, j, progress)
    out: list[dict[str, Any]] = []
    for r in rows:
        if isinstance(r, _Job):
            m = _metrics(r.acc, r.ea.stats.get("norm", NAN), math.prod(r.ea.shape))
            status = "dtype_changed" if not r.same_dtype else ("changed" if m["frac_changed"] else "unchanged")
            out.append(_row(r.name, status, r.ea, r.eb, m))
        else:
            out.append(r)
    return out


def sort_rows(rows: list[dict[str, Any]], key: str = "rel_change", top: int | None = None) -> list[dict[str, Any]]:
    """Most different first (descending metrics, ascending cosine); rows
    without the metric (added/removed/shape_changed) and NaN last."""
    if key not in SORT_KEYS:
        from dstt.errors import ConfigError

        raise ConfigError(f"cannot sort by {key!r}; choose one of {', '.join(SORT_KEYS)}")
    desc = SORT_KEYS[key]

    def k(r: dict[str, Any]) -> tuple[int, Any]:
        v = r.get(key)
        if isinstance(v, str):
            return (0, v)
        if v is None or v != v:
            return (2, 0.0)
        return (1, -v if desc else v)

    out = sorted(rows, key=k) if key not in ("name",) else sorted(rows, key=lambda r: r["name"])
    return out[:top] if top is not None and top >= 0 else out
