"""The chunks of a held step that other ranks' rings hold, for the
collective rewind from memory (issue 25).

A replicated tensor's chunks are spread over the ranks that hold it (each
written once: store/plan.py), so each rank's ring holds only its share;
every rank must restore all of it. :func:`exchange` (collective, every
rank, once the ranks agreed to rewind from memory):

1. every rank states what its ring holds of the step's replicated chunks
   and where (an :class:`~dstt.capture.peerring.Offer`, one all-gather);
2. each rank takes each chunk its own ring lacks from the first rank that
   holds it: read in place from that rank's pool file where it is on the
   same host (peerring.py: proven, not assumed), else over gloo;
3. what any rank still wants goes over gloo (a small all-gather of the
   wants, then each sending rank's wanted chunks as one flat tensor:
   flatcast.py) -- only those, never a chunk its reader holds already
   (``redundancy="replicas"``: every ring holds every replicated chunk,
   nothing crosses).

:func:`settle` (collective where any rank read in place, after every
rank's restore, before any rank lets the step go): each reader checks
that every peer it read from still holds the step (its lease unchanged);
where one let go, every chunk that reader read in place is taken again
over gloo from its owners (their trainers are still in the rewind: their
own views are the step's) and the reader restores again from them -- once, bounded by the collectives'
timeout. The owners remove their leases only after that collective.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dstt.capture import flatcast as F
from dstt.capture import peerring as P
from dstt.store.plan import ChunkTask

log = logging.getLogger("dstt.capture")

#: Chunks by tensor name: (offset, shape, data) -- as rewind.py reads them.
Parts = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]]

#: Why chunks went over gloo, each said once per process.
_SAID: set[str] = set()


def _replicated(t: ChunkTask) -> bool:
    """Whether chunk ``t`` lies in a region several ranks hold (one of them
    writes it: the others' rings lack it, unless they hold replicas)."""
    for r in t.layout.regions:
        if all(ro <= o < ro + rs for o, ro, rs in zip(t.offset, r.offset, r.shape)):
            return len(r.holders) > 1
    return False


@dataclass
class Exchange:
    """One rank's side of a rewind's exchange (see the module docstring)."""

    #: Every chunk this rank's ring lacks: mapped from a peer's pool, or received.
    parts: Parts = field(default_factory=dict)
    #: The chunks received over gloo (kept for a second restore).
    received: Parts = field(default_factory=dict)
    #: The peers read in place: rank -> (its map, the indices of its offer read).
    maps: dict[int, tuple[P.PeerMap, list[int]]] = field(default_factory=dict)
    offers: list[P.Offer] = field(default_factory=list)
    #: This rank's offered views (what it sends), in its offer's order.
    mine: list[torch.Tensor] = field(default_factory=list)
    #: Every rank's (wanted over gloo, read in place), each {source rank: offer indices}.
    plans: list[tuple[dict[int, list[int]], dict[int, list[int]]]] = field(default_factory=list)
    lease: Path | None = None
    #: Bytes by how they came: ``mapped`` (in place), ``gloo``, ``again`` (over gloo after a peer let go).
    stats: dict[str, int] = field(default_factory=lambda: {"mapped": 0, "gloo": 0, "again": 0})

    @property
    def mapped_anywhere(self) -> bool:
        """Whether any rank read some peer's ring in place (settle is collective then)."""
        return any(m for _, m in self.plans)

    def close(self) -> None:
        """Let go of the peers' maps and this rank's lease (after the last collective)."""
        for m, _ in self.maps.values():
            m.close()
        self.maps = {}
        self.parts = {}
        P.drop_lease(self.lease)
        self.lease = None


def _offer(mine: list[tuple[ChunkTask, torch.Tensor]], step: int, ring_dir: Path | None, pool: Any,
           ex: Exchange) -> P.Offer:
    """This rank's offer, its lease written (where its chunks are in a ring's pool file)."""
    name = getattr(pool, "ring_name", None)
    if not mine or ring_dir is None or not name:
        return P.Offer([(t.layout.name, tuple(t.offset), tuple(t.shape), v.dtype, 0, F.nbytes(v)) for t, v in mine])
    # (a slot of a memory tier's pool is a window of the file from byte ``_base``: hostpool.py)
    base = pool.buffer.data_ptr() - int(getattr(pool, "_base", 0))
    chunks = [(t.layout.name, tuple(t.offset), tuple(t.shape), v.dtype, v.data_ptr() - base, F.nbytes(v))
              for t, v in mine]
    end = pool.buffer.data_ptr() - base + int(pool.file_bytes)
    if any(not (0 <= c[4] and c[4] + c[5] <= end) for c in chunks) or not all(v.is_contiguous() for _, v in mine):
        return P.Offer(chunks)  # (some chunk is not in the pool file: process memory)
    try:
        st = os.stat(ring_dir / name)
        ex.lease, nonce = P.write_lease(ring_dir, step)
    except OSError as e:
        log.warning("dstt: rewind: this rank's ring cannot be offered in place (%s); its chunks go over gloo", e)
        return P.Offer(chunks)
    return P.Offer(chunks, P.host_identity(), os.fspath(ring_dir), name, (st.st_dev, st.st_ino), ex.lease.name,
                   nonce)


def exchange(job: Any, coord: Any, ring_dir: Path | None) -> Exchange:
    """Collective (every rank): the chunks of ``job``'s step (held in this
    rank's ring) that other ranks' rings hold and this one's lacks."""
    ex = Exchange()
    try:
        _exchange(ex, job, coord, ring_dir)
    except BaseException:
        ex.close()
        raise
    return ex


def _exchange(ex: Exchange, job: Any, coord: Any, ring_dir: Path | None) -> None:
    mine = [(t, view) for t, view in job.ring.views if _replicated(t) and view.numel()]
    ex.mine = [v for _, v in mine]
    ex.offers = list(coord.all_gather(_offer(mine, job.plan.step, ring_dir, job.ring.pool, ex)))
    if not any(o.chunks for o in ex.offers):
        return  # (no replicated chunk anywhere: FSDP-sharded state)
    have = {(t.layout.name, tuple(t.offset)) for t, _ in job.ring.views}
    layouts = {l.name: l for l in job.plan.layouts}
    need: dict[int, list[int]] = {}
    for r, o in enumerate(ex.offers):
        if r == coord.rank:
            continue
        for i, (name, off, *_) in enumerate(o.chunks):
            if name in layouts and (name, tuple(off)) not in have:
                have.add((name, tuple(off)))
                need.setdefault(r, []).append(i)
    wants: dict[int, list[int]] = {}
    here = P.host_identity()
    for r, idx in need.items():
        try:
            m, why = P.open_peer(ex.offers[r], idx, layouts, here=here)
        except Exception as e:  # noqa: BLE001 - an offer that does not check out: over gloo (no rank left waiting)
            m, why = None, f"its offer does not check out ({type(e).__name__}: {e})"
        if m is None:
            wants[r] = idx
            _say(f"rank {r}'s chunks go over gloo: {why}", other_host="another host" in why)
            continue
        ex.maps[r] = (m, idx)
        _add(ex.parts, ex.offers[r], idx, m.views)
        ex.stats["mapped"] += sum(ex.offers[r].chunks[i][5] for i in idx)
    ex.plans = [tuple(p) for p in coord.all_gather((wants, {r: idx for r, (_, idx) in ex.maps.items()}))]
    ex.received = _cast(ex, coord, [p[0] for p in ex.plans])
    for name, got in ex.received.items():
        ex.parts.setdefault(name, []).extend(got)
    ex.stats["gloo"] = sum(F.nbytes(v) for got in ex.received.values() for *_, v in got)


def _add(parts: Parts, offer: P.Offer, idx: list[int], views: list[torch.Tensor]) -> None:
    for i, view in zip(idx, views):
        name, off, shape, *_ = offer.chunks[i]
        parts.setdefault(name, []).append((tuple(off), tuple(shape), view))


def _cast(ex: Exchange, coord: Any, wanted: list[dict[int, list[int]]]) -> Parts:
    """Collective: for each rank some rank ``wanted`` chunks of (``wanted[r]``:
    rank r's {source: offer indices}), those chunks as one flat tensor from
    it; the ones this rank wanted."""
    out: Parts = {}
    for src in range(coord.world):
        union = sorted(set().union(*(w.get(src, ()) for w in wanted)))
        if not union:
            continue
        sizes = [int(ex.offers[src].chunks[i][5]) for i in union]
        flat, starts = F.cast(coord, src, sizes, [ex.mine[i] for i in union] if src == coord.rank else None)
        mine = wanted[coord.rank].get(src, [])
        if src == coord.rank or not mine:
            continue
        at = {i: starts[k] for k, i in enumerate(union)}
        for i in mine:
            name, off, shape, dtype, _, _ = ex.offers[src].chunks[i]
            out.setdefault(name, []).append((tuple(off), tuple(shape), F.view_of(flat, at[i], dtype, tuple(shape))))
    return out


def settle(ex: Exchange, coord: Any, restored: bool) -> Parts | None:
    """Collective where any rank read a peer's ring in place (every rank,
    after its restore, ``restored``: whether it went through): the chunks
    this rank must restore again -- every chunk it lacks, the ones of peers
    that let the step go while it copied them taken again over gloo -- or
    None where nothing changed."""
    if not ex.mapped_anywhere:
        return None
    changed = sorted(r for r, (m, _) in ex.maps.items() if not m.unchanged()) if restored else []
    for r in changed:
        log.warning("dstt: rewind: rank %d's ring changed while this rank copied from it (its lease on the "
                    "step's slot is gone or rewritten): every chunk read in place is taken again over gloo", r)
    for m, _ in ex.maps.values():
        m.close()  # (after a change, no peer's mapped bytes are trusted again: they could change next)
    every = coord.all_gather(bool(changed))
    again = [ex.plans[r][1] if every[r] else {} for r in range(coord.world)]
    if not any(again):
        return None
    got = _cast(ex, coord, again)
    if not changed:
        return None
    ex.stats["again"] = sum(F.nbytes(v) for parts in got.values() for *_, v in parts)
    out: Parts = {name: list(parts) for name, parts in ex.received.items()}
    for name, parts in got.items():
        out.setdefault(name, []).extend(parts)
    return out


def _say(what: str, other_host: bool) -> None:
    """Why chunks cross gloo, once per process (another host: the normal
    case of a multi-node run, at INFO)."""
    key = what.split(":", 1)[1]
    if key in _SAID:
        return
    _SAID.add(key)
    log.log(logging.INFO if other_host else logging.WARNING, "dstt: rewind from memory: %s", what)


__all__ = ["Exchange", "Parts", "exchange", "settle"]
