"""The one gc path (``dstt.gc()`` and ``dstt gc``): commit what dead
trainers sealed (:mod:`dstt.capture.salvage`), then collect garbage
(:func:`dstt.format.gc.collect_garbage`), then the memory tier's records of
runs that are over (:mod:`dstt.capture.runsover`).

Torch-free unless there is something to salvage: salvaging writes steps
(the store's writer, which imports torch), but whether there is anything
to salvage is decided here from the rings on this host and the records in
the store, without torch (:func:`salvage_needed`). The check is
conservative: any staging ring on this host whose owner is proven gone
(:func:`dstt.capture.ringowner.probe`, what salvage itself asks) and that
names this store, whatever its branch, or any uncommitted step directory
holding rank 0's record, takes the full path, which decides ring by ring as
before. A ring whose owner may live is never salvaged (and a live writer
makes gc refuse anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from dstt.capture import ringowner as O
from dstt.capture.runsover import collect_runs
from dstt.format import layout as L
from dstt.format.backends import open_backend
from dstt.format.gc import GcReport, collect_garbage, leftover_records
from dstt.format.root import check_root, list_branches

#: rank 0's record in a step directory (capture/ranks.py ``record_key``).
RANK0_RECORD = "rank-00000.json"


def salvage_needed(backend: Any, base: Path | None = None) -> bool:
    """Could salvage commit anything in this store? False only when no
    branch of it has a single-process ring on this host, no other ring whose
    owner is gone names this store, and no branch
    has an uncommitted step directory with rank 0's record."""
    url = str(backend.url)
    if any(O.rings_in(O.group_dir(url, b, base)) for b in list_branches(backend)):
        return True  # (the rings salvage recovers, or removes when their owner died setting them up)
    for group in O.groups(base):
        for ring in O.rings_in(group):
            owner = O.probe(ring)
            if owner is not None and owner.get("store") == url:
                return True
    for branch in list_branches(backend):
        prefix = L.steps_prefix(branch).rstrip("/")
        for d in backend.list_dir(prefix):
            if not (d.isdigit() and len(d) == L.STEP_DIGITS):
                continue
            names = backend.list_dir(f"{prefix}/{d}")
            if L.COMMIT_FILE not in names and RANK0_RECORD in names:
                return True
    return False


def gc(store: Any, *, dry_run: bool = False, progress: Callable[[str], None] | None = None,
       base: Path | None = None) -> GcReport:
    """Salvage (only when :func:`salvage_needed`), then collect; see
    :func:`dstt.gc`."""
    backend = open_backend(store, create=False)
    check_root(backend)
    committed: dict[str, list[int]] = {}
    incidents: list[dict[str, Any]] = []
    if salvage_needed(backend, base):
        from dstt.capture.salvage import salvage  # (writes steps: imports torch)

        if progress:
            progress("committing the steps dead trainers sealed")
        saved = salvage(store, dry_run=dry_run, base=base)
        committed, records, incidents = saved.committed, saved.records_removed, saved.incidents
    else:
        records = sum(leftover_records(backend, b, dry_run) for b in list_branches(backend))
    report = collect_garbage(store, dry_run=dry_run, progress=progress)
    report.committed, report.records_removed, report.incidents = committed, records, incidents
    # the memory tier's records of runs that are over, some helper of which died (runsover.py)
    n, nbytes = collect_runs(backend, list_branches(backend), dry_run=dry_run, base=base)
    report.tier_records_removed += n
    report.bytes_freed += nbytes
    return report
