"""gc's last step for the memory tier (issue 25): the records of capture
runs that are over -- their marks, persist decisions, incident requests and
the helpers' held records -- removed, where no live run can need them.

A run's helpers remove its records themselves when every one of them closes
cleanly (format/tier.py ``close_run``). A run one of whose helpers died
(SIGKILL, a node lost) keeps them, and so would forever. gc removes them
once it can prove, on this host, that the run is over -- for every rank of
the run (format/tierruns.py):

* its helper closed cleanly (``closed-<rank>.json``), or
* its ``open-<rank>.json`` names processes of this boot and PID namespace,
  neither its helper nor its trainer runs any more (pid *and* start time:
  capture/ringowner.py), and no staging ring of the run for that rank is
  left on this host whose owner may still live (a ring a dead trainer left
  is committed by the salvage that runs before this, and removed).

Anything short of that proof keeps the run's records: a rank with no mark
(its helper not started yet, or a dstt before the marks), a mark of another
host or boot, a mark that fails validation, a live process. So a live run
never loses a record it needs; the worst a wrong "alive" costs is records
kept for a later gc. Torch-free (gc's path without anything to salvage).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dstt.capture import ringowner as O
from dstt.errors import DsttError
from dstt.format.backends import Backend
from dstt.format.tier import read_held, remove_held, remove_run, run_prefix
from dstt.format.tierruns import RunMarks, list_runs, read_marks

log = logging.getLogger("dstt.capture")


def run_over(marks: RunMarks, rings: set[tuple[str, int]], run: str) -> bool:
    """Whether ``marks`` prove ``run`` over on this host (see the module
    docstring); ``rings``: (run, rank) of the rings on this host, of this
    store and branch, whose owner may still live."""
    if marks.damaged or marks.world <= 0:
        return False
    for rank in range(marks.world):
        if rank in marks.closed:
            continue
        mark = marks.opened.get(rank)
        if mark is None or (run, rank) in rings:
            return False
        if not (O.same_namespace(mark.helper, "pidns") and O.same_namespace(mark.trainer, "pidns")):
            return False  # (another host, boot or container: nothing proven here)
        if O.identity_alive(mark.helper) or O.identity_alive(mark.trainer):
            return False
    return True


def live_rings(store_url: str, branch: str, base: Path | None = None) -> set[tuple[str, int]]:
    """(run, rank) of this host's staging rings of ``store_url``'s
    ``branch`` that are not proven abandoned (their owner may live, or
    their owner record cannot be read)."""
    out: set[tuple[str, int]] = set()
    for group in O.groups(base):
        for ring in O.rings_in(group):
            try:
                owner = json.loads(O.read_regular(ring / O.OWNER_FILE, O.OWNER_MAX_BYTES))
            except (OSError, ValueError, RecursionError):
                continue  # (not this run's as far as anyone can tell: salvage sets such rings aside)
            if not isinstance(owner, dict) or owner.get("store") != store_url or owner.get("branch") != branch:
                continue
            run, rank = owner.get("run"), owner.get("rank")
            if isinstance(run, str) and type(rank) is int and O.probe(ring) is None:
                out.add((run, rank))
    return out


def collect_runs(backend: Backend, branches: list[str], *, dry_run: bool = False, base: Path | None = None
                 ) -> tuple[int, int]:
    """Remove (``dry_run``: count) every record of the runs of ``branches``
    that are over (see the module docstring): ``(records, bytes)``."""
    n = nbytes = 0
    url = str(backend.url)
    for branch in branches:
        runs = list_runs(backend, branch)
        if not runs:
            continue
        rings = live_rings(url, branch, base)
        for run in runs:
            try:
                over = run_over(read_marks(backend, branch, run), rings, run)
            except (DsttError, OSError) as e:
                log.warning("gc: leaving the memory-tier records of run %r alone: %s", run, e)
                continue
            if not over:
                continue
            keys = backend.list_prefix(run_prefix(branch, run).rstrip("/"))
            held = [h for h in _held(backend, branch) if h.run == run]
            n += len(keys) + len(held)
            nbytes += sum(backend.size(k) or 0 for k in keys)
            if not dry_run:
                remove_run(backend, branch, run)
                for h in held:  # (a dead helper's last word on what it held: shown stale until now)
                    remove_held(backend, branch, h.rank)
    return n, nbytes


def _held(backend: Backend, branch: str) -> list[Any]:
    try:
        return read_held(backend, branch)
    except (DsttError, OSError) as e:
        log.warning("gc: the held-in-memory records of branch %r: %s", branch, e)
        return []


__all__ = ["collect_runs", "live_rings", "run_over"]
