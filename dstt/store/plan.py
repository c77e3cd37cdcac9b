"""Plan a step: state → logical tensors → chunk layout → this rank's chunk tasks.

The chunk layout is chosen so every chunk lies inside exactly one shard
region (chunk sizes divide every interior shard boundary), so each stored
chunk has exactly one writer (Megatron-LM #1053 lost optimizer state when two
ranks wrote one chunk). Replicated regions are spread over their holders by a
deterministic hash, so replicated tensors are written once with the work
shared. Everything here is a pure function of the inputs, so every rank
computes the same layout without talking to the others. The layout itself
(:class:`~dstt.format.geometry.TensorLayout`, the chunk shape, the regions)
is torch-free: :mod:`dstt.format.geometry`; this module holds the torch side
(local tensors, chunk tasks viewing their data, the step plan).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dstt import knobs
from dstt.errors import ShardingError, UnsupportedValueError
from dstt.format.codecs.spec import CodecSpec
from dstt.format.geometry import DEFAULT_MAX_CHUNK_BYTES, Region, TensorLayout, build_layout
from dstt.format.pygc import paused_gc
from dstt.store.shards import ShardedTensor, dtensor_regions, is_dtensor
from dstt.store.torch_dtypes import info_for_torch
from dstt.store.tree import flatten


@dataclass
class LocalTensor:
    """What this rank knows of one logical tensor before ranks exchange plans."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    mode: str  # "replicated" | "global" (DTensor) | "pieces"
    regions: list[Region]
    data: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # offset -> local data

    def describe(self) -> tuple[Any, ...]:
        """Picklable, data-free description exchanged between ranks."""
        return (
            self.kind,
            self.dtype,
            self.shape,
            self.mode,
            [(r.offset, r.shape, tuple(r.holders)) for r in self.regions],
        )


@dataclass(slots=True)
class ChunkTask:
    layout: TensorLayout
    index: int
    coords: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    source: torch.Tensor  # the chunk's box of local data, logical dtype, any device
    #: Bytes of ``source`` (its box, no padding) when the planner knew them
    #: (the single-process plan cache); -1: not given (see ``data_nbytes``).
    data_bytes: int = -1

    @property
    def data_nbytes(self) -> int:
        """Bytes of the chunk's data (its box: edge padding excluded)."""
        n = self.data_bytes
        return n if n >= 0 else math.prod(self.shape) * self.source.element_size()

    @property
    def padded(self) -> bool:
        return self.shape != self.layout.chunk_shape

    @property
    def nbytes(self) -> int:
        return self.layout.chunk_nbytes


@dataclass
class StepPlan:
    step: int
    tree: Any
    layouts: list[TensorLayout]
    tasks: list[ChunkTask]
    meta_arrays: list[TensorLayout]
    seq: int = -1
    slot: int = -1
    #: (array, chunk index) -> this step's keyframes.Link for each chunk this
    #: rank writes, chained to the previous planned step's (set by Writer.plan).
    links: dict[tuple[str, int], Any] = field(default_factory=dict)
    #: compression="auto" only: planned while the writer was behind, so its
    #: chunks are stored without compression or deltas (set by Writer.plan).
    fast: bool = False
    #: This rank's packs of the step (packs.StepPacks; set by the writer
    #: that stores the step, in Writer._reserve).
    packs: Any = None
    #: Predictive coding of the step's chunks (store/predflush.PredStep; set
    #: by predflush.prepare before the flush), or None.
    pred: Any = None
    #: The caller of the flush gives each chunk's previous values itself
    #: (the memory tier: ``prev_staged``); the flusher's own copies
    #: (dstt.store.prevvalues) are then neither used nor made.
    prev_told: bool = False
    #: The last ``replicas`` tasks are chunks this rank holds as a replica of
    #: another holder's (redundancy="replicas"): staged and sealed, never
    #: written by this rank (a plan read back from a seal has none: seals.plan_of).
    replicas: int = 0

    @property
    def local_bytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)

    @property
    def own_tasks(self) -> list[ChunkTask]:
        """The tasks whose chunks this rank writes (all but the replicas)."""
        return self.tasks[:len(self.tasks) - self.replicas] if self.replicas else self.tasks


# ----------------------------------------------------------------------------- local


