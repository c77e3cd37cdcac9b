"""Mergeable partial statistics of a tensor's values (torch-free format layer).

A :class:`Partial` holds what one chunk contributes to its tensor's stats
row (count, mean, M2, sum of squares, min, max, non-finite count, and the sum
of squares of the update since the previous captured step); :func:`merge`
combines the partials of chunks written by different threads or ranks with
Chan's parallel update, and :func:`finalize` makes the row of
:data:`~dstt.format.layout.STATS_COLUMNS` that ``stats.npy`` stores. The
partials themselves are computed from tensors at write time
(:mod:`dstt.store.stats`).

>>> a, b = Partial(2, 3.5, 0.5, 25.0, 3.0, 4.0, 0, 1.0), Partial(1, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0)
>>> row = finalize(merge([a, b]))
>>> row[:3], [round(v, 4) for v in row[3:5]], row[5:8]  # values 3, 4 and 0: the update of one was 1
([3.0, 0.0, 5.0], [2.3333, 2.0817], [0.0, 4.0, 1.0])
>>> finalize(merge([a, Partial(1, 0.0, 0.0, 0.0, 0.0, 0.0, 0)]))[7]  # one part's update unknown: NaN
nan
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NAN = float("nan")


@dataclass
class Partial:
    """What some of a tensor's values contribute to its stats row (their
    count, mean, M2, sum of squares, extremes, non-finite count)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    nonfinite: int = 0
    #: Sum of squares of (x - prev) over the chunk's values; NaN when the
    #: previous value is unknown (merged: NaN if any part's is).
    usq: float = NAN

    def to_list(self) -> list[float]:
        return [self.n, self.mean, self.m2, self.sumsq, self.min, self.max, self.nonfinite, self.usq]

    @classmethod
    def from_list(cls, v: list[float]) -> "Partial":
        """Inverse of :meth:`to_list` (a 7-item list, from before ``usq``: NaN)."""
        return cls(int(v[0]), v[1], v[2], v[3], v[4], v[5], int(v[6]), v[7] if len(v) > 7 else NAN)


def merge(parts: list[Partial]) -> Partial:
    """The partial of all of ``parts``' values (Chan's parallel update)."""
    out = Partial()
    # The update sum: NaN as soon as one part lacks it (an empty merge too).
    usq = sum(p.usq for p in parts) if parts else NAN
    for p in parts:
        if p.n == 0:
            continue
        if out.n == 0:
            out = Partial(p.n, p.mean, p.m2, p.sumsq, p.min, p.max, p.nonfinite)
            continue
        n = out.n + p.n
        delta = p.mean - out.mean
        mean = out.mean + delta * p.n / n
        m2 = out.m2 + p.m2 + delta * delta * out.n * p.n / n
        out = Partial(
            n,
            mean,
            m2,
            out.sumsq + p.sumsq,
            _nanmin(out.min, p.min),
            _nanmax(out.max, p.max),
            out.nonfinite + p.nonfinite,
        )
    out.usq = usq
    return out


def _nanmin(a: float, b: float) -> float:
    return NAN if (a != a or b != b) else min(a, b)


def _nanmax(a: float, b: float) -> float:
    return NAN if (a != a or b != b) else max(a, b)


def finalize(p: Partial) -> list[float]:
    """Row of ``STATS_COLUMNS`` for a merged partial."""
    update_norm = math.sqrt(p.usq) if p.usq == p.usq and p.usq >= 0 else NAN
    if p.n == 0:
        return [0.0, 0.0, 0.0, NAN, NAN, NAN, NAN, update_norm, _ratio(update_norm, 0.0)]
    std = math.sqrt(max(p.m2, 0.0) / (p.n - 1)) if p.n > 1 else (NAN if p.m2 != p.m2 else 0.0)
    if p.m2 != p.m2:
        std = NAN
    norm = math.sqrt(p.sumsq) if p.sumsq == p.sumsq and p.sumsq >= 0 else NAN
    return [float(p.n), float(p.nonfinite), norm, p.mean, std, p.min, p.max, update_norm,
            _ratio(update_norm, norm)]


def _ratio(update_norm: float, norm: float) -> float:
    """update_norm / norm: 0 when both are 0, inf when only norm is, NaN
    when either is unknown."""
    if update_norm != update_norm or norm != norm:
        return NAN
    if norm == 0:
        return 0.0 if update_norm == 0 else math.inf
    return update_norm / norm
