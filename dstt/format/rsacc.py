"""One group member's share of ``redundancy="parity:k+m"`` (issue 26,
``m >= 2``), torch-free: Reed-Solomon across the nodes of a group, through
pyeclib (the ``erasure`` extra: ISA-L, bundled in its wheel).

**Layout.** A group is ``g = k + m`` ranks (one per node, ``members`` in
group order). Each member cuts its step image into ``k`` stripes of
``ceil(len / k)`` bytes. There are ``g`` codewords a step: codeword ``c``'s
*holders* are members ``c, c+1, ..., c+m-1`` (mod ``g``), its *data* the
``k`` other members, one stripe of each (member ``i``'s ``j``-th stripe goes
to the ``j``-th codeword it is data of). Every member is data of ``k``
codewords and holder of ``m``; a holder keeps one parity fragment of each
of its ``m`` codewords: ``m`` stripes, ``m/k`` of an image, per step.
Losing any ``m`` members of a group leaves, for every codeword, at least
``k`` of its ``k + m`` fragments -- the survivors' stripes (in their rings)
and parities -- so each lost image is decoded (:func:`rebuild_lost`).

**Sent.** A member sends each of its ``k`` stripes to the ``m`` holders of
its codeword (all of one holder's in one block): ``m`` images a step (each
of its codeword's holders encodes the codeword itself -- one hop, so no
holder waits on another holder's forwarding; a two-hop layout, one encoder
per codeword forwarding the other parities, would send ``1 + (m-1)/k``).

**Not accumulated.** Reed-Solomon parity is not built stripe by stripe as
XOR is: :class:`RSAccumulator` buffers a codeword's ``k`` stripes until all
are in, encodes it, and keeps only its fragment (at most ``max_open``
steps open). Stripes arrive framed (kind ``"stripe"``, with the image's
length and CRC-32C, the holder, the members, ``m`` and the codewords);
torn or stale ones are refused, duplicates ignored. A complete step's
fragments are returned framed (kind ``"fragment"``) with every
contributor's length and CRC and the pyeclib headers of the codeword's data
fragments (80 bytes each: a survivor's stripe becomes a fragment again at
recovery).

>>> import os
>>> members, m = [0, 1, 2, 3], 2
>>> images = {i: os.urandom(n) for i, n in zip(members, (100, 37, 0, 64))}
>>> accs = {h: RSAccumulator("r", 1, h, members, m) for h in members}
>>> for src, img in images.items():
...     for h in members:
...         if h != src:
...             _ = accs[h].add(stripe_block(img, run="r", branch_id=1, step=5, src=src, holder=h,
...                                          members=members, m=m), src)
>>> frags = {h: parse_fragments(accs[h].complete(5), run="r", branch_id=1, step=5, holder=h) for h in members}
>>> got = rebuild_lost([1, 3], {0: images[0], 2: images[2]}, {0: frags[0], 2: frags[2]}, members, m)
>>> got == {1: images[1], 3: images[3]}
True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from dstt.errors import ConfigError
from dstt.format import redundancy as RD
from dstt.format.codecs.spec import crc32c

#: An image's length a stripe may announce (64 GiB: a step of one rank).
MAX_IMAGE_BYTES = 64 << 30
#: Stripes are zero-padded to a multiple of this in a codeword (liberasurecode's word).
ALIGN = 16
#: A pyeclib fragment header is 80 bytes; anything near this is not one.
MAX_HEADER = 4096
#: The pyeclib backends tried, in order (both in its wheel; Cauchy is MDS for every k, m).
EC_TYPES = ("isa_l_rs_cauchy", "liberasurecode_rs_vand")


@functools.lru_cache(maxsize=16)
def driver(k: int, m: int) -> Any:
    """pyeclib's encoder of ``k`` data + ``m`` parity fragments; ConfigError naming the extra if absent."""
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError:
        raise ConfigError(f"redundancy='parity:{k}+{m}' (m > 1: Reed-Solomon) needs pyeclib: "
                          "pip install 'dstt[erasure]'") from None
    errors = []
    for ec_type in EC_TYPES:
        try:
            return ECDriver(k=k, m=m, ec_type=ec_type)
        except Exception as e:  # noqa: BLE001 - the next backend
            errors.append(f"{ec_type}: {e}")
    raise ConfigError(f"pyeclib has no Reed-Solomon backend for k={k}, m={m}: {'; '.join(errors)}"[:400])


