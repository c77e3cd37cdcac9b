"""The memory tier's I/O in the capture helper (issue 25): the ring steps
the trainer hands over (``tier <step>``) become :class:`HelperTier`'s,
adopted by the helper's Writer in step order, written when the tier says
so, their slots given back to the trainer when they leave the tier.

The commands (one line each) and answers (capture/helper.py carries
them)::

    trainer -> helper                      helper -> trainer
    tier <step>                            ok <step> <commit json> | err <step> <message>
    incident <step|-> <reason hex> [src]  incident <step> <record json>
    hold <step> / unhold <step>            held <step> yes|no
    close                                  mem <step>    (passed over: memory only, for now)
                                           free <step>   (its slot may be reused)
                                           busy <step>   (a batch of its chunks written)

Answers come in any order: a step persisted takes longer than newer ones
evicted as memory-only. Answers are the only progress the trainer's waits
on the helper count (tiercommitter.py): ``busy`` keeps a long write from
looking like a silent helper. A step is ``free`` only once it left the tier
(helpertier.py's rules); its seal is removed before that, so a ring left
by a crash never names bytes that were reused.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dstt.capture import ring as R
from dstt.capture.helpercpu import CpuWatch, PersistPace
from dstt.capture.helpertier import HelperTier, Peers
from dstt.format.incidents import Incident, crash_ident, record_incident, record_once
from dstt.store.predflush import Backfills

log = logging.getLogger("dstt.capture")

#: How long the helper's loop waits for a command while the tier has no
#: work (it then looks at the other ranks' requests and decisions).
IDLE_POLL_S = 0.05
#: Steps whose sequence number a helper remembers after they left its tier.
MAX_SEQS = 4096


def nonfinite_names(plan: Any) -> tuple[str, ...]:
    """Names of the floating-point tensors of ``plan`` (sources in the ring
    pool) holding NaN or Inf: one sum per chunk; exact check only where
    the sum is not finite."""
    bad: list[str] = []
    for t in plan.tasks:
        v = t.source
        name = t.layout.name
        if name in bad or not (v.is_floating_point() or v.is_complex()) or v.numel() == 0:
            continue
        try:
            total = v.sum(dtype=torch.float32) if v.element_size() <= 2 and not v.is_complex() else v.sum()
            if bool(torch.isfinite(total)) or bool(torch.isfinite(v).all()):
                continue
        except (RuntimeError, TypeError, NotImplementedError):  # dtypes without these kernels
            wide = v.to(torch.complex64 if v.is_complex() else torch.float32)
            if bool(torch.isfinite(wide).all()):
                continue
        bad.append(name)
    return tuple(bad)


class HelperOps:
    """:class:`~dstt.capture.helpertier.TierOps` over the helper's ring and
    Writer (``records``: a distributed Capture's RecordCoordinator)."""

    def __init__(self, writer: Any, ring_dir: Any, pools: dict[str, Any], records: Any,
                 reply: Callable[[str], None], flush: Any) -> None:
        self.writer, self.ring_dir, self.pools, self.records, self.reply, self.flush = \
            writer, ring_dir, pools, records, reply, flush
        self.steps: dict[int, tuple[Any, dict[str, Any]]] = {}  # held step -> (adopted plan, seal record)
        self.seqs: dict[int, int] = {}  # the trainers' sequence number of recent steps (lost(): its record)
        # Predictive coding (store/predflush.py) of the persisted steps: the
        # coder remembers the previous persisted step as views of its ring
        # slot (no copy while the tier holds it; copied by release() when
        # the slot is given back first); only steps after the last coded one.
        self.coded_upto: int | None = None
        self.backfills = Backfills()  # (under torch.distributed backfills are stored whole)
        if writer.coder is not None:
            writer.coder.borrow = True
        # compression="auto": steps stored fast while the host has no core to spare (helpercpu.py)
        self.cpu = CpuWatch() if writer.codec.compression == "auto" else None

    def adopt(self, step: int) -> None:
        """Read sealed ``step`` and adopt its plan (in step order: its
        chunks compare with the steps before it)."""
        record = R.read_record(R.read_bounded(self.ring_dir / f"seal-{step:020d}.json"))
        name = record["pool"]
        if name not in self.pools:
            self.pools[name] = R.map_pool(self.ring_dir, name)
        if self.records is not None:
            self.writer.next_seq = int(record["seq"])  # the trainers' sequence number: the same on every rank
        if self.cpu is not None:
            self.writer.auto_cpu_cores = self.cpu.budget()
        plan = self.writer.adopt(R.plan_of(record, self.pools[name], verify=False))
        self.steps[step] = (plan, record)
        self.seqs[step] = int(record["seq"])
        while len(self.seqs) > MAX_SEQS:
            del self.seqs[next(iter(self.seqs))]

    def check(self, step: int) -> tuple[str, ...]:
        return nonfinite_names(self.steps[step][0])

    def persist(self, step: int, prev: int | None, memory_only: list[tuple[int, int]] | None) -> Any:
        from dstt.capture import ranks
        from dstt.format.rankparts import plan_doc
        from dstt.store.flusher import batches

        w = self.writer
        plan, record = self.steps[step]
        w.relink(plan)
        w.settle_before(plan)
        w.ensure_arrays(plan)
        # Its chunks stay in the ring slot until the step leaves the tier,
        # after this returns: packed where they lie, uncopied (packs.py).
        plan.packs.borrow = True
        if self.coded_upto is None or step > self.coded_upto:
            self.coded_upto = step
            self.backfills.drop()
            w.prepare_pred(plan)
        elif self.records is None:  # a backfill: against the previous captured step, if stored (predflush.py)
            prev_step = max((s for s in self.seqs if s < step), default=None)
            self.backfills.prepare(w, plan, prev_step if prev_step is not None and w.is_stored(prev_step) else None)
        prevs: dict[tuple[str, int], torch.Tensor] = {}
        if prev is not None and prev in self.steps:
            prevs = {(t.layout.array, t.index): t.source for t in self.steps[prev][0].tasks}

        def flush(tasks: list[Any]) -> Any:
            ps = [prevs.get((t.layout.array, t.index)) for t in tasks]
            ps = [p if p is not None and p.shape == t.source.shape else None for p, t in zip(ps, tasks)]
            done = w.flush_chunks(plan, tasks, None, ps)  # (given, even all None: the tier decides)
            self.reply(f"busy {step}")  # progress the trainer's waits count (a long step's write)
            return done

        parts = batches(plan.tasks)
        flushed = [flush(parts[0])] if len(parts) == 1 else list(self.flush.map(flush, parts))
        results = [r for done, _ in flushed for r in done]
        error = next((e for _, e in flushed if e is not None), None)
        if self.records is not None:
            self.records.begin(step, plan.seq, plan_doc(record) if self.records.rank == 0 else None)
        try:
            info = w.commit(plan, results, error, memory_only=memory_only)
        except ranks.Recorded:  # a rank other than 0: its record is durable, rank 0 commits
            info = None
        R.unseal_file(self.ring_dir, step)
        return info

    def answer(self, step: int, outcome: Any) -> None:
        from dataclasses import asdict

        if isinstance(outcome, BaseException):
            msg = f"step {step} on branch {self.writer.branch.name!r} not committed: {type(outcome).__name__}: {outcome}"
            self.reply(f"err {step} {msg}".replace("\n", " "))
        else:
            self.reply(f"ok {step} {json.dumps(asdict(outcome) if outcome is not None else {})}")

    def passed(self, step: int) -> None:
        self.reply(f"mem {step}")

    def release(self, step: int) -> None:
        if self.writer.coder is not None:  # what the coder remembers of its slot: copied before it is reused
            self.writer.coder.detach(step)
        R.unseal_file(self.ring_dir, step)  # (removed before the slot is reused: a seal never outlives its bytes)
        self.steps.pop(step, None)
        self.reply(f"free {step}")

    def record(self, incident: Incident, ident: str | None) -> None:
        if incident.source == "crash" and ident is not None:  # (once, whoever records it: crashnote.py)
            record_once(self.writer.backend, incident, ident)
        else:
            record_incident(self.writer.backend, incident, ident)

    def lost(self, step: int, why: str) -> None:
        seq = self.seqs.get(step)
        if self.records is not None and seq is not None:  # (a step never seen here: no record to match)
            from dstt.errors import CaptureError

            self.records.fail_unrecorded(step, seq, CaptureError(why))


def serve_tier(tier_args: dict[str, Any], writer: Any, records: Any, ring_dir: Any, pools: dict[str, Any],
               commands: Any, reply: Callable[[str], None], flush: Any) -> bool:
    """The helper's loop with the memory tier; False at end of file (the
    trainer died) once every held step is stored as an incident -- the
    ring may go then; True otherwise (``close``, or steps that could not be
    stored left sealed in the ring)."""
    from dstt.capture import guards
    from dstt.capture.tierpeers import StorePeers

    ops = HelperOps(writer, ring_dir, pools, records, reply, flush)
    peers: Peers | None = None
    if records is not None:
        peers = StorePeers(writer.backend, writer.branch.name, str(tier_args["run"]), records.rank, records.world)
        trainer = tier_args.get("trainer")
        peers.opened(trainer if isinstance(trainer, int) else None)
        if records.rank != 0:
            records.mode = "record"  # rank 0 commits; this rank's helper never waits on it (no order to agree)
    policy = tier_args["policy"]
    tier = HelperTier(int(tier_args["k"]), policy if policy in ("all", "newest") else int(policy), ops,
                      branch=writer.branch.name, peers=peers, watch=bool(tier_args.get("watch", True)),
                      pace=PersistPace(ops.cpu or CpuWatch()) if policy == "newest" else None)  # (one watch: one rule)
    # (the run's crash recorded once: by this helper, or by whoever salvages its ring: crashnote.py)
    tier.crash_ident = crash_ident(str(tier_args["run"]) if records is not None else Path(ring_dir).name)
    guard = guards.start(tier_args, records, writer, ops)  # redundancy= (issue 26): None for "none"
    busy = False
    while True:
        batch = commands.available(0.0 if busy else IDLE_POLL_S)
        if batch is None:
            tier.trainer_died()
            if guard is not None:
                guard.close(clean=False)
            return bool(tier.unstored())  # (steps left sealed: the ring stays for the next Capture or `dstt gc`)
        for cmd in batch:
            if len(cmd) == 2 and cmd[0] == "redundancy" and guard is None:  # redundancy="auto" chose (issue 26)
                guard = guards.start({**tier_args, "redundancy": cmd[1]}, records, writer, ops)
                continue
            if _handle(cmd, tier, ops, reply):
                tier.close()
                if guard is not None:
                    guard.close(clean=True)
                return True
        busy = guard is not None and guard.pump(tier.steps_held())
        busy = tier.pump() or busy


def _handle(cmd: list[str], tier: HelperTier, ops: HelperOps, reply: Callable[[str], None]) -> bool:
    """One command; True for ``close``."""
    if cmd == ["close"]:
        return True
    if len(cmd) == 2 and cmd[0] == "tier" and cmd[1].isdigit():
        step = int(cmd[1])
        try:
            ops.adopt(step)
            tier.add(step)
        except Exception as e:  # noqa: BLE001 - the step fails; its slot is the trainer's again
            ops.answer(step, e)
            ops.release(step)
    elif len(cmd) >= 2 and cmd[0] in ("hold", "unhold") and cmd[1].isdigit():
        step = int(cmd[1])
        if cmd[0] == "hold":
            reply(f"held {step} {'yes' if tier.hold(step) else 'no'}")
        else:
            tier.unhold(step)
    elif len(cmd) in (3, 4) and cmd[0] == "incident" and (cmd[1] == "-" or cmd[1].isdigit()):
        asked = None if cmd[1] == "-" else int(cmd[1])
        try:
            reason = bytes.fromhex(cmd[2]).decode()
        except ValueError:
            reason = "(an incident whose reason could not be read)"
        source = cmd[3] if len(cmd) == 4 and cmd[3] in ("trainer", "rewind") else "trainer"
        inc = tier.incident(reason, asked, source)
        at = asked if asked is not None else (tier.held[-1].step if tier.held else 0)
        doc = inc.to_dict() if inc is not None else {"step": at, "reason": reason, "recorded_by": "rank 0"}
        reply(f"incident {at} {json.dumps(doc)}")
    else:
        log.warning("dstt helper (pid %d): unknown command %r", os.getpid(), " ".join(cmd)[:200])
    return False


__all__ = ["HelperOps", "IDLE_POLL_S", "nonfinite_names", "serve_tier"]
