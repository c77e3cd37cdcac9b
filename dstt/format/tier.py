"""The memory tier's records in the store, under torch.distributed (issue 25).

Every rank's capture helper keeps its shards of the last K steps
(capture/helpertier.py). What the ranks must agree on, and what a reader
of the store (``dstt ls``, ``find``, the report) shows about steps held in
memory, lives here, torch-free, under ``meta/tier/<branch>/``::

    held/rank-<rank:05d>.json       what one rank's tier holds now (HeldRecord)
    <run>/decisions.json            rank 0's persist decisions (persist="newest")
    <run>/incident-<id>.json        an incident raised on some rank (IncidentRequest)

Each is one small JSON document written with ``put_atomic`` (readers see
the old or the new one, never a mix) or ``put_if_absent``. Everything read
back is untrusted: bounded reads, validated field by field, a record that
fails validation skipped with a warning, never trusted -- a listing never
fails because of one.

>>> from dstt.format.backends.zarr_store import ZarrStoreBackend
>>> import zarr.storage
>>> b = ZarrStoreBackend(zarr.storage.MemoryStore())
>>> for r in (0, 1):
...     write_held(b, HeldRecord("main", "run1", r, 2, 100 + r, "h", 1.0e9, ((4, 7),) if r else ((5, 7),)))
>>> held_ranges(read_held(b, "main"), now=1.0e9)
[(4, 4, 1, 2), (5, 7, 2, 2)]
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from dstt.errors import ConfigError, CorruptStoreError, DsttError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.incidents import MAX_REASON_CHARS, MAX_TENSORS, SOURCES
from dstt.format.manifest import decode_json, encode_json

log = logging.getLogger("dstt.store.tier")

TIER_DIR = f"{L.META}/tier"
HELD_FORMAT = "dstt-tier-held"
DECISIONS_FORMAT = "dstt-tier-decisions"
REQUEST_FORMAT = "dstt-tier-incident"
TIER_VERSION = 1
#: A record is small; anything bigger is not one.
MAX_RECORD_BYTES = 1 << 20
#: Step ranges one held record names at most (a tier holds K steps: few ranges).
MAX_RANGES = 4096
#: Persist decisions kept in the decisions record (a window: every rank is
#: within a few steps of rank 0, the collectives of training see to that).
DECISION_WINDOW = 4096
#: Ranks a record may name.
MAX_WORLD = 1 << 20
#: A held record older than this (seconds) is shown as stale, never counted.
HELD_STALE_S = 60.0
#: Incident requests listed per run at most.
MAX_REQUESTS = 10_000
_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_RUN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptStoreError(f"{where}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1e11


def validate_run(run: str) -> str:
    """A capture run id as used in keys (letters, digits, ``_``, ``-``)."""
    if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
        raise ConfigError(f"invalid capture run id {run!r}")
    return run


def validate_id(ident: str) -> str:
    """An incident request id (letters, digits, ``_.-``, at most 64)."""
    if not isinstance(ident, str) or not _ID_RE.fullmatch(ident) or ident in (".", ".."):
        raise ConfigError(f"invalid incident id {ident!r}")
    return ident


def _ranges(raw: Any, where: str, what: str, limit: int) -> tuple[tuple[int, int], ...]:
    _need(isinstance(raw, list) and len(raw) <= limit, where, f"{what} must be a list of at most {limit} ranges")
    out: list[tuple[int, int]] = []
    prev = -1
    for r in raw:
        _need(isinstance(r, list) and len(r) == 2 and all(_is_int(x) and 0 <= x <= L.MAX_STEP for x in r), where,
              f"{what}: each range must be [first, last] step numbers")
        _need(prev < r[0] <= r[1], where, f"{what}: ranges must be ascending and disjoint")
        out.append((r[0], r[1]))
        prev = r[1]
    return tuple(out)


# ----------------------------------------------------------------------------- held in memory


@dataclass(frozen=True)
class HeldRecord:
    """What one rank's tier holds now: ``steps`` as inclusive ranges."""

    branch: str
    run: str
    rank: int
    world: int
    pid: int
    host: str
    time: float
    steps: tuple[tuple[int, int], ...]


def held_prefix(branch: str) -> str:
    return f"{TIER_DIR}/{L.validate_branch(branch)}/held/"


def held_key(branch: str, rank: int) -> str:
    return f"{held_prefix(branch)}rank-{rank:05d}.json"


