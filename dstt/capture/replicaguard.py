"""redundancy="replicas" (issue 26): a lost rank's sealed steps rebuilt from
the rings of the ranks that hold replicas of its state.

With ``replicas`` each rank's ring holds, after the chunks it writes, every
chunk of a replicated region that another holder writes (store/plan.py,
``hold_replicas``; the seal marks them and gives each its CRC-32C:
seals.py, dstt.format.replicas). When a node is lost -- its processes and
its /dev/shm gone -- the restarted job's recovery (crashsafe.py) runs:

1. :func:`stage`, on every rank, before it records its own dead rings:
   from each sealed step of those rings, the step of every other rank all
   of whose chunks this ring holds (``owned_chunks`` of that rank: its
   whole part of the step) is written as a ring of that rank under a
   private directory of this process (stepimage.materialize: a sparse
   pool, a seal record with a CRC per chunk and the rank's own ``meta``);
   a held chunk whose bytes do not match the CRC sealed with them is
   never used (the step is not offered);
2. :func:`finish`, collective, after every rank recorded its own rings:
   the ranks all-gather what they offer, ``(rank, step) -> digest`` of the
   chunks' CRCs; a step whose rank recorded it itself is left alone; where
   replicas disagree (any chunk's CRC differs) the step is refused and
   named; otherwise the lowest offering rank records its rebuilt ring as
   that rank's (ranks.record_rings, every CRC checked again). Rank 0 then
   commits the steps every rank recorded; those still missing a rank's
   part are named once (nodeloss.report_unrebuilt) and restores fall back
   to the newest step in the store.

Only a single survivor holding a lost rank's whole part is used (DDP: any
other rank; HSDP: any rank of the same shard's replica group); a part
spread over several survivors' rings is not assembled across nodes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dstt.capture import ranks, stepimage
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.capture.seals import SEAL_FORMAT, SEAL_VERSION, StaleSeal, encode_record, plan_of
from dstt.errors import NodeLossWarning
from dstt.format import replicas as RP
from dstt.format.codecs.spec import crc32c
from dstt.format.rankparts import read_record
from dstt.store.plan import StepPlan

log = logging.getLogger("dstt.capture")

#: Each rebuilt chunk starts on this boundary in its pool (a view as any dtype).
ALIGN = 64
_LEN = struct.Struct("<I")


@dataclass
class Pending:
    """What :func:`stage` rebuilt on this rank: rings of other ranks under
    ``base``, and for each ``(rank, step)`` the digest of its chunks' CRCs."""

    base: Path | None = None
    offers: dict[tuple[int, int], str] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def drop(self) -> None:
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None


def stage(writer: Any, identity: dict[str, Any], exclude: Path | None = None, base: Path | None = None) -> Pending:
    """Rebuild, from this rank's abandoned rings (left as they are), the
    steps of other ranks whose every chunk they hold (see the module
    docstring, 1); ``base``: the ring root's base (tests)."""
    pending = Pending()
    last = writer.last_step if writer.last_step is not None else -1
    for ring in R.abandoned(identity, base, exclude, dry_run=True):
        try:
            for seal in ring.seals:
                if seal["step"] > last and _has_held(seal):
                    _stage_seal(pending, ring, seal, base)
        finally:
            ring.keep()
    return pending


def _has_held(seal: dict[str, Any]) -> bool:
    tasks = seal.get("tasks")
    return isinstance(tasks, dict) and any(len(t) == 7 for t in tasks.get("static", ()))


def _stage_seal(pending: Pending, ring: R.Abandoned, seal: dict[str, Any], base: Path | None) -> None:
    step = int(seal["step"])
    try:
        pool = R.map_pool(ring.dir, seal["pool"])
        plan = plan_of(seal, pool, verify=True, held=True)
    except (StaleSeal, R.CorruptRing, OSError, ValueError) as e:
        pending.refused.append(f"step {step} (rank {ring.owner.get('rank')}'s replicas: {e})")
        return
    for rank, image, dig in derive_images(seal, plan, ring.owner):
        if pending.base is None:
            pending.base = O.ring_root(base) / f"replicas-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            O.make_private(pending.base)
        stepimage.materialize(image, pending.base)
        pending.offers[(rank, step)] = dig


def derive_images(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]) -> list[tuple[int, bytes, str]]:
    """``[(rank, image, digest)]``: the step image (stepimage.parse's form)
    of every other rank whose whole part of ``seal``'s step ``plan``
    (plan_of with ``held``) holds -- its chunks, each CRC'd, its seal
    record, ``owner`` with its rank -- and the digest of its chunks' CRCs."""
    statics = seal["tasks"]["static"]
    held = plan.tasks[len(plan.tasks) - plan.replicas:]
    marked = [e for e in statics if len(e) == 7]
    if len(marked) != len(held):
        return []
    world = int(owner.get("world", 0))
    by_rank: dict[int, dict[tuple[int, int], tuple[list[Any], Any]]] = {}
    for entry, task in zip(marked, held):
        who, _ = RP.read_marker(entry[6], world=world, shards=len(plan.layouts[entry[0]].regions))
        by_rank.setdefault(who, {})[(entry[0], entry[1])] = (entry[:6], task)
    out = []
    for rank, chunks in sorted(by_rank.items()):
        need = RP.owned_chunks(plan.layouts, rank)
        if not need or not set(need) <= set(chunks):
            continue  # this ring does not hold that rank's whole part
        out.append((rank, *_image(seal, plan, {**owner, "rank": rank}, [chunks[k] for k in sorted(need)],
                                  RP.meta_positions(plan.layouts, rank))))
    return out


