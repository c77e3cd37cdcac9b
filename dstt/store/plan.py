"""Plan a step: state → logical tensors → chunk layout → this rank's chunk tasks.

The chunk layout is chosen so every chunk lies inside exactly one shard
region (chunk sizes divide every interior shard boundary), so each stored
chunk has exactly one writer (Megatron-LM #1053 lost optimizer state when two
ranks wrote one chunk). Replicated regions are spread over their holders by a
deterministic hash, so replicated tensors are written once with the work
shared. Everything here is a pure function of the inputs, so every rank
computes the same layout without talking to the others. The layout itself
(:class:`~dstt.format.geometry.TensorLayout`, the chunk shape, the regions)
is torch-free: :mod:`dstt.format.geometry`; the torch side of chunks (local
tensors, chunk tasks viewing their data) is :mod:`dstt.store.chunktasks`,
a single process's plan and its memo :mod:`dstt.store.planlocal`; this
module holds the step plan and the general (distributed) planning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from dstt import knobs
from dstt.errors import ShardingError
from dstt.format.codecs.spec import CodecSpec
from dstt.format.geometry import DEFAULT_MAX_CHUNK_BYTES, TensorLayout
from dstt.format.pygc import paused_gc
from dstt.store.chunktasks import (  # (the torch side of chunks; here for the modules that import them from here)
    MAX_CACHED_LAYOUTS,
    SHARED_LAYOUTS_MAX,
    ChunkTask,
    LocalTensor,
    _cached_layout,
    _local_data_for,
    changed_positions,
    describe_local,
    region_tasks,
)
from dstt.store.planlocal import plan_local
from dstt.store.tree import flatten


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
    #: An object shared by the plans of one writer laid out alike (the
    #: single-process plan memo, planlocal.StepMemo): the very same
    #: ``layouts`` and ``meta_arrays`` lists, and tasks that differ at most
    #: in their sources -- the same layout, index, coords, offset, shape,
    #: dtype, device and data bytes at every position; a task whose tensor
    #: is a new object (the RNG state) is a new task object there, every
    #: other task the same object. None: no such promise (:attr:`layout_token`).
    layout_key: Any = None

    @property
    def layout_token(self) -> object:
        """What caches of a step's layout key on: :attr:`layout_key`, or
        the task list itself where the plan has none."""
        return self.tasks if self.layout_key is None else self.layout_key

    @property
    def local_bytes(self) -> int:
        return sum(t.nbytes for t in self.tasks)

    @property
    def own_tasks(self) -> list[ChunkTask]:
        """The tasks whose chunks this rank writes (all but the replicas)."""
        return self.tasks[:len(self.tasks) - self.replicas] if self.replicas else self.tasks


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
    # next step of the same writer compares with: planlocal.py, flatten)
    memos: dict[Any, Any] | None = layout_cache
    memo = None if memos is None else memos.setdefault("$flatten", {})
    tree, tensors, kinds = flatten(state, allow_pickle=allow_pickle, memo=memo)
    if exchange is None and layout_cache is not None:
        planned = plan_local(tensors, kinds, rank, codec, max_chunk_bytes, pack_chunk_bytes, layout_cache)
        return StepPlan(step, tree, *planned[:3], layout_key=planned[3])
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


__all__ = ["HOLD_REPLICAS", "MAX_CACHED_LAYOUTS", "SHARED_LAYOUTS_MAX", "AgreedExchange", "ChunkTask", "LocalTensor",
           "StepPlan", "changed_positions", "describe_local", "hold_replicas", "merge_descriptions", "merge_trees",
           "plan_step", "region_tasks"]
