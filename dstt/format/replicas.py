"""redundancy="replicas" (issue 26), torch-free: which chunks a rank's ring
holds as a replica of another holder's, how its seal record says so, and
what a lost rank's record is, derived from a survivor's.

A replicated tensor (DDP's parameters and optimizer state; an HSDP
DTensor's shard along a ``Replicate`` mesh dimension) is one *region* of
its layout with several holders; each of its chunks is written to the
store by one of them, its *owner* (``TensorLayout.owner``: the work is
shared out). With ``replicas`` each holder also stages, after its own
chunks, every chunk of the region that another holder owns: its ring then
holds the whole region, so the loss of any holder's node leaves every
byte of that holder's share in the rings of the others.

A held chunk's task in the seal record's static part carries a seventh
field, its *marker* ``[owner, shard]``: the rank that writes it and the
index of its region (the logical shard) in the layout. A record read back
is untrusted: :func:`read_marker` refuses anything else with ValueError.

>>> from dstt.format.codecs.spec import CodecSpec
>>> from dstt.format.geometry import build_layout
>>> l = build_layout("w", ("param", "float32", (4, 4), "replicated", [((0, 0), (4, 4), (0, 1))]),
...                  CodecSpec(), 16)
>>> mine, theirs = owned_chunks([l], 0), owned_chunks([l], 1)
>>> sorted([*mine, *theirs]) == [(0, i) for i in range(4)] and not set(mine) & set(theirs)
True
>>> read_marker([1, 0], world=2, shards=1)
(1, 0)
>>> read_marker([1, 0, 3], world=2, shards=1)
Traceback (most recent call last):
ValueError: a held chunk's marker must be [owner, shard], got [1, 0, 3]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

from dstt.errors import CorruptStoreError
from dstt.format import layout as L
from dstt.format.geometry import TensorLayout
from dstt.format.manifest import decode_json, encode_json


def marker(layout: TensorLayout, index: int, offset: Sequence[int]) -> list[int]:
    """The marker of chunk ``index`` of ``layout`` at ``offset``: ``[owner, shard]``."""
    shard = shard_of(layout, offset)
    return [layout.owner(layout.regions[shard], index), shard]


def shard_of(layout: TensorLayout, offset: Sequence[int]) -> int:
    """The index of the region (logical shard) of ``layout`` holding the element at ``offset``."""
    for i, r in enumerate(layout.regions):
        if all(ro <= o < ro + n for o, ro, n in zip(offset, r.offset, r.shape)):
            return i
    raise ValueError(f"{layout.name}: no region holds the chunk at {list(offset)}")


def read_marker(value: Any, *, world: int, shards: int) -> tuple[int, int]:
    """``(owner, shard)`` from a marker read back; ValueError unless it is two
    integers, a rank of ``world`` and a region of ``shards``."""
    if not (type(value) is list and len(value) == 2 and all(type(v) is int for v in value)):
        raise ValueError(f"a held chunk's marker must be [owner, shard], got {str(value)[:80]}")
    owner, shard = value
    if not (0 <= owner < world and 0 <= shard < shards):
        raise ValueError(f"a held chunk's marker {value} names no rank of {world} or shard of {shards}")
    return owner, shard


def owned_chunks(layouts: Sequence[TensorLayout], rank: int) -> dict[tuple[int, int], int]:
    """``{(layout position, chunk index): shard}`` of every chunk ``rank`` writes:
    what its own seal record of a step holds (a rank's part of the step)."""
    out: dict[tuple[int, int], int] = {}
    for li, layout in enumerate(layouts):
        for si, region in enumerate(layout.regions):
            if rank not in region.holders or math.prod(region.shape) == 0:
                continue
            for coords in layout.chunk_grid.overlapping(region.offset, region.shape):
                index = layout.linear(coords)
                if layout.owner(region, index) == rank:
                    out[(li, index)] = si
    return out


def meta_positions(layouts: Sequence[TensorLayout], rank: int) -> list[int]:
    """Positions of the layouts whose array documents ``rank`` writes."""
    return [i for i, layout in enumerate(layouts) if layout.meta_owner_rank == rank]


def replicated_elsewhere(layouts: Iterable[TensorLayout], node_of: Sequence[str]) -> list[str]:
    """Names of the tensors some part of which no holder on another node
    holds (``node_of[rank]``: each rank's node): with none, every rank's
    share survives the loss of its node in a replica's ring."""
    out = []
    for layout in layouts:
        for region in layout.regions:
            if math.prod(region.shape) and len({node_of[h] for h in region.holders}) < 2:
                out.append(layout.name)
                break
    return out


def held_bytes(layouts: Iterable[TensorLayout], rank: int) -> int:
    """Bytes of the chunks ``rank`` holds as a replica of another holder's:
    the extra host memory ``replicas`` costs it per step in its ring."""
    total = 0
    for layout in layouts:
        for region in layout.regions:
            if rank not in region.holders or len(region.holders) < 2:
                continue
            for coords in layout.chunk_grid.overlapping(region.offset, region.shape):
                index = layout.linear(coords)
                if layout.owner(region, index) != rank:
                    total += layout.chunk_grid.valid_numel(index) * layout.dtype.itemsize
    return total


#: Where rank 0 records what ``redundancy="auto"`` chose, per branch.
CHOICE_DIR = "meta/replicas"
CHOICE_FORMAT = "dstt-redundancy-choice"
CHOICES = ("replicas", "pair")


def choice_key(branch: str) -> str:
    return f"{CHOICE_DIR}/{L.validate_branch(branch)}.json"


def write_choice(backend: Any, branch: str, doc: dict[str, Any]) -> None:
    """Record (overwrite) what ``redundancy="auto"`` chose for ``branch``:
    ``doc`` with ``redundancy`` (one of CHOICES), ``step``, ``why``, ``nodes``."""
    if doc.get("redundancy") not in CHOICES:
        raise ValueError(f"not a choice of redundancy='auto': {doc.get('redundancy')!r}")
    backend.put_atomic(choice_key(branch), encode_json({"format": CHOICE_FORMAT, "format_version": 1,
                                                        "branch": branch, **doc}))


def read_choice(backend: Any, branch: str) -> dict[str, Any] | None:
    """What ``redundancy="auto"`` chose for ``branch`` (None: nothing, or a
    record that does not check out -- never trusted)."""
    data = backend.get(choice_key(branch), max_bytes=1 << 16)
    if data is None:
        return None
    try:
        doc = decode_json(data, choice_key(branch))
    except CorruptStoreError:
        return None
    ok = (isinstance(doc, dict) and doc.get("format") == CHOICE_FORMAT and doc.get("branch") == branch
          and doc.get("redundancy") in CHOICES and type(doc.get("step")) is int)
    return doc if ok else None


def digest(crcs: Iterable[tuple[int, int, int]]) -> str:
    """One digest of ``(layout position, chunk index, CRC-32C)`` triples: two
    replicas of a rank's step agree when their digests do."""
    h = hashlib.sha256()
    for li, index, crc in sorted(crcs):
        h.update(b"%d:%d:%d;" % (li, index, crc))
    return h.hexdigest()


__all__ = ["CHOICES", "choice_key", "digest", "read_choice", "write_choice", "held_bytes", "marker", "meta_positions", "owned_chunks", "read_marker",
           "replicated_elsewhere", "shard_of"]
