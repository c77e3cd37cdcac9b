"""Commits under torch.distributed without the trainers' process group:
per-rank durable records in the store, gathered by one helper (issue 12).

Each rank's capture helper (helper.py) writes its rank's chunks of a
sealed step, makes them durable, then records them in the step's
directory (a *rank record*: its document and keys are the format's,
:mod:`dstt.format.rankparts`).

Rank 0's helper (which shares the trainer's branch lock) waits until every
rank's record of the step is there, builds the index and commit marker
from them with the Writer's own commit code (``Writer.commit`` through a
:class:`RecordCoordinator`: the coordinator's ``gather`` reads the records
instead of calling gloo) and removes the records. The other helpers wait
for the commit marker (or rank 0's ``rank-fail.json``) so a failure
surfaces on every rank. Cost per step: one small file per rank, O(ranks)
reads on rank 0 -- no collective between trainers (as DCP and Orbax do it).

A record is written only after the rank's chunks are durable, and names
the capture run (``run``) and the step's sequence number (``seq``), so a
record left by another run of the same branch is never combined with this
one's. Records of a step that is never committed lie in an uncommitted step
directory: ``dstt gc`` removes them with it. If every helper died after
recording, the next Capture (rank 0) or ``dstt gc`` commits the step from
the records alone (:func:`commit_recorded`); steps sealed in a rank's ring
but not recorded are recorded first by that rank (:func:`record_rings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dstt import knobs
from dstt.capture import rebuilt
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.capture.sealcheck import check_record
from dstt.errors import DsttError
from dstt.format import layout as L
from dstt.format.commit import CommitInfo
from dstt.format.rankparts import (
    MAX_WORLD,
    commit_doc,
    payload,
    plan_doc,
    read_fail,
    read_record,
    record_key,
    recorded_steps,
    remove_records,
    write_fail,
    write_record,
)
from dstt.store.coord import Coordinator
from dstt.store.plan import StepPlan
from dstt.store.writer import Writer

#: The longest pause between two looks for records or the commit marker
#: (from 2 ms, doubling): a few stat() calls per step on a local store.
POLL_MAX_S = 0.01
#: How long rank 0's helper waits for another rank's record of a step (and
#: another rank's helper for the commit) while the trainers live, and after
#: they died (the helpers then finish what was sealed, bounded): read when a
#: wait starts, :func:`dstt.knobs.rank_wait_s` and :func:`dstt.knobs.rank_wait_dead_s`
#: (``$DSTT_RANK_WAIT_S``, ``$DSTT_RANK_WAIT_DEAD_S``).


class FixedRank(Coordinator):
    """The rank and world size of a process that talks to no other rank
    (a capture helper, gc): planning-side collectives are never called.

    >>> c = FixedRank(1, 4)
    >>> c.rank, c.world, c.distributed
    (1, 4, True)
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


def plan_from_doc(doc: dict[str, Any], step: int | None = None) -> StepPlan:
    """A plan with the layouts and tree of ``doc`` (no tasks: commit only);
    CorruptRing if any field of it does not check out (it is read from the
    store: untrusted, as a seal record is)."""
    import torch

    check_record(doc, step=step)
    plan = R.plan_of(doc, torch.empty(0, dtype=torch.uint8), verify=False)
    plan.seq = int(doc["seq"])
    return plan


# ----------------------------------------------------------------------------- records


class Recorded(BaseException):  # noqa: N818 - a signal, not an error
    """Raised by a ``record``-mode coordinator once the rank's record is
    durable. A BaseException, like other control-flow signals: a handler of
    errors on its way out (``Writer.commit`` sends a rank's failure on to
    rank 0) must not take it for one and record a failure over the record."""