def describe_local(name: str, kind: str, value: Any, rank: int) -> LocalTensor:
    if is_dtensor(value):
        regions, my_off, local = dtensor_regions(value)
        info = info_for_torch(value.dtype)
        return LocalTensor(name, kind, info.logical, tuple(value.shape), "global", regions, {my_off: local.detach()})
    if isinstance(value, ShardedTensor):
        info = info_for_torch(value.dtype)
        regions = [Region(off, tuple(t.shape), [rank]) for off, t in value.pieces]
        # Empty pieces hold no data, and one may share its offset with a real piece.
        return LocalTensor(name, kind, info.logical, value.shape, "pieces", regions,
                           {off: t.detach() for off, t in value.pieces if t.numel()})
    if isinstance(value, torch.Tensor):
        # Refused here, on the caller's thread, with the tensor's name: these
        # used to fail later with a raw RuntimeError or only in the background.
        # (Cheapest checks first: this runs per tensor per step on the
        # trainer's thread; .device builds an object per call.)
        if value.is_nested:
            raise UnsupportedValueError(f"{name}: nested (ragged) tensors cannot be stored; "
                                        "store their components (.unbind()) instead")
        if value.layout is not torch.strided:  # sparse layouts included
            raise UnsupportedValueError(f"{name}: only dense (strided) tensors can be stored, got {value.layout}")
        if value.is_meta:
            raise UnsupportedValueError(f"{name}: a tensor on the meta device has no data to store")
        info = info_for_torch(value.dtype)
        shape = tuple(value.shape)
        zero = (0,) * len(shape)
        return LocalTensor(name, kind, info.logical, shape, "replicated",
                           [Region(zero, shape, [rank])], {zero: value.detach()})
    raise UnsupportedValueError(f"{name}: not a tensor: {type(value).__name__}")


def merge_descriptions(per_rank: list[dict[str, tuple[Any, ...]]]) -> dict[str, tuple[Any, ...]]:
    """Combine every rank's view of its tensors into one global description."""
    merged: dict[str, tuple[Any, ...]] = {}
    for desc in per_rank:
        for name, (kind, dtype, shape, mode, regions) in desc.items():
            if name not in merged:
                merged[name] = (kind, dtype, tuple(shape), mode, [list(r) for r in regions])
                continue
            k0, d0, s0, m0, r0 = merged[name]
            if (d0, tuple(s0), m0) != (dtype, tuple(shape), mode):
                raise ShardingError(
                    f"{name}: ranks disagree on the tensor: {d0}{list(s0)} ({m0}) vs {dtype}{list(shape)} ({mode})"
                )
            if mode == "global":
                continue  # every rank computed the same global regions
            boxes = {(tuple(o), tuple(s)): r for r in r0 for o, s in [r[:2]]}
            for off, shp, holders in regions:
                key = (tuple(off), tuple(shp))
                if key in boxes:
                    boxes[key][2] = tuple(sorted(set(boxes[key][2]) | set(holders)))
                else:
                    r0.append([tuple(off), tuple(shp), tuple(holders)])
                    boxes[key] = r0[-1]
    return merged


def merge_trees(trees: list[Any]) -> Any:
    """Deep-merge dict trees from several ranks; rank 0's values win conflicts."""

    def m(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict) and not any(k.startswith("$") for k in a):
            out = dict(a)
            for k, v in b.items():
                out[k] = m(a[k], v) if k in a else v
            return out
        return a

    out = trees[0]
    for t in trees[1:]:
        out = m(out, t)
    return out


def region_tasks(layout: TensorLayout, region: Region, data: torch.Tensor, rank: int,
                 held: bool = False) -> list[ChunkTask]:
    """Chunk tasks of one region that ``rank`` owns; ``data`` is the region's local data.
    ``held``: instead, the region's chunks that another of its holders owns
    (``rank`` holds them as a replica: redundancy="replicas")."""
    if math.prod(region.shape) == 0:
        return []
    if held:
        return _region_chunks(layout, region, data, rank, False)
    if layout.chunk_shape == region.shape == layout.shape and len(region.holders) == 1:
        # One chunk, the whole tensor, one holder (most small tensors): no
        # grid walk, and the data itself is the chunk.
        if region.holders[0] != rank:
            return []
        zero = region.offset
        return [ChunkTask(layout, 0, zero, zero, layout.shape, data)]
    return _region_chunks(layout, region, data, rank, True)