def _image(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any], chunks: list[tuple[list[Any], Any]],
           meta: list[int]) -> tuple[bytes, str]:
    """A step image of ``chunks`` (static entry, task viewing the survivor's
    pool) laid out anew, and the digest of their CRCs."""
    parts: list[bytes] = []
    ranges: list[list[int]] = []
    extents: list[list[Any]] = []
    statics: list[list[Any]] = []
    at = 0
    for i, (entry, task) in enumerate(chunks):
        data = np.ascontiguousarray(task.source.reshape(-1).view(torch.uint8).numpy()).tobytes()
        ranges.append([at, len(data)])
        extents.append([at, crc32c(data), [i]])
        statics.append(list(entry))
        parts.append(data)
        at += -(-len(data) // ALIGN) * ALIGN if data else 0
    pool = "pool-0.bin"  # (a ring of its own per rebuilt step: ring.py's pool names)
    record = {"format": SEAL_FORMAT, "version": SEAL_VERSION, "step": int(seal["step"]), "seq": int(seal["seq"]),
              "pool": pool, "tree": seal["tree"], "layouts": seal["layouts"], "meta": meta,
              "tasks": {"static": statics, "extents": extents}}
    sealed = encode_record(record)
    ranges = [r for r in ranges if r[1]]
    head = json.dumps({"pool": pool, "pool_bytes": max(at, 1), "ranges": ranges, "seal_bytes": len(sealed),
                       "step": int(seal["step"]),
                       "owner": {k: owner[k] for k in stepimage.OWNER_KEYS if k in owner}}).encode()
    dig = RP.digest((int(s[0]), int(s[1]), int(e[1])) for s, e in zip(statics, extents))
    return b"".join([_LEN.pack(len(head)), head, sealed, *(p for p in parts if p)]), dig


def finish(writer: Any, coord: Any, pending: Pending) -> list[tuple[int, int]]:
    """Collective (every rank, after each recorded its own rings): record
    the rebuilt steps no rank recorded itself (module docstring, 2); the
    ``(rank, step)`` pairs recorded here. Always takes part in the gather."""
    try:
        gathered = coord.all_gather((sorted(pending.offers.items()), pending.refused))
        return _record_chosen(writer, coord, pending, gathered)
    finally:
        pending.drop()


def _record_chosen(writer: Any, coord: Any, pending: Pending, gathered: list[Any]) -> list[tuple[int, int]]:
    offers: dict[tuple[int, int], dict[int, str]] = {}
    refused: list[str] = []
    for by, (items, why) in enumerate(gathered):
        refused.extend(why)
        for (rank, step), dig in items:
            offers.setdefault((int(rank), int(step)), {})[by] = dig
    branch = writer.branch.name
    chosen: dict[int, list[int]] = {}
    for (rank, step), digests in sorted(offers.items()):
        if read_record(writer.backend, branch, step, rank) is not None:
            continue  # recorded by that rank itself: its node survived
        if len(set(digests.values())) > 1:
            refused.append(f"step {step} (the replicas of rank {rank}'s part differ: ranks {sorted(digests)})")
            continue
        if min(digests) == coord.rank:
            chosen.setdefault(rank, []).append(step)
    if refused and coord.rank == 0:
        warnings.warn("dstt: not rebuilt from replicas (never trusted): " + "; ".join(refused[:20]),
                      NodeLossWarning, stacklevel=3)
    done: list[tuple[int, int]] = []
    for rank, steps in sorted(chosen.items()):
        got = _record_as(writer, rank, coord.world, pending.base)
        done.extend((rank, s) for s in got if s in steps)
    if done:
        log.warning("dstt: rebuilt from replicas on rank %d: %s", coord.rank,
                    "; ".join(f"rank {r} step {s}" for r, s in done))
    return done


class _Delegated:
    """The branch lock, held by rank 0's Capture while another rank records
    a lost rank 0's part (rank 0 waits in the recovery's collective)."""

    def check(self) -> None:
        return None

    def release(self) -> None:
        return None


def _record_as(writer: Any, rank: int, world: int, base: Path | None) -> list[int]:
    """Record, as rank ``rank``'s, the rebuilt rings of that rank under ``base``."""
    if base is None:
        return []
    identity = ranks.ring_identity(str(writer.backend.url), writer.branch, rank, world)
    from dstt.format.writeoptions import WriteOptions
    from dstt.store.writer import Writer

    with Writer(str(writer.backend.url), WriteOptions(branch=writer.branch.name),
                lock=_Delegated() if rank == 0 else None, coordinator=ranks.FixedRank(rank, world)) as other:
        return ranks.record_rings(other, identity, base=base)


__all__ = ["Pending", "derive_images", "finish", "stage"]