def code_name(k: int, m: int) -> str:
    """The code the fragments are made with (the pyeclib backend's name): recorded with them, checked at recovery."""
    ec_type = driver(k, m).ec_type
    return str(getattr(ec_type, "name", ec_type))


# ----------------------------------------------------------------------------- layout (indices into the group)


def holders(c: int, g: int, m: int) -> list[int]:
    """The members (indices) holding codeword ``c``'s ``m`` parities, in parity order."""
    return [(c + j) % g for j in range(m)]


def data_of(c: int, g: int, m: int) -> list[int]:
    """The ``k`` members (indices) whose stripes codeword ``c`` codes, in fragment order."""
    hold = holders(c, g, m)
    return [i for i in range(g) if i not in hold]


def held_by(h: int, g: int, m: int) -> list[int]:
    """The codewords member ``h`` holds a parity of."""
    return sorted((h - j) % g for j in range(m))


def stripes_of(i: int, g: int, m: int) -> list[int]:
    """The codewords member ``i`` is data of: its ``j``-th stripe goes to the ``j``-th."""
    return [c for c in range(g) if i not in holders(c, g, m)]


def part(length: int, k: int) -> int:
    """A stripe's length (the last one zero-padded) of an image of ``length`` bytes."""
    return -(-length // k)


def stripe(image: bytes, j: int, k: int, size: int | None = None) -> bytes:
    """Stripe ``j`` of ``image``, zero-padded to ``size`` (default: its :func:`part`)."""
    p = part(len(image), k)
    return image[j * p:(j + 1) * p].ljust(p if size is None else size, b"\0")


def _sent(src: int, holder: int, g: int, m: int) -> list[int]:
    """The codewords of ``holder``'s that member ``src`` is data of (never empty for src != holder)."""
    return [c for c in held_by(holder, g, m) if src not in holders(c, g, m)]


def stripe_block(image: bytes, *, run: str, branch_id: int, step: int, src: int, holder: int, members: list[int],
                 m: int) -> bytes:
    """The framed stripes of ``src``'s ``image`` of ``step`` that ``holder`` codes."""
    g = len(members)
    si, hi = members.index(src), members.index(holder)
    mine = stripes_of(si, g, m)
    words = _sent(si, hi, g, m)
    payload = b"".join(stripe(image, mine.index(c), g - m) for c in words)
    return RD.frame(payload, run=run, branch_id=branch_id, step=step, rank=src, kind="stripe",
                    meta={"holder": holder, "members": list(members), "m": m, "codewords": words,
                          "length": len(image), "crc": crc32c(image)})


def _aligned(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


@dataclass
class _Open:
    """A step's codewords while stripes arrive."""

    stripes: dict[int, dict[int, bytes]] = field(default_factory=dict)  # codeword -> member index -> stripe
    lengths: dict[int, int] = field(default_factory=dict)  # member index -> image length
    crcs: dict[int, int] = field(default_factory=dict)
    coded: dict[int, bytes] = field(default_factory=dict)  # codeword -> its [size, header] + headers + fragment


class RSAccumulator:
    """The parity fragments ``holder`` keeps of its codewords (see the module docstring)."""

    def __init__(self, run: str, branch_id: int, holder: int, members: list[int], m: int,
                 max_open: int = 16) -> None:
        if holder not in members or len(set(members)) != len(members) or not 1 <= m < len(members):
            raise RD.BlockError(f"rank {holder} is not one of the group {members} (m = {m})")
        self.run, self.branch_id, self.holder, self.members, self.m = run, branch_id, holder, list(members), m
        self.g, self.k, self.hi = len(members), len(members) - m, members.index(holder)
        self.words = held_by(self.hi, self.g, m)
        self.max_open = max_open
        self.open: dict[int, _Open] = {}
        self.done: dict[int, bytes] = {}
        self.finished: set[int] = set()
        self.cut = -1

    def add(self, data: bytes, src: int) -> tuple[str, int]:
        """Take ``src``'s framed stripes: ``("added"|"duplicate"|"late"|"complete", step)``;
        BlockError (nothing taken) if torn, corrupted or not this group's."""
        if src == self.holder or src not in self.members:
            raise RD.BlockError(f"rank {src} does not contribute to rank {self.holder}'s parity")
        head, _ = RD.read_head(data)
        _, payload = RD.unframe(data, run=self.run, branch_id=self.branch_id, step=head.step, rank=src,
                                kind="stripe")
        meta, si = head.meta, self.members.index(src)
        words = _sent(si, self.hi, self.g, self.m)
        if meta.get("holder") != self.holder or meta.get("members") != self.members or meta.get("m") != self.m \
                or meta.get("codewords") != words:
            raise RD.BlockError(f"stale stripes of step {head.step}: for rank {meta.get('holder')!r} of group "
                                f"{meta.get('members')!r}, m={meta.get('m')!r} (this is rank {self.holder} of "
                                f"{self.members}, m={self.m})")
        length, crc = meta.get("length"), meta.get("crc")
        if not (type(length) is int and type(crc) is int and 0 <= length <= MAX_IMAGE_BYTES and 0 <= crc < 1 << 32):
            raise RD.BlockError(f"stripes of step {head.step}: image length/CRC out of range")
        p = part(length, self.k)
        if len(payload) != p * len(words):
            raise RD.BlockError(f"stripes of step {head.step} from rank {src}: {len(payload)} bytes, "
                                f"expected {p * len(words)}")
        step = head.step
        if step < self.cut:
            return "late", step
        entry = self.open.get(step)
        if step in self.finished or (entry is not None and si in entry.lengths):
            return "duplicate", step
        if entry is None:
            while len(self.open) >= self.max_open:  # (the oldest open step gives way: it stays unprotected)
                del self.open[min(self.open)]
            entry = self.open[step] = _Open()
        entry.lengths[si], entry.crcs[si] = length, crc
        for n, c in enumerate(words):
            entry.stripes.setdefault(c, {})[si] = payload[n * p:(n + 1) * p]
            self._code(entry, c)
        if len(entry.lengths) < self.g - 1:
            return "added", step
        del self.open[step]
        self.finished.add(step)
        self.done[step] = self._framed(step, entry)
        return "complete", step

    def _code(self, entry: _Open, c: int) -> None:
        """Encode codeword ``c`` once its ``k`` stripes are in; keep this holder's fragment only."""
        have, data = entry.stripes.get(c, {}), data_of(c, self.g, self.m)
        if c in entry.coded or set(have) != set(data):
            return
        size = _aligned(max(len(have[i]) for i in data))
        frags = driver(self.k, self.m).encode(b"".join(have[i].ljust(size, b"\0") for i in data))
        hlen = len(frags[0]) - size
        ok = len(frags) == self.g and all(len(f) == hlen + size for f in frags) and 0 < hlen <= MAX_HEADER \
            and all(frags[t][hlen:] == have[i].ljust(size, b"\0") for t, i in enumerate(data))
        if not ok:
            raise RD.BlockError("pyeclib's fragments are not the systematic layout expected (data fragments = stripes)")
        mine = frags[self.k + holders(c, self.g, self.m).index(self.hi)]
        entry.coded[c] = size.to_bytes(8, "little") + hlen.to_bytes(4, "little") + \
            b"".join(f[:hlen] for f in frags[:self.k]) + mine
        del entry.stripes[c]  # (only the fragment is kept)

    def _framed(self, step: int, entry: _Open) -> bytes:
        payload = b"".join(entry.coded[c] for c in self.words)
        return RD.frame(payload, run=self.run, branch_id=self.branch_id, step=step, rank=self.holder,
                        kind="fragment",
                        meta={"members": self.members, "m": self.m, "codewords": self.words,
                              "code": code_name(self.k, self.m),
                              "lengths": [entry.lengths.get(i) for i in range(self.g)],
                              "crcs": [entry.crcs.get(i) for i in range(self.g)]})

    def complete(self, step: int) -> bytes | None:
        """The framed fragments of ``step`` once complete (taken: the caller keeps them), else None."""
        return self.done.pop(step, None)

    def contributors(self, step: int) -> list[int]:
        """The ranks whose stripes of ``step`` are in (an open step)."""
        entry = self.open.get(step)
        return sorted(self.members[i] for i in entry.lengths) if entry is not None else []

    def drop_below(self, step: int) -> None:
        """Forget the steps below ``step`` (a member's tier no longer holds them)."""
        self.cut = max(self.cut, step)
        self.open = {s: e for s, e in self.open.items() if s >= step}
        self.done = {s: d for s, d in self.done.items() if s >= step}
        self.finished = {s for s in self.finished if s >= step}


@dataclass(frozen=True)
class Word:
    """One codeword's part a holder keeps: the stripe size, the data fragments' headers, its parity fragment."""

    size: int
    headers: list[bytes]
    fragment: bytes


@dataclass(frozen=True)
class Fragments:
    """A holder's complete fragments of a step, checked."""

    step: int
    holder: int
    members: list[int]
    m: int
    code: str
    lengths: list[int | None]
    crcs: list[int | None]
    words: dict[int, Word]


def parse_fragments(data: bytes | memoryview | None, *, run: str, branch_id: int, step: int,
                    holder: int) -> Fragments:
    """The fragments ``holder`` kept of ``step`` (framed by :class:`RSAccumulator`); BlockError unless whole and that."""
    if data is None:
        raise RD.BlockError(f"rank {holder} holds no parity of step {step}")
    head, payload = RD.unframe(data, run=run, branch_id=branch_id, step=step, rank=holder, kind="fragment")
    members, m, lengths, crcs = (head.meta.get(x) for x in ("members", "m", "lengths", "crcs"))
    bad = RD.BlockError(f"parity of step {step} held by rank {holder}: its members/lengths/CRCs do not add up")
    if not (isinstance(members, list) and all(type(x) is int and x >= 0 for x in members) and holder in members
            and len(set(members)) == len(members) and type(m) is int and 1 <= m < len(members)
            and isinstance(lengths, list) and isinstance(crcs, list) and len(lengths) == len(crcs) == len(members)):
        raise bad
    g, hi = len(members), members.index(holder)
    for i, (n, c) in enumerate(zip(lengths, crcs)):
        if (i == hi) != (n is None and c is None) or (i != hi and not (
                type(n) is int and type(c) is int and 0 <= n <= MAX_IMAGE_BYTES and 0 <= c < 1 << 32)):
            raise bad
    code = head.meta.get("code")
    if head.meta.get("codewords") != held_by(hi, g, m) or not isinstance(code, str):
        raise bad
    words, at, k = {}, 0, g - m
    for c in held_by(hi, g, m):
        if len(payload) < at + 12:
            raise bad
        size, hlen = int.from_bytes(payload[at:at + 8], "little"), int.from_bytes(payload[at + 8:at + 12], "little")
        end = at + 12 + k * hlen + hlen + size
        if not (0 < hlen <= MAX_HEADER and 0 < size <= MAX_IMAGE_BYTES and end <= len(payload)):
            raise bad
        heads = [payload[at + 12 + t * hlen:at + 12 + (t + 1) * hlen] for t in range(k)]
        words[c] = Word(size, heads, payload[at + 12 + k * hlen:end])
        at = end
    if at != len(payload):
        raise bad
    return Fragments(step, holder, list(members), m, code[:64], list(lengths), list(crcs), words)


def _agreed(frags: dict[int, Fragments], members: list[int]) -> dict[int, tuple[int, int]]:
    """Each member's image length and CRC, as every holder that recorded it
    did (BlockError if they disagree; a member none of ``frags`` records --
    a lone survivor's own image, k = 1 -- is left out)."""
    out: dict[int, tuple[int, int]] = {}
    for i in range(len(members)):
        seen = {(f.lengths[i], f.crcs[i]) for f in frags.values() if f.lengths[i] is not None}
        if len(seen) > 1:
            raise RD.BlockError(f"the parities disagree on rank {members[i]}'s image")
        if seen:
            n, c = seen.pop()
            assert n is not None and c is not None
            out[i] = (n, c)
    return out


def rebuild_lost(lost: list[int], images: dict[int, bytes], frags: dict[int, Fragments], members: list[int],
                 m: int, only: int | None = None) -> dict[int, bytes]:
    """The images of the ``lost`` ranks (at most ``m``; ``only``: just that one's) from every other
    member's image and fragments (by rank), each checked against the
    lengths and CRCs the fragments recorded; BlockError if anything is
    missing, disagrees, fails its CRC or cannot be decoded."""
    g, k = len(members), len(members) - m
    others = [x for x in members if x not in lost]
    if not 1 <= len(lost) <= m or not set(lost) <= set(members):
        raise RD.BlockError(f"ranks {lost} cannot be rebuilt by a group of {members} with {m} parities")
    if not (set(images) >= set(others) and set(frags) >= set(others)):
        raise RD.BlockError(f"ranks {lost}' images cannot be rebuilt: the group's images or parities are missing")
    if any(frags[h].members != members or frags[h].m != m for h in others):
        raise RD.BlockError(f"a parity of another group (not {members}, m={m})")
    codes = {frags[h].code for h in others}
    if codes != {code_name(k, m)}:
        raise RD.BlockError(f"the fragments were coded with {sorted(codes)}; this pyeclib codes with "
                            f"{code_name(k, m)}: not decoded")
    recorded = _agreed({h: frags[h] for h in others}, members)
    for x in others:
        if members.index(x) in recorded and crc32c(images[x]) != recorded[members.index(x)][1]:
            raise RD.BlockError(f"rank {x}'s image is not the one the parities were made of (CRC-32C)")
    if any(members.index(x) not in recorded for x in lost):
        raise RD.BlockError(f"no surviving parity records the images of ranks {lost}")
    gone = {members.index(x) for x in lost}
    decoded: dict[int, bytes] = {}
    out: dict[int, bytes] = {}
    for x in lost if only is None else [only]:
        li = members.index(x)
        pieces = []
        for c in stripes_of(li, g, m):
            if c not in decoded:
                decoded[c] = _decode(c, gone, images, frags, members, m)
            size = len(decoded[c]) // k
            pieces.append(decoded[c][data_of(c, g, m).index(li) * size:][:part(recorded[li][0], k)])
        length, crc = recorded[li]
        img = b"".join(pieces)[:length]
        if len(img) != length or crc32c(img) != crc:
            raise RD.BlockError(f"rank {x}'s rebuilt image fails its CRC-32C")
        out[x] = img
    return out


def _decode(c: int, gone: set[int], images: dict[int, bytes], frags: dict[int, Fragments], members: list[int],
            m: int) -> bytes:
    """Codeword ``c``'s data (its ``k`` stripes, each padded) from the surviving fragments."""
    g, k = len(members), len(members) - m
    keep = [h for h in holders(c, g, m) if h not in gone]
    if not keep:
        raise RD.BlockError(f"codeword {c}: every holder of its parity is lost")
    word = frags[members[keep[0]]].words[c]
    if any(frags[members[h]].words[c].size != word.size for h in keep):
        raise RD.BlockError(f"codeword {c}: the holders disagree on its stripe size")
    have = [word.headers[t] + stripe(images[members[i]], stripes_of(i, g, m).index(c), k, word.size)
            for t, i in enumerate(data_of(c, g, m)) if i not in gone]
    have += [frags[members[h]].words[c].fragment for h in keep]
    if len(have) < k:
        raise RD.BlockError(f"codeword {c}: {len(have)} fragments left of the {k} it needs")
    try:
        data = bytes(driver(k, m).decode(have))
    except Exception as e:  # noqa: BLE001 - pyeclib's own errors: the step is not rebuilt
        raise RD.BlockError(f"codeword {c} cannot be decoded: {e}") from None
    if len(data) != k * word.size:
        raise RD.BlockError(f"codeword {c} decoded to {len(data)} bytes, not {k * word.size}")
    return data


__all__ = ["ALIGN", "EC_TYPES", "Fragments", "MAX_IMAGE_BYTES", "RSAccumulator", "Word", "data_of", "driver",
           "held_by", "holders", "parse_fragments", "rebuild_lost", "stripe", "stripe_block", "stripes_of"]