def _region_chunks(layout: TensorLayout, region: Region, data: torch.Tensor, rank: int, own: bool,
                   ) -> list[ChunkTask]:
    """Tasks of ``region``'s chunks that ``rank`` owns (``own``) or that another holder owns."""
    tasks = []
    for coords in layout.chunk_grid.overlapping(region.offset, region.shape):
        index = layout.linear(coords)
        if (layout.owner(region, index) == rank) != own:
            continue
        off, shp = layout.chunk_box(coords)
        if off == tuple(region.offset) and shp == tuple(region.shape):
            view = data  # the whole region (a small tensor's one chunk): no view to build
        else:
            view = data[tuple(slice(o - ro, o - ro + n) for o, ro, n in zip(off, region.offset, shp))]
        tasks.append(ChunkTask(layout, index, coords, off, shp, view))
    return tasks


def plan_step(
    step: int,
    state: Any,
    *,
    rank: int = 0,
    exchange: Callable[[Any], list[Any]] | None = None,
    codec: CodecSpec = CodecSpec(),
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    allow_pickle: bool = False,
    layout_cache: dict[Any, TensorLayout] | None = None,
    pack_chunk_bytes: int | None = None,
) -> StepPlan:
    """Plan one step. ``exchange(obj)`` all-gathers ``obj`` across ranks
    (None for a single process). ``layout_cache`` (kept by the caller across
    steps) reuses the layout of a tensor whose global description is
    unchanged: a layout is a pure function of it (and of codec and chunk
    size), and building one per tensor per step dominated planning of small
    tensors (issue 16). Chunks of at most ``pack_chunk_bytes`` raw bytes
    (default: :func:`dstt.knobs.pack_chunk_bytes`) are packed."""
    # Planning builds a few objects per tensor and keeps them: with the
    # collector on, tens of thousands of them trigger full collections that
    # walk every live object (most of an unchanged step's planning time at
    # 20,000 tensors; issue 16). They hold no cycles.
    agreed = None if exchange is None else AgreedExchange(step, exchange)
    with paused_gc():
        try:
            return _plan_step(step, state, rank, agreed, codec, max_chunk_bytes, allow_pickle, layout_cache,
                              pack_chunk_bytes)
        except Exception as e:
            if agreed is not None and not agreed.reached:
                agreed.fail(e)  # the other ranks raise too, instead of waiting for this one
            raise


class AgreedExchange:
    """``exchange`` for planning one step under torch.distributed: every
    rank reaches it, with its description or with the error that stopped it
    (:meth:`fail`), and every rank checks that all of them plan the same
    step. A rank that failed alone used to leave the others waiting in the
    all-gather; had its script gone on, its next step was planned (and then
    committed) together with their current one.

    >>> a = AgreedExchange(3, lambda obj: [obj, (3, None, "desc of rank 1")])
    >>> a("desc of rank 0")
    ['desc of rank 0', 'desc of rank 1']
    >>> AgreedExchange(3, lambda obj: [obj, (4, None, "")])("")
    Traceback (most recent call last):
    dstt.errors.ShardingError: step 3 not planned: the ranks plan different steps ([3, 4])
    """

    def __init__(self, step: int, exchange: Callable[[Any], list[Any]]) -> None:
        self.step, self._exchange = step, exchange
        self.reached = False  # this rank took part in the exchange

    def __call__(self, obj: Any) -> list[Any]:
        self.reached = True
        gathered = self._exchange((self.step, None, obj))
        failures = [f"rank {r}: {err}" for r, (_, err, _) in enumerate(gathered) if err is not None]
        steps = sorted({s for s, _, _ in gathered})
        if len(steps) > 1:
            failures.append(f"the ranks plan different steps ({steps})")
        if failures:
            raise ShardingError(f"step {self.step} not planned: " + "; ".join(failures))
        return [o for _, _, o in gathered]

    def fail(self, error: BaseException) -> None:
        """This rank cannot plan the step: tell the others (they raise)."""
        self.reached = True
        self._exchange((self.step, f"{type(error).__name__}: {error}"[:2000], None))


