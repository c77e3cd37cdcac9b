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
   step is not offered) and finds every other rank some of whose part of
   the step (``owned_chunks`` of that rank) this ring holds; it keeps the
   CRC of each of those chunks and a hard link to the pool file (the ring
   is removed once recorded; nothing is copied before a rank is known lost);
2. :func:`finish`, collective, after every rank recorded its own rings:
   the ranks all-gather what they offer; a step whose rank recorded it
   itself is left alone; for the others, dstt.format.replicapieces decides
   who assembles each lost part and which survivor provides each chunk --
   a part may be spread over several survivors' rings (no single one
   holding all of it, e.g. HSDP-like layouts whose tensors are replicated
   along different mesh dimensions). Where two holders of the same chunk
   disagree on its CRC, or some chunk is held by no survivor, the part is
   refused and named. The chunks an assembler lacks are sent to it (one
   more all-gather, each chunk with its CRC, checked on arrival); it
   writes that rank's step as a ring of its own (stepimage.materialize: a
   sparse pool, a CRC per chunk, a derived seal record with the rank's own
   ``meta``) and records it as that rank's (ranks.record_rings, every CRC
   checked again). Rank 0 then commits the steps every rank recorded;
   those still missing a rank's part are named once
   (nodeloss.report_unrebuilt) and restores fall back to the newest step
   in the store.
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
from dstt.format import replicapieces as RPC
from dstt.format import replicas as RP
from dstt.format.codecs.spec import crc32c
from dstt.format.rankparts import read_record
from dstt.format.replicapieces import Key
from dstt.store.plan import StepPlan

log = logging.getLogger("dstt.capture")

#: Each rebuilt chunk starts on this boundary in its pool (a view as any dtype).
ALIGN = 64
_LEN = struct.Struct("<I")


@dataclass
class Pending:
    """What :func:`stage` found on this rank: for each ``(rank, step)`` of
    which it holds chunks, that part's chunk keys and the CRC of each one
    held (``offers``), and where from (``sources``: the seal and its pool
    file, hard-linked under ``base`` so that recording this rank's own
    rings, which removes them, leaves the bytes: no copy is made before a
    rank is known to be lost)."""

    base: Path | None = None
    offers: dict[tuple[int, int], tuple[list[Key], dict[Key, int]]] = field(default_factory=dict)
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
    pieces = _pieces(seal, plan, ring.owner)
    if not pieces:
        return
    if pending.base is None:
        pending.base = O.ring_root(base) / f"replicas-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        O.make_private(pending.base)
    linked = pending.base / f"{ring.dir.name}-{seal['pool']}"
    if not linked.exists():
        os.link(ring.dir / seal["pool"], linked)  # (the same file: no byte copied)
    for rank, (need, have) in pieces.items():
        pending.offers[(rank, step)] = (need, {k: crc32c(_bytes(t)) for k, (_, t) in have.items()})
        pending.sources[(rank, step)] = (seal, linked, ring.owner)


Piece = tuple[list[Any], Any]  # (static entry, task viewing a pool)


def _pieces(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]
            ) -> dict[int, tuple[list[Key], dict[Key, Piece]]]:
    """``{rank: (need, {key: (static entry, task)})}``: each other rank some
    of whose part of ``seal``'s step ``plan`` (plan_of with ``held``) holds --
    the keys of its whole part (``need``) and the chunks of it held here."""
    statics = seal["tasks"]["static"]
    held = plan.tasks[len(plan.tasks) - plan.replicas:]
    marked = [e for e in statics if len(e) == 7]
    world, me = int(owner.get("world", 0)), owner.get("rank")
    if len(marked) != len(held) or not marked:
        return {}
    have: dict[Key, Piece] = {}
    for entry, task in zip(marked, held):
        RP.read_marker(entry[6], world=world, shards=len(plan.layouts[entry[0]].regions))
        have[(entry[0], entry[1])] = (entry[:6], task)
    out = {}
    for rank in range(world):
        if rank == me:
            continue
        need = sorted(RP.owned_chunks(plan.layouts, rank))
        mine = {k: have[k] for k in need if k in have}
        if mine:
            out[rank] = (need, mine)
    return out


def _parts(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]) -> dict[int, list[Piece]]:
    """``{rank: [(static entry, task)]}``: each other rank whose whole part of
    ``seal``'s step ``plan`` holds, its chunks in the order of its plan's keys."""
    return {rank: [have[k] for k in need] for rank, (need, have) in _pieces(seal, plan, owner).items()
            if len(have) == len(need)}


