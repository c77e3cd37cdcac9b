"""The memory tier in the capture helper (issue 25): the decisions of the
flight recorder, made in the helper process, on the steps the trainer
sealed in its ring.

The trainer copies a step into a slot of its /dev/shm pool, seals it and
hands it over (``tier <step>``); from then on the step is the helper's:
:class:`HelperTier` keeps the last K, checks each for NaN/Inf (every one,
in order: the check runs in the helper's loop before anything else may
happen to the step), decides which are persisted (``"all"``, ``"newest"``,
every N-th), writes them with the update statistics against the previous
held step, dumps the tier on incidents (older steps stored after newer
ones: backfills) and gives each slot back (:meth:`TierOps.release`) once
the step left the tier. The I/O is :class:`TierOps`'s (the helper's ring
and writer: capture/helper.py); what the ranks must agree on goes through
a :class:`Peers` (capture/tierpeers.py: the store) -- this module does no
I/O of its own, so every rule here is tested on its own.

Rules (the invariants the tests check):

* a step leaves the tier (its slot released) only once it is checked for
  NaN/Inf, decided, written if it was to be, not held for a rewind, and
  not needed as the previous step of a step still to be written; the K
  newest steps always stay;
* ``persist="all"`` and ``N`` are decided from the capture ordinal alone,
  the same on every rank; ``"newest"`` by rank 0 (or the only rank) when
  its writer is free, published for the others (:meth:`Peers.publish_decisions`),
  who never evict a step rank 0 has not decided about;
* writes go forced (incident) steps first, oldest first, then decided
  steps in step order, then -- ``"newest"``, rank 0 -- the newest
  undecided step, which passes over every older undecided one;
* the steps passed over are recorded in the next stored step's commit
  (``memory_only`` ranges), never on a backfill.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from dstt import knobs
from dstt.format.incidents import Incident
from dstt.format.layout import step_ranges
from dstt.format.tier import Decisions, IncidentRequest, new_id

log = logging.getLogger("dstt.capture")

#: Named tensors in an automatic incident's reason.
MAX_NAMED = 8


class TierOps(Protocol):
    """The helper's I/O for the tier (capture/helper.py)."""

    def check(self, step: int) -> tuple[str, ...]:
        """Names of the floating-point tensors of held ``step`` holding NaN/Inf."""

    def persist(self, step: int, prev: int | None, memory_only: list[tuple[int, int]] | None) -> Any:
        """Write and commit held ``step`` (``prev``: the held step before
        it, for the update statistics; ``memory_only``: ranges for its
        commit, None on a backfill); its commit's figures, or raises."""

    def answer(self, step: int, outcome: Any) -> None:
        """Tell the trainer ``step``'s outcome: its commit figures, or the
        exception that failed it."""

    def release(self, step: int) -> None:
        """``step`` left the tier: its slot may be reused by the trainer."""

    def passed(self, step: int) -> None:
        """``step`` is passed over: memory only (unless an incident stores it later)."""

    def record(self, incident: Incident, ident: str | None) -> None:
        """Record ``incident`` in the store (one record per ``ident``)."""

    def lost(self, step: int, why: str) -> None:
        """An incident asks for ``step``, which this rank's tier no longer
        holds: say so now (its rank record, as a failure), so rank 0 -- or,
        where rank 0 lost it, every other rank -- stops waiting for this
        rank's part of it at once instead of after ``DSTT_RANK_WAIT_S``."""


class Peers(Protocol):
    """The other ranks' helpers (capture/tierpeers.py)."""

    rank: int
    world: int

    def publish_decisions(self, upto: int, persist: list[int]) -> None: ...

    def decisions(self) -> Decisions | None: ...

    def publish_request(self, req: IncidentRequest) -> bool:
        """Publish ``req``; False if a request of its id exists already."""

    def requests(self) -> list[IncidentRequest]: ...

    def publish_held(self, steps: list[int], force: bool = False) -> None: ...

    def closed(self) -> None:
        """This helper closed cleanly (the last rank's removes the run's records)."""

    def request(self, ident: str, step: int, reason: str, source: str, steps: tuple[int, ...],
                tensors: tuple[str, ...]) -> IncidentRequest: ...


