"""User-defined per-tensor metrics over a run: ``run.map(fn, names, steps)``
and the common ones by name (``history --metric sparsity``).

:func:`map_tensors` applies ``fn`` to every (tensor, step) -- ``fn`` gets
the tensor (torch, its logical dtype) and returns a number, a 0-d tensor or
a dict of numbers -- as tasks on the scan's executor
(:mod:`dstt.format.scan`: a local process pool by default, or any
``concurrent.futures.Executor``), and returns one row per (tensor, step),
pandas-ready, in the branch's step order and the step's tensor order.
``fn`` travels to the workers with cloudpickle where it is installed (a
lambda or a function of a notebook works), else with pickle.

:data:`METRICS` are computed from the data in float64 with numpy (one
thread: the same value whichever worker computes it); those the
capture-time stats determine (``rms``, ``absmax``; and every stat of
:data:`dstt.analysis.history.STATS`) are read from the step index instead
and cost nothing (``source="auto"``).

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(2):
...     _ = dstt.save(path, s, {"w": torch.tensor([0.0, 1.0, float(s), 0.0])})
>>> [(r["step"], r["value"]) for r in dstt.open(path).map("sparsity", "w", executor="inline")]
[(0, 0.75), (1, 0.5)]
>>> [(r["step"], r["value"]) for r in dstt.open(path).map(lambda t: float(t.sum()), "w", executor="inline")]
[(0, 1.0), (1, 2.0)]
"""

from __future__ import annotations

import math
import pickle
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from dstt.analysis.select import match_names, step_filter
from dstt.errors import ConfigError, TensorNotFoundError
from dstt.format.layout import STATS_COLUMNS

if TYPE_CHECKING:
    import torch

    from dstt.store.reader import TensorReader as Run

NAN = float("nan")


def _flat64(t: "torch.Tensor") -> np.ndarray:
    """The values as a flat float64 numpy array (exact for every real dtype
    dstt stores; complex: magnitudes)."""
    import torch

    t = t.detach().reshape(-1)
    if t.is_complex():
        return t.to(torch.complex128).abs().numpy()
    return t.to(torch.float64).numpy()


def _rms(x: np.ndarray) -> float:
    return math.sqrt(float(np.dot(x, x)) / x.size) if x.size else NAN


def _absmax(x: np.ndarray) -> float:
    return float(np.max(np.abs(x))) if x.size else NAN


def _sparsity(x: np.ndarray) -> float:
    return float(np.count_nonzero(x == 0)) / x.size if x.size else NAN


def _l1(x: np.ndarray) -> float:
    return float(np.sum(np.abs(x)))


def _matrix(t: "torch.Tensor") -> np.ndarray | None:
    """A tensor of 2+ dimensions as a (rows, rest) float64 matrix; None otherwise."""
    import torch

    if t.dim() < 2 or t.numel() == 0:
        return None
    x = t.detach().reshape(t.shape[0], -1)
    return x.to(torch.complex128 if x.is_complex() else torch.float64).numpy()


def _spectral_norm(t: "torch.Tensor") -> float:
    m = _matrix(t)
    if m is None or m.size == 0:
        return NAN
    if not np.isfinite(m).all():
        return NAN
    return float(np.linalg.norm(m, ord=2))


def _stable_rank(t: "torch.Tensor") -> float:
    """‖W‖_F² / ‖W‖_2² (between 1 and the rank)."""
    m = _matrix(t)
    if m is None or m.size == 0 or not np.isfinite(m).all():
        return NAN
    s = float(np.linalg.norm(m, ord=2))
    return float(np.vdot(m, m).real) / (s * s) if s else NAN  # (vdot: Σ|w|², complex included)


#: Metrics of the data by name: tensor (torch) -> float, computed in float64.
METRICS: dict[str, Callable[["torch.Tensor"], float]] = {
    "rms": lambda t: _rms(_flat64(t)),
    "absmax": lambda t: _absmax(_flat64(t)),
    "sparsity": lambda t: _sparsity(_flat64(t)),
    "l1": lambda t: _l1(_flat64(t)),
    "spectral_norm": _spectral_norm,
    "stable_rank": _stable_rank,
}


def from_stats(metric: str, row: dict[str, float]) -> float:
    """A metric the capture-time stats determine, NaN where they do not."""
    if metric == "rms":
        n, norm = row.get("numel", NAN), row.get("norm", NAN)
        return norm / math.sqrt(n) if n and n == n and norm == norm else NAN
    if metric == "absmax":
        lo, hi = row.get("min", NAN), row.get("max", NAN)
        if row.get("nonfinite", 1) != 0 or lo != lo or hi != hi:
            return NAN
        return max(abs(lo), abs(hi))
    return NAN


#: Metrics the capture-time stats can answer (:func:`from_stats`).
FROM_STATS = ("rms", "absmax")


def check_metric(name: str) -> str:
    """``name`` if it is one of :data:`METRICS`, else a one-line ConfigError."""
    if name not in METRICS:
        raise ConfigError(f"unknown metric {name!r}; choose one of {', '.join(METRICS)} (or --stat for a stat)")
    return name


def _encode(fn: Any) -> tuple[str, Any]:
    """How ``fn`` travels to a worker: a metric's name, or its pickle."""
    if isinstance(fn, str):
        if fn not in METRICS:
            raise ConfigError(f"unknown metric {fn!r}; choose one of {', '.join(METRICS)} or pass a function")
        return "metric", fn
    if not callable(fn):
        raise ConfigError(f"map needs a function or a metric name, got {type(fn).__name__}")
    try:
        import cloudpickle

        return "pickle", cloudpickle.dumps(fn)
    except ImportError:  # pragma: no cover - cloudpickle comes with dask
        try:
            return "pickle", pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ConfigError(f"cannot send {fn!r} to worker processes ({e}): define it at module level, "
                              "install cloudpickle, or pass executor='threads'") from None


