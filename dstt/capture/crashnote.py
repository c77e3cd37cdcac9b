"""The crash incident of a run whose capture helpers died too (issue 25).

A SIGKILL of the trainer alone is recorded by its capture helper: it sees
the end of its command pipe, stores the memory tier's steps and records a
``"crash"`` incident (helpertier.py). When the helpers die too -- the whole
node or job SIGKILLed -- nobody is left to record it: the staging rings
stay in /dev/shm, and whoever salvages them later (the next Capture on the
branch, ``dstt gc``: ring.recover, ranks.record_rings, salvage.py) commits
their sealed steps. This module makes that salvager record the crash too,
as the helper would have, so ``dstt ls``, ``find`` and the report point at
it:

* one ``"crash"`` incident per crashed run -- a single process's ring, or
  every rank's ring of one distributed run (its run id) -- naming the last
  step the run sealed (``step``), the sealed steps now stored
  (``steps``), the ranks whose rings were salvaged (``ranks``, and in the
  reason), and how it was found (by whom, when; the trainer's pid; whether
  the trainer gave its ring up alive after its helper died). Its ``time``
  is the newest seal's: the run's last sign of life, not the salvage's;
* recorded once: the key is made from the run (``dstt.format.incidents.
  crash_ident``), the same the helper uses for its own crash incident, and
  :func:`dstt.format.incidents.record_once` merges into a record of that
  id instead of adding one (a second gc, two salvagers one after the
  other under the branch lock, gc on another host of the same run);
* recorded before the ring is removed where the ring is salvaged alone (a
  single process): a salvager killed in between leaves the ring, and the
  next one records it. Under torch.distributed the rings are removed by
  each rank once its part is recorded, before rank 0 commits and records
  the incident: a salvager killed in that window commits the steps later
  (the records) without the incident.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dstt.capture.ringowner import LOCK_FILE, RELEASED_FILE
from dstt.format.backends import Backend
from dstt.format.incidents import Incident, crash_ident, keyed, ranks_text, record_once
from dstt.format.layout import step_ranges

log = logging.getLogger("dstt.capture")

#: Who salvages (in the reason): the Capture's constructor, or gc.
BY_CAPTURE = "the next Capture"
BY_GC = "dstt gc"


@dataclass
class Crash:
    """What the rings of one crashed run say: its branch, its run (a
    distributed Capture's run id, or the ring's directory name), the world
    size (None: a single process), the ranks whose rings were found, the
    steps sealed in them, the newest seal's time, the trainers' pids and
    whether a trainer gave its ring up alive (its helper had died)."""

    branch: str
    run: str
    world: int | None
    ranks: set[int] = field(default_factory=set)
    sealed: set[int] = field(default_factory=set)
    last_seal: float = 0.0
    trainers: set[int] = field(default_factory=set)
    released: bool = False
    #: The record :func:`record` wrote for it (new, or merged into): None
    #: if not recorded (yet), or if a record there said it all already.
    recorded: Incident | None = None

    def add(self, other: Crash) -> None:
        """Fold another ring of the same run into this one."""
        self.ranks |= other.ranks
        self.sealed |= other.sealed
        self.last_seal = max(self.last_seal, other.last_seal)
        self.trainers |= other.trainers
        self.released = self.released or other.released


def of_ring(ring: Any, branch: str) -> Crash | None:
    """The crash a salvaged ring (ring.Abandoned: its owner proven gone,
    its seals checked) shows; None without a sealed step (nothing points
    at the crash: a ring without seals is removed by the sweep)."""
    steps = sorted({int(s["step"]) for s in ring.seals})
    if not steps:
        return None
    owner = ring.owner
    rank, world = owner.get("rank"), owner.get("world")
    dist = type(rank) is int and type(world) is int and 0 <= rank < world
    run = owner.get("run") if dist else None
    crash = Crash(branch, run if isinstance(run, str) and run else ring.dir.name, world if dist else None,
                  {rank} if dist else set(), set(steps))
    for step in steps:
        try:
            crash.last_seal = max(crash.last_seal, os.lstat(ring.dir / f"seal-{step:020d}.json").st_mtime)
        except OSError:
            pass
    pid = owner.get("pid")
    if type(pid) is int and pid > 0:
        crash.trainers.add(pid)
    crash.released = (ring.dir / RELEASED_FILE).exists() and not (ring.dir / LOCK_FILE).exists()
    return crash


def merged(crashes: Iterable[Crash]) -> list[Crash]:
    """One Crash per (branch, run): the rings of every rank of a run folded."""
    out: dict[tuple[str, str], Crash] = {}
    for c in crashes:
        have = out.get((c.branch, c.run))
        if have is None:
            out[(c.branch, c.run)] = Crash(c.branch, c.run, c.world, set(c.ranks), set(c.sealed), c.last_seal,
                                           set(c.trainers), c.released)
        else:
            have.add(c)
    return list(out.values())


def incident_of(crash: Crash, stored: set[int], finder: str, now: float | None = None) -> Incident:
    """The incident recorded for ``crash`` (``stored``: its sealed steps
    stored now, by this salvager or before it)."""
    found_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() if now is None else now))
    pids = ", ".join(map(str, sorted(crash.trainers))) or "?"
    many = crash.world is not None and len(crash.ranks) > 1
    who = f"trainer{'s' if many else ''} (pid{'s' if len(crash.trainers) > 1 else ''} {pids})"
    if crash.released:
        how = (f"the capture helper died and the {who} left its sealed steps in the staging ring; found by "
               f"{finder} at {found_at}")
    else:
        how = (f"the {who} and {'their' if many else 'its'} capture helper{'s' if many else ''} died (staging "
               f"ring{'s' if len(crash.ranks) > 1 else ''} found abandoned by {finder} at {found_at})")
    kept = sorted(crash.sealed & stored)
    lost = sorted(crash.sealed - stored)
    text = f"crash: {how}; the steps sealed there are stored"
    if lost:
        text += f", but not steps {_steps(lost)} (see the log)"
    if crash.world is not None:
        text += f" ({ranks_text(sorted(crash.ranks), crash.world)})"
    ranks = tuple(sorted(crash.ranks)) if crash.world is not None else ()
    return Incident(crash.branch, max(crash.sealed), text, "crash", crash.last_seal or time.time(), tuple(kept),
                    rank=ranks[0] if ranks else None, world=crash.world, ranks=ranks)


def record(backend: Backend, crash: Crash, stored: Callable[[int], bool], finder: str) -> Incident:
    """Record ``crash``'s incident once (see the module docstring); the
    record as it now is. ``stored(step)``: whether a step is committed."""
    inc = incident_of(crash, {s for s in crash.sealed if stored(s)}, finder)
    now, wrote = record_once(backend, inc, crash_ident(crash.run))
    if wrote:
        crash.recorded = now
        log.warning("dstt: recorded a crash incident at step %d of branch %r: %s", now.step, now.branch, now.reason)
    return now


def record_ring(writer: Any, crash: Crash | None, finder: str, found: list[Any] | None) -> None:
    """A single process's ring salvaged by ``writer`` (ring.recover): its
    crash recorded, before the ring is removed (a salvager killed in
    between leaves the ring, and the next records it), and added to ``found``."""
    if crash is None:
        return
    record(writer.backend, crash, writer.is_stored, finder)
    if found is not None:
        found.append(crash)


def unrecorded(backend: Backend, crash: Crash) -> bool:
    """Whether no record of ``crash``'s run is there yet (a dry run's "would record")."""
    return keyed(backend, crash.branch, crash_ident(crash.run)) is None


def _steps(steps: list[int]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in step_ranges(steps))


__all__ = ["BY_CAPTURE", "BY_GC", "Crash", "incident_of", "merged", "of_ring", "record", "record_ring", "unrecorded"]
