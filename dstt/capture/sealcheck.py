"""Validation of a seal record read back from a staging ring (issue 23):
every field, of every format (seals.py), type- and bounds-checked before
anything is built from it.

A record left in /dev/shm is untrusted: a bit flip, a half-written file
or another program may have changed any field. Unchecked, single-field
corruptions raised raw AttributeError/IndexError/TypeError/RecursionError
from every later ``Capture()`` and ``dstt gc`` of the branch, hung on a
huge declared shape (the commit walks every chunk of a tensor), or
committed a wrong step (a negative or foreign step number, a value tree
that is not one). :func:`check_record` refuses all of these with
:class:`~dstt.capture.seals.CorruptRing`:

* the step: an integer in range, the one the record's file name says;
* the sequence number: in the range one branch can hold;
* the pool: a pool file name of the ring, and every chunk's bytes inside
  that file's real size (so no declared size exceeds what exists);
* layouts: known kind, dtype and compression, shapes of at most 32
  dimensions with at most 2**48 elements, chunk shapes no larger than the
  tensor dividing it into a bounded number of chunks, regions inside the
  tensor covering it once;
* tasks: a known layout, a chunk of its grid (coordinates, offset and
  shape those of that chunk), a dtype of the layout's item size, each
  chunk once -- and, for a single process's record, every chunk of every
  tensor once (what the commit requires);
* the value tree: nested at most MAX_TREE_DEPTH deep, decodable as a
  stored step's tree is, naming exactly the tensors the record lays out.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dstt.capture.seals import SEAL_FORMAT, CorruptRing
from dstt.errors import DsttError
from dstt.format import layout as L
from dstt.format.codecs.spec import COMPRESSIONS
from dstt.format.dtypes import info_for_name
from dstt.format.entries import MAX_ELEMENTS
from dstt.format.replicas import read_marker
from dstt.format.valuetree import MAX_TREE_DEPTH, TENSOR_TAGS, check_tree_depth, tagged_leaves
from dstt.store.tree import unflatten

#: Most dimensions of a tensor (as the store's index reader allows).
MAX_NDIM = 32
#: Most chunks of all tensors of one record (the commit walks each one).
MAX_CHUNKS = 1 << 24
#: Most ranks a region may name.
MAX_WORLD = 1 << 20
KINDS = ("tensor", "ndarray")
U32 = (1 << 32) - 1

#: Static parts checked already (by identity: read_record hands out the
#: same objects while a ring's records share them), with what they showed.
_CHECKED: list[tuple[Any, Any, bool, list[int], list[int]]] = []
#: Layout lists checked already, with each layout's number of chunks.
_LAYOUTS_CHECKED: list[tuple[Any, list[int]]] = []


def check_record(record: Any, *, step: int | None = None, pool_sizes: dict[str, int] | None = None,
                 complete: bool = False) -> None:
    """CorruptRing unless every field of ``record`` (:func:`seals.read_record`'s
    form, any format) checks out. ``step``: the step its file name says.
    ``pool_sizes``: the ring's pool files and their sizes (None: a plan with
    no tasks, as a rank record keeps it). ``complete``: a single process's
    record, which must hold every chunk of every tensor."""
    try:
        _check(record, step, pool_sizes, complete)
    except CorruptRing:
        raise
    except (DsttError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            RecursionError) as e:  # (a check above missed it: still a record that does not check out)
        raise CorruptRing(f"{type(e).__name__}: {e}") from None


def _check(record: Any, step: int | None, pool_sizes: dict[str, int] | None, complete: bool) -> None:
    need(isinstance(record, dict), "not an object")
    # (a plan kept in a rank record, pool_sizes None, is a record without its format)
    need(record.get("format", None if pool_sizes is not None else SEAL_FORMAT) == SEAL_FORMAT, "not a seal record")
    version = record.get("version", 1)
    need(type(version) is int and 1 <= version <= 4, f"unknown version {version!r}")
    s = integer(record.get("step"), "step", 0, L.MAX_STEP)  # (step=None: whatever the record says)
    need(step is None or s == step, f"step {s} in the record of step {step}")
    integer(record.get("seq"), "seq", 0, L.SLOTS_PER_BRANCH - 1)
    pool = record.get("pool")
    need(type(pool) is str, "pool must be a string")
    layouts, nchunks = _layouts(record.get("layouts"))
    meta = record.get("meta")
    need(type(meta) is list and len(meta) <= len(layouts), "meta must be a list of layouts")
    for i in meta:
        integer(i, "meta layout", 0, len(layouts) - 1)
    need(len(set(meta)) == len(meta) and (not complete or len(meta) == len(layouts)),
         "meta must name each layout once" + (" (every one: a single process's)" if complete else ""))
    _tree(record.get("tree"), {d["name"] for d in layouts})
    tasks = record.get("tasks")
    if pool_sizes is None:  # a plan without tasks (a rank record's)
        need(tasks == [] or tasks == {"static": [], "extents": []}, "a plan to commit has no tasks")
        return
    need(pool in pool_sizes, f"pool {pool!r} is not a pool file of the ring")
    size = pool_sizes[pool]
    if type(tasks) is list:  # the first format: a dict per task
        statics = [_v1_task(t) for t in tasks]
        sizes = _tasks(statics, layouts, nchunks, complete)
        for t, n in zip(tasks, sizes):
            need(t.get("nbytes") == n and type(t.get("nbytes")) is int, f"a task of {_short(t.get('nbytes'))} bytes "
                 f"for a {n}-byte chunk")
            _span(t.get("start"), n, size)
            need("crc" in t, "a task lacks its CRC")
            crc(t.get("crc"))
        return
    need(type(tasks) is dict, "tasks must be a list or an object")
    sizes = _tasks(tasks.get("static"), layouts, nchunks, complete)
    if "extents" in tasks:
        need(version >= 3, "extents in a record of format 1 or 2")
        _extents(tasks["extents"], sizes, size)
    else:
        need(version == 2, "no extents in a record of format 3 or later")
        starts, nbytes, crcs = tasks.get("start"), tasks.get("nbytes"), tasks.get("crc")
        need(type(starts) is list and type(nbytes) is list and len(starts) == len(nbytes) == len(sizes),
             "chunk table lengths differ")
        need(crcs is None or (type(crcs) is list and len(crcs) == len(sizes)), "chunk table lengths differ")
        for j, n in enumerate(sizes):
            need(nbytes[j] == n, f"chunk {j}: {nbytes[j]!r} bytes for a {n}-byte chunk")
            _span(starts[j], n, size)
            if crcs is not None:
                crc(crcs[j])


def need(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptRing(what)


def integer(v: Any, what: str, lo: int, hi: int) -> int:
    need(type(v) is int and lo <= v <= hi, f"{what} must be an integer in {lo}..{hi}, got {_short(v)}")
    return int(v)


def crc(v: Any) -> None:
    need(v is None or (type(v) is int and 0 <= v <= U32), f"bad CRC {_short(v)}")


def ints(v: Any, what: str, lo: int, hi: int, n: int | None = None) -> tuple[int, ...]:
    need(type(v) is list and len(v) <= MAX_NDIM and (n is None or len(v) == n),
         f"{what} must be a list of {n if n is not None else f'at most {MAX_NDIM}'} integers")
    return tuple(integer(x, what, lo, hi) for x in v)


def _short(v: Any) -> str:
    text = repr(v) if isinstance(v, (int, str, float, bool, type(None))) else type(v).__name__
    return text[:40]


def _span(start: Any, nbytes: int, size: int) -> None:
    integer(start, "a chunk's start", 0, size)
    need(start + nbytes <= size, f"a chunk at {start}+{nbytes} is outside the {size}-byte pool file")


def _layouts(docs: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """The layout documents, checked, and each one's number of chunks."""
    need(type(docs) is list, "layouts must be a list")
    for checked, counts_seen in _LAYOUTS_CHECKED:
        if checked is docs:
            return docs, counts_seen
    names: set[str] = set()
    counts = []
    for d in docs:
        counts.append(_layout(d))
        need(d["name"] not in names, f"tensor {d['name'][:80]!r} laid out twice")
        names.add(d["name"])
    need(sum(counts) <= MAX_CHUNKS, f"more than {MAX_CHUNKS} chunks")
    if len(_LAYOUTS_CHECKED) >= 4:
        del _LAYOUTS_CHECKED[0]
    _LAYOUTS_CHECKED.append((docs, counts))
    return docs, counts