class RecordCoordinator(Coordinator):
    """A commit coordinator over the store (see the module docstring).

    ``mode``: ``"live"`` (the helpers: write this rank's record; rank 0
    waits for every rank's, the others for the outcome), ``"record"``
    (recovery: write this rank's record, then raise :class:`Recorded`) or
    ``"collect"`` (recovery, rank 0: the records already there, no waiting).
    Call :meth:`begin` before each ``Writer.commit``.
    """

    def __init__(self, backend: Any, branch: str, rank: int, world: int, run: str, mode: str = "live",
                 alive: Callable[[], bool] | None = None) -> None:
        self.backend, self.branch, self.rank, self.world, self.run, self.mode = \
            backend, branch, rank, world, run, mode
        self._alive = alive or (lambda: True)  # the trainer still lives (bounds the waits)
        self.step = self.seq = -1
        self.plan: dict[str, Any] | None = None
        self.recorded: int | None = None  # the last step this rank recorded

    def begin(self, step: int, seq: int, plan: dict[str, Any] | None = None, run: str | None = None) -> None:
        self.step, self.seq, self.plan = step, seq, plan
        if run is not None:
            self.run = run

    def fail_unrecorded(self, step: int, seq: int | None, error: BaseException) -> None:
        """This rank's part of ``step`` failed before its commit (its seal
        unreadable, its chunks not written): record the failure, so rank 0's
        helper fails the step now instead of waiting DSTT_RANK_WAIT_S for a record
        that never comes; rank 0 also tells the other ranks' helpers. Best
        effort (a store that refuses the record too: the waits stay bounded)."""
        if seq is None or self.mode == "collect":
            return
        why = f"{type(error).__name__}: {error}"
        try:
            write_record(self.backend, self.branch, step, seq, self.run, self.rank, self.world, error=why)
            if self.rank == 0:
                write_fail(self.backend, self.branch, step, seq, self.run,
                           f"step {step} on branch {self.branch!r} not committed: rank 0: {why}")
        except Exception as e:  # noqa: BLE001
            R.log.error("dstt: could not record the failure of step %d: %s", step, e)

    def _deadline(self) -> Callable[[], bool]:
        start = time.monotonic()
        dead_since: list[float] = []
        wait_s, wait_dead_s = knobs.rank_wait_s(), knobs.rank_wait_dead_s()

        def passed() -> bool:
            now = time.monotonic()
            if not dead_since and not self._alive():
                dead_since.append(now)
            if dead_since:
                return now - dead_since[0] > wait_dead_s
            return now - start > wait_s
        return passed

    def _matching(self, rank: int) -> dict[str, Any] | None:
        doc = read_record(self.backend, self.branch, self.step, rank)
        if doc is None or doc["run"] != self.run or doc["seq"] != self.seq:
            return None  # absent, or another run's (it is overwritten when this run records)
        return doc

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj``: ``(step, (results, error))`` (Writer.commit); every rank's
        in that form on rank 0, from the records of this step."""
        _, (results, error) = obj
        if self.mode != "collect":
            write_record(self.backend, self.branch, self.step, self.seq, self.run, self.rank, self.world,
                         results=results, error=error, plan=self.plan if self.rank == 0 else None)
            self.recorded = self.step
        if self.mode == "record":
            raise Recorded(f"step {self.step}: rank {self.rank} recorded")
        if self.rank != 0:
            return None
        out: list[Any] = [None] * self.world
        passed = self._deadline()
        pause = 0.002
        while True:
            for r in range(self.world):
                if out[r] is None:
                    try:
                        doc = self._matching(r)
                        if doc is not None:
                            out[r] = payload(doc, record_key(self.branch, self.step, r))
                    except (OSError, DsttError, ValueError, TypeError) as e:
                        # An unreadable record fails the step; raised here, it
                        # left the other ranks' helpers waiting for the outcome.
                        out[r] = (None, f"its record cannot be read ({type(e).__name__}: {e})")
            missing = [r for r in range(self.world) if out[r] is None]
            if not missing:
                return [(self.step, got) for got in out]  # (a record is of this step: read_record checks)
            if self.mode == "collect" or passed():
                why = "no record" if self.mode == "collect" else "its record did not arrive in time"
                for r in missing:
                    out[r] = (None, f"{why} (its capture helper is gone or behind)")
                return [(self.step, got) for got in out]
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def broadcast(self, obj: Any) -> Any:
        if self.rank == 0:
            kind, value = obj
            try:
                if kind == "ok":
                    remove_records(self.backend, self.branch, self.step, self.world)
                elif self.mode == "live":
                    write_fail(self.backend, self.branch, self.step, self.seq, self.run, str(value))
            except Exception as e:  # noqa: BLE001 - the outcome stands: a committed step stays committed
                # (records left in a committed step's directory: dstt gc removes them; a fail
                # note not written: the other ranks' helpers wait for it until DSTT_RANK_WAIT_S)
                R.log.error("dstt: step %d: could not %s: %s", self.step,
                            "remove its rank records" if kind == "ok" else "tell the other ranks it failed", e)
            return obj
        # Another rank (live): wait for rank 0's helper to commit or fail the step.
        passed = self._deadline()
        pause = 0.002
        while True:
            doc = commit_doc(self.backend, self.branch, self.step)
            if doc is not None and doc.get("seq") == self.seq:
                return ("ok", CommitInfo(self.branch, self.step, self.seq, int(doc["n_tensors"]),
                                         int(doc["bytes_written"]), int(doc["bytes_referenced"])))
            note = read_fail(self.backend, self.branch, self.step)
            if note is not None and note.get("run") == self.run and note.get("seq") == self.seq:
                return ("error", str(note.get("error")))
            if passed():
                return ("error", f"step {self.step} on branch {self.branch!r}: rank 0's capture helper did not "
                                 "commit it in time (records stay: the next Capture or dstt gc commits it "
                                 "once every rank's record is there)")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)


# ----------------------------------------------------------------------------- recovery


def commit_recorded(writer: Writer, *, dry_run: bool = False) -> list[int]:
    """Rank 0 (holding the branch lock): commit, in step order, the steps
    after the branch's last commit that every rank recorded (same run, same
    seq, no error); others stay uncommitted (gc removes them). The steps
    committed (with ``dry_run``: that would be)."""
    branch = writer.branch.name
    done: list[int] = []
    for step in recorded_steps(writer.backend, branch, writer.last_step):
        zero = read_record(writer.backend, branch, step, 0)
        if zero is None or zero["error"] is not None or not isinstance(zero.get("plan"), dict):
            continue
        world = zero["world"]
        docs = [read_record(writer.backend, branch, step, r) for r in range(1, world)]
        if any(d is None or d["run"] != zero["run"] or d["seq"] != zero["seq"] or d["error"] is not None
               for d in docs):
            continue
        try:
            plan = plan_from_doc(zero["plan"], step)
            plan.slot = L.slot_for(writer.branch.id, plan.seq)
        except (KeyError, TypeError, ValueError, DsttError, R.CorruptRing) as e:
            R.log.warning("dstt: not committing recorded step %d of branch %r: its plan does not check out (%s)",
                          step, branch, e)
            continue
        if dry_run:
            done.append(step)
            continue
        coord = RecordCoordinator(writer.backend, branch, 0, world, zero["run"], mode="collect")
        coord.begin(step, plan.seq)
        saved, saved_world = writer.commit_coord, writer.coord
        writer.commit_coord = coord
        writer.coord = FixedRank(0, world)  # the commit records the run's world size
        try:
            writer.commit(plan, [])
        finally:
            writer.commit_coord, writer.coord = saved, saved_world
        writer.last_step = step
        writer.next_seq = max(writer.next_seq, plan.seq + 1)
        done.append(step)
    return done


def ring_identity(store_url: str, branch_info: Any, rank: int, world: int) -> dict[str, Any]:
    """The identity of rank ``rank``'s ring of a distributed Capture (ring.py)."""
    return {"store": store_url, "branch": branch_info.name, "branch_id": branch_info.id,
            "branch_created": branch_info.created, "rank": rank, "world": world}