def _plan_step(step: int, state: Any, rank: int, exchange: Callable[[Any], list[Any]] | None, codec: CodecSpec,
               max_chunk_bytes: int, allow_pickle: bool, layout_cache: dict[Any, TensorLayout] | None,
               pack_chunk_bytes: int | None) -> StepPlan:
    if pack_chunk_bytes is None:
        pack_chunk_bytes = knobs.pack_chunk_bytes()
    # (the layout cache also keeps, under "$"-tuples and strings, what the
    # next step of the same writer compares with: _plan_local, flatten)
    memos: dict[Any, Any] | None = layout_cache
    memo = None if memos is None else memos.setdefault("$flatten", {})
    tree, tensors, kinds = flatten(state, allow_pickle=allow_pickle, memo=memo)
    if exchange is None and layout_cache is not None:
        return StepPlan(step, tree, *_plan_local(tensors, kinds, rank, codec, max_chunk_bytes, pack_chunk_bytes,
                                                 layout_cache))
    local = {name: describe_local(name, kinds[name], v, rank) for name, v in tensors.items()}
    desc = {name: lt.describe() for name, lt in local.items()}
    if exchange is not None:
        gathered = exchange((desc, tree))
        desc = merge_descriptions([d for d, _ in gathered])
        tree = merge_trees([t for _, t in gathered])
    layouts = [_cached_layout(n, desc[n], codec, max_chunk_bytes, pack_chunk_bytes, layout_cache)
               for n in sorted(desc)]
    tasks: list[ChunkTask] = []
    held: list[ChunkTask] = []
    replicas = memos is not None and bool(memos.get(HOLD_REPLICAS))
    meta: list[TensorLayout] = []
    for layout in layouts:
        if layout.meta_owner_rank == rank:
            meta.append(layout)
        lt = local.get(layout.name)
        if lt is None:
            continue
        for region in layout.regions:
            if rank not in region.holders or math.prod(region.shape) == 0:
                continue  # an empty shard has no chunks
            data = _local_data_for(lt, region)
            tasks.extend(region_tasks(layout, region, data, rank))
            if replicas and len(region.holders) > 1:
                held.extend(region_tasks(layout, region, data, rank, held=True))
    return StepPlan(step, tree, layouts, tasks + held, meta, replicas=len(held))


#: A writer's layout cache holding this key (True) plans, after this rank's
#: own chunk tasks, a task for every chunk of a replicated region it holds
#: that another holder owns (``StepPlan.replicas`` of them, last): staged in
#: its ring and never written by it (redundancy="replicas", issue 26).
HOLD_REPLICAS = "$hold-replicas"


def hold_replicas(layout_cache: dict[Any, Any]) -> None:
    """Plan the replicated chunks other holders own too (see HOLD_REPLICAS)."""
    layout_cache[HOLD_REPLICAS] = True


