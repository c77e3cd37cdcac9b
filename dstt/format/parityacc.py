"""One group member's share of ``redundancy="parity:k"`` (issue 26), torch-free:
the stripes a member sends of its step image, and the XOR parity a member
keeps of the others' stripes, built as they arrive.

A group is ``k + 1`` ranks (one per node: dstt.format.redundancy.parity_groups),
``members`` in group order. Each member cuts its step image into ``k``
stripes and sends stripe ``i`` to the ``i``-th other member (the placement
of :func:`dstt.format.redundancy.stripe_for`); every member is thus the
parity holder of one stripe of each other member's image, and keeps only
their XOR (``1/k`` of an image): any one lost member's image is rebuilt from
the others' images and parities (:func:`dstt.format.redundancy.rebuild`).

A stripe travels framed (kind ``"stripe"``) with the image's length and
CRC-32C, the holder and the members. :class:`ParityAccumulator` takes them
in any order, refuses a torn or stale one (another run, branch, step
already complete..., never XORed in), ignores a duplicate, and says when a
step's parity is complete -- then it returns it framed (kind ``"parity"``,
with every contributor's length and CRC: what recovery checks the rebuilt
image and the survivors' images against). Memory: one parity per open or
complete step the caller keeps, at most ``max_open`` steps open.

>>> images = {0: b"alpha-image", 1: b"beta", 2: b"gamma-image!"}
>>> members = [0, 1, 2]
>>> accs = {h: ParityAccumulator("r", 1, h, members) for h in members}
>>> for src, img in images.items():
...     for h in members:
...         if h != src:
...             _ = accs[h].add(stripe_block(img, run="r", branch_id=1, step=5, src=src, holder=h, members=members), src)
>>> parities = {h: parse_parity(accs[h].complete(5), run="r", branch_id=1, step=5, holder=h) for h in members}
>>> rebuild_lost(1, {0: images[0], 2: images[2]}, parities, members)
b'beta'
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dstt.format import redundancy as RD
from dstt.format.codecs.spec import crc32c

#: An image's length a stripe may announce (64 GiB: a step of one rank).
MAX_IMAGE_BYTES = 64 << 30


@dataclass
class _Open:
    """A step's parity while contributions arrive."""

    acc: np.ndarray
    lengths: dict[int, int] = field(default_factory=dict)
    crcs: dict[int, int] = field(default_factory=dict)


