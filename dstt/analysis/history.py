"""A tensor statistic across the steps of a branch, from the step index only
(``names.json`` + ``stats.npy`` per step; no tensor data is read).

A branch's history includes its ancestry: a branch forked from
``(parent, step)`` continues the parent's points up to that step.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s + 1))})
>>> [(p["step"], p["value"]) for p in dstt.open(path).history("w", stat="max")]
[(0, 1.0), (1, 2.0), (2, 3.0)]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from dstt.analysis.select import match_names
from dstt.errors import ConfigError, TensorNotFoundError
from dstt.format.layout import STATS_COLUMNS

if TYPE_CHECKING:
    from dstt.format.index import RunIndex as Run

#: Stats a history can follow (columns of the step index's stats table).
STATS = ("norm", "mean", "std", "min", "max", "nonfinite", "numel", "update_norm", "update_ratio")
NAN = float("nan")


def stat_column(stat: str) -> int:
    if stat not in STATS:
        from dstt.analysis.metrics import METRICS

        raise ConfigError(f"unknown stat {stat!r}; choose one of {', '.join(STATS)} "
                          f"(or a metric of the data: {', '.join(METRICS)})")
    return STATS_COLUMNS.index(stat)


def scan(run: "Run", branch: str | None = None, ancestry: bool = True) -> Iterator[tuple[str, int, list[str], np.ndarray]]:
    """(branch, step, names, stats) for every step of a branch's lineage."""
    for b, steps in run.lineage(branch, ancestry):
        for s in steps:
            names, stats = run.step_stats(s, branch=b)
            yield b, s, names, stats


class _Matcher:
    """Row indices of the names matching ``patterns``, cached while the
    names table stays the same from step to step."""

    def __init__(self, patterns: Iterable[str] | None, keep: Callable[[str], bool] | None = None) -> None:
        self.patterns = list(patterns or [])
        self.keep = keep  # without patterns: only the names it keeps (find's default scope)
        self._names: list[str] | None = None
        self._hits: list[tuple[str, int]] = []
        self.seen: set[str] = set()
        self.last_names: list[str] = []

    def __call__(self, names: list[str]) -> list[tuple[str, int]]:
        if names != self._names:
            self._names = names
            self.last_names = names
            pos = {n: i for i, n in enumerate(names)}
            keep = self.keep if not self.patterns else None
            self._hits = [(n, pos[n]) for n in match_names(names, self.patterns) if keep is None or keep(n)]
            self.seen.update(n for n, _ in self._hits)
        return self._hits

    def check(self, where: str, also: Callable[[str], bool] | None = None) -> None:
        """A pattern that matched no name (nor, by ``also``, anything else) is an error."""
        from dstt.analysis.select import is_glob
        from dstt.format.index import suggest

        for p in self.patterns:
            if also is not None and also(p):
                continue
            if not any(p == n or (is_glob(p) and match_names([n], [p])) for n in self.seen):
                hint = "" if is_glob(p) else suggest(p, self.last_names)
                raise TensorNotFoundError(f"no tensor matches {p!r} {where}{hint}")


def history(run: "Run", names: str | Iterable[str], stat: str = "norm", branch: str | None = None, *,
            delta: bool = False, ancestry: bool = True, **scan_kw: Any) -> list[dict[str, Any]]:
    """One row ``{"tensor", "branch", "step", "value"}`` per tensor and step
    (pandas-ready: ``pd.DataFrame(run.history("model/*"))``).

    ``names`` are tensor names or globs; ``delta=True`` gives the relative
    change from the previous captured point of the same tensor,
    ``(v - prev) / |prev|`` (NaN for the first point).

    ``stat`` may also be a metric of the data
    (:data:`dstt.analysis.metrics.METRICS`: ``sparsity``, ``rms``,
    ``absmax``, ``spectral_norm``, ...): read from the stats where they
    determine it, else computed from the tensors as scan tasks (``executor=``,
    ``workers=``, ``progress=`` go to :func:`dstt.analysis.metrics.map_tensors`).
    """
    if stat not in STATS:
        from dstt.analysis.metrics import METRICS, map_tensors

        if stat in METRICS:
            found = map_tensors(run, stat, names, None, branch, ancestry=ancestry, **scan_kw)  # type: ignore[arg-type]
            return _deltas(found) if delta else found
    col = stat_column(stat)
    pats = [names] if isinstance(names, str) else list(names)
    if not pats:
        raise ConfigError("history needs at least one tensor name or glob")
    match = _Matcher(pats)
    rows: list[dict[str, Any]] = []
    prev: dict[str, float] = {}
    for b, s, step_names, stats in scan(run, branch, ancestry):
        for n, i in match(step_names):
            v = float(stats[i, col])
            if delta:
                p = prev.get(n)
                prev[n] = v
                v = NAN if p is None else _rel(v, p)
            rows.append({"tensor": n, "branch": b, "step": s, "value": v})
    match.check(f"on branch {branch or run.default_branch!r}")
    return rows


def _deltas(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's value as the relative change from the tensor's previous row."""
    prev: dict[str, float] = {}
    for r in rows:
        p = prev.get(r["tensor"])
        prev[r["tensor"]] = r["value"]
        r["value"] = NAN if p is None else _rel(r["value"], p)
    return rows


def _rel(v: float, p: float) -> float:
    """(v − p) / |p|; from p = 0: 0 if v is 0, else ±inf by the sign of v (NaN stays NaN)."""
    if p == 0:
        return 0.0 if v == 0 else (NAN if v != v else math.copysign(math.inf, v))
    return (v - p) / abs(p)


def to_series(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group history rows into ``[{"tensor", "points": [{"branch", "step", "value"}]}]``."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["tensor"], []).append({"branch": r["branch"], "step": r["step"], "value": r["value"]})
    return [{"tensor": t, "points": pts} for t, pts in series.items()]


def histogram(run: "Run", name: str, step: Any = None, branch: str | None = None, bins: int = 20) -> dict[str, Any]:
    """Counts of a tensor's finite values in ``bins`` equal bins between its
    finite min and max, streamed chunk by chunk:
    ``{"edges": [...], "counts": [...], "nonfinite": n}``. Torch-free
    (numpy; bfloat16 and float8 through :func:`dstt.format.dtypes.decode`)."""
    from dstt.format.dtypes import decode

    if bins < 1:
        raise ConfigError(f"bins must be at least 1, got {bins}")
    e = run.entry(name, step, branch=branch)
    rec = run.record(step, branch=branch)
    lo, hi = e.stats.get("min", NAN), e.stats.get("max", NAN)

    def values() -> Iterator[np.ndarray]:
        for _, arr in run.iter_chunk_arrays(name, rec.step, branch=rec.branch):
            a = decode(arr, e.dtype)
            v = (np.abs(a) if np.iscomplexobj(a) else a).reshape(-1).astype(np.float64)
            yield v[np.isfinite(v)]

    if not (np.isfinite(lo) and np.isfinite(hi)):
        lo, hi = np.inf, -np.inf
        for v in values():
            if v.size:
                lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))
    if not lo <= hi:
        return {"edges": [], "counts": [], "nonfinite": int(e.stats.get("nonfinite", 0))}
    width = hi - lo if hi > lo else 1.0
    counts = np.zeros(bins, dtype=np.int64)
    for v in values():
        idx = np.clip(np.floor((v - lo) / width * bins), 0, bins - 1).astype(np.int64)
        counts += np.bincount(idx, minlength=bins)
    edges = [lo + width * i / bins for i in range(bins + 1)]
    return {"edges": edges, "counts": counts.tolist(), "nonfinite": int(e.stats.get("nonfinite", 0))}
