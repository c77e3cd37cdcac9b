"""A sealed step's plan rebuilt from its seal record (seals.py): its
layouts, and its tasks' sources as views of the pool file's bytes -- by the
capture helper at every step, by recovery after a crash, and by the
rebuilding of another rank's steps (replicaguard.py). With ``verify``,
every chunk's bytes are checked against their CRC-32C first (a ring a dead
trainer left: its blocks may have been reused, :class:`StaleSeal`); a
record that does not describe the pool is :class:`CorruptRing`.

What repeats from one record to the next -- the layouts, the task templates
of the static part -- is rebuilt once (memoized by content and by the
identity of the static part read back: read-only objects, shared)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dstt import knobs
from dstt.capture.seals import CorruptRing, StaleSeal
from dstt.format.codecs.spec import CodecSpec, crc32c
from dstt.format.dtypes import info_for_name
from dstt.format.geometry import Region, TensorLayout
from dstt.store.plan import ChunkTask, StepPlan

#: Layouts rebuilt from their documents, memoized by content (a layout is
#: never changed once built); cleared when full.
_LAYOUTS: dict[Any, TensorLayout] = {}
_MEMO_MAX = 1 << 17


def _layout_of(d: dict[str, Any]) -> TensorLayout:
    """The layout a document describes; the same object for the same
    content (a layout is never changed once built)."""
    packing = d.get("pack_chunk_bytes")
    key = (d["name"], d["kind"], d["dtype"], tuple(d["shape"]), tuple(d["chunk_shape"]), d["compression"],
           d["level"], packing if isinstance(packing, int) else ("env", knobs.pack_chunk_bytes()),
           tuple((tuple(o), tuple(s), tuple(h)) for o, s, h in d["regions"]))
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _make_layout(d)
        if len(_LAYOUTS) >= _MEMO_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _make_layout(d: dict[str, Any]) -> TensorLayout:
    packing = d.get("pack_chunk_bytes")  # packed as the trainer planned it (packs.py)
    extra: dict[str, Any] = {"pack_chunk_bytes": packing} if isinstance(packing, int) else {}
    return TensorLayout(d["name"], d["kind"], info_for_name(d["dtype"]), tuple(d["shape"]),
                        tuple(d["chunk_shape"]), CodecSpec(d["compression"], d["level"]),
                        [Region(tuple(o), tuple(s), list(h)) for o, s, h in d["regions"]], **extra)


#: A task template: (layout, index, coords, offset, shape, dtype, data bytes).
_Template = tuple[TensorLayout, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype, int]
#: Layouts and task templates of the last static parts replayed (plan_of),
#: by the identity of the static part's task list (kept alive here).
_REPLAYED: list[tuple[list[Any], list[TensorLayout], list[_Template]]] = []


def _templates(layout_docs: list[dict[str, Any]], static_tasks: list[Any]
               ) -> tuple[list[TensorLayout], list[_Template]]:
    global _REPLAYED
    for tasks, layouts, templates in _REPLAYED:
        if tasks is static_tasks:
            return layouts, templates
    layouts = [_layout_of(d) for d in layout_docs]
    templates = []
    for li, index, coords, offset, shape, dtype_name, *_ in static_tasks:  # (a held chunk's marker: 7th)
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise CorruptRing(f"unknown dtype {dtype_name!r}")
        shape = tuple(shape)
        numel = 1
        for n in shape:
            if not isinstance(n, int) or n < 0:
                raise CorruptRing(f"bad chunk shape {shape!r}")
            numel *= n
        templates.append((layouts[li], int(index), tuple(coords), tuple(offset), shape, dtype,
                          numel * dtype.itemsize))
    _REPLAYED = [*_REPLAYED[-3:], (static_tasks, layouts, templates)]
    return layouts, templates


def plan_of(record: dict[str, Any], pool: torch.Tensor, verify: bool = True, held: bool = False) -> StepPlan:
    """Rebuild a sealed step's plan, its tasks' sources viewing ``pool``;
    with ``verify``, StaleSeal if a chunk's bytes no longer match their CRC
    (a ring left by a dead trainer; the live trainer's helper trusts it),
    CorruptRing if the record does not describe the pool.

    The chunks the rank holds as a replica of another's (redundancy="replicas")
    are never among the plan's tasks -- it does not write them -- and their
    CRCs are checked only with ``held``, which puts them last (``replicas``
    of them: capture/replicaguard.py)."""
    tasks_doc = record["tasks"]
    if isinstance(tasks_doc, list):  # the first format: one dict per task
        return _plan_of_v1(record, pool, verify)
    statics = tasks_doc["static"]
    layouts, templates = _templates(record["layouts"], statics)
    marked = [len(e) == 7 for e in statics] if any(len(e) == 7 for e in statics) else None
    if "extents" in tasks_doc:
        starts = _starts_of_extents(record, templates, tasks_doc["extents"], pool, verify, None if held else marked)
    else:
        starts = _starts_of_v2(record, templates, tasks_doc, pool, verify)
    tasks: list[ChunkTask] = []
    kept: list[ChunkTask] = []
    narrow = pool.narrow
    for j, ((layout, index, coords, offset, shape, dtype, nbytes), start) in enumerate(zip(templates, starts)):
        source = narrow(0, start, nbytes).view(dtype)
        if len(shape) != 1:
            source = source.view(shape)
        (kept if marked is not None and marked[j] else tasks).append(ChunkTask(layout, index, coords, offset,
                                                                               shape, source))
    plan = StepPlan(int(record["step"]), record["tree"], layouts, tasks + kept if held else tasks,
                    [layouts[i] for i in record["meta"]])
    plan.replicas = len(kept) if held else 0
    return plan


def _starts_of_extents(record: dict[str, Any], templates: list[_Template], extents: Any, pool: torch.Tensor,
                       verify: bool, skip: list[bool] | None = None) -> list[int]:
    """Each task's start in the pool from a third-format record's extents
    (checking each extent's CRC with ``verify``, but not one of only tasks
    ``skip`` marks): every task in exactly one extent, every extent inside
    the pool."""
    n, size = len(templates), pool.numel()
    starts: list[int] = [-1] * n
    if not isinstance(extents, list):
        raise CorruptRing("bad extents")
    for ext in extents:
        if not (isinstance(ext, list) and len(ext) == 3 and isinstance(ext[0], int) and isinstance(ext[2], list)
                and (ext[1] is None or isinstance(ext[1], int))):
            raise CorruptRing("bad extent")
        first, crc, positions = ext
        at = first
        for p in positions:
            if not isinstance(p, int) or not 0 <= p < n or starts[p] != -1:
                raise CorruptRing("an extent names a chunk twice or one the plan lacks")
            starts[p] = at
            at += templates[p][6]
        if not 0 <= first <= at <= size:
            raise CorruptRing(f"an extent at {first}+{at - first} is outside the pool")
        if skip is not None and positions and all(skip[p] for p in positions):
            continue  # (held for another rank: checked when rebuilding that rank's step)
        if verify and crc is not None and crc32c(np.frombuffer(pool[first:at].numpy(), np.uint8)) != crc:
            name = templates[positions[0]][0].name if positions else "?"
            raise StaleSeal(f"step {record['step']}: the chunks from {name} on do not match their CRC")
    if -1 in starts:
        raise CorruptRing("a chunk of the plan is in no extent")
    return starts


def _starts_of_v2(record: dict[str, Any], templates: list[_Template], tasks_doc: dict[str, Any],
                  pool: torch.Tensor, verify: bool) -> list[int]:
    """Each task's start in the pool from a second-format record (checking
    each chunk's CRC with ``verify``)."""
    starts, sizes, crcs = tasks_doc["start"], tasks_doc["nbytes"], tasks_doc["crc"]
    if not len(starts) == len(sizes) == len(templates) or (crcs is not None and len(crcs) != len(starts)):
        raise CorruptRing("chunk table lengths differ")
    size = pool.numel()
    for j, template in enumerate(templates):
        start, nbytes = starts[j], sizes[j]
        if not (isinstance(start, int) and isinstance(nbytes, int) and 0 <= start <= start + nbytes <= size):
            raise CorruptRing(f"chunk at {start}+{nbytes} outside the pool")
        if nbytes != template[6]:
            raise CorruptRing(f"chunk at {start}: {nbytes} bytes for a {template[6]}-byte chunk")
        if verify and crcs is not None and crc32c(np.frombuffer(pool[start:start + nbytes].numpy(),
                                                                np.uint8)) != crcs[j]:
            raise StaleSeal(f"step {record['step']}: a chunk of {template[0].name} does not match its CRC")
    return list(starts)


def _plan_of_v1(record: dict[str, Any], pool: torch.Tensor, verify: bool) -> StepPlan:
    layouts = [_layout_of(d) for d in record["layouts"]]
    tasks = []
    for d in record["tasks"]:
        start, nbytes = int(d["start"]), int(d["nbytes"])
        if not 0 <= start <= start + nbytes <= pool.numel():
            raise CorruptRing(f"chunk at {start}+{nbytes} outside the pool")
        block = pool[start:start + nbytes]
        if verify and d["crc"] is not None and crc32c(np.frombuffer(block.numpy(), np.uint8)) != d["crc"]:
            raise StaleSeal(f"step {record['step']}: a chunk of {layouts[d['layout']].name} does not match its CRC")
        dtype = getattr(torch, d["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise CorruptRing(f"unknown dtype {d['dtype']!r}")
        source = block.view(dtype).view(tuple(d["shape"]))
        tasks.append(ChunkTask(layouts[d["layout"]], int(d["index"]), tuple(d["coords"]), tuple(d["offset"]),
                               tuple(d["shape"]), source))
    return StepPlan(int(record["step"]), record["tree"], layouts, tasks, [layouts[i] for i in record["meta"]])


__all__ = ["plan_of"]