def _stripe_len(length: int, member: int, holder: int, size: int) -> int:
    """The length of ``member``'s stripe for ``holder`` of an image of ``length`` bytes (group of ``size``)."""
    pieces = size - 1
    part = -(-length // pieces) if length else 0
    idx = RD._stripe_index(member, holder)
    return max(0, min(part, length - idx * part))


def stripe_block(image: bytes, *, run: str, branch_id: int, step: int, src: int, holder: int,
                 members: list[int]) -> bytes:
    """The framed stripe of ``src``'s ``image`` of ``step`` that goes to ``holder``'s parity."""
    g = len(members)
    payload = RD.stripe_for(image, members.index(src), members.index(holder), g)
    return RD.frame(payload, run=run, branch_id=branch_id, step=step, rank=src, kind="stripe",
                    meta={"holder": holder, "members": list(members), "length": len(image), "crc": crc32c(image)})


class ParityAccumulator:
    """The parity ``holder`` keeps of the other ``members``' stripes (see the module docstring)."""

    def __init__(self, run: str, branch_id: int, holder: int, members: list[int], max_open: int = 16) -> None:
        if holder not in members or len(members) < 2 or len(set(members)) != len(members):
            raise RD.BlockError(f"rank {holder} is not one of the group {members}")
        self.run, self.branch_id, self.holder, self.members = run, branch_id, holder, list(members)
        self.max_open = max_open
        self.open: dict[int, _Open] = {}
        self.done: dict[int, bytes] = {}  # step -> its framed parity, until taken or dropped
        self.finished: set[int] = set()  # steps whose parity was completed (duplicates after it: ignored)
        self.cut = -1  # steps below it are no longer kept (they left a member's tier)

    def add(self, data: bytes, src: int) -> tuple[str, int]:
        """Take ``src``'s framed stripe: ``("added"|"duplicate"|"late"|"complete", step)``;
        BlockError (nothing taken) if it is torn, corrupted or not this group's."""
        if src == self.holder or src not in self.members:
            raise RD.BlockError(f"rank {src} does not contribute to rank {self.holder}'s parity")
        head, _ = RD.read_head(data)
        _, payload = RD.unframe(data, run=self.run, branch_id=self.branch_id, step=head.step, rank=src,
                                kind="stripe")
        meta = head.meta
        length, crc = meta.get("length"), meta.get("crc")
        if meta.get("holder") != self.holder or meta.get("members") != self.members:
            raise RD.BlockError(f"stale stripe of step {head.step}: for rank {meta.get('holder')!r} of group "
                                f"{meta.get('members')!r} (this is rank {self.holder} of {self.members})")
        if not (type(length) is int and type(crc) is int and 0 <= length <= MAX_IMAGE_BYTES and 0 <= crc < 1 << 32):
            raise RD.BlockError(f"stripe of step {head.step}: image length/CRC out of range")
        g = len(self.members)
        want = _stripe_len(length, self.members.index(src), self.members.index(self.holder), g)
        if len(payload) != want:
            raise RD.BlockError(f"stripe of step {head.step} from rank {src}: {len(payload)} bytes, expected {want}")
        step = head.step
        if step < self.cut:
            return "late", step
        entry = self.open.get(step)
        if step in self.finished or (entry is not None and src in entry.lengths):
            return "duplicate", step
        if entry is None:
            while len(self.open) >= self.max_open:  # (the oldest open step gives way: it stays unprotected)
                del self.open[min(self.open)]
            entry = self.open[step] = _Open(np.zeros(0, np.uint8))
        entry.acc = RD.xor_into(entry.acc, payload)
        entry.lengths[src], entry.crcs[src] = length, crc
        if len(entry.lengths) < g - 1:
            return "added", step
        del self.open[step]
        self.finished.add(step)
        self.done[step] = RD.frame(entry.acc.tobytes(), run=self.run, branch_id=self.branch_id, step=step,
                                   rank=self.holder, kind="parity",
                                   meta={"members": self.members,
                                         "lengths": [entry.lengths.get(m) for m in self.members],
                                         "crcs": [entry.crcs.get(m) for m in self.members]})
        return "complete", step

    def complete(self, step: int) -> bytes | None:
        """The framed parity of ``step`` once complete (taken: the caller keeps it), else None."""
        return self.done.pop(step, None)

    def contributors(self, step: int) -> list[int]:
        """The ranks whose stripes of ``step`` are in (an open step), for acknowledgements."""
        entry = self.open.get(step)
        return sorted(entry.lengths) if entry is not None else []

    def drop_below(self, step: int) -> None:
        """Forget the steps below ``step`` (a member's tier no longer holds them)."""
        self.cut = max(self.cut, step)
        for s in [s for s in self.open if s < step]:
            del self.open[s]
        for s in [s for s in self.done if s < step]:
            del self.done[s]
        self.finished = {s for s in self.finished if s >= step}


@dataclass(frozen=True)
class Parity:
    """A complete parity block, checked."""

    step: int
    holder: int
    members: list[int]
    lengths: list[int | None]
    crcs: list[int | None]
    payload: bytes


def parse_parity(data: bytes | memoryview | None, *, run: str, branch_id: int, step: int, holder: int) -> Parity:
    """The parity ``holder`` kept of ``step`` (framed by :class:`ParityAccumulator`); BlockError unless whole and that."""
    if data is None:
        raise RD.BlockError(f"rank {holder} holds no parity of step {step}")
    head, payload = RD.unframe(data, run=run, branch_id=branch_id, step=step, rank=holder, kind="parity")
    members, lengths, crcs = (head.meta.get(k) for k in ("members", "lengths", "crcs"))
    ok = isinstance(members, list) and isinstance(lengths, list) and isinstance(crcs, list) \
        and len(members) == len(lengths) == len(crcs) >= 2 and holder in members \
        and all(type(m) is int and m >= 0 for m in members) and len(set(members)) == len(members)
    if ok:
        for m, n, c in zip(members, lengths, crcs):  # type: ignore[arg-type]
            if m == holder:
                ok = ok and n is None and c is None
            else:
                ok = ok and type(n) is int and type(c) is int and 0 <= n <= MAX_IMAGE_BYTES
    if not ok:
        raise RD.BlockError(f"parity of step {step} held by rank {holder}: its members/lengths/CRCs do not add up")
    return Parity(step, holder, list(members), list(lengths), list(crcs), payload)  # type: ignore[arg-type]


def rebuild_lost(lost: int, images: dict[int, bytes], parities: dict[int, Parity], members: list[int]) -> bytes:
    """Rank ``lost``'s image from the other members' ``images`` and ``parities``
    (by rank), every one checked against the CRCs the parities recorded;
    BlockError if anything is missing, disagrees or fails its CRC."""
    g = len(members)
    others = [m for m in members if m != lost]
    if set(parities) < set(others) or set(images) < set(others):
        raise RD.BlockError(f"rank {lost}'s image cannot be rebuilt: the group's images or parities are missing")
    idx = members.index(lost)
    for h in others:
        p = parities[h]
        if p.members != members:
            raise RD.BlockError(f"rank {h}'s parity is of another group ({p.members}, not {members})")
    lengths = {parities[h].lengths[idx] for h in others}
    crcs = {parities[h].crcs[idx] for h in others}
    if len(lengths) != 1 or len(crcs) != 1:
        raise RD.BlockError(f"the parities disagree on rank {lost}'s image (lengths {sorted(map(str, lengths))})")
    for m in others:
        want = next((parities[h].crcs[members.index(m)] for h in others if h != m), None)  # (k = 1: none)
        if want is not None and crc32c(images[m]) != want:
            raise RD.BlockError(f"rank {m}'s image is not the one the parities were made of (CRC-32C)")
    length, crc = lengths.pop(), crcs.pop()
    assert length is not None
    out = RD.rebuild(idx, length, {members.index(m): images[m] for m in others},
                     {members.index(h): parities[h].payload for h in others}, g)
    if crc32c(out) != crc:
        raise RD.BlockError(f"rank {lost}'s rebuilt image fails its CRC-32C")
    return out


__all__ = ["MAX_IMAGE_BYTES", "Parity", "ParityAccumulator", "parse_parity", "rebuild_lost", "stripe_block"]
