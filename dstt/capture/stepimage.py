"""A sealed step of a rank's ring as one block of bytes, and back as a ring
(issue 26: peer redundancy of the memory tier).

The *image* of a step is what its ring holds for it: its seal record
(seals.py, format 4: CRC-32Cs over its own fields and every pool byte it
names), the ring's owner.json (store, branch, rank, world, run) and the
pool bytes the record names, at their offsets. :func:`materialize` writes
an image back as a ring directory of its own -- a sparse pool file with
those bytes at the same offsets, the seal record verbatim, an owner that
is gone -- so the recovery that already commits a dead rank's ring
(ranks.record_rings: every CRC checked, a step whose bytes changed never
committed) commits a rebuilt one the same way, on whichever node holds it.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import torch

from dstt.capture import ring as R
from dstt.capture import ringowner as O
from dstt.capture.seals import encode_record
from dstt.format.codecs.spec import crc32c
from dstt.format.redundancy import BlockError

_LEN = struct.Struct("<I")
#: An image's header (offsets, owner) is small; anything bigger is not one.
MAX_HEAD_BYTES = 16 << 20
#: Owner fields an image carries (its process is gone: never carried).
OWNER_KEYS = ("store", "branch", "branch_id", "branch_created", "rank", "world", "run")


def _ranges(plan: Any, pool: torch.Tensor) -> list[tuple[int, int]]:
    """The (offset, length) byte ranges of ``pool`` the step's tasks occupy, merged."""
    base = pool.data_ptr()
    spans = []
    for t in plan.tasks:
        v = t.source
        n = v.numel() * v.element_size()
        if n:
            if not v.is_contiguous():
                raise BlockError(f"a staged chunk of step {plan.step} is not contiguous in the pool")
            spans.append((v.data_ptr() - base, n))
    spans.sort()
    out: list[tuple[int, int]] = []
    for off, n in spans:
        if out and off <= out[-1][0] + out[-1][1]:
            a, m = out[-1]
            out[-1] = (a, max(a + m, off + n) - a)
        else:
            out.append((off, n))
    return out


def _with_crcs(record: dict[str, Any], plan: Any, raw: Any) -> dict[str, Any]:
    """``record`` with the CRC-32C of every extent's pool bytes filled in
    (a live seal leaves them out: crashsafe.py): the rebuilt ring's bytes
    are then checked at recovery like those of a ring a crash left."""
    tasks = record.get("tasks")
    extents = tasks.get("extents") if isinstance(tasks, dict) else None
    if not isinstance(extents, list):
        return record
    out = []
    for first, crc, positions in extents:
        if crc is None:
            n = sum(plan.tasks[p].source.numel() * plan.tasks[p].source.element_size() for p in positions)
            crc = crc32c(raw[first:first + n])
        out.append([first, crc, positions])
    return {**record, "tasks": {**tasks, "extents": out}}  # type: ignore[dict-item]


def image(record: dict[str, Any], plan: Any, pool: torch.Tensor, owner: dict[str, Any]) -> bytes:
    """The image of a held step: ``record`` (its seal record), ``plan`` (its
    plan adopted from ``pool``, the ring's mapped pool file), ``owner``
    (the ring's owner.json)."""
    raw = pool.numpy()
    seal = encode_record(_with_crcs(record, plan, raw))
    ranges = _ranges(plan, pool)
    head = json.dumps({"pool": record["pool"], "pool_bytes": int(pool.numel()), "ranges": ranges,
                       "seal_bytes": len(seal), "step": int(record["step"]),
                       "owner": {k: owner[k] for k in OWNER_KEYS if k in owner}}).encode()
    parts = [_LEN.pack(len(head)), head, seal, *(raw[o:o + n].tobytes() for o, n in ranges)]
    return b"".join(parts)


def parse(data: bytes) -> tuple[dict[str, Any], bytes, list[tuple[int, memoryview]]]:
    """(header, seal record bytes, [(offset, bytes)]) of an image; BlockError if it does not add up."""
    mv = memoryview(data)
    try:
        (n,) = _LEN.unpack(mv[:4])
        if n > MAX_HEAD_BYTES:
            raise ValueError("header too long")
        head = json.loads(bytes(mv[4:4 + n]))
        at = 4 + n + int(head["seal_bytes"])
        seal = bytes(mv[4 + n:at])
        parts: list[tuple[int, memoryview]] = []
        size = int(head["pool_bytes"])
        for off, length in head["ranges"]:
            if not (type(off) is int and type(length) is int and 0 <= off and 0 < length and off + length <= size):
                raise ValueError(f"range {off}+{length} outside a pool of {size} bytes")
            parts.append((off, mv[at:at + length]))
            at += length
        if at != len(mv) or not isinstance(head.get("owner"), dict) or "/" in str(head["pool"]):
            raise ValueError("length or owner does not add up")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise BlockError(f"step image unreadable: {e}") from None
    return head, seal, parts


def materialize(data: bytes, base: Path | None = None) -> Path:
    """Write the image ``data`` as a ring of its own under ``base`` (the
    owner's group directory: recovery finds it as that rank's ring, its
    owner gone); the ring directory. BlockError if the image is not one."""
    head, seal, parts = parse(data)
    owner = dict(head["owner"])
    group = R.group_of(owner, base)
    O.make_private(R.ring_root(base))
    O.make_private(group)
    ring = group / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # (ringowner.RING_RE's form)
    O.make_private(ring)
    fd = os.open(ring / str(head["pool"]), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, int(head["pool_bytes"]))  # sparse: only the step's bytes take memory
        for off, chunk in parts:
            os.pwrite(fd, chunk, off)
    finally:
        os.close(fd)
    O.write_atomic(ring / f"seal-{int(head['step']):020d}.json", seal)
    os.close(os.open(ring / O.LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))  # nobody holds it
    O.write_atomic(ring / O.OWNER_FILE, json.dumps({**owner, "pid": 0, "lock": O.LOCK_FILE,
                                                    "rebuilt": True}).encode())
    return ring


__all__ = ["image", "materialize", "parse"]
