"""Searching across branches: ``find`` on every branch, and where two
branches' trajectories first differ. From the step index only (stats and
per-tensor checksums), torch-free.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(4):
...     _ = dstt.save(path, s, {"w": torch.full((4,), float(s))})
>>> _ = dstt.save(path, 2, {"w": torch.full((4,), float("nan"))}, branch="b", parent=("main", 1))
>>> _ = dstt.save(path, 3, {"w": torch.full((4,), 3.0)}, branch="b")
>>> run = dstt.open(path)
>>> {b: [e["step"] for e in evs] for b, evs in find_branches(run).items()}
{'b': [2], 'main': []}
>>> d = first_divergence(run, "main", "b")
>>> d["fork"], d["step"], d["tensors"]
(('main', 1), 2, ['w'])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dstt.errors import TensorNotFoundError

if TYPE_CHECKING:
    from dstt.format.index import RunIndex


def find_branches(run: RunIndex, patterns: Iterable[str] | None = None, branches: list[str] | None = None,
                  *, first: bool = True, **checks: Any) -> dict[str, list[dict[str, Any]]]:
    """:func:`dstt.analysis.anomaly.find` on every branch (or ``branches``):
    ``{branch: events}``, each branch judged on its own trajectory (its
    parent's steps up to the fork count as history) but reporting only its
    own steps, so an inherited problem is reported once, by the branch that
    has it. A pattern must match on some branch."""
    from dstt.analysis.anomaly import find

    out: dict[str, list[dict[str, Any]]] = {}
    missing: Exception | None = None
    matched = False
    for b in branches or run.branches():
        try:
            evs = find(run, patterns, b, first=False, **checks)
        except TensorNotFoundError as e:  # this branch lacks the tensor; another may have it
            missing = e
            out[b] = []
            continue
        matched = True
        own = [e for e in evs if e["branch"] == b]
        if first and own:
            own = [e for e in own if e["step"] == own[0]["step"]]
        out[b] = own
    if not matched and missing is not None:
        raise missing
    return out


def first_divergence(run: RunIndex, a: str, b: str) -> dict[str, Any]:
    """Where branches ``a`` and ``b`` first differ: the latest step they share
    (``fork``, the common ancestor step; None when unrelated) and the first
    step number both trajectories captured after it where some tensor's
    checksum differs (``step``, ``tensors`` that differ, added or removed;
    ``step`` None when they never differ over the steps both have)."""
    la = {s: (br, s) for br, steps in run.lineage(a) for s in steps}
    lb = {s: (br, s) for br, steps in run.lineage(b) for s in steps}
    shared = [s for s in sorted(set(la) & set(lb)) if la[s] == lb[s]]
    fork = la[shared[-1]] if shared else None
    for s in sorted(set(la) & set(lb)):
        if la[s] == lb[s]:
            continue  # the same stored step, inherited by both
        ra, rb = run.record(la[s][1], branch=la[s][0]), run.record(lb[s][1], branch=lb[s][0])
        diff = [n for n in ra.names if n not in rb.by_name or rb.by_name[n].checksum != ra.by_name[n].checksum
                or rb.by_name[n].shape != ra.by_name[n].shape]
        diff += [n for n in rb.names if n not in ra.by_name]
        if diff:
            return {"a": a, "b": b, "fork": fork, "step": s, "tensors": diff}
    return {"a": a, "b": b, "fork": fork, "step": None, "tensors": []}


__all__ = ["find_branches", "first_divergence"]