def write_held(backend: Backend, rec: HeldRecord) -> None:
    """Publish (overwrite) ``rec``: the rank's tier as it is now."""
    validate_run(rec.run)
    if not (0 <= rec.rank < rec.world <= MAX_WORLD):
        raise ConfigError(f"rank {rec.rank} of world {rec.world}")
    steps = [[a, b] for a, b in rec.steps][:MAX_RANGES]
    backend.put_atomic(held_key(rec.branch, rec.rank), encode_json({
        "format": HELD_FORMAT, "format_version": TIER_VERSION, "branch": rec.branch, "run": rec.run,
        "rank": rec.rank, "world": rec.world, "pid": rec.pid, "host": rec.host[:256], "time": float(rec.time),
        "steps": steps}))


def remove_held(backend: Backend, branch: str, rank: int) -> None:
    """The rank's tier is empty (closed): nothing held any more."""
    backend.delete(held_key(branch, rank))


def parse_held(data: bytes, where: str, branch: str) -> HeldRecord:
    doc = decode_json(data, where)
    _need(isinstance(doc, dict) and doc.get("format") == HELD_FORMAT, where, "not a held-in-memory record")
    _need(doc.get("format_version") == TIER_VERSION, where, f"format version {doc.get('format_version')!r}")
    _need(doc.get("branch") == branch, where, f"record of branch {doc.get('branch')!r} under {branch!r}")
    run, rank, world = doc.get("run"), doc.get("rank"), doc.get("world")
    _need(isinstance(run, str) and bool(_RUN_RE.fullmatch(run)), where, "invalid run id")
    _need(_is_int(world) and 0 < world <= MAX_WORLD and _is_int(rank) and 0 <= rank < world, where,
          "rank and world must be integers, 0 <= rank < world")
    _need(_is_int(doc.get("pid")) and isinstance(doc.get("host"), str) and len(doc["host"]) <= 256, where,
          "pid and host")
    _need(_is_time(doc.get("time")), where, "time must be seconds since the epoch")
    steps = _ranges(doc.get("steps"), where, "steps", MAX_RANGES)
    return HeldRecord(branch, run, rank, world, doc["pid"], doc["host"], float(doc["time"]), steps)


def read_rank_records(backend: Any, prefix: str, parse: Callable[[bytes, str], Any], what: str) -> list[Any]:
    """The per-rank records ``<prefix>rank-NNNNN.json`` (at most MAX_WORLD),
    each parsed by ``parse(data, key)`` (which returns a record with a
    ``rank``); a bad one, or one filed under another rank's name, is
    skipped with a warning naming ``what`` it is."""
    out: list[Any] = []
    for name in sorted(backend.list_dir(prefix.rstrip("/")))[:MAX_WORLD]:
        if not re.fullmatch(r"rank-[0-9]{5,7}\.json", name):
            continue
        try:
            data = backend.get(prefix + name, max_bytes=MAX_RECORD_BYTES)
            if data is not None:
                rec = parse(bytes(data), prefix + name)
                _need(name == f"rank-{rec.rank:05d}.json", prefix + name, f"names rank {rec.rank}")
                out.append(rec)
        except (DsttError, OSError) as e:
            log.warning("skipping %s record %r: %s", what, prefix + name, e)
    return out


def read_held(backend: Backend, branch: str) -> list[HeldRecord]:
    """Every rank's held record of ``branch`` (validated; a bad one skipped
    with a warning), by rank."""
    return read_rank_records(backend, held_prefix(branch), lambda data, key: parse_held(data, key, branch),
                             "held-in-memory")


def held_ranges(records: list[HeldRecord], now: float, stale_s: float = HELD_STALE_S
                ) -> list[tuple[int, int, int, int]]:
    """``(first, last, ranks holding, world)`` runs of steps held in memory,
    from the fresh records of the latest run (records older than
    ``stale_s`` at ``now``, or of an older run, are left out: see
    :func:`stale_records`)."""
    fresh = _current(records, now, stale_s)
    if not fresh:
        return []
    world = max(r.world for r in fresh)
    # a sweep over the ranges' ends: O(ranges), whatever steps they span
    delta: dict[int, int] = {}
    for r in fresh:
        for a, b in r.steps:
            delta[a] = delta.get(a, 0) + 1
            delta[b + 1] = delta.get(b + 1, 0) - 1
    out: list[tuple[int, int, int, int]] = []
    n, start = 0, -1
    for s in sorted(delta):
        if n > 0:
            out.append((start, s - 1, n, world))
        n += delta[s]
        start = s
    return out


