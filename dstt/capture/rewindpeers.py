"""The chunks of a held step that other ranks' rings hold, for the
collective rewind from memory (issue 25).

A replicated tensor's chunks are spread over the ranks that hold it (each
written once: store/plan.py), so each rank's ring holds only its share;
every rank must restore all of it. :func:`exchange` (collective, every
rank, once the ranks agreed to rewind from memory):

1. every rank states what its ring holds of the step's replicated chunks
   and where (an :class:`~dstt.capture.peerring.Offer`: one all-gather,
   the only one of the common case);
2. from the offers alone, every rank works out alike what each rank lacks
   (:func:`needs`: each chunk from the first rank that holds it) and which
   of it that rank reads in place -- an owner on the same host, node and
   boot that offers its ring (:func:`foreseen_local`) -- and what goes
   over gloo: only the chunks some rank wants, as one flat tensor per
   sending rank (flatcast.py), never a chunk its reader holds already
   (``redundancy="replicas"``: every ring holds every replicated chunk,
   nothing crosses);
3. each rank maps what it reads in place (peerring.py proves the rest:
   the lease, the same pool file, every chunk bounded and checked); one it
   cannot map puts its restore off until :func:`settle`.

:func:`settle` (collective where any rank was to read in place, after
every rank's restore, before any rank lets the step go): each reader
checks that every peer it read from still holds the step (its lease
unchanged). A reader that could not map a peer, or whose peer let go
while it copied, gets every chunk it was to read in place over gloo from
the owners (their trainers are still in the rewind: their own views are
the step's) and restores (again) from them -- once, bounded by the
collectives' timeout. The owners remove their leases only after that
collective.
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
    #: The peers read in place: rank -> its map.
    maps: dict[int, P.PeerMap] = field(default_factory=dict)
    offers: list[P.Offer] = field(default_factory=list)
    #: This rank's offered views (what it sends), in its offer's order.
    mine: list[torch.Tensor] = field(default_factory=list)
    #: Every rank's needs, ``{source rank: indices of its offer}`` (the same on every rank).
    need: list[dict[int, list[int]]] = field(default_factory=list)
    #: Every rank's needs that it reads in place, as every rank foresees it from the offers.
    local: list[dict[int, list[int]]] = field(default_factory=list)
    #: Sources this rank was to read in place and could not: it restores only after :func:`settle`.
    deferred: list[int] = field(default_factory=list)
    lease: Path | None = None
    #: Bytes by how they came: ``mapped`` (in place), ``gloo``, ``again`` (over gloo after a peer let go).
    stats: dict[str, int] = field(default_factory=lambda: {"mapped": 0, "gloo": 0, "again": 0})

    def close(self) -> None:
        """Let go of the peers' maps and this rank's lease (after the last collective)."""
        for m in self.maps.values():
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
        return P.Offer([(t.layout.name, tuple(t.offset), tuple(t.shape), v.dtype, 0, F.nbytes(v)) for t, v in mine],
                       P.host_identity())
    # (a slot of a memory tier's pool is a window of the file from byte ``_base``: hostpool.py)
    base = pool.buffer.data_ptr() - int(getattr(pool, "_base", 0))
    chunks = [(t.layout.name, tuple(t.offset), tuple(t.shape), v.dtype, v.data_ptr() - base, F.nbytes(v))
              for t, v in mine]
    end = pool.buffer.data_ptr() - base + int(pool.file_bytes)
    if any(not (0 <= c[4] and c[4] + c[5] <= end) for c in chunks) or not all(v.is_contiguous() for _, v in mine):
        return P.Offer(chunks, P.host_identity())  # (some chunk is not in the pool file: process memory)
    try:
        st = os.stat(ring_dir / name)
        ex.lease, nonce = P.write_lease(ring_dir, step)
    except OSError as e:
        log.warning("dstt: rewind: this rank's ring cannot be offered in place (%s); its chunks go over gloo", e)
        return P.Offer(chunks, P.host_identity())
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
    layouts = {l.name: l for l in job.plan.layouts}
    # What every rank needs from which, and which of it it reads in place,
    # worked out alike on every rank from the offers alone: no other collective.
    ex.need = needs(ex.offers, set(layouts))
    ex.local = [{src: idx for src, idx in n.items() if foreseen_local(ex.offers[r], ex.offers[src])}
                for r, n in enumerate(ex.need)]
    me = coord.rank
    for src in ex.need[me]:
        if src not in ex.local[me]:
            _say(f"rank {src}'s chunks go over gloo: it runs on another host or offers no lease",
                 other_host=ex.offers[src].host != ex.offers[me].host)
    ex.received = _cast(ex, coord, [{src: idx for src, idx in n.items() if src not in ex.local[r]}
                                    for r, n in enumerate(ex.need)])
    ex.stats["gloo"] = _nbytes(ex.received)
    here = P.host_identity()
    for src, idx in ex.local[me].items():
        try:
            m, why = P.open_peer(ex.offers[src], idx, layouts, here=here)
        except Exception as e:  # noqa: BLE001 - an offer that does not check out: over gloo, after settle
            m, why = None, f"its offer does not check out ({type(e).__name__}: {e})"
        if m is None:
            ex.deferred.append(src)
            _say(f"rank {src}'s chunks go over gloo: {why}", other_host=False)
            continue
        ex.maps[src] = m
        _add(ex.parts, ex.offers[src], idx, m.views)
        ex.stats["mapped"] += sum(ex.offers[src].chunks[i][5] for i in idx)
    for name, got in ex.received.items():
        ex.parts.setdefault(name, []).extend(got)


def needs(offers: list[P.Offer], names: set[str]) -> list[dict[int, list[int]]]:
    """Each rank's needs, ``{source rank: indices of its offer}``: every
    replicated chunk of a tensor of the step that the rank's own offer lacks
    (its ring holds every replicated chunk it has: all are offered), from
    the first rank offering it."""
    out: list[dict[int, list[int]]] = []
    for r, mine in enumerate(offers):
        have = {(c[0], tuple(c[1])) for c in mine.chunks}
        need: dict[int, list[int]] = {}
        for src, o in enumerate(offers):
            if src == r:
                continue
            for i, (name, off, *_) in enumerate(o.chunks):
                if name in names and (name, tuple(off)) not in have:
                    have.add((name, tuple(off)))
                    need.setdefault(src, []).append(i)
        out.append(need)
    return out


def foreseen_local(reader: P.Offer, owner: P.Offer) -> bool:
    """Whether ``reader`` is to read ``owner``'s ring in place: the same
    host, node and boot as their offers say, and the owner offers its ring
    (the reader proves the rest: peerring.open_peer; where that fails, it
    gets the chunks over gloo in :func:`settle`)."""
    return (owner.lease is not None and bool(owner.host.get("boot"))
            and all(reader.host.get(k) == owner.host.get(k) for k in ("host", "node", "boot")))


def _nbytes(parts: Parts) -> int:
    return sum(F.nbytes(v) for got in parts.values() for *_, v in got)


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
    """Collective where any rank was to read a peer's ring in place (every
    rank, after its restore -- ``restored``: whether it went through --
    or, with :attr:`Exchange.deferred`, instead of it): the chunks this rank
    must restore from (again), every chunk it lacks, those it was to read
    in place now over gloo -- where it could not map a peer's ring, or one
    it read changed while it copied (a lease gone or rewritten) -- or None
    where it is done."""
    if not any(ex.local):
        return None
    changed = sorted(r for r, m in ex.maps.items() if not m.unchanged()) if restored else []
    for r in changed:
        log.warning("dstt: rewind: rank %d's ring changed while this rank copied from it (its lease on the "
                    "step's slot is gone or rewritten): every chunk read in place is taken again over gloo", r)
    for m in ex.maps.values():
        m.close()  # (after a change, no peer's mapped bytes are trusted again: they could change next)
    redo = bool(changed or ex.deferred)
    every = coord.all_gather(redo)
    got = _cast(ex, coord, [ex.local[r] if every[r] else {} for r in range(coord.world)]) if any(every) else {}
    if not redo:
        return None
    ex.stats["again" if changed else "gloo"] += _nbytes(got)
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
