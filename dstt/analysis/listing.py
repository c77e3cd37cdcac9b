"""What ``dstt ls`` shows, as plain data: branches with their steps, and the
tensors of one step.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 0, {"model": {"w": torch.ones(2, 3)}})
>>> [(b["name"], [s["step"] for s in b["steps"]]) for b in list_store(dstt.open(path))]
[('main', [0])]
>>> [(t["name"], t["shape"]) for t in list_tensors(dstt.open(path), 0)]
[('model/w', [2, 3])]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from dstt.analysis.select import require_matches
from dstt.errors import ConfigError
from dstt.format import layout as L
from dstt.format.layout import STATS_COLUMNS
from dstt.format.manifest import memory_only_of, parse_commit

if TYPE_CHECKING:
    from dstt.format.index import RunIndex as Run

TENSOR_SORT_KEYS = ("name", "nbytes", "numel", "dtype", "written") + tuple(c for c in STATS_COLUMNS if c != "numel")


_UNREAD: Any = object()


def step_summary(run: "Run", branch: str, step: int, raw: Any = _UNREAD) -> dict[str, Any]:
    """Time, tensor count and bytes written/referenced of one committed step
    (reads only its commit.json, unless given its bytes as ``raw``)."""
    where = L.step_dir(branch, step)
    if raw is _UNREAD:
        raw = run.backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
    if raw is None:  # raced with a prune
        return {"step": step, "time": None, "n_tensors": None, "bytes_written": None, "bytes_referenced": None,
                "memory_only": []}
    c = parse_commit(raw, where)
    return {"step": step, "time": c["time"], "n_tensors": c["n_tensors"],
            "bytes_written": c["bytes_written"], "bytes_referenced": c["bytes_referenced"],
            "memory_only": [list(r) for r in memory_only_of(c)]}


def _summaries(run: "Run", branch: str, steps: list[int]) -> list[dict[str, Any]]:
    """step_summary of each step; on object stores the commit records are
    fetched concurrently first (one round trip's latency, not one per step)."""
    get_many = getattr(run.backend, "get_many", None)
    if get_many is None or len(steps) < 2:
        return [step_summary(run, branch, s) for s in steps]
    raws = get_many([f"{L.step_dir(branch, s)}/{L.COMMIT_FILE}" for s in steps])
    return [step_summary(run, branch, s, raw) for s, raw in zip(steps, raws)]


def list_store(run: "Run", branch: str | None = None) -> list[dict[str, Any]]:
    """``[{"name", "parent", "created", "steps": [...], "captured",
    "memory_only", "incidents"}]`` for every branch (or only ``branch``);
    ``parent`` is ``{"branch", "step"}`` or None. ``steps`` are the
    persisted (committed) steps; ``captured`` the spans of steps captured,
    in memory or persisted, and ``memory_only`` those never persisted, as
    ``[first, last]`` ranges (:func:`dstt.format.index.captured_spans`);
    ``incidents`` the branch's incident records (oldest step first);
    ``held``: ``[first, last, ranks, world]`` runs of steps a live capture's
    memory tier holds now, by how many of its ranks (issue 25:
    :func:`dstt.format.tier.held_ranges`), ``held_stale``: records of
    helpers that stopped publishing (not counted)."""
    import time

    from dstt.format import tier as T
    from dstt.format.incidents import list_incidents
    from dstt.format.index import captured_spans

    names = [branch] if branch else run.branches()
    incidents = list_incidents(run.backend, branch) if branch else list_incidents(run.backend)
    out = []
    for b in names:
        info = run.branch_info(b)
        steps = _summaries(run, b, run.steps(b))
        spans, _, memory = captured_spans([(s["step"], [tuple(r) for r in s["memory_only"]]) for s in steps])
        out.append({
            "name": b,
            "parent": None if info.parent is None else {"branch": info.parent[0], "step": info.parent[1]},
            "created": info.created,
            "steps": steps,
            "captured": [list(r) for r in spans],
            "memory_only": [list(r) for r in memory],
            "incidents": [i.to_dict() for i in incidents if i.branch == b],
            **_held(T, run.backend, b, time.time()),
        })
    return out


def held_in_memory(backend: Any, branch: str) -> dict[str, Any]:
    """The ``held``, ``held_stale`` (and ``protected``) entries of one
    branch, as :func:`list_store` gives them: what ``find`` and the report
    show beside the listing (one reading of the helpers' records)."""
    import time

    from dstt.format import tier as T

    return _held(T, backend, branch, time.time())


def held_text(b: dict[str, Any]) -> str:
    """One branch's ``held`` entries as text, e.g. ``6-8 by 2/2 ranks (1
    stale record(s) of stopped helpers not counted)``; "" when nothing is
    held and no record is stale (``ls``, ``find`` and the report)."""
    held = "; ".join(f"{a}-{z} by {n}/{w} rank{'s' if w > 1 else ''}" if a != z else f"{a} by {n}/{w}"
                     for a, z, n, w in b.get("held", [])[:4])
    if b.get("held_stale"):
        held += f" ({b['held_stale']} stale record(s) of stopped helpers not counted)"
    return held.strip()


def _held(T: Any, backend: Any, branch: str, now: float) -> dict[str, Any]:
    """The ``held`` and ``held_stale`` entries of a branch (see list_store)."""
    from dstt.format import redundancy as RD

    records = T.read_held(backend, branch)
    scheme, protected = RD.protected_steps(RD.read_protected(backend, branch))  # (issue 26: peer redundancy)
    return {"held": [list(r) for r in T.held_ranges(records, now)], "held_stale": len(T.stale_records(records, now)),
            **({"protected": {"scheme": scheme, "steps": [list(r) for r in protected]}} if protected else {})}


def list_tensors(run: "Run", step: Any = None, branch: str | None = None,
                 patterns: Iterable[str] | None = None, sort: str = "name",
                 reverse: bool = False) -> list[dict[str, Any]]:
    """The tensors of a step (no tensor data read): ``{"name", "shape",
    "dtype", "nbytes", "written", "stats"}`` each, filtered by name globs and
    sorted by ``sort`` (a key of :data:`TENSOR_SORT_KEYS`)."""
    if sort not in TENSOR_SORT_KEYS:
        raise ConfigError(f"cannot sort by {sort!r}; choose one of {', '.join(TENSOR_SORT_KEYS)}")
    rec = run.record(step, branch=branch)
    wanted = set(require_matches(rec.names, patterns, f"at step {rec.step} of branch {rec.branch!r}"))
    rows = [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype.logical, "nbytes": e.nbytes,
             "written": e.written, "stats": dict(e.stats)} for e in rec.entries if e.name in wanted]

    def key(r: dict[str, Any]) -> Any:
        if sort in r:
            return r[sort]
        v = r["stats"].get(sort, float("nan"))
        return (v != v, v)  # NaN last

    return sorted(rows, key=key, reverse=reverse)