def held_by(records: list[HeldRecord], step: int, now: float, stale_s: float = HELD_STALE_S) -> tuple[int, int]:
    """``(ranks holding step in memory, world)`` (0, 0 without fresh records)."""
    for a, b, n, w in held_ranges(records, now, stale_s):
        if a <= step <= b:
            return n, w
    fresh = _current(records, now, stale_s)
    return 0, max((r.world for r in fresh), default=0)


def stale_records(records: list[HeldRecord], now: float, stale_s: float = HELD_STALE_S) -> list[HeldRecord]:
    """The records not counted by :func:`held_ranges` (too old, or of an
    older run): a helper that died without removing its record."""
    fresh = set(map(id, _current(records, now, stale_s)))
    return [r for r in records if id(r) not in fresh]


def _current(records: list[HeldRecord], now: float, stale_s: float) -> list[HeldRecord]:
    fresh = [r for r in records if now - r.time <= stale_s]
    if not fresh:
        return []
    latest = max(fresh, key=lambda r: r.time).run
    return [r for r in fresh if r.run == latest]


# ----------------------------------------------------------------------------- persist decisions


@dataclass(frozen=True)
class Decisions:
    """Rank 0's persist decisions (``persist="newest"``): every step up to
    ``upto`` is decided; those in ``persist`` are stored, the others are
    memory only. ``upto`` -1: nothing decided yet."""

    branch: str
    run: str
    upto: int
    persist: frozenset[int]

    def decided(self, step: int) -> bool | None:
        """True (persist), False (memory only) or None (not decided yet, or
        older than the window: the caller persists it, never drops it)."""
        if step > self.upto:
            return None
        if step in self.persist:
            return True
        low = min(self.persist) if len(self.persist) >= DECISION_WINDOW else -1
        return None if step < low else False


def run_prefix(branch: str, run: str) -> str:
    return f"{TIER_DIR}/{L.validate_branch(branch)}/{validate_run(run)}/"


def decisions_key(branch: str, run: str) -> str:
    return run_prefix(branch, run) + "decisions.json"


def write_decisions(backend: Backend, d: Decisions) -> None:
    """Publish ``d`` (rank 0's helper; ``upto`` and ``persist`` only grow)."""
    L.validate_step(max(d.upto, 0))
    keep = sorted(d.persist)[-DECISION_WINDOW:]
    backend.put_atomic(decisions_key(d.branch, d.run), encode_json({
        "format": DECISIONS_FORMAT, "format_version": TIER_VERSION, "branch": d.branch, "run": d.run,
        "upto": d.upto, "persist": keep}))


def read_decisions(backend: Backend, branch: str, run: str) -> Decisions | None:
    """Rank 0's decisions of ``run`` (None when none were published yet).
    A damaged record is CorruptStoreError: the caller (a helper) then
    persists every undecided step rather than guess."""
    key = decisions_key(branch, run)
    data = backend.get(key, max_bytes=MAX_RECORD_BYTES)
    if data is None:
        return None
    doc = decode_json(bytes(data), key)
    _need(isinstance(doc, dict) and doc.get("format") == DECISIONS_FORMAT, key, "not a decisions record")
    _need(doc.get("format_version") == TIER_VERSION, key, f"format version {doc.get('format_version')!r}")
    _need(doc.get("branch") == branch and doc.get("run") == run, key, "of another branch or run")
    upto, persist = doc.get("upto"), doc.get("persist")
    _need(_is_int(upto) and -1 <= upto <= L.MAX_STEP, key, "upto must be a step number or -1")
    _need(isinstance(persist, list) and len(persist) <= DECISION_WINDOW
          and all(_is_int(s) and 0 <= s <= upto for s in persist), key,
          f"persist must be at most {DECISION_WINDOW} steps up to 'upto'")
    _need(all(a < b for a, b in zip(persist, persist[1:])), key, "persist must be ascending")
    return Decisions(branch, run, upto, frozenset(persist))


# ----------------------------------------------------------------------------- incident requests


@dataclass(frozen=True)
class IncidentRequest:
    """An incident raised on one rank, for every rank's helper to act on:
    dump the steps it holds up to ``step`` (``steps``: those the raising
    rank held), and, on rank 0, record one incident."""

    branch: str
    run: str
    ident: str
    step: int
    reason: str
    source: str
    rank: int
    world: int
    time: float
    steps: tuple[int, ...]
    tensors: tuple[str, ...] = ()