def record_rings(writer: Writer, identity: dict[str, Any], *, exclude: Path | None = None,
                 base: Path | None = None, dry_run: bool = False, found: list[Any] | None = None) -> list[int]:
    """Record (rank ``identity["rank"]``) the sealed steps of this rank's
    abandoned rings (their owners proven gone: ring.abandoned) that are
    newer than the branch's last commit and not recorded yet, then remove
    those rings (set aside: one that does not check out). ``writer`` is of
    that rank (its chunk writes are this rank's). The steps recorded.
    ``found``: each such ring's crash is added (crashnote.Crash; rank 0
    records the run's incident once its steps are committed)."""
    from dstt.capture import crashnote

    done: list[int] = []
    for ring in R.abandoned(identity, base, exclude, dry_run=dry_run):
        try:
            crash = crashnote.of_ring(ring, identity["branch"])
            _record_ring(writer, identity, ring, done, dry_run)
            if crash is not None and found is not None:
                found.append(crash)
        except R.CorruptRing as e:
            if dry_run:
                ring.keep()
            else:
                ring.set_aside(str(e))
            continue
        except BaseException:
            ring.keep()
            raise
        if dry_run:
            ring.keep()
        else:
            ring.remove()
    return done


def _record_ring(writer: Writer, identity: dict[str, Any], ring: R.Abandoned, done: list[int],
                 dry_run: bool) -> None:
    rank, world, branch = identity["rank"], identity["world"], identity["branch"]
    run = ring.owner.get("run")
    if not isinstance(run, str) or not run:
        raise R.CorruptRing("its owner.json names no run")
    maps: dict[str, Any] = {}
    try:
        for seal in ring.seals:
            step, seq = seal["step"], seal["seq"]
            if writer.last_step is not None and step <= writer.last_step:
                continue  # committed before the helpers died
            have = read_record(writer.backend, branch, step, rank)
            if have is not None and have["run"] == run and have["seq"] == seq and have["error"] is None:
                continue  # recorded before its helper died (an error recorded for a sealed
                # step means its helper was lost: the ring's bytes, CRC-checked, replace it)
            if dry_run:
                done.append(step)
                continue
            pool = maps.get(seal["pool"])
            if pool is None:
                pool = maps[seal["pool"]] = R.map_pool(ring.dir, seal["pool"])
            try:
                plan = R._replay(seal, pool)
            except R.StaleSeal as e:
                write_record(writer.backend, branch, step, seq, run, rank, world, error=str(e))
                continue
            plan.seq, plan.slot = seq, L.slot_for(writer.branch.id, seq)
            record_plan(writer, plan, run, world, plan_doc(seal) if rank == 0 else None)
            rebuilt.keep(rank, plan)  # (a restore from memory: rebuilt.py)
            done.append(step)
    finally:
        maps.clear()


