"""Recovery under ``redundancy="parity:k"`` (issue 26): the restarted job
rebuilds a lost rank's images of every protected step from its parity
group's survivors, before the recovery every distributed Capture runs
(crashsafe.py: each rank records its own dead rings, rank 0 commits the
steps every rank recorded).

Collective, once per distributed Capture of a ``parity`` scheme, and
never raises (every rank takes part in its one ``all_gather`` whatever
fails; every other wait is bounded):

1. each rank says what its node still has: the sealed steps of its own
   dead rings (by run) and the parities it keeps (capture/paritygroup.py:
   each with its group and every contributor's image length and CRC);
2. every rank derives the same list of rebuilds: a step of a group where
   exactly one member's image is missing and every other member holds
   its image and its parity (two missing in a group: nothing rebuilt; the
   recovery then names the steps once, capture/nodeloss.py);
3. for each, the survivors send their image (read back from their ring,
   CRC-checked as recovery reads any ring) and their parity to the lost
   rank, point to point over a gloo group the ranks form for the
   recovery (capture/transport.py, as the helpers' guards send theirs:
   its own rendezvous under the recovery's prefix of the job's c10d
   store; the store mailbox only where that group cannot form); the lost rank's new
   process rebuilds its image by XOR, checks it and every survivor's
   image against the CRCs the parities recorded (dstt.format.parityacc),
   and writes it as its own dead ring (capture/stepimage.py), which the
   rank recovery then records like any ring a crash left -- every CRC
   checked again, a changed byte never committed.

The parities are removed once the exchange is over (the steps are then
in rings of their own ranks, recorded next); if it is killed they stay,
and the next Capture runs it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dstt import knobs
from dstt.capture import ranks, stepimage
from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.capture.nodeloss import private_subdirs, read_copy
from dstt.capture.paritygroup import _PAR_RE, parity_group
from dstt.capture.peerguard import STORE_TIMEOUT_S, open_box, post_block, take_block
from dstt.capture.transport import TransportError
from dstt.errors import NodeLossWarning
from dstt.format import parityacc as PA
from dstt.format import redundancy as RD

log = logging.getLogger("dstt.capture")

#: Steps of parity a rank reports at most (a node keeps K per run).
MAX_REPORTED = 4096
#: A parity file is read whole: at most this many bytes (one stripe of a step).
MAX_PARITY_BYTES = 64 << 30
#: How long the lost rank waits for a survivor's part, and a survivor for the rebuild (seconds).
WAIT_S = STORE_TIMEOUT_S


class _Local:
    """What this rank's node still holds: its dead rings (claimed until
    :meth:`release`) and its parity files (read by :attr:`parse`:
    parity:k's; capture/rsrecover.py's reads parity:k+m's fragments)."""

    parse: Any = staticmethod(PA.parse_parity)

    def __init__(self, writer: Any, rank: int, world: int, base: Path | None) -> None:
        self.writer, self.rank, self.world, self.base = writer, rank, world, base
        identity = ranks.ring_identity(str(writer.backend.url), writer.branch, rank, world)
        self.rings = R.abandoned(identity, base, dry_run=True)
        self.group = parity_group(str(writer.backend.url), writer.branch.name, base)
        self.parity: dict[tuple[str, int], Path] = {}

    def release(self) -> None:
        for ring in self.rings:
            ring.keep()
        self.rings = []

    def summary(self, token: str) -> dict[str, Any]:
        images: dict[str, list[int]] = {}
        last = self.writer.last_step if self.writer.last_step is not None else -1
        for ring in self.rings:
            run = ring.owner.get("run")
            if isinstance(run, str):
                images.setdefault(run, []).extend(int(s["step"]) for s in ring.seals if int(s["step"]) > last)
        parity: list[list[Any]] = []
        for run_dir in private_subdirs(self.group, RD._RUN_RE):
            pdir = run_dir / f"rank-{self.rank}"
            for name in sorted(os.listdir(pdir)) if O.private(pdir) else []:
                m = _PAR_RE.fullmatch(name)
                if m is None or int(m.group(1)) <= last or len(parity) >= MAX_REPORTED:
                    continue
                try:
                    p = self.parse(read_copy(pdir / name), run=run_dir.name, branch_id=int(self.writer.branch.id),
                                        step=int(m.group(1)), holder=self.rank)
                except (RD.BlockError, OSError, ValueError) as e:
                    warnings.warn(f"dstt: the parity {pdir / name} is not used: {e}", NodeLossWarning, stacklevel=2)
                    continue
                self.parity[(run_dir.name, p.step)] = pdir / name
                parity.append([run_dir.name, p.step, p.members, p.lengths, p.crcs, getattr(p, "m", 1)])
        return {"token": token, "images": {r: sorted(set(s))[-MAX_REPORTED:] for r, s in images.items()},
                "parity": parity}

    def image(self, run: str, step: int) -> bytes:
        """This rank's image of ``step`` of ``run``, read back from its dead ring (CRCs checked)."""
        for ring in self.rings:
            if ring.owner.get("run") != run:
                continue
            for seal in ring.seals:
                if int(seal["step"]) == step:
                    pool = R.map_pool(ring.dir, seal["pool"])
                    plan = R._replay(seal, pool)  # (StaleSeal if a byte changed since its seal)
                    return stepimage.image(seal, plan, pool, ring.owner)
        raise RD.BlockError(f"rank {self.rank} no longer holds step {step}")


def rebuilds(everyone: list[dict[str, Any] | None], world: int) -> list[tuple[str, int, int, list[int]]]:
    """``(run, step, lost rank, members)`` for every step of a group where
    exactly one member's image is missing and every other member reported
    its image and a parity of the same group; the same on every rank.

    >>> s = lambda imgs, par: {"images": {"r": imgs}, "parity": [["r", 5, [0, 1, 2], *par]]}
    >>> rebuilds([s([5], ([None, 3, 4], [None, 1, 2])), None, s([5], ([3, 3, None], [1, 1, None]))], 3)
    [('r', 5, 1, [0, 1, 2])]
    """
    groups: dict[tuple[str, int], dict[int, list[int]]] = {}
    for rank, doc in enumerate(everyone):
        for entry in (doc or {}).get("parity", []):
            run, step, members = entry[0], entry[1], entry[2]
            if isinstance(members, list) and all(type(m) is int and 0 <= m < world for m in members):
                groups.setdefault((run, step), {})[rank] = members
    out = []
    for (run, step), holders in sorted(groups.items()):
        members = next(iter(holders.values()))
        if any(v != members for v in holders.values()):
            continue
        missing = [m for m in members if step not in ((everyone[m] or {}).get("images", {}).get(run) or [])]
        if len(missing) == 1 and set(holders) >= set(members) - set(missing):
            out.append((run, step, missing[0], members))
    return out


def recover(writer: Any, coord: Any, base: Path | None = None, *, local_kind: type[_Local] | None = None,
            plan: Any = None, exchange: Any = None) -> list[int]:
    """Rebuild this rank's lost images of protected steps (collective; see
    the module docstring): the steps rebuilt here, as rings of this rank.
    (``local_kind``, ``plan``, ``exchange``: another scheme's reading of the
    parity files, choice of rebuilds and exchange -- capture/rsrecover.py.)"""
    local: _Local | None = None
    doc: dict[str, Any] | None = None
    try:
        local = (local_kind or _Local)(writer, coord.rank, coord.world, base)
        doc = local.summary(uuid.uuid4().hex)
    except Exception as e:  # noqa: BLE001 - this rank takes part with nothing (its steps fall back)
        log.warning("dstt: rank %d cannot take part in rebuilding a lost node's steps: %s", coord.rank, e)
    everyone = coord.all_gather(doc)
    try:
        tasks = (plan or rebuilds)(everyone, coord.world)
        if not tasks or local is None:
            return []
        token = (everyone[0] or {}).get("token") or "none"
        return list((exchange or _exchange)(local, tasks, str(token), coord.rank))
    except Exception as e:  # noqa: BLE001 - nothing rebuilt: the recovery names what falls back
        log.warning("dstt: rebuilding a lost node's steps from parity failed on rank %d: %s", coord.rank, e)
        return []
    finally:
        if local is not None:
            local.release()
            if doc is not None:
                shutil.rmtree(local.group, ignore_errors=True)


@contextlib.contextmanager
def recovery_box(local: _Local, token: str) -> Iterator[Any]:
    """The mailbox of a recovery's exchange (collective: every rank that has
    tasks): blocks point to point over a gloo group the ranks form for it
    (peerguard.open_box: the replacement joins as the lost rank), closed at
    the end."""
    addr = knobs.redundancy_store()
    if addr is None:
        raise OSError("no MASTER_ADDR/MASTER_PORT or DSTT_REDUNDANCY_STORE to meet the other ranks at")
    box = open_box(addr, f"recover-{token}"[:64], local.rank, local.world)
    try:
        yield box
    finally:
        close = getattr(box, "close", None)
        if close is not None:
            close()


def _exchange(local: _Local, tasks: list[tuple[str, int, int, list[int]]], token: str, rank: int) -> list[int]:
    with recovery_box(local, token) as box:
        return _exchange_over(box, local, tasks, rank)


def _exchange_over(box: Any, local: _Local, tasks: list[tuple[str, int, int, list[int]]], rank: int) -> list[int]:
    done: list[int] = []
    gone = False  # a part (or the lost rank's answer) did not come in time: the rest is not waited for
    for run, step, lost, members in tasks:
        key = f"{run}/{step}/{lost}"
        if rank == lost:
            if gone:
                box.put(f"done/{key}", b"0")
                warnings.warn(f"dstt: rank {lost}'s step {step} is not rebuilt from its parity group: a survivor "
                              "did not answer for an earlier step", NodeLossWarning, stacklevel=2)
                continue
            ok, gone = _rebuild(local, box, run, step, lost, members, key)
            if ok:
                done.append(step)
        elif rank in members and not gone:
            gone = not _contribute(local, box, run, step, key, lost)
    if done:
        log.warning("dstt: rank %d rebuilt its steps %s from its parity group (redundancy)", rank,
                    ", ".join(map(str, done)))
    return done


def own_part(local: _Local, run: str, step: int) -> tuple[bytes, bytes]:
    """This rank's framed image of ``step`` and its parity (or fragments)
    file, b"" for both where it cannot give them (refused by their frames on
    the other side: nothing is waited for in vain)."""
    bid = int(local.writer.branch.id)
    try:
        img = RD.frame(local.image(run, step), run=run, branch_id=bid, step=step, rank=local.rank)
        return img, read_copy(local.parity[(run, step)])
    except (RD.BlockError, R.CorruptRing, OSError, KeyError, ValueError) as e:
        log.warning("dstt: rank %d cannot give its part of step %d: %s", local.rank, step, e)
        return b"", b""


def wait_done(box: Any, keys: list[str]) -> bool:
    """Wait (bounded) until every key of ``keys`` is in the mailbox: whether in time."""
    deadline = time.monotonic() + WAIT_S
    while any(box.peek(k) is None for k in keys):
        if time.monotonic() > deadline or getattr(box, "failed", None):
            return False
        time.sleep(0.01)
    return True


class PartLate(RD.BlockError):
    """A survivor's part did not come in time."""


def take_part(box: Any, img_key: str, par_key: str, deadline: float, who: int) -> tuple[bytes, bytes]:
    """A survivor's image and parity blocks, waited for until ``deadline``;
    PartLate if either did not come."""
    img = par = None
    while (img is None or par is None) and time.monotonic() < deadline:
        img = img if img is not None else take_block(box, img_key)
        par = par if par is not None else take_block(box, par_key)
        if img is None or par is None:
            time.sleep(0.01)
    if img is None or par is None:
        raise PartLate(f"rank {who}'s part did not arrive within {WAIT_S:.0f} s")
    return img, par


def drop_parts(box: Any, keys: list[str]) -> None:
    """Take what did arrive of ``keys`` out of the mailbox (nothing more comes over a failed transport)."""
    try:
        for k in keys:
            take_block(box, k)
    except TransportError:
        pass


def _contribute(local: _Local, box: Any, run: str, step: int, key: str, lost: int) -> bool:
    """Send this rank's image and parity of ``step`` to rank ``lost``; wait
    (bounded) for it to be done with them: whether it said so in time."""
    img, par = own_part(local, run, step)
    post_block(box, f"img/{key}/{local.rank}", img, dst=lost)
    post_block(box, f"par/{key}/{local.rank}", par, dst=lost)
    return wait_done(box, [f"done/{key}"])


def _rebuild(local: _Local, box: Any, run: str, step: int, lost: int, members: list[int],
             key: str) -> tuple[bool, bool]:
    """Take the survivors' parts of ``step``, rebuild this rank's image, write
    it as a ring of its own: (whether it was, whether a part did not come in
    time or the transport failed)."""
    bid = int(local.writer.branch.id)
    images: dict[int, bytes] = {}
    parities: dict[int, PA.Parity] = {}
    deadline = time.monotonic() + WAIT_S
    try:
        for m in (x for x in members if x != lost):
            img, par = take_part(box, f"img/{key}/{m}", f"par/{key}/{m}", deadline, m)
            images[m] = RD.unframe(img, run=run, branch_id=bid, step=step, rank=m)[1]
            parities[m] = PA.parse_parity(par, run=run, branch_id=bid, step=step, holder=m)
        stepimage.materialize(PA.rebuild_lost(lost, images, parities, members), local.base)
        return True, False
    except (RD.BlockError, OSError, ValueError) as e:
        warnings.warn(f"dstt: rank {lost}'s step {step} is not rebuilt from its parity group: {e}",
                      NodeLossWarning, stacklevel=2)
        drop_parts(box, [f"{kind}/{key}/{m}" for m in members for kind in ("img", "par")])
        return False, isinstance(e, (PartLate, TransportError))  # (nothing more comes over a failed transport)
    finally:
        box.put(f"done/{key}", b"1")  # (the survivors stop waiting)


__all__ = ["recover", "rebuilds"]