def request_key(branch: str, run: str, ident: str) -> str:
    return f"{run_prefix(branch, run)}incident-{validate_id(ident)}.json"


def new_id(source: str, step: int) -> str:
    """The id of a new request: ``nonfinite-<step>`` for the watcher (every
    rank seeing the same NaN makes the same request), ``crash-<step>`` for
    the trainers' death (every rank's helper of a job killed whole makes
    the same one), else random."""
    if source in ("non-finite", "crash"):
        return f"{source.replace('-', '')}-{step}"
    return f"{source}-{step}-{secrets.token_hex(6)}"


def publish_request(backend: Backend, req: IncidentRequest) -> bool:
    """Create the request unless one of the same id exists; True if this
    call created it."""
    L.validate_step(req.step)
    if req.source not in SOURCES:
        raise ConfigError(f"incident source must be one of {', '.join(SOURCES)}, got {req.source!r}")
    doc = {"format": REQUEST_FORMAT, "format_version": TIER_VERSION, "branch": req.branch, "run": req.run,
           "id": validate_id(req.ident), "step": req.step, "reason": req.reason[:MAX_REASON_CHARS],
           "source": req.source, "rank": req.rank, "world": req.world, "time": float(req.time),
           "steps": sorted(set(req.steps))[:DECISION_WINDOW], "tensors": list(req.tensors[:MAX_TENSORS])}
    return backend.put_if_absent(request_key(req.branch, req.run, req.ident), encode_json(doc))


def parse_request(data: bytes, where: str, branch: str, run: str) -> IncidentRequest:
    doc = decode_json(data, where)
    _need(isinstance(doc, dict) and doc.get("format") == REQUEST_FORMAT, where, "not an incident request")
    _need(doc.get("format_version") == TIER_VERSION, where, f"format version {doc.get('format_version')!r}")
    _need(doc.get("branch") == branch and doc.get("run") == run, where, "of another branch or run")
    ident = doc.get("id")
    _need(isinstance(ident, str) and bool(_ID_RE.fullmatch(ident)), where, "invalid id")
    step, rank, world = doc.get("step"), doc.get("rank"), doc.get("world")
    _need(_is_int(step) and 0 <= step <= L.MAX_STEP, where, "step must be a step number")
    _need(_is_int(world) and 0 < world <= MAX_WORLD and _is_int(rank) and 0 <= rank < world, where,
          "rank and world")
    reason = doc.get("reason")
    _need(isinstance(reason, str) and len(reason) <= MAX_REASON_CHARS, where, "reason must be bounded text")
    _need(doc.get("source") in SOURCES, where, f"unknown source {doc.get('source')!r}")
    _need(_is_time(doc.get("time")), where, "time must be seconds since the epoch")
    steps = doc.get("steps")
    _need(isinstance(steps, list) and len(steps) <= DECISION_WINDOW
          and all(_is_int(s) and 0 <= s <= L.MAX_STEP for s in steps), where, "steps must be step numbers")
    _need(all(a < b for a, b in zip(steps, steps[1:])), where, "steps must be ascending")
    tensors = doc.get("tensors", [])
    _need(isinstance(tensors, list) and len(tensors) <= MAX_TENSORS
          and all(isinstance(t, str) and len(t) <= 4096 for t in tensors), where, "tensors must be names")
    return IncidentRequest(branch, run, ident, step, reason, doc["source"], rank, world, float(doc["time"]),
                           tuple(steps), tuple(tensors))


def list_requests(backend: Backend, branch: str, run: str) -> list[IncidentRequest]:
    """The incident requests of ``run`` (validated; a bad one skipped with a
    warning), by (step, time)."""
    prefix = run_prefix(branch, run)
    out: list[IncidentRequest] = []
    names = [n for n in backend.list_dir(prefix.rstrip("/")) if n.startswith("incident-") and n.endswith(".json")]
    for name in sorted(names)[:MAX_REQUESTS]:
        try:
            data = backend.get(prefix + name, max_bytes=MAX_RECORD_BYTES)
            if data is not None:
                req = parse_request(bytes(data), prefix + name, branch, run)
                _need(name == f"incident-{req.ident}.json", prefix + name, f"names id {req.ident!r}")
                out.append(req)
        except (DsttError, OSError) as e:
            log.warning("skipping incident request %r: %s", prefix + name, e)
    out.sort(key=lambda r: (r.step, r.time, r.ident))
    return out


