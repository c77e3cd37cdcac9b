"""redundancy="replicas" (issue 26): a lost rank's sealed steps rebuilt from
the rings of the ranks that hold replicas of its state.

With ``replicas`` each rank's ring holds, after the chunks it writes, every
chunk of a replicated region that another holder writes (store/plan.py,
``hold_replicas``; the seal marks them and gives each its CRC-32C:
seals.py, dstt.format.replicas). When a node is lost -- its processes and
its /dev/shm gone -- the restarted job's recovery (crashsafe.py) runs:

1. :func:`stage`, on every rank, before it records its own dead rings:
   in each sealed step of those rings it checks every held chunk against
   the CRC sealed with it (a chunk whose bytes changed is never used: the
   step is not offered) and finds every other rank all of whose part of
   the step this ring holds (``owned_chunks`` of that rank); it keeps the
   digest of that part's CRCs and a hard link to the pool file (the ring is
   removed once recorded; nothing is copied before a rank is known lost);
2. :func:`finish`, collective, after every rank recorded its own rings:
   the ranks all-gather what they offer, ``(rank, step) -> digest`` of the
   chunks' CRCs; a step whose rank recorded it itself is left alone; where
   replicas disagree (any chunk's CRC differs) the step is refused and
   named; otherwise the lowest offering rank writes that rank's step as a
   ring of its own (stepimage.materialize: a sparse pool, a CRC per chunk,
   a derived seal record with the rank's own ``meta``) and records it as
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
import re
import shutil
import struct
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dstt.capture import nodeloss, stepimage
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.capture.sealplan import plan_of
from dstt.capture.seals import SEAL_FORMAT, SEAL_VERSION, StaleSeal, encode_record
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
    """What :func:`stage` found on this rank: for each ``(rank, step)`` it can
    rebuild, the digest of that rank's chunks' CRCs (``offers``) and where
    from (``sources``: the seal and its pool file, hard-linked under
    ``base`` so that recording this rank's own rings, which removes them,
    leaves the bytes: no copy is made before a rank is known to be lost)."""

    base: Path | None = None
    offers: dict[tuple[int, int], str] = field(default_factory=dict)
    sources: dict[tuple[int, int], tuple[dict[str, Any], Path, dict[str, Any]]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def drop(self) -> None:
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None


_PENDING_RE = re.compile(r"replicas-([0-9]{1,10})-[0-9a-f]{8}")


def stage(writer: Any, identity: dict[str, Any], exclude: Path | None = None, base: Path | None = None) -> Pending:
    """From this rank's abandoned rings (left as they are), what it can
    rebuild of other ranks' steps (see the module docstring, 1); ``base``:
    the ring root's base (tests)."""
    _sweep(base)
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
    parts = _parts(seal, plan, ring.owner)
    if not parts:
        return
    if pending.base is None:
        pending.base = O.ring_root(base) / f"replicas-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        O.make_private(pending.base)
    linked = pending.base / f"{ring.dir.name}-{seal['pool']}"
    if not linked.exists():
        os.link(ring.dir / seal["pool"], linked)  # (the same file: no byte copied)
    for rank, chunks in parts.items():
        pending.offers[(rank, step)] = RP.digest((e[0], e[1], crc32c(_bytes(t))) for e, t in chunks)
        pending.sources[(rank, step)] = (seal, linked, ring.owner)


def _parts(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]) -> dict[int, list[tuple[list[Any], Any]]]:
    """``{rank: [(static entry, task)]}``: each other rank whose whole part
    of ``seal``'s step ``plan`` (plan_of with ``held``) holds, its chunks in
    the order of its own plan's (layout, chunk index)."""
    statics = seal["tasks"]["static"]
    held = plan.tasks[len(plan.tasks) - plan.replicas:]
    marked = [e for e in statics if len(e) == 7]
    world, me = int(owner.get("world", 0)), owner.get("rank")
    if len(marked) != len(held) or not marked:
        return {}
    have: dict[tuple[int, int], tuple[list[Any], Any]] = {}
    for entry, task in zip(marked, held):
        RP.read_marker(entry[6], world=world, shards=len(plan.layouts[entry[0]].regions))
        have[(entry[0], entry[1])] = (entry[:6], task)
    out = {}
    for rank in range(world):
        need = RP.owned_chunks(plan.layouts, rank) if rank != me else None
        if need is not None and set(need) <= set(have):
            out[rank] = [have[k] for k in sorted(need)]
    return out


