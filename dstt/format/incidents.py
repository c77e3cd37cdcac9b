"""Incident records: the moments a run went wrong, as the capture saw them
(issue 14, the flight recorder).

An incident is recorded when the trainer calls ``cap.incident(reason)``
(source ``"trainer"``), when a captured tensor holds NaN/Inf values (source
``"non-finite"``, with the tensors named) or when the trainer rewinds
(source ``"rewind"``). Each is one small JSON document, written atomically
and durably (``put_atomic``) under a key of its own, so two incidents never
overwrite each other::

    meta/incidents/<branch>/<step:020d>-<time ns>-<pid>-<random>.json

    {"format": "dstt-incident", "format_version": 1, "branch": "main",
     "step": 131, "reason": "loss spike: 9.1 after 2.3", "source": "trainer",
     "time": 1763700000.5, "steps": [124, 125, ..., 131], "tensors": []}

``steps`` are the steps of the memory ring persisted because of it (the K
steps that led up to it); ``tensors`` the non-finite tensors, if any. An
incident is not a step: it may name a step that was never persisted.

Reading is defensive (a store may be someone else's): every document is
read with a size bound, validated field by field, and a damaged one is
skipped with a warning -- a listing never fails because of one record.

>>> import tempfile, torch, dstt
>>> from dstt.format.backends import open_backend
>>> path = tempfile.mkdtemp() + "/run"
>>> _ = dstt.save(path, 7, {"w": torch.ones(1)})
>>> b = open_backend(path)
>>> key = record_incident(b, Incident("main", 7, "loss spike", "trainer", 1.0e9, (6, 7)))
>>> [(i.step, i.reason, i.steps) for i in list_incidents(b)]
[(7, 'loss spike', (6, 7))]
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time as _time
from dataclasses import dataclass, replace
from typing import Any

from dstt.errors import ConfigError, CorruptStoreError, DsttError
from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.manifest import decode_json, encode_json

log = logging.getLogger("dstt.store.incidents")  # (its name before the move: logger names are public)

INCIDENT_FORMAT = "dstt-incident"
INCIDENT_VERSION = 1
#: Where incident records live: ``<INCIDENTS_DIR>/<branch>/<...>.json``.
INCIDENTS_DIR = L.INCIDENTS_DIR
incidents_prefix = L.incidents_prefix
#: Sources an incident can have.
SOURCES = ("trainer", "non-finite", "rewind", "crash")
#: Longest reason kept (characters; a longer one is cut, with "..." at the end).
MAX_REASON_CHARS = 1000
#: Ring steps and tensor names one record holds at most (a ring holds far
#: fewer steps; the tensor list is cut, never the record refused on write).
MAX_STEPS = 100_000
MAX_TENSORS = 1000
MAX_TENSOR_NAME_CHARS = 4096
#: Latest time a record may carry (seconds since the epoch, ~year 5000):
#: anything beyond (or NaN, which JSON readers accept) cannot be shown as a date.
MAX_TIME_S = 1e11
#: A record is small; anything bigger is not one.
MAX_INCIDENT_BYTES = 1 << 20
#: Ranks a record may name.
MAX_WORLD = 1 << 20
#: Records listed per branch at most (a hostile store cannot make a listing
#: read millions of files).
MAX_INCIDENTS = 100_000
_IDENT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Incident:
    """One recorded incident of a branch.

    ``steps``: the ring's steps persisted because of it; ``tensors``: the
    non-finite tensors (for ``source="non-finite"``)."""

    branch: str
    step: int
    reason: str
    source: str  # "trainer" (cap.incident), "non-finite" (automatic), "rewind"
    time: float
    steps: tuple[int, ...]
    tensors: tuple[str, ...] = ()
    #: Under torch.distributed (issue 25): the rank it was raised on and the
    #: world size (every rank's helper dumped its shards; one record).
    rank: int | None = None
    world: int | None = None
    #: A crash found by whoever salvaged the run's staging rings (its
    #: helpers died too): the ranks whose rings were salvaged (optional).
    ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {"branch": self.branch, "step": self.step, "reason": self.reason, "source": self.source,
               "time": self.time, "steps": list(self.steps), "tensors": list(self.tensors)}
        if self.world is not None:
            out["rank"], out["world"] = self.rank, self.world
            if self.ranks:
                out["ranks"] = list(self.ranks)
        return out


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def incident_document(incident: Incident) -> bytes:
    """The record of ``incident`` (what :func:`parse_incident` reads back);
    the reason and tensor names are cut to their bounds, never refused: an
    incident is recorded while something is already going wrong."""
    L.validate_branch(incident.branch)
    L.validate_step(incident.step)
    if incident.source not in SOURCES:
        raise ConfigError(f"incident source must be one of {', '.join(SOURCES)}, got {incident.source!r}")
    if not isinstance(incident.reason, str):
        raise ConfigError(f"incident reason must be text, got {type(incident.reason).__name__}")
    steps = sorted({L.validate_step(s, "incident step") for s in incident.steps})[:MAX_STEPS]
    tensors = [_cut(str(t), MAX_TENSOR_NAME_CHARS) for t in incident.tensors[:MAX_TENSORS]]
    t = float(incident.time)
    ranks: dict[str, int | list[int]] = {}
    if incident.world is not None:
        if not (isinstance(incident.rank, int) and 0 <= incident.rank < incident.world <= MAX_WORLD):
            raise ConfigError(f"incident rank {incident.rank!r} of world {incident.world!r}")
        ranks = {"rank": incident.rank, "world": incident.world}
        named = sorted(set(incident.ranks))
        if not all(isinstance(r, int) and 0 <= r < incident.world for r in named):
            raise ConfigError(f"incident ranks {incident.ranks!r} of world {incident.world!r}")
        if named:
            ranks["ranks"] = named
    elif incident.ranks:
        raise ConfigError("incident ranks need a world size")
    return encode_json({
        "format": INCIDENT_FORMAT, "format_version": INCIDENT_VERSION, "branch": incident.branch,
        "step": incident.step, "reason": _cut(incident.reason, MAX_REASON_CHARS), "source": incident.source,
        "time": t if 0 <= t <= MAX_TIME_S else 0.0, "steps": steps, "tensors": tensors, **ranks,
    })


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptStoreError(f"{where}: {what}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_incident(data: bytes, where: str, branch: str | None = None) -> Incident:
    """An incident record, validated (CorruptStoreError otherwise): format,
    branch (``branch`` when given), step, text reason of bounded length, a
    known source, numeric time, ascending ring steps, tensor names."""
    doc = decode_json(data, where)
    _need(isinstance(doc, dict), where, "not an incident record (not a JSON object)")
    _need(doc.get("format") == INCIDENT_FORMAT, where, f"not an incident record (format {doc.get('format')!r})")
    _need(doc.get("format_version") == INCIDENT_VERSION, where,
          f"incident record format version {doc.get('format_version')!r}, this dstt reads {INCIDENT_VERSION}")
    b = doc.get("branch")
    _need(isinstance(b, str), where, "branch must be a string")
    try:
        L.validate_branch(b)
    except DsttError:
        raise CorruptStoreError(f"{where}: invalid branch name {b!r}") from None
    _need(branch is None or b == branch, where, f"incident of branch {b!r} under branch {branch!r}")
    step = doc.get("step")
    _need(_is_int(step) and 0 <= step <= L.MAX_STEP, where, f"step must be an integer in 0..{L.MAX_STEP}")
    reason = doc.get("reason")
    _need(isinstance(reason, str) and len(reason) <= MAX_REASON_CHARS, where,
          f"reason must be text of at most {MAX_REASON_CHARS} characters")
    source = doc.get("source")
    _need(source in SOURCES, where, f"unknown source {source!r}")
    t = doc.get("time")
    _need(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= MAX_TIME_S, where,
          f"time must be a number of seconds since the epoch (0..{MAX_TIME_S:g})")
    steps = doc.get("steps")
    _need(isinstance(steps, list) and len(steps) <= MAX_STEPS
          and all(_is_int(s) and 0 <= s <= L.MAX_STEP for s in steps), where,
          f"steps must be a list of at most {MAX_STEPS} step numbers")
    _need(all(a < c for a, c in zip(steps, steps[1:])), where, "steps must be ascending")
    tensors = doc.get("tensors", [])
    _need(isinstance(tensors, list) and len(tensors) <= MAX_TENSORS
          and all(isinstance(n, str) and len(n) <= MAX_TENSOR_NAME_CHARS for n in tensors), where,
          f"tensors must be a list of at most {MAX_TENSORS} names")
    rank, world = doc.get("rank"), doc.get("world")
    _need((rank is None and world is None)
          or (_is_int(rank) and _is_int(world) and 0 <= rank < world <= MAX_WORLD), where,
          "rank and world must be integers, 0 <= rank < world")
    named = doc.get("ranks", [])
    _need(isinstance(named, list) and (not named or world is not None)
          and all(_is_int(r) and 0 <= r < world for r in named)
          and all(a < c for a, c in zip(named, named[1:])), where,
          "ranks must be ascending ranks of the world")
    return Incident(b, step, reason, source, float(t), tuple(steps), tuple(tensors), rank, world, tuple(named))


def incident_key(incident: Incident, ident: str | None = None) -> str:
    """A key of its own for a new record: the step first (listings sort by
    it), then the wall clock, the process and a random part, so records
    written at once by any number of processes never share a key. With
    ``ident`` (an incident every rank acts on, issue 25) the key is
    ``<step>-<ident>.json``: a retry, or another rank's helper recording
    the same incident, rewrites the one record."""
    if ident is not None:
        if not _IDENT_RE.fullmatch(ident):
            raise ConfigError(f"invalid incident id {ident!r}")
        return f"{incidents_prefix(incident.branch)}{incident.step:0{L.STEP_DIGITS}d}-{ident}.json"
    return (f"{incidents_prefix(incident.branch)}{incident.step:0{L.STEP_DIGITS}d}-{_time.time_ns()}"
            f"-{os.getpid()}-{secrets.token_hex(4)}.json")


def record_incident(backend: Backend, incident: Incident, ident: str | None = None) -> str:
    """Write ``incident`` durably (its record is complete or absent, never
    partial) and return its key (``ident``: see :func:`incident_key`)."""
    data = incident_document(incident)
    key = incident_key(incident, ident)
    backend.put_atomic(key, data)  # durable when it returns (temp file, fsync, rename, fsync dir)
    return key


def ranks_text(ranks: tuple[int, ...] | list[int], world: int | None) -> str:
    """``ranks 0, 1 of 4``: the ranks a crash incident names (at the end of
    its reason, in parentheses; :func:`record_once` keeps it up to date).

    >>> ranks_text([0, 1], 4)
    'ranks 0, 1 of 4'
    """
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))} of {world}"


_RANKS_RE = re.compile(r"\(ranks? [0-9, ]+ of [0-9]+\)$")


def crash_ident(run: str) -> str:
    """The id of the crash incident of the run whose staging ring is
    ``run`` (a distributed Capture's run id, or a single process's ring
    directory name): the capture helper that saw its trainer die and
    whoever salvages its ring later record under the same id, so the crash
    is recorded once (:func:`record_once`).

    >>> crash_ident("4242-0123456789ab")
    'crash-4242-0123456789ab'
    """
    text = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:58]
    return f"crash-{text or 'run'}"


def keyed(backend: Backend, branch: str, ident: str) -> str | None:
    """The key of ``branch``'s record made with ``ident`` (see
    :func:`incident_key`), if there is one."""
    if not _IDENT_RE.fullmatch(ident):
        raise ConfigError(f"invalid incident id {ident!r}")
    tail = f"-{ident}.json"
    names = backend.list_dir(incidents_prefix(branch).rstrip("/"))
    found = sorted(n for n in names if n.endswith(tail) and n[: -len(tail)].isdigit())
    return incidents_prefix(branch) + found[0] if found else None


def record_once(backend: Backend, incident: Incident, ident: str) -> tuple[Incident, bool]:
    """Record ``incident`` under ``ident`` unless a record of that id is
    there already: then the two are one incident, the steps and ranks of
    ``incident`` merged into the record there (rewritten only if that adds
    any). (the record now, whether this call wrote it). The caller holds
    the branch's write lock; two callers racing on the same new key
    still make one record (``put_if_absent``)."""
    key = keyed(backend, incident.branch, ident)
    if key is None:
        new = incident_key(incident, ident)
        if backend.put_if_absent(new, incident_document(incident)):
            return incident, True
        key = new
    try:
        have = parse_incident(bytes(backend.get(key, max_bytes=MAX_INCIDENT_BYTES) or b""), key, incident.branch)
    except CorruptStoreError as e:
        log.warning("replacing incident record %r: %s", key, e)
        backend.put_atomic(key, incident_document(incident))
        return incident, True
    steps = tuple(sorted(set(have.steps) | set(incident.steps)))
    ranks = tuple(sorted(set(have.ranks) | set(incident.ranks))) if have.world is not None else have.ranks
    if steps == have.steps and ranks == have.ranks:
        return have, False
    reason = _RANKS_RE.sub(f"({ranks_text(ranks, have.world)})", have.reason) if ranks != have.ranks else have.reason
    merged = replace(have, step=max(have.step, incident.step), steps=steps, ranks=ranks, reason=reason)
    backend.put_atomic(key, incident_document(merged))
    return merged, True


def _branches(backend: Backend) -> list[str]:
    out = []
    for name in backend.list_dir(INCIDENTS_DIR):
        try:
            out.append(L.validate_branch(name))
        except DsttError:
            log.warning("ignoring %r in %s: not a branch name", name[:80], INCIDENTS_DIR)
    return sorted(out)


def list_incidents(backend: Backend, branch: str | None = None) -> list[Incident]:
    """The incidents recorded on ``branch`` (every branch when None), sorted
    by (branch, step, time). A record that cannot be read or fails
    validation is skipped with a warning (logging)."""
    branches = [L.validate_branch(branch)] if branch is not None else _branches(backend)
    out: list[Incident] = []
    for b in branches:
        names = [n for n in backend.list_dir(incidents_prefix(b).rstrip("/")) if n.endswith(".json")]
        if len(names) > MAX_INCIDENTS:
            log.warning("branch %r has %d incident records; reading the first %d", b, len(names), MAX_INCIDENTS)
            names = sorted(names)[:MAX_INCIDENTS]
        for name in names:
            key = incidents_prefix(b) + name
            try:
                data = backend.get(key, max_bytes=MAX_INCIDENT_BYTES)
                if data is None:
                    continue  # removed since the listing (or a directory stands there)
                out.append(parse_incident(bytes(data), key, b))
            except (DsttError, OSError) as e:
                log.warning("skipping incident record %r: %s", key, e)  # %r: a file name is store text
    out.sort(key=lambda i: (i.branch, i.step, i.time))
    return out


__all__ = ["INCIDENTS_DIR", "Incident", "crash_ident", "incident_document", "incidents_prefix", "keyed",
           "list_incidents", "parse_incident", "record_incident", "record_once"]