# ----------------------------------------------------------------------------- gc


def _done(backend: Backend, key: str, name: str, branch: str, run: str, committed: set[int]) -> bool:
    """Whether gc may remove the record ``name`` of ``run``: no helper can
    still need it (see :func:`collect_records`). A record that cannot be
    read or fails validation is left alone (never judged, never trusted)."""
    if name == "decisions.json":
        d = read_decisions(backend, branch, run)
        return d is not None and d.upto <= max(committed, default=-1)
    if name.startswith("incident-") and name.endswith(".json"):
        data = backend.get(key, max_bytes=MAX_RECORD_BYTES)
        if data is None:
            return False
        req = parse_request(bytes(data), key, branch, run)
        return req.step in committed and all(s in committed for s in req.steps)
    return False


def collect_records(backend: Backend, branch: str, committed: set[int], *, dry_run: bool = False
                    ) -> tuple[int, int]:
    """Remove (with ``dry_run``: count) the decisions and incident requests
    of ``branch``'s capture runs that no helper can still need;
    ``(records, bytes)``. gc calls it holding every branch lock: no rank 0
    helper of any run of the branch is alive (it shares the lock), though
    another rank's may be. ``committed``: the branch's committed steps.

    * an incident request, once **every step it names is committed**: every
      rank's shards of them are stored, so no helper has anything left to
      store for it (a request naming a step some rank lost stays);
    * the persist decisions, once **their ``upto`` is at or below the
      newest committed step**: a step is committed only after every rank
      recorded it, and a helper records a step of ``persist="newest"`` only
      after reading a decisions record that decides every step up to it,
      which decides every step it held up to ``upto`` (later steps are
      newer); a committed step of a later run means this run's rank 0 is
      gone and its other helpers persist what they cannot decide, never
      drop it.

    Held records (``held/``) are the helpers' own (removed at close, shown
    stale otherwise) and left alone, and so are the directories (another
    rank's live helper may be creating a record in one)."""
    base = f"{TIER_DIR}/{L.validate_branch(branch)}"
    n = nbytes = 0
    for run in sorted(backend.list_dir(base)):
        if run == "held" or not _RUN_RE.fullmatch(run):
            continue
        prefix = run_prefix(branch, run)
        for name in sorted(backend.list_dir(prefix.rstrip("/")))[:MAX_REQUESTS + 1]:
            key = prefix + name
            try:
                if not _done(backend, key, name, branch, run, committed):
                    continue
            except (DsttError, OSError) as e:
                log.warning("gc: leaving memory-tier record %r alone: %s", key, e)
                continue
            n += 1
            nbytes += backend.size(key) or 0
            if not dry_run:
                backend.delete(key)
    return n, nbytes


def remove_run(backend: Backend, branch: str, run: str) -> None:
    """A run's decisions and requests, once its helpers are done (:func:`close_run`)."""
    backend.delete_prefix(run_prefix(branch, run).rstrip("/"))


def closed_key(branch: str, run: str, rank: int) -> str:
    return f"{run_prefix(branch, run)}closed-{int(rank)}.json"


def close_run(backend: Backend, branch: str, run: str, rank: int, world: int) -> bool:
    """Rank ``rank``'s helper of ``run`` closed cleanly: say so; the last of
    the ``world`` helpers to close removes the run's records (its
    decisions, requests and these marks: nobody can need them any more).
    True if this call removed them. A run some helper of which died keeps
    its records (gc removes what no helper can need)."""
    prefix = run_prefix(branch, run)
    backend.put_atomic(closed_key(branch, run, rank), encode_json({"rank": int(rank), "world": int(world)}))
    names = set(backend.list_dir(prefix.rstrip("/"))[:MAX_REQUESTS + 1])
    if not all(f"closed-{r}.json" in names for r in range(world)):
        return False
    remove_run(backend, branch, run)
    return True


__all__ = ["DECISION_WINDOW", "Decisions", "HELD_STALE_S", "HeldRecord", "IncidentRequest", "TIER_DIR",
           "close_run", "closed_key", "collect_records", "decisions_key", "held_by", "held_key", "held_ranges", "list_requests", "new_id", "parse_held",
           "parse_request", "publish_request", "read_decisions", "read_held", "remove_held", "remove_run",
           "request_key", "stale_records", "write_decisions", "write_held"]
