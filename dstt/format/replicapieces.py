"""redundancy="replicas" (issue 26), torch-free: how a lost rank's part of a
step is assembled from the pieces several survivors' rings hold.

Each survivor offers, for each ``(rank, step)`` of which its ring holds
some chunks of that rank's part, the part's chunk keys as its plan says
(``need``: ``(layout position, chunk index)``, :func:`dstt.format.replicas.owned_chunks`)
and the CRC-32C of every one of them it holds. :func:`decide`, run alike on
every rank over the gathered offers, says for each part not recorded by
its own rank who assembles it and which survivor provides each chunk --
or why it is refused: the survivors disagree on what the part is, two
holders of the same chunk disagree on its CRC (named, never trusted), or
some chunk is held by no survivor (the step then falls back to the store,
named by nodeloss.report_unrebuilt).

>>> offers = [[((2, 7), ([(0, 0), (0, 1)], {(0, 0): 11}))],      # rank 0 holds chunk (0, 0) of rank 2's part
...           [((2, 7), ([(0, 0), (0, 1)], {(0, 1): 22}))]]      # rank 1 holds chunk (0, 1)
>>> [a], refused = decide(offers, lambda rank, step: False)
>>> a.assembler, a.providers, refused
(0, {(0, 0): 0, (0, 1): 1}, [])
>>> decide([[((2, 7), ([(0, 0)], {(0, 0): 11}))], [((2, 7), ([(0, 0)], {(0, 0): 12}))]], lambda r, s: False)[1]
["step 7 (the replicas of rank 2's part differ: chunk (0, 0) on ranks 0, 1)"]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Key = tuple[int, int]


@dataclass(frozen=True)
class Assembly:
    """How rank ``rank``'s part of ``step`` is assembled: by ``assembler``,
    each chunk (key) from ``providers[key]``, checked against ``crcs[key]``."""

    rank: int
    step: int
    assembler: int
    providers: dict[Key, int]
    crcs: dict[Key, int]


def _key(value: Any) -> Key:
    a, b = value
    if type(a) is not int or type(b) is not int:
        raise ValueError(f"not a chunk key: {value!r}")
    return (a, b)


def decide(offers: Sequence[Sequence[Any]], recorded: Callable[[int, int], bool]
           ) -> tuple[list[Assembly], list[str]]:
    """``(assemblies, refusals)`` from ``offers[by]`` (rank ``by``'s list of
    ``((rank, step), (need, {key: crc}))``), leaving out every part
    ``recorded(rank, step)`` says its own rank recorded. The same on every
    rank given the same offers (the assembler: the survivor holding most of
    the part, the lowest rank on a tie; each other chunk from the lowest
    rank holding it)."""
    parts: dict[tuple[int, int], dict[int, tuple[frozenset[Key], dict[Key, int]]]] = {}
    for by, items in enumerate(offers):
        for (rank, step), (need, held) in items:
            parts.setdefault((int(rank), int(step)), {})[by] = (
                frozenset(_key(k) for k in need), {_key(k): int(c) for k, c in held.items()})
    out: list[Assembly] = []
    refused: list[str] = []
    for (rank, step), by_rank in sorted(parts.items()):
        if recorded(rank, step):
            continue  # recorded by that rank itself: its node survived
        why = _problem(rank, by_rank)
        if why is not None:
            refused.append(f"step {step} ({why})")
            continue
        need = next(iter(by_rank.values()))[0]
        assembler = max(by_rank, key=lambda b: (len(by_rank[b][1]), -b))
        providers = {k: assembler if k in by_rank[assembler][1] else min(b for b in by_rank if k in by_rank[b][1])
                     for k in sorted(need)}
        crcs = {k: by_rank[p][1][k] for k, p in providers.items()}
        out.append(Assembly(rank, step, assembler, providers, crcs))
    return out, refused


def _problem(rank: int, by_rank: dict[int, tuple[frozenset[Key], dict[Key, int]]]) -> str | None:
    """Why rank ``rank``'s part cannot be assembled from what the survivors offer; None if it can."""
    if len({need for need, _ in by_rank.values()}) > 1:
        return f"the survivors disagree on what rank {rank}'s part is: ranks {', '.join(map(str, sorted(by_rank)))}"
    need = next(iter(by_rank.values()))[0]
    crcs: dict[Key, dict[int, int]] = {}
    for by, (_, held) in by_rank.items():
        for k, c in held.items():
            if k in need:
                crcs.setdefault(k, {})[by] = c
    differ = sorted(k for k, c in crcs.items() if len(set(c.values())) > 1)
    if differ:
        k = differ[0]
        more = f" and {len(differ) - 1} more" if len(differ) > 1 else ""
        return (f"the replicas of rank {rank}'s part differ: chunk {k}{more} on ranks "
                f"{', '.join(map(str, sorted(crcs[k])))}")
    missing = need - set(crcs)
    if missing:
        return f"rank {rank}'s part: {len(missing)} of its {len(need)} chunks are held by no survivor"
    return None


def held_chunks(layouts: Sequence[Any], rank: int) -> set[Key]:
    """The keys of the chunks ``rank``'s ring holds as a replica of another
    holder's (every chunk of each replicated region it holds that another
    holder writes: what its seal records mark)."""
    out: set[Key] = set()
    for li, layout in enumerate(layouts):
        for region in layout.regions:
            if rank not in region.holders or len(region.holders) < 2 or not math.prod(region.shape):
                continue
            for coords in layout.chunk_grid.overlapping(region.offset, region.shape):
                index = layout.linear(coords)
                if layout.owner(region, index) != rank:
                    out.add((li, index))
    return out


def unprotected(layouts: Sequence[Any], statics: Sequence[Any], rank: int, node_of: Sequence[int]) -> str | None:
    """Why rank ``rank``'s seal of a step (its record's static task entries
    ``statics``) does not count toward the step's protection under
    ``replicas``; None if it does: its ring holds every chunk it should hold
    for the other holders (marked ``[owner, shard]``), and every region it
    holds has a holder on another node (``node_of[rank]``). A step is
    protected once every rank's seal counts: every rank's part is then in
    the ring of a holder on another node.

    >>> from dstt.format.codecs.spec import CodecSpec
    >>> from dstt.format.geometry import build_layout
    >>> l = build_layout("w", ("param", "float32", (4, 4), "replicated", [((0, 0), (4, 4), (0, 1))]),
    ...                  CodecSpec(), 16)
    >>> marks = [[0, i, 0, 0, 0, 0, [0, 0]] for i in sorted(k for _, k in held_chunks([l], 1))]
    >>> unprotected([l], marks, 1, [0, 1]) is None
    True
    >>> unprotected([l], marks, 1, [0, 0])
    'w: no holder of a region on another node'
    >>> unprotected([l], marks[1:], 1, [0, 1])
    '1 of the 2 chunks it holds for others not in its seal'
    """
    for layout in layouts:
        for region in layout.regions:
            if rank in region.holders and math.prod(region.shape) and \
                    all(node_of[h] == node_of[rank] for h in region.holders):
                return f"{layout.name}: no holder of a region on another node"
    want = held_chunks(layouts, rank)
    marked = {(int(e[0]), int(e[1])) for e in statics if isinstance(e, list) and len(e) == 7}
    if not want <= marked:
        return f"{len(want - marked)} of the {len(want)} chunks it holds for others not in its seal"
    return None


__all__ = ["Assembly", "Key", "decide", "held_chunks", "unprotected"]
