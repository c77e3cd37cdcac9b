"""Who took part in a capture run's memory tier, and who is done (issue 25):
the marks under ``meta/tier/<branch>/<run>/`` that let the last helper to
close, or ``dstt gc`` after a crash, remove a run's records.

    <run>/open-<rank>.json      rank <rank>'s helper started serving the run:
                                its host, and its own and its trainer's
                                process identity (pid, start time, boot id,
                                PID namespace)
    <run>/closed-<rank>.json    rank <rank>'s helper closed cleanly
                                (format/tier.py :func:`~dstt.format.tier.close_run`)

A run whose helpers all closed cleanly removes its records itself (the last
one to close). A run some helper of which died keeps them: gc removes them
once it can prove that no helper of the run can still need them (the
capture side decides, capture/runsover.py, from :func:`read_marks`). Every
mark read back is untrusted: bounded reads, validated field by field; a
mark that fails validation is never taken for proof of anything.

>>> from dstt.format.backends.zarr_store import ZarrStoreBackend
>>> import zarr.storage
>>> b = ZarrStoreBackend(zarr.storage.MemoryStore())
>>> write_open(b, OpenMark("main", "run1", 1, 2, "h", {"pid": 7}, {"pid": 6}))
>>> m = read_marks(b, "main", "run1")
>>> sorted(m.opened), m.closed, m.world
([1], set(), 2)
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from dstt.errors import CorruptStoreError, DsttError
from dstt.format.backends import Backend
from dstt.format.manifest import decode_json, encode_json
from dstt.format.tier import MAX_RECORD_BYTES, MAX_WORLD, TIER_DIR, run_prefix, validate_run

log = logging.getLogger("dstt.store.tier")

OPEN_FORMAT = "dstt-tier-open"
OPEN_VERSION = 1
#: Marks read per run at most (two per rank).
MAX_MARKS = 2 * 65536
_MARK_RE = re.compile(r"(open|closed)-([0-9]{1,7})\.json")
_ID_KEYS = ("pid", "start", "boot", "pidns")


@dataclass(frozen=True)
class OpenMark:
    """Rank ``rank``'s helper of ``run`` started: where, and which processes
    (``helper``, ``trainer``: process identities, capture/ringowner.py)."""

    branch: str
    run: str
    rank: int
    world: int
    host: str
    helper: dict[str, Any]
    trainer: dict[str, Any]


@dataclass
class RunMarks:
    """A run's marks as read back: the valid open marks by rank, the ranks
    closed, the world size they agree on (0: unknown), and whether any mark
    could not be read or failed validation (then nothing is proven)."""

    opened: dict[int, OpenMark] = field(default_factory=dict)
    closed: set[int] = field(default_factory=set)
    world: int = 0
    damaged: bool = False


def open_key(branch: str, run: str, rank: int) -> str:
    return f"{run_prefix(branch, run)}open-{int(rank)}.json"


def write_open(backend: Backend, mark: OpenMark) -> None:
    """Publish ``mark`` (a helper starting to serve its run)."""
    validate_run(mark.run)
    backend.put_atomic(open_key(mark.branch, mark.run, mark.rank), encode_json({
        "format": OPEN_FORMAT, "format_version": OPEN_VERSION, "branch": mark.branch, "run": mark.run,
        "rank": int(mark.rank), "world": int(mark.world), "host": mark.host[:256],
        "helper": _identity(mark.helper), "trainer": _identity(mark.trainer)}))


def _identity(proc: Any) -> dict[str, Any]:
    """The fields of a process identity a mark keeps (ints and short strings)."""
    out: dict[str, Any] = {}
    if isinstance(proc, dict):
        for k in _ID_KEYS:
            v = proc.get(k)
            if (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and len(v) <= 256):
                out[k] = v
    return out


def parse_open(data: bytes, where: str, branch: str, run: str) -> OpenMark:
    doc = decode_json(data, where)
    if not (isinstance(doc, dict) and doc.get("format") == OPEN_FORMAT and doc.get("format_version") == OPEN_VERSION):
        raise CorruptStoreError(f"{where}: not a memory-tier open mark")
    rank, world, host = doc.get("rank"), doc.get("world"), doc.get("host")
    ok = (doc.get("branch") == branch and doc.get("run") == run and type(rank) is int and type(world) is int
          and 0 <= rank < world <= MAX_WORLD and isinstance(host, str) and len(host) <= 256
          and isinstance(doc.get("helper"), dict) and isinstance(doc.get("trainer"), dict))
    if not ok:
        raise CorruptStoreError(f"{where}: branch, run, rank, world, host or processes invalid")
    return OpenMark(branch, run, int(doc["rank"]), int(doc["world"]), str(doc["host"]), _identity(doc["helper"]),
                    _identity(doc["trainer"]))


def list_runs(backend: Backend, branch: str) -> list[str]:
    """The run ids with records under ``meta/tier/<branch>/``."""
    from dstt.format import layout as L

    base = f"{TIER_DIR}/{L.validate_branch(branch)}"
    return sorted(r for r in backend.list_dir(base) if r != "held" and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", r))


def read_marks(backend: Backend, branch: str, run: str) -> RunMarks:
    """``run``'s open and closed marks (see :class:`RunMarks`)."""
    prefix = run_prefix(branch, run)
    out = RunMarks()
    worlds: set[int] = set()
    names = backend.list_dir(prefix.rstrip("/"))
    if len(names) > MAX_MARKS:
        out.damaged = True
    for name in sorted(names)[:MAX_MARKS]:
        m = _MARK_RE.fullmatch(name)
        if m is None:
            continue
        rank = int(m.group(2))
        try:
            data = backend.get(prefix + name, max_bytes=MAX_RECORD_BYTES)
            if data is None:
                continue
            if m.group(1) == "closed":
                doc = decode_json(bytes(data), prefix + name)
                w = doc.get("world") if isinstance(doc, dict) else None
                if not (isinstance(doc, dict) and doc.get("rank") == rank and type(w) is int and 0 <= rank < w):
                    raise CorruptStoreError(f"{prefix + name}: not a closed mark of rank {rank}")
                out.closed.add(rank)
                worlds.add(w)
            else:
                mark = parse_open(bytes(data), prefix + name, branch, run)
                if mark.rank != rank:
                    raise CorruptStoreError(f"{prefix + name}: names rank {mark.rank}")
                out.opened[rank] = mark
                worlds.add(mark.world)
        except (DsttError, OSError) as e:
            log.warning("memory-tier mark %r: %s", prefix + name, e)
            out.damaged = True
    if len(worlds) == 1:
        out.world = worlds.pop()
    elif worlds:
        out.damaged = True  # (marks of one run disagree on its size: nothing is proven)
    return out


__all__ = ["OPEN_FORMAT", "OpenMark", "RunMarks", "list_runs", "open_key", "parse_open", "read_marks", "write_open"]