def _decode(how: str, what: Any) -> Callable[["torch.Tensor"], Any]:
    return METRICS[what] if how == "metric" else pickle.loads(what)  # noqa: S301 - this process pickled it


def _value(v: Any) -> Any:
    """A result as a plain Python value (numbers stay exact)."""
    if hasattr(v, "detach") and hasattr(v, "numel") and v.numel() == 1:
        return v.detach().reshape(()).item()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray) and v.size == 1:
        return v.reshape(()).item()
    return v


def map_task(spec: Any, how: str, what: Any, items: list[tuple[str, int, str]]) -> list[Any]:
    """A task of a map scan (runs in a worker): ``fn(tensor)`` of each (branch, step, name)."""
    from dstt.format.scan import opened
    from dstt.store.reader import TensorReader

    run = opened(spec, TensorReader)
    return _apply(run, _decode(how, what), items)


def _apply(run: "Run", fn: Callable[["torch.Tensor"], Any], items: list[tuple[str, int, str]]) -> list[Any]:
    return [_value(fn(run.read(name, step, branch=branch))) for branch, step, name in items]


def _points(run: "Run", names: Iterable[str], steps: Any, branch: str | None,
            ancestry: bool) -> list[tuple[str, int, str, int, dict[str, float]]]:
    """(branch, step, tensor, elements, stats row) of every matching tensor
    of every selected step of the branch's lineage, from the step index."""
    pats = [names] if isinstance(names, str) else list(names)
    if not pats:
        raise ConfigError("map needs at least one tensor name or glob")
    want = step_filter(steps)
    out: list[tuple[str, int, str, int, dict[str, float]]] = []
    seen: set[str] = set()
    cols = {c: STATS_COLUMNS.index(c) for c in STATS_COLUMNS}
    for b, ss in run.lineage(branch, ancestry):
        for s in ss:
            if not want(s):
                continue
            step_names, stats = run.step_stats(s, branch=b)
            pos = {n: i for i, n in enumerate(step_names)}
            for n in match_names(step_names, pats):
                seen.add(n)
                row = stats[pos[n]]
                vals = {c: float(row[j]) for c, j in cols.items() if j < len(row)}
                out.append((b, s, n, int(vals.get("numel", 0)), vals))
    if not seen:
        raise TensorNotFoundError(f"no tensor matches {', '.join(map(repr, pats))} "
                                  f"on branch {branch or run.default_branch!r} at the steps asked")
    return out


def map_tensors(run: "Run", fn: Any, names: Any = "*", steps: Any = None, branch: str | None = None, *,
                executor: Any = None, workers: int | None = None, source: str = "auto",
                progress: Callable[[int], None] | None = None, ancestry: bool = True) -> list[dict[str, Any]]:
    """One row ``{"tensor", "branch", "step", "value"}`` per matching
    (tensor, step) with ``value = fn(tensor)`` (a dict result gives its keys
    as columns instead). ``fn``: a function of a torch tensor or a name of
    :data:`METRICS`; ``names``: names or globs; ``steps``: None (all), a
    step, a list, a ``range`` or a ``slice`` of step numbers. ``source``
    (named metrics): ``"auto"`` reads what the capture-time stats determine
    from them (:data:`FROM_STATS`), ``"data"`` always reads the tensors.
    """
    from dstt.format.scan import StoreSpec, groups_by_bytes, run_placed, scan_executor

    if source not in ("auto", "data"):
        raise ConfigError(f"source must be 'auto' or 'data', got {source!r}")
    how, what = _encode(fn)
    points = _points(run, names, steps, branch, ancestry)
    values: list[Any] = [NAN] * len(points)
    todo = list(range(len(points)))
    if how == "metric" and source == "auto" and what in FROM_STATS:
        todo = []
        for k, p in enumerate(points):
            values[k] = from_stats(what, p[4])
            if values[k] != values[k]:
                todo.append(k)  # the stats do not hold it (no stats, NaN/Inf in the data): read
    sizes = [max(1, points[k][3]) * 4 for k in todo]
    groups = groups_by_bytes(sizes, min_groups=16)
    items = [[points[todo[x]][:3] for x in g] for g in groups]
    spec = StoreSpec.of(run)
    weights = [sum(sizes[x] for x in g) for g in groups]
    with scan_executor(executor, workers, total_bytes=sum(sizes), n_tasks=len(groups),
                       portable=spec is not None) as place:
        if place.executor is None:
            fun = _decode(how, what)
            results = []
            for w, it in zip(weights, items):
                results.append(_apply(run, fun, it))
                if progress is not None:
                    progress(w)
        else:
            results = run_placed(place, map_task, [(spec, how, what, it) for it in items], weights, progress)
    for g, res in zip(groups, results):
        for x, v in zip(g, res):
            values[todo[x]] = v
    rows: list[dict[str, Any]] = []
    for (b, s, n, _, _), v in zip(points, values):
        row: dict[str, Any] = {"tensor": n, "branch": b, "step": s}
        if isinstance(v, dict):
            row.update({str(k): _value(x) for k, x in v.items()})
        else:
            row["value"] = v
        rows.append(row)
    return rows


__all__ = ["map_tensors", "METRICS", "FROM_STATS", "from_stats", "map_task"]