def _plan_local(tensors: dict[str, Any], kinds: dict[str, str], rank: int, codec: CodecSpec,
                max_chunk_bytes: int, pack_chunk_bytes: int, cache: dict[Any, Any]
                ) -> tuple[list[TensorLayout], list[ChunkTask], list[TensorLayout]]:
    """A single process's plan. A step whose tensors all view what they
    viewed at the previous step gets that step's layouts and tasks back
    (:class:`_StepMemo`). Otherwise tensor by tensor: one laid out as at an
    earlier step (same name, kind, dtype, shape; strided, not nested, not
    meta) takes the layout and chunk boxes from the cache (a pure function
    of those), and its previous step's tasks when it is :func:`same_view`
    as then; anything else (DTensors, ShardedTensors, a first sighting)
    takes the general path, whose result is remembered (issue 16: snapshot()
    of 20,000 tensors)."""
    config = (codec, max_chunk_bytes, pack_chunk_bytes, rank)
    memo: _StepMemo | None = cache.get(("$step",) + config)
    if memo is not None:
        same = memo.reuse(tensors, kinds)
        if same is not None:
            return same
    layouts: list[TensorLayout] = []
    tasks: list[ChunkTask] = []
    meta: list[TensorLayout] = []
    # Per-tensor plans of this configuration, by name: (kind, dtype, shape,
    # layout, meta owner?, [(index, coords, offset, shape, box or None, bytes)]).
    known: dict[str, Any] = cache.setdefault(("$local",) + config, {})
    # Plain tensors of the previous step and of this one, by name: (the
    # tensor detached when its tasks were made, the tasks). Only the last
    # step's: what they keep alive is what the trainer holds anyway.
    before: dict[str, tuple[torch.Tensor, list[ChunkTask]]] = cache.get(("$views",) + config, {})
    views: dict[str, tuple[torch.Tensor, list[ChunkTask]]] = {}
    all_plain = True
    strided = torch.strided
    for name in sorted(tensors):
        v = tensors[name]
        plain = False
        if isinstance(v, torch.Tensor):
            # (exact torch.Tensor is never a DTensor: no is_dtensor call)
            plain = not v.is_nested and v.layout is strided and not v.is_meta and (
                type(v) is torch.Tensor or not is_dtensor(v))
            if plain:
                hit = known.get(name)
                if hit is not None and hit[1] is v.dtype and hit[0] == kinds[name] and hit[2] == v.shape:
                    layout, owner, boxes = hit[3], hit[4], hit[5]
                    layouts.append(layout)
                    if owner:
                        meta.append(layout)
                    last = before.get(name)
                    if last is not None and last[1] and last[1][0].layout is layout and same_view(v, last[0]):
                        tasks.extend(last[1])  # the same memory, viewed alike: its tasks copy what v holds
                        views[name] = last
                        continue
                    src = v.detach()  # (a tensor object; also what the next step compares with)
                    if len(boxes) == 1 and boxes[0][4] is None:
                        i, c, o, shp, _, nb = boxes[0]
                        mine = [ChunkTask(layout, i, c, o, shp, src, nb)]
                    else:
                        mine = [ChunkTask(layout, i, c, o, shp, src if box is None else src[box], nb)
                                for i, c, o, shp, box, nb in boxes]
                    tasks.extend(mine)
                    views[name] = (src, mine)
                    continue
        lt = describe_local(name, kinds[name], v, rank)
        layout = _cached_layout(name, lt.describe(), codec, max_chunk_bytes, pack_chunk_bytes, cache)
        layouts.append(layout)
        owner = layout.meta_owner_rank == rank
        if owner:
            meta.append(layout)
        mine = []
        for region in layout.regions:
            if rank not in region.holders or math.prod(region.shape) == 0:
                continue  # an empty shard has no chunks
            mine.extend(region_tasks(layout, region, _local_data_for(lt, region), rank))
        tasks.extend(mine)
        if plain and lt.mode == "replicated":
            assert isinstance(v, torch.Tensor)
            base = (0,) * len(layout.shape)
            if len(known) >= MAX_CACHED_LAYOUTS:
                known.clear()
            itemsize = v.element_size()
            known[name] = (kinds[name], v.dtype, v.shape, layout, owner, [
                (t.index, t.coords, t.offset, t.shape,
                 None if t.offset == base and t.shape == layout.shape else
                 tuple(slice(o, o + n) for o, n in zip(t.offset, t.shape)),
                 math.prod(t.shape) * itemsize)
                for t in mine])
            views[name] = (_local_data_for(lt, layout.regions[0]), mine)  # (v detached)
        else:
            all_plain = False  # (a DTensor or a sharded tensor: planned afresh every step)
    cache[("$views",) + config] = views
    if all_plain and len(views) == len(tensors):
        cache[("$step",) + config] = _StepMemo(list(tensors), list(kinds.values()),
                                               [views[n][0] for n in tensors], (layouts, tasks, meta))
    else:
        cache.pop(("$step",) + config, None)
    return layouts, tasks, meta


_IS_SET_TO = torch.Tensor.is_set_to
_IS_NEG = torch.Tensor.is_neg
_DTYPE = operator.attrgetter("dtype")


def same_view(v: torch.Tensor, alias: torch.Tensor) -> bool:
    """``v`` views exactly the memory ``alias`` (a detached tensor kept from
    an earlier step) views, in the same way: the same storage, offset,
    sizes, strides, dtype, and conjugate/negative bits. Then chunk tasks
    made from ``alias`` copy what ``v`` holds now, bit for bit. (A tensor
    changed in place -- ``.data =``, ``set_``, ``resize_``, ``t_`` -- or
    replaced by another one fails it.)

    >>> x = torch.zeros(2, 3); a = x.detach()
    >>> same_view(x, a), same_view(x.t_(), a)
    (True, False)
    """
    return (v.dtype is alias.dtype and v.is_set_to(alias) and v.is_neg() == alias.is_neg()
            and v.is_conj() == alias.is_conj())


