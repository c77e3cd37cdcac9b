"""Recovery under ``redundancy="parity:k+m"`` (issue 26, ``m >= 2``): the
restarted job rebuilds up to ``m`` lost ranks of a group at once, each from
the group's survivors (their images and Reed-Solomon fragments,
dstt.format.rsacc), before the recovery every distributed Capture runs.

Collective and never raising, as ``parity:k``'s (capture/parityrecover.py,
whose gathering, claiming and clean-up it shares):

1. each rank says what its node still has: the sealed steps of its own
   dead rings and the fragments it keeps (with its group, ``m`` and every
   contributor's image length and CRC);
2. every rank derives the same list of rebuilds (:func:`rebuilds`): a step
   of a group where 1 to ``m`` members' images are missing and every other
   member holds its image and its fragments of the same group -- more than
   ``m`` missing: nothing rebuilt, the recovery names the steps once
   (capture/nodeloss.py);
3. for each, every survivor posts its image (read back from its ring,
   CRC-checked) and its fragments to each lost rank, point to point over
   the recovery's gloo group (parityrecover.recovery_box,
   capture/transport.py; the store mailbox only where it cannot form);
   each lost rank's new process decodes its image (pyeclib),
   checks it and every survivor's image against the recorded CRCs, and
   writes it as its own dead ring, which the rank recovery then records
   like any ring a crash left.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

from dstt.capture import stepimage
from dstt.capture.parityrecover import (
    WAIT_S,
    PartLate,
    _Local,
    drop_parts,
    own_part,
    recovery_box,
    take_part,
    wait_done,
)
from dstt.capture.parityrecover import recover as _recover
from dstt.capture.peerguard import post_block
from dstt.capture.transport import TransportError
from dstt.errors import DsttError, NodeLossWarning
from dstt.format import redundancy as RD

log = logging.getLogger("dstt.capture")

Task = tuple[str, int, list[int], list[int], int]  # run, step, lost ranks, members, m


class _RSLocal(_Local):
    """What this rank's node still holds, its parity files read as Reed-Solomon fragments."""

    @staticmethod
    def parse(data: bytes, **kw: Any) -> Any:
        from dstt.format.rsacc import parse_fragments

        return parse_fragments(data, **kw)


def rebuilds(everyone: list[dict[str, Any] | None], world: int) -> list[Task]:
    """``(run, step, lost ranks, members, m)`` for every step of a group
    where 1 to ``m`` members' images are missing and every other member
    reported its image and fragments of the same group; the same on every rank.

    >>> s = lambda imgs: {"images": {"r": imgs}, "parity": [["r", 5, [0, 1, 2, 3], [], [], 2]]}
    >>> rebuilds([s([5]), None, None, s([5])], 4)
    [('r', 5, [1, 2], [0, 1, 2, 3], 2)]
    >>> rebuilds([s([5]), None, None, None], 4)
    []
    """
    groups: dict[tuple[str, int], dict[int, tuple[list[int], int]]] = {}
    for rank, doc in enumerate(everyone):
        for entry in (doc or {}).get("parity", []):
            run, step, members, m = entry[0], entry[1], entry[2], entry[5] if len(entry) > 5 else None
            if isinstance(members, list) and all(type(x) is int and 0 <= x < world for x in members) \
                    and type(m) is int and 2 <= m < len(members):
                groups.setdefault((run, step), {})[rank] = (members, m)
    out: list[Task] = []
    for (run, step), holders in sorted(groups.items()):
        members, m = next(iter(holders.values()))
        if any(v != (members, m) for v in holders.values()):
            continue
        missing = [x for x in members if step not in ((everyone[x] or {}).get("images", {}).get(run) or [])]
        if 1 <= len(missing) <= m and set(holders) >= set(members) - set(missing):
            out.append((run, step, missing, members, m))
    return out


def recover(writer: Any, coord: Any, base: Path | None = None) -> list[int]:
    """Rebuild this rank's lost images of protected steps (collective; see
    the module docstring): the steps rebuilt here, as rings of this rank."""
    return _recover(writer, coord, base, local_kind=_RSLocal, plan=rebuilds, exchange=_exchange)


def _exchange(local: _Local, tasks: list[Task], token: str, rank: int) -> list[int]:
    with recovery_box(local, token) as box:
        return _exchange_over(box, local, tasks, rank)


def _exchange_over(box: Any, local: _Local, tasks: list[Task], rank: int) -> list[int]:
    done: list[int] = []
    gone = False  # a part (or a lost rank's answer) did not come in time: the rest is not waited for
    for run, step, lost, members, m in tasks:
        key = f"{run}/{step}"
        if rank in lost:
            if gone:
                box.put(f"done/{key}/{rank}", b"0")
                warnings.warn(f"dstt: rank {rank}'s step {step} is not rebuilt from its parity group: a survivor "
                              "did not answer for an earlier step", NodeLossWarning, stacklevel=2)
                continue
            ok, gone = _rebuild(local, box, (run, step, lost, members, m), key)
            if ok:
                done.append(step)
        elif rank in members and not gone:
            gone = not _contribute(local, box, run, step, lost, key)
    if done:
        log.warning("dstt: rank %d rebuilt its steps %s from its parity group (redundancy)", rank,
                    ", ".join(map(str, done)))
    return done


def _contribute(local: _Local, box: Any, run: str, step: int, lost: list[int], key: str) -> bool:
    """Post this rank's image and fragments of ``step`` to each lost rank;
    wait (bounded) for them to be done: whether they said so in time."""
    img, par = own_part(local, run, step)
    for x in lost:
        post_block(box, f"img/{key}/{x}/{local.rank}", img, dst=x)
        post_block(box, f"par/{key}/{x}/{local.rank}", par, dst=x)
    return wait_done(box, [f"done/{key}/{x}" for x in lost])


def _rebuild(local: _Local, box: Any, task: Task, key: str) -> tuple[bool, bool]:
    """Take the survivors' parts of the step, decode this rank's image, write
    it as a ring of its own: (whether it was, whether a part did not come in time)."""
    from dstt.format import rsacc as RS

    run, step, lost, members, m = task
    bid, me = int(local.writer.branch.id), local.rank
    images: dict[int, bytes] = {}
    frags: dict[int, Any] = {}
    deadline = time.monotonic() + WAIT_S
    survivors = [x for x in members if x not in lost]
    try:
        for x in survivors:
            img, par = take_part(box, f"img/{key}/{me}/{x}", f"par/{key}/{me}/{x}", deadline, x)
            images[x] = RD.unframe(img, run=run, branch_id=bid, step=step, rank=x)[1]
            frags[x] = RS.parse_fragments(par, run=run, branch_id=bid, step=step, holder=x)
        stepimage.materialize(RS.rebuild_lost(lost, images, frags, members, m, only=me)[me], local.base)
        return True, False
    except (DsttError, OSError, ValueError) as e:
        warnings.warn(f"dstt: rank {me}'s step {step} is not rebuilt from its parity group: {e}",
                      NodeLossWarning, stacklevel=2)
        drop_parts(box, [f"{kind}/{key}/{me}/{x}" for x in survivors for kind in ("img", "par")])
        return False, isinstance(e, (PartLate, TransportError))  # (nothing more comes over a failed transport)
    finally:
        box.put(f"done/{key}/{me}", b"1")  # (the survivors stop waiting)


__all__ = ["recover", "rebuilds"]
