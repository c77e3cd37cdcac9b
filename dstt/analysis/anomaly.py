"""Finding where a run went wrong, from the step index only (no tensor reads).

Checks, per tensor and step of a branch's lineage:

* ``nonfinite``: the tensor holds NaN or Inf values;
* ``norm_jump``: its norm changed by more than ``jump``× (up or down) since
  the previous captured step (steps where the previous norm was 0 are not
  judged);
* ``threshold``: a stat is above ``gt`` / below ``lt``;
* ``update_jump``: its update ratio ‖θₖ − θₖ₋₁‖ / ‖θₖ‖ (recorded at capture
  time where the previous step was at hand) is more than ``update_jump``×
  the median of its previous :data:`UPDATE_WINDOW` captured ratios -- a
  loss spike shows as a jump in the update size before the norms move.
  Steps without update stats (stores written before them, the first step
  of a capture) are not judged.

Incidents recorded by the capture (:mod:`dstt.format.incidents`) are not
detections: ``dstt find`` lists them beside these.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s, v in enumerate([1.0, 1.1, float("nan")]):
...     _ = dstt.save(path, s, {"w": torch.full((4,), v)})
>>> [(e["step"], e["tensor"], e["reason"]) for e in find(dstt.open(path))]
[(2, 'w', 'nonfinite')]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from dstt.analysis.history import _Matcher, scan, stat_column
from dstt.errors import ConfigError
from dstt.format.layout import STATS_COLUMNS

if TYPE_CHECKING:
    from dstt.format.index import RunIndex as Run

_NORM = STATS_COLUMNS.index("norm")
_NONFINITE = STATS_COLUMNS.index("nonfinite")
_URATIO = STATS_COLUMNS.index("update_ratio")
#: Previous update ratios a tensor's current one is compared with (their median).
UPDATE_WINDOW = 8


def find(run: "Run", patterns: Iterable[str] | None = None, branch: str | None = None, *,
         nonfinite: bool = True, jump: float | None = 10.0, stat: str | None = None,
         gt: float | None = None, lt: float | None = None, first: bool = True,
         ancestry: bool = True, update_jump: float | None = 10.0) -> list[dict[str, Any]]:
    """Events ``{"branch", "step", "tensor", "reason", "stat", "value", "previous"}``
    in step order; with ``first=True`` only those of the first step that has any.
    (``previous`` of an ``update_jump`` is the median of the earlier ratios.)"""
    if jump is not None and not jump > 1:
        raise ConfigError(f"jump must be a factor greater than 1, got {jump}")
    if update_jump is not None and not update_jump > 1:
        raise ConfigError(f"update jump must be a factor greater than 1, got {update_jump}")
    if (gt is not None or lt is not None) and stat is None:
        stat = "norm"
    col = stat_column(stat) if stat is not None else None
    if col is not None and gt is None and lt is None:
        raise ConfigError("--stat needs a threshold: --gt and/or --lt")
    if not nonfinite and jump is None and col is None and update_jump is None:
        raise ConfigError("nothing to look for: enable nonfinite, a norm jump, an update jump or a stat threshold")
    match = _Matcher(patterns)
    prev_hits: list[tuple[str, int]] = []
    prev_norms = np.empty(0)
    last: dict[str, float] = {}  # latest norm of every tensor seen, as of the last change of tensor set
    updates = _UpdateWindows()
    events: list[dict[str, Any]] = []
    for b, s, names, stats in scan(run, branch, ancestry):
        hits = match(names)
        if not hits:
            continue
        idx = np.fromiter((i for _, i in hits), dtype=np.int64, count=len(hits))
        rows = stats[idx]
        norms = rows[:, _NORM]
        if hits is prev_hits:  # the same tensors as the step before: rows line up
            prevs = prev_norms
        else:  # a tensor is compared with its latest captured norm, however long ago
            last.update(zip((n for n, _ in prev_hits), prev_norms.tolist()))
            prevs = np.array([last.get(n, np.nan) for n, _ in hits], dtype=np.float64)
        # Vectorized screening over the step's tensors; events are built only
        # for the (rare) flagged rows.
        flagged = np.zeros(len(hits), dtype=bool)
        if nonfinite:
            flagged |= rows[:, _NONFINITE] > 0
        if jump is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = norms / prevs
                flagged |= ((prevs > 0) & np.isfinite(prevs) & np.isfinite(norms) & ((ratio > jump) | (ratio < 1.0 / jump))
                            & ~_counters(hits))
        if col is not None:
            v = rows[:, col]
            if gt is not None:
                flagged |= v > gt
            if lt is not None:
                flagged |= v < lt
        base = updates.step(hits, rows[:, _URATIO]) if update_jump is not None else None
        if base is not None:
            with np.errstate(invalid="ignore"):
                up = (base > 0) & np.isfinite(rows[:, _URATIO]) & (rows[:, _URATIO] > update_jump * base)
            flagged |= up
        found: list[dict[str, Any]] = []
        for k in np.flatnonzero(flagged).tolist():
            p = float(prevs[k])
            found.extend(_check(b, s, hits[k][0], rows[k], None if p != p else p, nonfinite, jump, stat, col, gt, lt))
            if base is not None and up[k]:
                found.append({"branch": b, "step": s, "tensor": hits[k][0], "reason": "update_jump",
                              "stat": "update_ratio", "value": float(rows[k, _URATIO]), "previous": float(base[k])})
        prev_hits, prev_norms = hits, norms
        if found:
            events.extend(found)
            if first:
                break
    match.check(f"on branch {branch or run.default_branch!r}")
    return events


def _check(b: str, s: int, name: str, row: np.ndarray, prev_norm: float | None, nonfinite: bool,
           jump: float | None, stat: str | None, col: int | None, gt: float | None,
           lt: float | None) -> list[dict[str, Any]]:
    out = []

    def ev(reason: str, st: str, value: float, previous: float | None = None) -> None:
        out.append({"branch": b, "step": s, "tensor": name, "reason": reason, "stat": st,
                    "value": value, "previous": previous})

    if nonfinite and row[_NONFINITE] > 0:
        ev("nonfinite", "nonfinite", float(row[_NONFINITE]))
    norm = float(row[_NORM])
    if (jump is not None and prev_norm is not None and prev_norm > 0 and np.isfinite(prev_norm) and np.isfinite(norm)
            and not _is_counter(name)):
        ratio = norm / prev_norm
        if ratio > jump or ratio < 1.0 / jump:
            ev("norm_jump", "norm", norm, prev_norm)
    if col is not None and stat is not None:
        v = float(row[col])
        if (gt is not None and v > gt) or (lt is not None and v < lt):
            ev("threshold", stat, v)
    return out


def _is_counter(name: str) -> bool:
    """An optimizer's step counter (``optim/<param>/step``): it grows with
    every step by design, and by the gap between captured steps (a norm jump
    of 11x from step 0 to 10 is not a training problem)."""
    return name.startswith("optim/") and name.endswith("/step")


_COUNTERS: dict[int, tuple[list[tuple[str, int]], np.ndarray]] = {}


def _counters(hits: list[tuple[str, int]]) -> np.ndarray:
    """Mask of the counters among ``hits`` (cached per hits list: it is the
    same object from step to step while the tensor set does not change)."""
    got = _COUNTERS.get(id(hits))
    if got is None or got[0] is not hits:
        _COUNTERS.clear()
        got = _COUNTERS[id(hits)] = (hits, np.fromiter((_is_counter(n) for n, _ in hits), dtype=bool,
                                                       count=len(hits)))
    return got[1]


class _UpdateWindows:
    """Each tensor's last UPDATE_WINDOW finite update ratios, as an array
    whose rows line up with the current step's matched tensors (rebuilt only
    when the tensor set changes), so a step costs a few vector operations."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, int]] | None = None
        self.buf = np.empty((0, UPDATE_WINDOW))
        self.kept: dict[str, np.ndarray] = {}  # rows of tensors seen before the last change of tensor set
        self.seen_any = False

    def step(self, hits: list[tuple[str, int]], ratios: np.ndarray) -> np.ndarray | None:
        """The median of each tensor's previous ratios (NaN without any),
        then remembers ``ratios``; None while no step had update stats (old
        stores: nothing to compare, nothing computed)."""
        have = np.isfinite(ratios)
        if not self.seen_any and not have.any():
            return None
        self.seen_any = True
        if hits is not self.hits:
            if self.hits is not None:
                self.kept.update(zip((n for n, _ in self.hits), self.buf))
            nan_row = np.full(UPDATE_WINDOW, np.nan)
            self.buf = np.array([self.kept.get(n, nan_row) for n, _ in hits]).reshape(len(hits), UPDATE_WINDOW)
            self.hits = hits
        base = _nanmedian_rows(self.buf)
        # Shift in the finite ratios only: a step without one keeps the window.
        if have.any():
            shifted = np.concatenate([self.buf[:, 1:], ratios[:, None]], axis=1)
            self.buf = np.where(have[:, None], shifted, self.buf)
        return base


def _nanmedian_rows(a: np.ndarray) -> np.ndarray:
    """Median of each row's non-NaN values (NaN for a row without any): the
    same as ``np.nanmedian(a, axis=1)`` at ~10x less cost for short rows
    (sorting puts NaN last).

    >>> _nanmedian_rows(np.array([[3.0, np.nan, 1.0, 2.0], [np.nan] * 4, [4.0, 1.0, np.nan, np.nan]])).tolist()
    [2.0, nan, 2.5]
    """
    if a.shape[0] == 0:
        return np.empty(0)
    srt = np.sort(a, axis=1)
    k = np.count_nonzero(~np.isnan(a), axis=1)
    rows = np.arange(a.shape[0])
    lo = srt[rows, np.maximum(k - 1, 0) // 2]
    hi = srt[rows, np.maximum(k, 1) // 2 - (k == 0)]
    return np.where(k > 0, (lo + hi) / 2, np.nan)