@dataclass
class _StepMemo:
    """The last single-process plan of a writer, and what it was made from:
    a step whose tensors are all laid out as then gets its layouts and
    tasks back (issue 16: a step of 20,000 unchanged tensors cost ~30 ms to
    plan tensor by tensor; this is a few C-level passes over them).

    ``aliases``: each tensor detached at planning time, in the order of the
    flattened state; the tasks' sources are these (or views of them), so
    they read what the live tensors hold as long as each live tensor is
    :func:`same_view` as its alias."""

    names: list[str]
    kinds: list[str]
    aliases: list[torch.Tensor]
    result: tuple[list[TensorLayout], list[ChunkTask], list[TensorLayout]]
    dtypes: list[torch.dtype] = field(default_factory=list)
    complex_at: list[int] = field(default_factory=list)  # (only a complex tensor has a conjugate bit)
    #: Some alias has its negative or conjugate bit set: compared tensor by
    #: tensor (same_view), not here.
    odd: bool = False

    def __post_init__(self) -> None:
        self.dtypes = list(map(_DTYPE, self.aliases))
        self.complex_at = [i for i, a in enumerate(self.aliases) if a.is_complex()]
        self.odd = any(map(_IS_NEG, self.aliases)) or any(self.aliases[i].is_conj() for i in self.complex_at)

    def reuse(self, tensors: dict[str, Any], kinds: dict[str, str],
              ) -> tuple[list[TensorLayout], list[ChunkTask], list[TensorLayout]] | None:
        """The remembered (layouts, tasks, meta arrays) if every tensor of
        ``tensors`` is :func:`same_view` as its alias, else None. The same
        list and task objects: read-only for everyone."""
        if self.odd or list(tensors) != self.names or list(kinds.values()) != self.kinds:
            return None
        values = list(tensors.values())
        try:
            # (dtypes first: a complex value then fails before is_conj matters)
            if not (all(map(operator.is_, map(type, values), itertools.repeat(torch.Tensor)))
                    and list(map(_DTYPE, values)) == self.dtypes
                    and all(map(_IS_SET_TO, values, self.aliases))
                    and not any(map(_IS_NEG, values))
                    and not any(values[i].is_conj() for i in self.complex_at)):
                return None
        except Exception:  # noqa: BLE001 - anything odd is planned the long way (which says what is wrong)
            return None
        return self.result


#: Layouts a cache keeps at most (it is cleared when full: a run whose
#: tensors keep changing shape never grows it without bound).
MAX_CACHED_LAYOUTS = 1 << 20
#: Layouts shared by every writer of this process (``dstt.save`` opens a
#: writer per call: 100,000 tensors took ~3 s per call to lay out again).
#: Cleared when it holds more than SHARED_LAYOUTS_MAX (~1-2 KiB each).
_SHARED_LAYOUTS: dict[Any, TensorLayout] = {}
SHARED_LAYOUTS_MAX = 1 << 17


def _cached_layout(name: str, desc: tuple[Any, ...], codec: CodecSpec, max_chunk_bytes: int,
                   pack_chunk_bytes: int | None, cache: dict[Any, TensorLayout] | None) -> TensorLayout:
    if cache is None:
        return build_layout(name, desc, codec, max_chunk_bytes, pack_chunk_bytes)
    kind, dtype, shape, mode, regions = desc
    key = (name, kind, dtype, tuple(shape), mode,
           tuple((tuple(o), tuple(s), tuple(h)) for o, s, h in regions), codec, max_chunk_bytes,
           pack_chunk_bytes)
    layout = cache.get(key)
    if layout is None:
        if len(cache) >= MAX_CACHED_LAYOUTS:
            cache.clear()
        layout = _SHARED_LAYOUTS.get(key)
        if layout is None:
            layout = build_layout(name, desc, codec, max_chunk_bytes, pack_chunk_bytes)
            if len(_SHARED_LAYOUTS) >= SHARED_LAYOUTS_MAX:
                _SHARED_LAYOUTS.clear()
            _SHARED_LAYOUTS[key] = layout
        cache[key] = layout
    return layout


def _local_data_for(lt: LocalTensor, region: Region) -> torch.Tensor:
    if lt.mode == "replicated":
        return next(iter(lt.data.values()))
    data = lt.data.get(region.offset)
    if data is None or tuple(data.shape) != region.shape:
        raise ShardingError(f"{lt.name}: this rank holds no local data for the shard at {region.offset}")
    return data
