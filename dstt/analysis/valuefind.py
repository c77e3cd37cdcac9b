"""``find``'s checks of values (a loss, a learning rate, a grad norm you
stored in ``extra``; the optimizer's hyperparameters; scheduler state), one
step at a time, from each step's value tree (torch-free).

Per value path, against the same path's earlier steps on the lineage:

* ``nonfinite``: the value is NaN or Inf;
* ``value_jump``: it changed by more than ``jump``x (up or down) since its
  previous captured step -- across a gap k times the run's usual spacing by
  more than k x ``jump`` (a linear warmup over the gap stays under it) --
  a learning rate x100 at step 120 is one; values whose previous one is 0
  are not judged. Values judged on rises only (:func:`rising_only`: a
  loss, a norm) are not judged this way: a loss falling is training working;
* ``spike``: a rising-only value is above ``spike``x the largest of its
  values of the previous :data:`SPIKE_WINDOW` steps (at least
  :data:`SPIKE_MIN` of them: else its last SPIKE_MIN values) times the
  square root of that high over their median -- a new high well above
  anything recent, by a margin that grows with the value's own noise (a
  per-batch loss 5x its median every few dozen steps needs a 2.3x larger
  rise; a language model's smooth loss rising 1.6x is a spike). Judged
  once SPIKE_MIN earlier values are known (the first steps move fast).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterable

from dstt.analysis.scope import default_value, rising_only
from dstt.analysis.select import match_names

#: Steps back a rising-only value is compared with (the largest of its values there).
SPIKE_WINDOW = 32
#: Earlier values needed before a spike is judged.
SPIKE_MIN = 8


class ValueChecks:
    """The running state of the value checks over one lineage."""

    def __init__(self, patterns: list[str] | None, *, nonfinite: bool, jump: float | None,
                 spike: float | None, spacing: int) -> None:
        self.patterns = patterns or None
        self.nonfinite, self.jump, self.spike, self.spacing = nonfinite, jump, spike, max(spacing, 1)
        self.prev: dict[str, tuple[float, int]] = {}
        self.windows: dict[str, deque[tuple[int, float]]] = {}
        self.seen: set[str] = set()
        self._pick: Callable[[dict[str, Any]], list[str]] = self._scoped if self.patterns is None else self._named

    def _scoped(self, flat: dict[str, Any]) -> list[str]:
        return [p for p, v in flat.items() if default_value(p, v)]

    def _named(self, flat: dict[str, Any]) -> list[str]:
        return [p for p in match_names(list(flat), self.patterns)
                if isinstance(flat[p], (int, float)) and not isinstance(flat[p], bool)]

    def step(self, branch: str, step: int, flat: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one step's values (then remembers them)."""
        out: list[dict[str, Any]] = []
        for path in self._pick(flat):
            self.seen.add(path)
            v = float(flat[path])
            out.extend(self._judge(branch, step, path, v))
            if math.isfinite(v):
                self.prev[path] = (v, step)
                self.windows.setdefault(path, deque(maxlen=SPIKE_WINDOW)).append((step, v))
        return out

    def _judge(self, b: str, s: int, path: str, v: float) -> list[dict[str, Any]]:
        def ev(reason: str, previous: float | None, gap: int | None = None) -> dict[str, Any]:
            return {"branch": b, "step": s, "tensor": path, "kind": "value", "reason": reason, "stat": "value",
                    "value": v, "previous": previous, "gap": gap}

        if not math.isfinite(v):
            return [ev("nonfinite", self.prev.get(path, (None, 0))[0])] if self.nonfinite else []
        rising = rising_only(path)
        if self.jump is not None and not rising and path in self.prev:
            p, ps = self.prev[path]
            if p != 0 and (p > 0) == (v > 0) and v != 0 and s > ps:
                ratio = max(v / p, p / v)
                if ratio > self.jump * max((s - ps) / self.spacing, 1.0):
                    return [ev("value_jump", p, s - ps)]
        win = self.windows.get(path)
        if self.spike is not None and rising and win is not None and v > 0:
            recent = [x for st, x in win if st >= s - SPIKE_WINDOW]
            if len(recent) < SPIKE_MIN:
                recent = [x for _, x in list(win)[-SPIKE_MIN:]]
            pos = sorted(x for x in recent if x > 0)
            if len(pos) >= SPIKE_MIN:
                top, mid = pos[-1], pos[len(pos) // 2]
                if v > self.spike * top * math.sqrt(top / mid):
                    return [ev("spike", top)]
        return []

    def unmatched(self, patterns: Iterable[str]) -> list[str]:
        """Patterns that matched no value so far."""
        return [p for p in patterns if not match_names(sorted(self.seen), [p])]


def usual_spacing(steps: list[int]) -> int:
    """The run's usual step spacing: the smallest gap between consecutive
    captured steps of a lineage (1 for a run captured every step; a jump
    across a longer gap is judged per spacing).

    >>> usual_spacing([0, 10, 20, 37]), usual_spacing([5])
    (10, 1)
    """
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return min(gaps) if gaps else 1