def record_plan(writer: Writer, plan: StepPlan, run: str, world: int, doc: dict[str, Any] | None) -> None:
    """Write ``plan``'s chunks (sources in a mapped ring) and record them."""
    coord = RecordCoordinator(writer.backend, writer.branch.name, writer.rank, world, run, mode="record")
    coord.begin(plan.step, plan.seq, doc)
    writer.ensure_arrays(plan)
    results, error = writer.flush_chunks(plan, plan.tasks)  # small chunks in groups (store/flusher.py)
    if error is not None:
        raise error
    saved = writer.commit_coord
    writer.commit_coord = coord
    try:
        writer.commit(plan, results)
    except Recorded:
        pass
    finally:
        writer.commit_coord = saved


def rings_of(store_url: str, branch: str, base: Path | None = None) -> list[dict[str, Any]]:
    """Identities (with ``rank``/``world``) of the distributed rings of a
    store's branch on this host whose owner is proven gone (ringowner.py)."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for group in O.groups(base):
        for ring in O.rings_in(group):
            owner = O.probe(ring)
            if owner is None or owner.get("store") != store_url or owner.get("branch") != branch:
                continue
            rank, world = owner.get("rank"), owner.get("world")
            if type(rank) is not int or type(world) is not int or not 0 <= rank < world <= MAX_WORLD:
                continue
            if (rank, world) not in seen and all(k in owner for k in ("branch_id", "branch_created")):
                seen.add((rank, world))
                out.append({k: owner[k] for k in ("store", "branch", "branch_id", "branch_created", "rank",
                                                  "world")})
    return out
