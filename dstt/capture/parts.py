"""What :attr:`dstt.Capture.parts` shows: the components of a Capture, for
tests and tools (read them; inject faults only through their documented
hooks: ``Ring.before_op``, ``Capture.before_copy``, ``Capture.after_seal``,
``Stager.before_lazy``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dstt.capture.committers import Committer
from dstt.capture.copygroups import LazySplit
from dstt.capture.crashsafe import CrashSafe
from dstt.capture.helper import HelperHandle
from dstt.capture.hostpool import HostPool, SlotPool
from dstt.capture.ledger import Ledger
from dstt.capture.pipeline import Job
from dstt.capture.ring import Ring
from dstt.capture.stager import Stager
from dstt.store.coord import Coordinator


@dataclass(frozen=True)
class Parts:
    """What :attr:`Capture.parts` shows: the components of a Capture."""

    ledger: Ledger  #: the pipeline's bookkeeping and its lock
    committer: Committer  #: the mode's committer (committers.py)
    stager: Stager  #: the host pool and the copies into it (stager.py; its hook ``before_lazy``)
    crashsafe: CrashSafe  #: the ring, its seals, the capture helper's handle, recovery (crashsafe.py)
    ring: Ring | None  #: the /dev/shm staging ring (None: staged in process memory)
    helper: HelperHandle | None  #: the capture helper process (None: none runs)
    pool: HostPool | None  #: the host staging pool (None before the first snapshot)
    pool_in_ring: bool  #: whether the pool lives in the ring's /dev/shm file
    slots: SlotPool | None  #: the memory tier's slots (None without memory_steps, or before the first snapshot)
    tier_held: tuple[Job, ...]  #: the memory tier's ring: the last K staged steps, oldest first
    last_job: Job | None  #: the latest step queued with lazy copies or held (what wait_staged waits for)
    lazy_split: LazySplit | None  #: the latest step's split into eager and lazy copies
    threads: dict[str, threading.Thread]  #: the background threads by name
    coordinators: tuple[Coordinator, Coordinator]  #: planning's and the committer's (torch.distributed)


__all__ = ["Parts"]