def derive_images(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]) -> list[tuple[int, bytes, str]]:
    """``[(rank, image, digest)]``: the step image (stepimage.parse's form)
    of every other rank whose whole part of ``seal``'s step ``plan``
    (plan_of with ``held``) holds -- its chunks, each CRC'd, its seal
    record, ``owner`` with its rank -- and the digest of its chunks' CRCs."""
    return [(rank, *_image(seal, {**owner, "rank": rank}, chunks, RP.meta_positions(plan.layouts, rank)))
            for rank, chunks in _parts(seal, plan, owner).items()]


def _bytes(task: Any) -> bytes:
    return np.ascontiguousarray(task.source.reshape(-1).view(torch.uint8).numpy()).tobytes()


def _sweep(base: Path | None) -> None:
    """Remove what a recovery killed before its end left (its process gone)."""
    root = O.ring_root(base)
    try:
        names = os.listdir(root) if O.private(root) else []
    except OSError:
        return
    for name in names:
        m = _PENDING_RE.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(root / name, ignore_errors=True)
        except OSError:
            pass


def _image(seal: dict[str, Any], owner: dict[str, Any], chunks: list[tuple[list[Any], Any]],
           meta: list[int]) -> tuple[bytes, str]:
    """A step image of ``chunks`` (static entry, task viewing the survivor's
    pool) laid out anew, and the digest of their CRCs."""
    parts: list[bytes] = []
    ranges: list[list[int]] = []
    extents: list[list[Any]] = []
    statics: list[list[Any]] = []
    at = 0
    for i, (entry, task) in enumerate(chunks):
        data = _bytes(task)
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
        rings = _materialize(pending, rank, steps)
        got = _record_as(writer, rank, coord.world, rings)
        done.extend((rank, s) for s in got if s in steps)
    if done:
        log.warning("dstt: rebuilt from replicas on rank %d: %s", coord.rank,
                    "; ".join(f"rank {r} step {s}" for r, s in done))
    return done


def _materialize(pending: Pending, rank: int, steps: list[int]) -> Path | None:
    """Rank ``rank``'s rebuilt rings of ``steps`` (checked again: every held
    chunk against its sealed CRC) under a base of their own; None if none."""
    if pending.base is None:
        return None
    base = pending.base / f"rank-{rank}"
    O.make_private(base)
    for step in steps:
        seal, linked, owner = pending.sources[(rank, step)]
        pool = _map(linked)
        plan = plan_of(seal, pool, verify=True, held=True)
        chunks = _parts(seal, plan, owner).get(rank)
        if chunks is not None:
            image, dig = _image(seal, {**owner, "rank": rank}, chunks, RP.meta_positions(plan.layouts, rank))
            if dig == pending.offers[(rank, step)]:  # (the bytes offered, still)
                stepimage.materialize(image, base)
    return base


def _map(path: Path) -> torch.Tensor:
    """A linked pool file, mapped (copy-on-write, as ring.map_pool does)."""
    import mmap

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return torch.empty(0, dtype=torch.uint8)
        mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def _record_as(writer: Any, rank: int, world: int, base: Path | None) -> list[int]:
    """Record, as rank ``rank``'s, the rebuilt rings of that rank under ``base``."""
    return [] if base is None else nodeloss.record_as(writer, rank, world, base)


__all__ = ["Pending", "derive_images", "finish", "stage"]
