"""Finding where a run went wrong, from the step index only (no tensor reads).

What is looked at by default is the rule of :mod:`dstt.analysis.scope`
(model tensors and float values such as a loss or a learning rate; never
RNG states, optimizer state, step counters or data offsets); values are
judged by :mod:`dstt.analysis.valuefind`. Checks, per tensor and step of a
branch's lineage:

* ``nonfinite``: the tensor holds NaN or Inf values;
* ``norm_jump``: its norm changed by more than ``jump``× (up or down)
  since its previous captured step; across a gap k times the run's usual
  spacing (the flight recorder's memory-only steps) by more than k ×
  ``jump`` (a ramp such as ``exp_avg_sq`` filling up is not a spike). Not
  judged: a previous norm of 0 or under 1/``jump`` of the tensor's peak so
  far (a bias crossing zero), a fall of a tensor of under
  :data:`SMALL_NUMEL` elements, optimizer step counters;
* ``threshold``: a stat is above ``gt`` / below ``lt``;
* ``update_jump``: its update ratio ‖θₖ − θₖ₋₁‖ / ‖θₖ‖ (recorded at capture
  time where the previous step was at hand) is more than ``update_jump``×
  the median of its previous :data:`UPDATE_WINDOW` captured ratios -- a
  loss spike shows as a jump in the update size before the norms move.
  Not judged for tensors of under :data:`SMALL_NUMEL` elements (beside a
  bias near zero any update is large).
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

from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import numpy as np

from dstt.analysis.history import _Matcher, stat_column
from dstt.analysis.scope import default_tensor
from dstt.analysis.valuefind import ValueChecks, usual_spacing
from dstt.analysis.values import flatten_values
from dstt.errors import ConfigError
from dstt.format.layout import STATS_COLUMNS

if TYPE_CHECKING:
    from dstt.format.index import RunIndex as Run

_NORM = STATS_COLUMNS.index("norm")
_NUMEL = STATS_COLUMNS.index("numel")
#: A tensor of fewer elements (a bias, a scale) may pass near zero: its norm
#: falling and its update ratio are not judged, only its norm rising.
SMALL_NUMEL = 16
_NONFINITE = STATS_COLUMNS.index("nonfinite")
_URATIO = STATS_COLUMNS.index("update_ratio")
#: A rising-only value (a loss, a norm) above this factor times the largest of its recent
#: values is a spike (:mod:`dstt.analysis.valuefind`).
SPIKE = 1.5
#: Previous update ratios a tensor's current one is compared with (their median).
UPDATE_WINDOW = 8


def find(run: "Run", patterns: Iterable[str] | None = None, branch: str | None = None, *,
         nonfinite: bool = True, jump: float | None = 10.0, stat: str | None = None,
         gt: float | None = None, lt: float | None = None, first: bool = True,
         ancestry: bool = True, update_jump: float | None = 10.0, spike: float | None = SPIKE,
         values: bool = True) -> list[dict[str, Any]]:
    """Events ``{"branch", "step", "tensor", "kind", "reason", "stat", "value",
    "previous", "gap"}`` in step order; with ``first=True`` only those of the
    first step that has any. ``tensor`` names the tensor or value (``kind``
    ``"tensor"`` or ``"value"``); ``previous`` is the value compared with
    (for an ``update_jump`` the median of the earlier ratios, for a
    ``spike`` the largest of the recent values); ``gap`` the steps since
    that previous value, where it was judged across one.

    Without ``patterns`` the default scope applies (:mod:`dstt.analysis.scope`:
    model tensors and float values, never RNG states, optimizer state,
    counters or data offsets); patterns (tensor globs, value paths) replace
    it. ``values=False`` looks at tensors only. :func:`group_by_step`
    gathers the events of a step into one detection."""
    if jump is not None and not jump > 1:
        raise ConfigError(f"jump must be a factor greater than 1, got {jump}")
    if update_jump is not None and not update_jump > 1:
        raise ConfigError(f"update jump must be a factor greater than 1, got {update_jump}")
    if spike is not None and not spike > 1:
        raise ConfigError(f"spike must be a factor greater than 1, got {spike}")
    if (gt is not None or lt is not None) and stat is None:
        stat = "norm"
    col = stat_column(stat) if stat is not None else None
    if col is not None and gt is None and lt is None:
        raise ConfigError("--stat needs a threshold: --gt and/or --lt")
    if not nonfinite and jump is None and col is None and update_jump is None and spike is None:
        raise ConfigError("nothing to look for: enable nonfinite, a norm jump, an update jump, a spike or a stat threshold")
    pats = [p for p in (patterns or []) if p]
    match = _Matcher(pats, keep=default_tensor)
    lineage = run.lineage(branch, ancestry)
    spacing = usual_spacing(sorted({s for _, steps in lineage for s in steps}))
    vals = ValueChecks(pats, nonfinite=nonfinite, jump=jump, spike=spike, spacing=spacing) if values else None
    prev_hits: list[tuple[str, int]] = []
    prev_norms = np.empty(0)
    prev_step = -1
    last: dict[str, float] = {}  # latest norm of every tensor, as of the last change of tensor set
    updates = _UpdateWindows()
    peaks = _Peaks()
    events: list[dict[str, Any]] = []
    for b, segment in lineage:
        for s in segment:
            names, stats = run.step_stats(s, branch=b)
            found = _tensor_events(b, s, match(names), stats, (prev_hits, prev_norms, prev_step), last,
                                   (updates, peaks), _Checks(nonfinite, jump, stat, col, gt, lt, update_jump, spacing))
            hits = match(names)
            if hits:
                prev_hits, prev_norms, prev_step = hits, stats[_rows(hits)][:, _NORM], s
            if vals is not None:
                found.extend(vals.step(b, s, flatten_values(_in_scope(run.value_tree(s, branch=b), pats))))
            if found:
                events.extend(found)
                if first:
                    match.check(f"on branch {branch or run.default_branch!r}",
                                also=lambda p: vals is not None and not vals.unmatched([p]))
                    return events
    match.check(f"on branch {branch or run.default_branch!r}",
                also=lambda p: vals is not None and not vals.unmatched([p]))
    return events


class _Checks(NamedTuple):
    nonfinite: bool
    jump: float | None
    stat: str | None
    col: int | None
    gt: float | None
    lt: float | None
    update_jump: float | None
    spacing: int


def _rows(hits: list[tuple[str, int]]) -> np.ndarray:
    return np.fromiter((i for _, i in hits), dtype=np.int64, count=len(hits))


def _in_scope(tree: Any, pats: Any) -> Any:
    """With the default scope, only the parts of a value tree it can look at
    (``extra``, ``scheduler``, ``optim/param_groups``): a step's tree also
    names every tensor, and walking them was most of ``find``'s time.

    >>> _in_scope({"model": {"w": 1.0}, "extra": {"loss": 2.0}, "optim": {"state": {}, "param_groups": []}}, None)
    {'extra': {'loss': 2.0}, 'optim': {'param_groups': []}}
    """
    if pats or not isinstance(tree, dict):
        return tree
    from dstt.analysis.scope import VALUE_ROOTS

    out = {k: v for k, v in tree.items() if k in VALUE_ROOTS}
    if isinstance(out.get("optim"), dict):
        out["optim"] = {k: v for k, v in out["optim"].items() if k == "param_groups"}
    return out


def _tensor_events(b: str, s: int, hits: list[tuple[str, int]], stats: np.ndarray,
                   before: tuple[list[tuple[str, int]], np.ndarray, int], last: dict[str, float],
                   windows: tuple["_UpdateWindows", "_Peaks"], c: _Checks) -> list[dict[str, Any]]:
    """The events of one step's tensors (vectorized screening; events are
    built only for the rare flagged rows)."""
    if not hits:
        return []
    prev_hits, prev_norms, prev_step = before
    rows = stats[_rows(hits)]
    norms = rows[:, _NORM]
    if hits is prev_hits:  # the same tensors as the step before: rows line up
        prevs = prev_norms
    else:  # a tensor is compared with its latest captured norm, however long ago
        last.update(zip((n for n, _ in prev_hits), prev_norms.tolist()))
        prevs = np.array([last.get(n, np.nan) for n, _ in hits], dtype=np.float64)
    # The gap is the run's (steps not captured since the previous captured
    # step), not the tensor's: a tensor absent from a captured step is
    # judged as if it had stayed put.
    gap = s - prev_step if prev_step >= 0 else 1
    updates, peaks = windows
    peak = peaks.step(hits, norms)
    flagged = np.zeros(len(hits), dtype=bool)
    if c.nonfinite:
        flagged |= rows[:, _NONFINITE] > 0
    jumped = np.zeros(len(hits), dtype=bool)
    if c.jump is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.maximum(norms / prevs, prevs / norms)
            # Across a gap k times the usual spacing the factor must be k x
            # jump (a ramp -- exp_avg_sq filling up, a warmup -- stays put);
            # from a norm under 1/jump of the tensor's peak so far (a bias
            # crossing zero) a factor means nothing.
            # A fall is judged only for tensors of SMALL_NUMEL elements or more.
            jumped = ((prevs > 0) & np.isfinite(prevs) & np.isfinite(norms) & (norms > 0)
                      & (ratio > c.jump * max(gap / c.spacing, 1.0)) & ~(prevs * c.jump < peak)
                      & ((norms > prevs) | (rows[:, _NUMEL] >= SMALL_NUMEL)) & ~_counters(hits))
        flagged |= jumped
    if c.col is not None:
        v = rows[:, c.col]
        if c.gt is not None:
            flagged |= v > c.gt
        if c.lt is not None:
            flagged |= v < c.lt
    base = updates.step(hits, rows[:, _URATIO]) if c.update_jump is not None else None
    up = np.zeros(len(hits), dtype=bool)
    if base is not None and c.update_jump is not None:
        with np.errstate(invalid="ignore"):
            up = ((base > 0) & np.isfinite(rows[:, _URATIO]) & (rows[:, _URATIO] > c.update_jump * base)
                  & (rows[:, _NUMEL] >= SMALL_NUMEL))  # (a bias near 0: any update is large beside it)
        flagged |= up
    found: list[dict[str, Any]] = []
    for k in np.flatnonzero(flagged).tolist():
        name, row = hits[k][0], rows[k]

        def ev(reason: str, st: str, value: float, previous: float | None = None, g: int | None = None,
               name: str = name) -> None:
            found.append({"branch": b, "step": s, "tensor": name, "kind": "tensor", "reason": reason, "stat": st,
                          "value": value, "previous": previous, "gap": g})

        if c.nonfinite and row[_NONFINITE] > 0:
            ev("nonfinite", "nonfinite", float(row[_NONFINITE]))
        if jumped[k]:
            ev("norm_jump", "norm", float(row[_NORM]), float(prevs[k]), gap)
        if c.col is not None and c.stat is not None:
            v = float(row[c.col])
            if (c.gt is not None and v > c.gt) or (c.lt is not None and v < c.lt):
                ev("threshold", c.stat, v)
        if base is not None and up[k]:
            ev("update_jump", "update_ratio", float(row[_URATIO]), float(base[k]))
    return found


def group_by_step(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One detection per (branch, step): ``{"branch", "step", "names" (the
    tensors and values flagged, values first), "reasons" ({reason: count}),
    "events"}``, in step order.

    >>> evs = [{"branch": "main", "step": 3, "tensor": "model/w", "kind": "tensor", "reason": "nonfinite"},
    ...        {"branch": "main", "step": 3, "tensor": "extra/loss", "kind": "value", "reason": "nonfinite"}]
    >>> g = group_by_step(evs)
    >>> len(g), g[0]["names"], g[0]["reasons"]
    (1, ['extra/loss', 'model/w'], {'nonfinite': 2})
    """
    groups: dict[tuple[str, int], dict[str, Any]] = {}
    for e in events:
        g = groups.setdefault((e["branch"], e["step"]), {"branch": e["branch"], "step": e["step"], "names": [],
                                                          "reasons": {}, "events": []})
        g["events"].append(e)
        g["reasons"][e["reason"]] = g["reasons"].get(e["reason"], 0) + 1
    for g in groups.values():
        evs = sorted(g["events"], key=lambda e: (e.get("kind") != "value", not str(e["tensor"]).startswith("model/")))
        g["names"] = list(dict.fromkeys(e["tensor"] for e in evs))
        g["events"] = evs
    return sorted(groups.values(), key=lambda g: (g["step"], g["branch"]))


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


class _Peaks:
    """Each tensor's largest finite norm so far, as an array lined up with
    the current step's matched tensors (rebuilt when the tensor set changes)."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, int]] | None = None
        self.peak = np.empty(0)
        self.kept: dict[str, float] = {}

    def step(self, hits: list[tuple[str, int]], norms: np.ndarray) -> np.ndarray:
        """The peaks before this step (NaN for a tensor not seen yet), then takes in ``norms``."""
        if hits is not self.hits:
            if self.hits is not None:
                self.kept.update(zip((n for n, _ in self.hits), self.peak.tolist()))
            self.peak = np.array([self.kept.get(n, np.nan) for n, _ in hits], dtype=np.float64)
            self.hits = hits
        before = self.peak
        self.peak = np.fmax(self.peak, np.where(np.isfinite(norms), norms, np.nan))
        return before


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