def _layout(d: Any) -> int:
    """Check one layout document; its number of chunks."""
    need(type(d) is dict, "a layout must be an object")
    name = d.get("name")
    need(type(name) is str and 0 < len(name) <= L.MAX_ARRAY_PATH and "\0" not in name, "bad tensor name")
    need(d.get("kind") in KINDS, f"{name[:80]}: unknown kind")
    try:
        info_for_name(d.get("dtype"))
    except DsttError:
        raise CorruptRing(f"{name[:80]}: unknown dtype {_short(d.get('dtype'))}") from None
    shape = ints(d.get("shape"), "shape", 0, MAX_ELEMENTS)
    chunk = ints(d.get("chunk_shape"), "chunk shape", 1, MAX_ELEMENTS, len(shape))
    need(math.prod(shape) <= MAX_ELEMENTS and all(c <= max(n, 1) for c, n in zip(chunk, shape)),
         f"{name[:80]}: too many elements, or chunks larger than the tensor")
    compression, level = d.get("compression"), d.get("level")
    need(compression in COMPRESSIONS and compression != "auto", f"{name[:80]}: unknown compression")
    integer(level, "level", -7, 22)
    packing = d.get("pack_chunk_bytes")
    need(packing is None or (type(packing) is int and 0 <= packing <= 1 << 40), f"{name[:80]}: bad pack_chunk_bytes")
    regions = d.get("regions")
    need(type(regions) is list and len(regions) <= MAX_CHUNKS, f"{name[:80]}: regions must be a list")
    covered = 0
    for r in regions:
        need(type(r) is list and len(r) == 3, f"{name[:80]}: a region must be [offset, shape, holders]")
        off = ints(r[0], "region offset", 0, MAX_ELEMENTS, len(shape))
        ext = ints(r[1], "region shape", 0, MAX_ELEMENTS, len(shape))
        need(all(o + e <= s for o, e, s in zip(off, ext, shape)), f"{name[:80]}: a region outside the tensor")
        holders = r[2]
        need(type(holders) is list and 0 < len(holders) <= MAX_WORLD, f"{name[:80]}: bad region holders")
        for h in holders:
            integer(h, "holder", 0, MAX_WORLD - 1)
        covered += math.prod(ext)
    # (regions never overlap: together they hold each element once)
    need(covered == math.prod(shape), f"{name[:80]}: its regions do not cover it once")
    return math.prod(-(-s // c) if s else 0 for s, c in zip(shape, chunk))


def _v1_task(t: Any) -> list[Any]:
    need(type(t) is dict, "a task must be an object")
    try:
        return [t["layout"], t["index"], t["coords"], t["offset"], t["shape"], t["dtype"]]
    except KeyError as e:
        raise CorruptRing(f"a task lacks {e}") from None


def _tasks(statics: Any, layouts: list[dict[str, Any]], nchunks: list[int], complete: bool) -> list[int]:
    """Check the tasks' static part; each task's size in bytes."""
    need(type(statics) is list, "tasks must be a list")
    for entry in _CHECKED:
        if entry[0] is layouts and entry[1] is statics and entry[2] == complete:
            return entry[4]
    seen: set[tuple[int, int]] = set()
    per_layout = [0] * len(layouts)
    sizes = []
    for t in statics:
        need(type(t) is list and len(t) in (6, 7),
             "a task must be [layout, index, coords, offset, shape, dtype] (and a held chunk's marker)")
        li = integer(t[0], "a task's layout", 0, len(layouts) - 1)
        d = layouts[li]
        if len(t) == 7:  # held as a replica of another rank's (dstt.format.replicas)
            read_marker(t[6], world=MAX_WORLD, shards=len(d["regions"]))
        shape, chunk = tuple(d["shape"]), tuple(d["chunk_shape"])
        index = integer(t[1], "a task's chunk", 0, max(nchunks[li] - 1, 0))
        need(nchunks[li] > 0 and (li, index) not in seen, f"{d['name'][:80]}: chunk {index} twice or of no chunk")
        seen.add((li, index))
        per_layout[li] += 1
        grid = [-(-s // c) for s, c in zip(shape, chunk)]
        coords = ints(t[2], "chunk coordinates", 0, MAX_ELEMENTS, len(shape))
        need(all(c < g for c, g in zip(coords, grid)) and _linear(coords, grid) == index,
             f"{d['name'][:80]}: chunk {index} at coordinates {coords}")
        offset = ints(t[3], "chunk offset", 0, MAX_ELEMENTS, len(shape))
        extent = ints(t[4], "chunk shape", 0, MAX_ELEMENTS, len(shape))
        need(all(o == c * k and e == min(k, s - o) for o, e, c, k, s in zip(offset, extent, coords, chunk, shape)),
             f"{d['name'][:80]}: chunk {index} is not the chunk at {coords}")
        dtype = _dtype(t[5])
        need(dtype.itemsize == info_for_name(d["dtype"]).itemsize, f"{d['name'][:80]}: a {t[5]} chunk")
        sizes.append(math.prod(extent) * dtype.itemsize)
    if complete:
        missing = [layouts[i]["name"] for i, n in enumerate(nchunks) if per_layout[i] != n]
        need(not missing, f"{str(missing[:1])[1:-1][:80]}: not every chunk is in the record")
    if len(_CHECKED) >= 4:
        del _CHECKED[0]
    _CHECKED.append((layouts, statics, complete, nchunks, sizes))
    return sizes


def _linear(coords: tuple[int, ...], grid: list[int]) -> int:
    i = 0
    for c, g in zip(coords, grid):
        i = i * g + c
    return i


def _dtype(name: Any) -> torch.dtype:
    need(type(name) is str and name.isidentifier() and not name.startswith("_"), f"unknown dtype {_short(name)}")
    dtype = getattr(torch, name, None)
    need(isinstance(dtype, torch.dtype), f"unknown dtype {_short(name)}")
    assert isinstance(dtype, torch.dtype)
    return dtype


def _extents(extents: Any, sizes: list[int], size: int) -> None:
    """Every task in exactly one extent, every extent inside the pool file."""
    need(type(extents) is list and len(extents) <= max(len(sizes), 1), "extents must be a list")
    placed = [False] * len(sizes)
    for ext in extents:
        need(type(ext) is list and len(ext) == 3 and type(ext[2]) is list, "an extent must be [start, crc, tasks]")
        start = integer(ext[0], "an extent's start", 0, size)
        crc(ext[1])
        total = 0
        for p in ext[2]:
            integer(p, "an extent's task", 0, len(sizes) - 1)
            need(not placed[p], "an extent names a chunk twice")
            placed[p] = True
            total += sizes[p]
        need(start + total <= size, f"an extent at {start}+{total} is outside the {size}-byte pool file")
    need(all(placed), "a chunk of the plan is in no extent")


def _tree(tree: Any, names: set[str]) -> None:
    """A value tree as a stored step's: bounded depth, decodable, naming
    only tensors the record lays out."""
    try:
        check_tree_depth(tree, "value tree", MAX_TREE_DEPTH)
        unflatten(tree, lambda name, kind: None, allow_pickle=False, depth_checked=True)
    except DsttError as e:
        if type(e).__name__ != "PickleNotAllowedError":  # (a pickled value: not decoded here)
            raise CorruptRing(str(e)) from None
    named = set()
    for tag, arg in tagged_leaves(tree):
        if tag in TENSOR_TAGS:
            need(type(arg) is str and arg in names, f"the value tree names a tensor {_short(arg)} not laid out")
            named.add(arg)
    need(named == names, f"{len(names - named)} tensor(s) laid out that the value tree does not name")