def derive_images(seal: dict[str, Any], plan: StepPlan, owner: dict[str, Any]) -> list[tuple[int, bytes, str]]:
    """``[(rank, image, digest)]``: the step image (stepimage.parse's form)
    of every other rank whose whole part of ``seal``'s step ``plan``
    (plan_of with ``held``) holds -- its chunks, each CRC'd, its seal
    record, ``owner`` with its rank -- and the digest of its chunks' CRCs."""
    return [(rank, *_image(seal, {**owner, "rank": rank}, [(e, _bytes(t)) for e, t in chunks],
                           RP.meta_positions(plan.layouts, rank)))
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


def _image(seal: dict[str, Any], owner: dict[str, Any], chunks: list[tuple[list[Any], bytes]],
           meta: list[int]) -> tuple[bytes, str]:
    """A step image of ``chunks`` (static entry, bytes) laid out anew, and
    the digest of their CRCs."""
    parts: list[bytes] = []
    ranges: list[list[int]] = []
    extents: list[list[Any]] = []
    statics: list[list[Any]] = []
    at = 0
    for i, (entry, data) in enumerate(chunks):
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
    branch = writer.branch.name
    decided: Any = None
    if coord.rank == 0:  # one decision, broadcast: every rank then agrees on the exchange below
        try:
            decided = RPC.decide([items for items, _ in gathered],
                                 lambda rank, step: read_record(writer.backend, branch, step, rank) is not None)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            decided = f"rank 0: {type(e).__name__}: {e}"
    decided = coord.broadcast(decided if coord.rank == 0 else None)
    if not isinstance(decided, tuple):
        raise RuntimeError(f"deciding what to rebuild from replicas failed: {decided}")
    plans, more = decided
    refused = [why for _, whys in gathered for why in whys] + more
    received = _exchange(coord, pending, plans)  # (collective where some part is spread over survivors)
    chosen: dict[int, list[RPC.Assembly]] = {}
    for a in plans:
        if a.assembler == coord.rank:
            chosen.setdefault(a.rank, []).append(a)
    if refused and coord.rank == 0:
        warnings.warn("dstt: not rebuilt from replicas (never trusted): " + "; ".join(refused[:20]),
                      NodeLossWarning, stacklevel=3)
    done: list[tuple[int, int]] = []
    for rank, asms in sorted(chosen.items()):
        rings = _materialize(pending, coord.rank, rank, asms, received)
        got = _record_as(writer, rank, coord.world, rings)
        done.extend((rank, s) for s in got if s in {a.step for a in asms})
    if done:
        log.warning("dstt: rebuilt from replicas on rank %d: %s", coord.rank,
                    "; ".join(f"rank {r} step {s}" for r, s in done))
    return done


Received = dict[tuple[int, int, Key], tuple[list[Any], bytes]]


def _exchange(coord: Any, pending: Pending, plans: list[RPC.Assembly]) -> Received:
    """The chunks each assembler lacks, from the survivors providing them:
    ``{(rank, step, key): (static entry, bytes)}`` of this rank's
    assemblies. Collective where some chunk comes from a survivor other than
    its assembler (the same on every rank: ``plans`` are); a chunk this
    rank cannot read back is not sent (its assembler then refuses the part)."""
    if all(p == a.assembler for a in plans for p in a.providers.values()):
        return {}
    mine: list[tuple[int, int, Key, list[Any], bytes]] = []
    for a in plans:
        wanted = [k for k, p in a.providers.items() if p == coord.rank and a.assembler != coord.rank]
        if not wanted:
            continue
        try:
            local = _local_pieces(pending, a.rank, a.step)
        except Exception as e:  # noqa: BLE001 - the assembler refuses the part and says so; never hang the others
            log.warning("dstt: rank %d's chunks of rank %d's step %d not sent: %s", coord.rank, a.rank, a.step, e)
            continue
        mine.extend((a.rank, a.step, k, *local[k]) for k in wanted if k in local)
    out: Received = {}
    for theirs in coord.all_gather(mine):
        for rank, step, key, entry, data in theirs:
            if any(a.rank == rank and a.step == step and a.assembler == coord.rank for a in plans):
                out[(int(rank), int(step), (int(key[0]), int(key[1])))] = (list(entry), bytes(data))
    return out


def _local_pieces(pending: Pending, rank: int, step: int) -> dict[Key, tuple[list[Any], bytes]]:
    """The chunks of rank ``rank``'s part of ``step`` this rank's ring holds,
    read back from its linked pool (every held chunk checked again against
    its sealed CRC: StaleSeal if one changed)."""
    return _read_back(pending, rank, step)[1]


def _read_back(pending: Pending, rank: int, step: int) -> tuple[list[int], dict[Key, tuple[list[Any], bytes]]]:
    """(rank ``rank``'s meta positions, :func:`_local_pieces`)."""
    seal, linked, owner = pending.sources[(rank, step)]
    plan = plan_of(seal, _map(linked), verify=True, held=True)
    _, have = _pieces(seal, plan, owner).get(rank, ([], {}))
    return RP.meta_positions(plan.layouts, rank), {k: (e, _bytes(t)) for k, (e, t) in have.items()}


def _materialize(pending: Pending, me: int, rank: int, asms: list[RPC.Assembly], received: Received
                 ) -> Path | None:
    """Rank ``rank``'s rebuilt rings of the steps ``asms`` assemble here
    (every chunk checked against the CRC its holders agreed on: a part
    with a chunk missing or changed is refused, named in a warning) under
    a base of their own; None if none."""
    if pending.base is None:
        return None
    base = pending.base / f"rank-{rank}"
    O.make_private(base)
    for a in asms:
        seal, _, owner = pending.sources[(rank, a.step)]
        try:
            meta, local = _read_back(pending, rank, a.step)
        except (StaleSeal, R.CorruptRing, OSError, ValueError):
            meta, local = [], {}  # (its chunks then count as changed, below)
        chunks, bad = [], []
        for key, by in sorted(a.providers.items()):
            got = local.get(key) if by == me else received.get((rank, a.step, key))
            if got is None or crc32c(got[1]) != a.crcs[key]:
                bad.append(f"chunk {key} from rank {by}")
            else:
                chunks.append(got)
        if bad:
            why = f"{'; '.join(bad[:3])}{' and more' if len(bad) > 3 else ''} missing or changed"
            warnings.warn(f"dstt: step {a.step} (rank {rank}'s part) not rebuilt from replicas (never trusted): "
                          f"{why}", NodeLossWarning, stacklevel=4)
            continue
        image, _ = _image(seal, {**owner, "rank": rank}, chunks, meta)
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
