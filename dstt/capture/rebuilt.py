"""The newest step a distributed recovery committed, kept in memory
(issue 26: restore from rebuilt memory, without reading the store).

After the loss of a node, the restarted job's recovery (crashsafe.py)
records every rank's part of the steps the memory tiers held: the
surviving ranks' own rings and the lost ranks' rings rebuilt from copies,
parity or replicas (nodeloss.py, parityrecover.py, replicaguard.py). Each
part is read from a ring through :func:`ranks.record_rings` -- its plan
replayed from the seal record, every chunk checked against the CRC sealed
with it -- and written to the store. While it records, :func:`keeping`
collects those plans (views of the mapped ring pools: no byte copied);
once rank 0 committed, :meth:`Kept.newest` keeps only the newest
committed step's.

``Capture.rewind`` and ``Capture.restore`` then restore that step from
those parts (:func:`gather`, collective: each rank sends the chunks it
holds, each with its CRC-32C, checked on arrival) -- no chunk is read from
the store. Where some rank's part is not held (it was recorded before the
loss, or was refused), every rank falls back to the store together. The
parts are let go of at the first ``snapshot()`` (or ``close()``).

The exchange sends every rank the whole step (a small all-gather of what
each rank offers, then each rank's chunks as one flat tensor broadcast
over dstt's gloo group, flatcast.py): fine for a restarted job of tens of
nodes; a large run would want each rank to fetch only the boxes it covers.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dstt.capture import flatcast as F
from dstt.format.codecs.spec import crc32c
from dstt.store.plan import StepPlan

log = logging.getLogger("dstt.capture")

_KEEPING: contextvars.ContextVar[Kept | None] = contextvars.ContextVar("dstt_rebuilt_keeping", default=None)

#: Chunks by tensor name: (offset, shape, data) -- rewind.py's ``Parts``.
Parts = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]]


@dataclass
class Kept:
    """The plans recorded by this process during a recovery, ``{step: {rank: plan}}``."""

    plans: dict[int, dict[int, StepPlan]] = field(default_factory=dict)

    def add(self, rank: int, plan: StepPlan) -> None:
        self.plans.setdefault(int(plan.step), {})[int(rank)] = plan

    def newest(self, committed: list[int]) -> Kept:
        """Only the newest of the ``committed`` steps (the others let go of)."""
        step = max(committed, default=None)
        return Kept({step: self.plans[step]} if step is not None and step in self.plans else {})


@contextlib.contextmanager
def keeping() -> Iterator[Kept]:
    """Collect, while in the block, the plans :func:`keep` is given (ranks.record_rings)."""
    kept = Kept()
    token = _KEEPING.set(kept)
    try:
        yield kept
    finally:
        _KEEPING.reset(token)


def keep(rank: int, plan: StepPlan) -> None:
    """Rank ``rank``'s part of a step, recorded from a ring (its CRCs checked): kept if collecting."""
    kept = _KEEPING.get(None)  # (a context variable: never blocks)
    if kept is not None:
        kept.add(rank, plan)


def _bytes_of(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(t.detach().reshape(-1).view(torch.uint8).numpy())


def _offer(kept: Kept, step: int) -> tuple[list[tuple[int, Any, list[Any], list[Any]]], list[torch.Tensor]]:
    """What this rank sends of ``step``: ``[(rank, tree, layouts, [(name,
    offset, shape, dtype, bytes, crc)])]``, one per part it holds, and the
    chunks' data in that order (views of the mapped rings)."""
    out, data = [], []
    for rank, plan in sorted(kept.plans.get(step, {}).items()):
        chunks = []
        for t in plan.tasks:
            src = t.source.detach()
            chunks.append((t.layout.name, tuple(t.offset), tuple(t.shape), src.dtype, F.nbytes(src),
                           crc32c(_bytes_of(src))))
            data.append(src)
        out.append((rank, plan.tree, list(plan.layouts), chunks))
    return out, data


@dataclass
class Gathered:
    """Every rank's part of a step, gathered: the value tree and layouts
    (of this rank's part where it was offered) and every chunk."""

    step: int
    tree: Any
    layouts: list[Any]
    parts: Parts


def gather(kept: Kept | None, step: int, coord: Any) -> Gathered | None:
    """Collective (every rank, the same ``step``): the chunks of ``step``
    every rank's part of it, from the parts the ranks hold in memory;
    None on every rank if some rank's part is held by none, or a chunk
    arrived other than it was sent (said in the log: the caller reads the
    store instead). What each rank offers goes by all-gather, its bytes as
    one flat tensor (flatcast.py), each chunk checked against its CRC-32C."""
    offers, data = _offer(kept, step) if kept is not None and step in kept.plans else ([], [])
    gathered = coord.all_gather((step, offers))
    parts: Parts = {}
    held: dict[int, tuple[Any, list[Any]]] = {}
    bad: list[str] = []
    if any(asked != step for asked, _ in gathered):
        bad.append(f"the ranks asked for different steps ({sorted({int(a) for a, _ in gathered})})")
    for sender, (_, theirs) in enumerate(gathered):
        listed = [c for _, _, _, chunks in theirs for c in chunks]
        if not listed or bad:
            continue
        flat, starts = F.cast(coord, sender, [int(c[4]) for c in listed], data if sender == coord.rank else None)
        at = iter(starts)
        for rank, tree, layouts, chunks in theirs:
            got = [(c, F.view_of(flat, next(at), c[3], tuple(c[2]))) for c in chunks]
            if rank in held:
                continue  # (the same part offered twice: the first one)
            for (name, offset, shape, _, _, crc), chunk in got:
                if crc32c(_bytes_of(chunk)) != crc:
                    bad.append(f"a chunk of {name!r} of rank {rank}'s part changed in transfer")
                parts.setdefault(name, []).append((tuple(offset), tuple(shape), chunk))
            held[int(rank)] = (tree, layouts)
    missing = sorted(set(range(coord.world)) - set(held))
    if bad or missing:
        why = "; ".join(bad[:5]) if bad else f"rank(s) {', '.join(map(str, missing))}'s part not in memory"
        log.warning("dstt: step %d is read from the store, not from the rebuilt memory: %s", step, why)
        return None
    tree, layouts = held[coord.rank]  # (this rank's own tree: its meta, its RNG states)
    return Gathered(step, tree, layouts, parts)


__all__ = ["Gathered", "Kept", "gather", "keep", "keeping"]