@dataclass
class TierStep:
    """One step in the tier."""

    step: int
    ordinal: int  # 1 for the first captured step
    decision: str | None = None  # "persist", "memory", None (not decided yet: "newest")
    forced: bool = False  # an incident stores it
    written: bool = False  # persisted (or failed: ``error``)
    error: str | None = None
    checked: bool = False
    nonfinite: tuple[str, ...] = ()
    pins: int = 0  # held for a rewind
    extra: dict[str, Any] = field(default_factory=dict)


class HelperTier:
    """The last ``k`` steps of one rank (see the module docstring)."""

    def __init__(self, k: int, policy: str | int, ops: TierOps, *, branch: str, peers: Peers | None = None,
                 watch: bool = True, clock: Any = time.monotonic, pace: Any = None) -> None:
        if k < 1:
            raise ValueError(f"memory_steps must be >= 1, got {k}")
        self.k, self.policy, self.ops, self.branch, self.peers, self.watch = k, policy, ops, branch, peers, watch
        self.rank = 0 if peers is None else peers.rank
        self.world = 1 if peers is None else peers.world
        self.held: deque[TierStep] = deque()  # oldest first
        self._ordinal = 0
        self._last_written: int | None = None  # the newest step persisted (not a backfill)
        self._memory_only: list[int] = []  # passed over, not recorded in a commit yet
        self._nonfinite_seen = False
        self._seen_requests: set[str] = set()
        self._kept: list[int] = []  # left sealed at the trainer's death (not stored)
        self._rewinds = 0  # rewinds asked of this helper (the same count on every rank: a rewind is collective)
        self._decided_upto = -1  # rank 0 ("newest"): the last step decided about
        self._decided_persist: list[int] = []
        self.incidents: list[Incident] = []  # recorded here (rank 0 / single)
        self.persisted: list[int] = []  # every step written, in order (the tests and the benchmark count them)
        self.passed_over: list[int] = []
        self._clock = clock
        #: ``persist="newest"``: when this helper may pick its next step
        #: (helpercpu.PersistPace: it yields to a host without spare cores).
        self.pace = pace
        #: The id of this run's crash incident (format/incidents.py ``crash_ident``):
        #: whoever salvages the ring after this helper died too records under the same.
        self.crash_ident: str | None = None

    # ------------------------------------------------------------ commands

    def add(self, step: int) -> None:
        """Sealed ``step`` enters the tier (the trainer's ``tier <step>``)."""
        if self.held and step <= self.held[-1].step:
            raise ValueError(f"step {step} handed to the tier after step {self.held[-1].step}")
        self._ordinal += 1
        s = TierStep(step, self._ordinal)
        if self.policy == "all":
            s.decision = "persist"
        elif isinstance(self.policy, int):
            s.decision = "persist" if (self._ordinal - 1) % self.policy == 0 else "memory"
        self.held.append(s)
        if s.decision == "memory":
            self._pass_over(s)

    def hold(self, step: int) -> bool:
        """Keep ``step`` in the tier for a rewind; whether it is held."""
        s = self._find(step)
        if s is None:
            return False
        s.pins += 1
        return True

    def unhold(self, step: int) -> None:
        s = self._find(step)
        if s is not None and s.pins > 0:
            s.pins -= 1

    def incident(self, reason: str, step: int | None = None, source: str = "trainer",
                 tensors: tuple[str, ...] = ()) -> Incident | None:
        """An incident on this rank: every held step is stored; the incident
        is recorded (single process), or published for every rank's helper
        (rank 0 records it once, when it acts on the request). Returns the
        record made here, if any."""
        at = step if step is not None else (self.held[-1].step if self.held else 0)
        steps = self._dump_set(at)
        if self.peers is None:
            return self._act(at, reason, source, steps, tensors, ident=None, origin=0)
        if source == "rewind":  # collective: every rank's helper makes the same request, recorded once
            self._rewinds += 1
            ident = f"rewind-{at}-{self._rewinds}"
        else:
            ident = new_id(source, at)
        req = self.peers.request(ident, at, reason, source, steps, tensors)
        if not self.peers.publish_request(req):
            # Another rank raised the same one first (the same NaN seen on
            # two ranks): acted on as that rank's request, recorded once.
            self._poll_peers()
            return None
        self._seen_requests.add(req.ident)
        return self._act(at, reason, source, steps, tensors, ident=req.ident, origin=self.rank)

    def trainer_died(self) -> None:
        """The trainer is gone (end of file): every held step is stored,
        as an incident, and the tier emptied."""
        if self.held:
            self.incident("the trainer died; the memory tier's steps are stored", source="crash")
        self.drain()
        # A step that could not be stored keeps its seal (its slot is never
        # reused now): the next Capture on the branch, or `dstt gc`, commits it.
        self.release_all(keep={s.step for s in self.held if s.decision == "persist" and
                               (not s.written or s.error is not None)})

    def unstored(self) -> list[int]:
        """Steps kept sealed by :meth:`trainer_died` (not stored)."""
        return list(self._kept)

    def close(self) -> None:
        """The trainer's ``close``: the last step is stored whatever the
        policy; everything decided is written; the tier is emptied."""
        if self.held:
            last = self.held[-1]
            if last.decision is None and self._deciding:
                self._decide_newest(last)  # (published: the other ranks store the same last step)
            elif last.decision != "persist":
                self._force(last)
        self.drain()
        self.release_all()
        if self.peers is not None:
            self.peers.closed()

    @property
    def _deciding(self) -> bool:
        """This helper decides ``persist="newest"`` (rank 0, or the only rank)."""
        return self.policy == "newest" and self.rank == 0

    # ------------------------------------------------------------ the loop

    def pump(self) -> bool:
        """One round of work: check, look at the other ranks, write one
        step, evict. Whether anything was done (call again at once)."""
        did = self._check_all()
        did = self._poll_peers() or did
        did = self._write_one() or did
        did = self._evict() or did
        if self.peers is not None:
            self.peers.publish_held([s.step for s in self.held])
        return did

    def drain(self, limit_s: float | None = None) -> None:
        """Pump until nothing is left to write (bounded by ``limit_s``
        without progress: a rank 0 that stopped deciding must not hold a
        closing helper forever; its undecided steps are then stored)."""
        limit = knobs.rank_wait_s() if limit_s is None else limit_s
        last = self._clock()
        while True:
            if self.pump():
                last = self._clock()
                continue
            waiting = [s for s in self.held if s.decision is None]
            if not waiting:
                return
            if self._clock() - last > limit:
                for s in waiting:  # never dropped on a guess: stored (a step rank 0 passed over is harmless)
                    self._force(s)
                continue
            time.sleep(0.01)

    def release_all(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Give every slot back (after :meth:`drain`), but those of ``keep``
        (left sealed, for the next Capture or `dstt gc`)."""
        while self.held:
            s = self.held.popleft()
            if s.step in keep:
                self._kept.append(s.step)
                log.error("dstt helper (rank %d): step %d could not be stored (%s); it stays sealed for the next "
                          "Capture on branch %r or `dstt gc`", self.rank, s.step, s.error or "not written",
                          self.branch)
                continue
            if s.decision is None:
                self._pass_over(s)
            self.ops.release(s.step)
        if self.peers is not None:
            self.peers.publish_held([], force=True)

    # ------------------------------------------------------------ internals

    def _find(self, step: int) -> TierStep | None:
        return next((s for s in self.held if s.step == step), None)

    def _check_all(self) -> bool:
        """Check every step not checked yet, in order; the first non-finite
        step after a clean one raises an incident (once per divergence)."""
        did = False
        for s in self.held:
            if s.checked:
                continue
            did = True
            s.checked = True
            if not self.watch:
                continue
            try:
                s.nonfinite = self.ops.check(s.step)
            except Exception as e:  # noqa: BLE001 - a check that fails must not stop the tier
                log.warning("dstt helper: could not check step %d for non-finite values: %s", s.step, e)
                s.nonfinite = ()
            if s.nonfinite and not self._nonfinite_seen:
                names = s.nonfinite[:MAX_NAMED]
                more = f" and {len(s.nonfinite) - MAX_NAMED} more" if len(s.nonfinite) > MAX_NAMED else ""
                where = f" on rank {self.rank}" if self.world > 1 else ""
                self.incident(f"non-finite values in {', '.join(names)}{more}{where}", s.step, "non-finite", names)
            self._nonfinite_seen = bool(s.nonfinite)
        return did

    def _act(self, at: int, reason: str, source: str, steps: tuple[int, ...], tensors: tuple[str, ...],
             ident: str | None, origin: int) -> Incident | None:
        """Store every held step up to the incident's latest (``steps``:
        those the raising rank held; a step this rank no longer holds is
        its loss, stated in the record); rank 0 records the incident."""
        # Exactly the raising rank's steps (every rank stores the same ones:
        # a step one rank stores alone would leave rank 0 waiting for the
        # others' records of it); this rank's own when it raised it.
        wanted = set(steps) if steps else set(self._dump_set(at))
        forced = [s for s in self.held if s.step in wanted]
        for s in forced:
            self._force(s)
        mine = {s.step for s in forced}
        missing = sorted(wanted - mine)
        if missing and self.world > 1:
            log.warning("dstt helper (rank %d): incident at step %d: steps %s are no longer in this rank's memory",
                        self.rank, at, ", ".join(map(str, missing)))
            written = set(self.persisted)
            for step in (m for m in missing if m not in written):  # (a step this rank wrote: its record went)
                self.ops.lost(step, f"an incident at step {at} asked for step {step}, which rank {self.rank}'s "
                                    "memory tier no longer held")
        if self.rank != 0:
            return None
        if source == "crash" and any(i.source == "crash" for i in self.incidents):
            # (the trainers' death is one incident: the ranks' helpers that
            # saw it at different newest steps store their steps, recorded once)
            log.warning("dstt helper: the trainers' death, seen again at step %d: steps %s stored, recorded "
                        "with the first", at, ", ".join(map(str, sorted(mine))))
            return None
        inc = Incident(self.branch, at, reason, source, time.time(), tuple(sorted(mine)), tensors,
                       rank=origin if self.world > 1 else None, world=self.world if self.world > 1 else None)
        try:
            self.ops.record(inc, self.crash_ident if source == "crash" and self.crash_ident else ident)
        except Exception as e:  # noqa: BLE001 - the steps are still stored; the trainer hears of it
            log.error("dstt helper: incident at step %d not recorded: %s", at, e)
            return None
        self.incidents.append(inc)
        return inc

    def _dump_set(self, at: int) -> tuple[int, ...]:
        """The held steps an incident at ``at`` stores: the K before it and
        itself, and every one queued after it (a helper behind may hold
        more than K; the incident asks for the K that led up to it)."""
        before = [s.step for s in self.held if s.step <= at][-(self.k + 1):]
        return (*before, *(s.step for s in self.held if s.step > at))

    def _poll_peers(self) -> bool:
        if self.peers is None:
            return False
        did = False
        for req in self.peers.requests():
            if req.ident in self._seen_requests:
                continue
            self._seen_requests.add(req.ident)
            if req.source == "non-finite":
                self._nonfinite_seen = True  # (this rank's own watcher would raise the same one)
            self._act(req.step, req.reason, req.source, req.steps, req.tensors, req.ident, req.rank)
            did = True
        if self.policy == "newest" and self.rank != 0:
            d = self.peers.decisions()
            if d is not None:
                for s in self.held:
                    if s.decision is None:
                        verdict = d.decided(s.step)
                        if verdict is True:
                            s.decision = "persist"
                            did = True
                        elif verdict is False:
                            self._pass_over(s)
                            did = True
        return did

    def _next(self) -> TierStep | None:
        todo = [s for s in self.held if s.decision == "persist" and not s.written and s.checked]
        forced = [s for s in todo if s.forced]
        if forced:
            if self._deciding:  # undecided steps older than the dump: passed over now, recorded in its commits
                newest = max(s.step for s in forced)
                for s in self.held:
                    if s.decision is None and s.step < newest:
                        self._pass_over(s)
            return forced[0]
        if todo:
            return todo[0]
        if not self._deciding:
            return None
        undecided = [s for s in self.held if s.decision is None and s.checked]
        if not undecided:
            return None
        if self.pace is not None and not self.pace.ready():
            self._pass_over_older(undecided[-1])  # (the older ones may leave memory: the ring never fills)
            return None
        self._decide_newest(undecided[-1])
        return undecided[-1]

    def _pass_over_older(self, newest: TierStep) -> None:
        """Rank 0 (or the only rank), resting: every undecided step older
        than ``newest`` is passed over; published for the other ranks."""
        older = [s for s in self.held if s.decision is None and s.step < newest.step]
        for s in older:
            self._pass_over(s)
        if older:
            self._decided_upto = max(self._decided_upto, older[-1].step)
            if self.peers is not None:
                self.peers.publish_decisions(self._decided_upto, self._decided_persist)

    def _decide_newest(self, newest: TierStep) -> None:
        """Rank 0 (or the only rank): ``newest`` is stored, every older
        undecided step passed over; published for the other ranks."""
        for s in self.held:
            if s.decision is None and s.step < newest.step:
                self._pass_over(s)
        newest.decision = "persist"
        self._decided_upto = newest.step
        self._decided_persist.append(newest.step)
        if self.peers is not None:
            self.peers.publish_decisions(self._decided_upto, self._decided_persist)

    def _write_one(self) -> bool:
        s = self._next()
        if s is None:
            return False
        i = self.held.index(s)
        prev = self.held[i - 1].step if i > 0 and self.held[i - 1].step == s.step - 1 else None
        backfill = self._last_written is not None and s.step < self._last_written
        ranges: list[tuple[int, int]] | None = None
        if not backfill:
            ranges = step_ranges(sorted(x for x in self._memory_only if x < s.step))
            self._memory_only = [x for x in self._memory_only if x > s.step]
        started = self._clock()
        try:
            outcome: Any = self.ops.persist(s.step, prev, ranges)
        except Exception as e:  # noqa: BLE001 - answered to the trainer, naming the step
            outcome = e
            s.error = f"{type(e).__name__}: {e}"
        if self.pace is not None and not s.forced and not backfill:
            self.pace.wrote(started, self._clock())
        s.written = True
        if s.error is None:
            self.persisted.append(s.step)
            if not backfill:
                self._last_written = s.step
        self.ops.answer(s.step, outcome)
        return True

    def _pass_over(self, s: TierStep) -> None:
        s.decision = "memory"
        self._memory_only.append(s.step)
        self.passed_over.append(s.step)
        self.ops.passed(s.step)

    def _force(self, s: TierStep) -> None:
        s.forced = True
        if s.decision != "persist":
            if s.decision == "memory":  # passed over: stored after all (a backfill where a later one is)
                self._memory_only = [x for x in self._memory_only if x != s.step]
                self.passed_over = [x for x in self.passed_over if x != s.step]
            s.decision = "persist"

    def _evictable(self, i: int) -> bool:
        s = self.held[i]
        if not s.checked or s.pins or s.decision is None or (s.decision == "persist" and not s.written):
            return False
        nxt = self.held[i + 1] if i + 1 < len(self.held) else None  # its previous step, for the update stats
        return not (nxt is not None and nxt.decision == "persist" and not nxt.written and nxt.step == s.step + 1)

    def _evict(self) -> bool:
        did = False
        while len(self.held) > self.k and self._evictable(0):
            s = self.held.popleft()
            self.ops.release(s.step)
            did = True
        return did

    def steps_held(self) -> list[int]:
        return [s.step for s in self.held]


__all__ = ["HelperTier", "MAX_NAMED", "Peers", "TierOps", "TierStep"]
