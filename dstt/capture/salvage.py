"""What gc (``dstt.gc()`` and ``dstt gc`` alike: store/gc.py) commits
before collecting garbage: the steps that dead trainers (and their dead
capture helpers) left sealed in staging rings on this host, or recorded by
every rank in the store (ring.py, ranks.py).

Without this, gc would take such a step's chunks for the leftovers of a
crash and remove them, although the step was captured whole. Per branch,
under its write lock (a live writer makes gc refuse, as it does anyway):

* single-process rings: :func:`dstt.capture.ring.recover`;
* rings of a distributed Capture (one per rank): each rank's sealed,
  unrecorded steps are written and recorded (:func:`ranks.record_rings`),
  then every step all ranks recorded is committed (:func:`ranks.commit_recorded`);
* records left in committed step directories (a helper killed between
  the commit marker and their removal) are removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstt.capture import crashnote, ranks
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.format.backends import open_backend
from dstt.format.gc import leftover_records as _leftover_records
from dstt.format.rankparts import recorded_steps
from dstt.format.root import list_branches
from dstt.format.writeoptions import WriteOptions


@dataclass
class Salvage:
    """Steps committed (or, dry run, that would be) per branch."""

    committed: dict[str, list[int]] = field(default_factory=dict)
    records_removed: int = 0
    #: The crash incidents of the runs salvaged (crashnote.py), as recorded
    #: (dry run: as they would be), one per run, plain data.
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"committed": [{"branch": b, "step": s} for b, steps in self.committed.items() for s in steps],
                "records_removed": self.records_removed, "incidents": self.incidents}


def _ring_steps(store_url: str, branch_info: Any, base: Path | None, found: list[crashnote.Crash]) -> list[int]:
    """Sealed steps of this branch's single-process rings whose owners are
    proven gone, their records checked (read only: nothing removed); their
    crashes added to ``found``."""
    identity = {"store": store_url, "branch": branch_info.name, "branch_id": branch_info.id,
                "branch_created": branch_info.created}
    steps: set[int] = set()
    for ring in R.abandoned(identity, base, dry_run=True):
        steps.update(seal["step"] for seal in ring.seals)
        crash = crashnote.of_ring(ring, branch_info.name)
        if crash is not None:
            found.append(crash)
        ring.keep()
    return sorted(steps)


def salvage(store: Any, *, dry_run: bool = False, base: Path | None = None) -> Salvage:
    """Commit what dead trainers sealed or recorded on ``store`` (see the
    module docstring); with ``dry_run`` only say what would be committed.

    >>> import tempfile, torch, dstt
    >>> path = tempfile.mkdtemp() + "/run"
    >>> _ = dstt.save(path, 0, {"w": torch.ones(2)})
    >>> salvage(path).committed
    {}
    """
    from dstt.store.writer import Writer

    backend = open_backend(store, create=False)
    out = Salvage()
    url = str(backend.url)
    for branch in list_branches(backend):
        dist = ranks.rings_of(url, branch, base)
        if not (_has_single_rings(url, branch, base) or dist or recorded_steps(backend, branch, None)):
            out.records_removed += _leftover_records(backend, branch, dry_run)
            continue
        with Writer(store, WriteOptions(branch=branch)) as writer:
            last = writer.last_step
            found: list[crashnote.Crash] = []
            if dry_run:
                steps = set(_ring_steps(url, writer.branch, base, found))
                for ident in dist:
                    identity = ranks.ring_identity(url, writer.branch, ident["rank"], ident["world"])
                    steps.update(ranks.record_rings(writer, identity, base=base, dry_run=True, found=found))
                steps.update(ranks.commit_recorded(writer, dry_run=True))
                done = sorted(s for s in steps if last is None or s > last)
                out.incidents += [crashnote.incident_of(c, c.sealed, crashnote.BY_GC).to_dict()
                                  for c in crashnote.merged(found) if crashnote.unrecorded(backend, c)]
            else:
                identity = {"store": url, "branch": branch, "branch_id": writer.branch.id,
                            "branch_created": writer.branch.created}
                done = R.recover(writer, identity, base=base, finder=crashnote.BY_GC, found=found)
                single = len(found)  # (recorded by R.recover, ring by ring)
                for ident in dist:
                    rank, world = ident["rank"], ident["world"]
                    identity = ranks.ring_identity(url, writer.branch, rank, world)
                    if rank == 0:
                        ranks.record_rings(writer, identity, base=base, found=found)
                        continue
                    with Writer(store, WriteOptions(branch=branch), coordinator=ranks.FixedRank(rank, world)) as other:
                        ranks.record_rings(other, identity, base=base, found=found)  # this rank's chunk writes
                done += ranks.commit_recorded(writer)
                runs = crashnote.merged(found[single:])  # one incident per distributed run
                for crash in runs:
                    crashnote.record(writer.backend, crash, writer.is_stored, crashnote.BY_GC)
                out.incidents += [c.recorded.to_dict() for c in found[:single] + runs if c.recorded is not None]
            if done:
                out.committed[branch] = done
        out.records_removed += _leftover_records(backend, branch, dry_run)
    return out


def _has_single_rings(url: str, branch: str, base: Path | None) -> bool:
    return bool(O.rings_in(R.group_dir(url, branch, base)))
