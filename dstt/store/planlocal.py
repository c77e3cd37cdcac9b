"""A single process's step plan, and the memo that hands a step laid out as
the previous one that step's plan back (issue 16: snapshot() of 20,000
tensors), renewing only the tasks of the tensors that are new objects
(issue 25: the RNG state).

Why the memo renews tasks instead of wanting every tensor to be the same
memory: ``torch.get_rng_state()`` and ``np.random.get_state()`` give a new
tensor (array) at every call, and so does a fresh loss or metric tensor
passed in ``extra``. With the memo all-or-nothing, one such tensor sent
every step of a 2,000-tensor AdamW state down the tensor-by-tensor path
and, because the task list was then a new object, past every cache of the
stager and the seals keyed on it (110 ms per snapshot against 24-47 ms
with ``rng=False``). The other way out -- copying the RNG state into a
stable per-Capture buffer so the tensor object never changes -- would
fix only the RNG state (not a fresh ``extra`` tensor), add a copy, and be
safe only while every read of the buffer ends before the next step
overwrites it. Renewing keeps every step's task reading that step's own
tensor: a copy made late can never read a later step's values.

A renewed plan is a new task list whose tasks are the memo's except at
the renewed tensors' positions, where new task objects have the same
layout, index, coords, offset, shape, dtype, device and data bytes; the
plans share :attr:`dstt.store.plan.StepPlan.layout_key`, so the caches
downstream (seals.py, copygroups.py) keep what depends on the layout alone
and redo what depends on sources only at
:func:`~dstt.store.chunktasks.changed_positions`.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from dstt.format.codecs.spec import CodecSpec
from dstt.format.geometry import TensorLayout
from dstt.store.chunktasks import (
    MAX_CACHED_LAYOUTS,
    ChunkTask,
    _cached_layout,
    _local_data_for,
    describe_local,
    region_tasks,
)
from dstt.store.shards import is_dtensor

#: A plain tensor's chunk boxes: (index, coords, offset, shape, box or None (the whole tensor), data bytes).
Boxes = list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], Any, int]]
#: A plain tensor's tasks in a plan: (first task, end, its layout, its boxes).
Span = tuple[int, int, TensorLayout, Boxes]
Planned = tuple[list[TensorLayout], list[ChunkTask], list[TensorLayout], Any]


def plan_local(tensors: dict[str, Any], kinds: dict[str, str], rank: int, codec: CodecSpec,
               max_chunk_bytes: int, pack_chunk_bytes: int, cache: dict[Any, Any]) -> Planned:
    """A single process's plan: (layouts, tasks, meta arrays, layout key).

    A step whose tensors view what they viewed at the previous step, or
    are new objects laid out alike, gets that step's plan back
    (:class:`StepMemo`; the key shared). Otherwise tensor by tensor: one
    laid out as at an earlier step (same name, kind, dtype, shape; strided,
    not nested, not meta) takes the layout and chunk boxes from the cache
    (a pure function of those), and its previous step's tasks when it is
    :func:`same_view` as then; anything else (DTensors, ShardedTensors, a
    first sighting) takes the general path, whose result is remembered
    (issue 16: snapshot() of 20,000 tensors)."""
    config = (codec, max_chunk_bytes, pack_chunk_bytes, rank)
    memo: StepMemo | None = cache.get(("$step",) + config)
    if memo is not None:
        same = memo.reuse(tensors, kinds)
        if same is not None:
            return same
    layouts: list[TensorLayout] = []
    tasks: list[ChunkTask] = []
    meta: list[TensorLayout] = []
    # Per-tensor plans of this configuration, by name: (kind, dtype, shape,
    # layout, meta owner?, boxes).
    known: dict[str, Any] = cache.setdefault(("$local",) + config, {})
    # Plain tensors of the previous step and of this one, by name: (the
    # tensor detached when its tasks were made, the tasks). Only the last
    # step's: what they keep alive is what the trainer holds anyway.
    before: dict[str, tuple[torch.Tensor, list[ChunkTask]]] = cache.get(("$views",) + config, {})
    views: dict[str, tuple[torch.Tensor, list[ChunkTask]]] = {}
    spans: dict[str, Span] = {}
    all_plain = True
    strided = torch.strided
    for name in sorted(tensors):
        v = tensors[name]
        plain = False
        start = len(tasks)
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
                    else:
                        src = v.detach()  # (a tensor object; also what the next step compares with)
                        mine = tasks_of(layout, boxes, src)
                        tasks.extend(mine)
                        views[name] = (src, mine)
                    spans[name] = (start, len(tasks), layout, boxes)
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
            boxes = [(t.index, t.coords, t.offset, t.shape,
                      None if t.offset == base and t.shape == layout.shape else
                      tuple(slice(o, o + n) for o, n in zip(t.offset, t.shape)),
                      math.prod(t.shape) * itemsize)
                     for t in mine]
            known[name] = (kinds[name], v.dtype, v.shape, layout, owner, boxes)
            views[name] = (_local_data_for(lt, layout.regions[0]), mine)  # (v detached)
            spans[name] = (start, len(tasks), layout, boxes)
        else:
            all_plain = False  # (a DTensor or a sharded tensor: planned afresh every step)
    cache[("$views",) + config] = views
    key = None
    if all_plain and len(views) == len(tensors):
        key = object()
        cache[("$step",) + config] = StepMemo(list(tensors), list(kinds.values()),
                                              [views[n][0] for n in tensors], (layouts, tasks, meta, key),
                                              [spans[n] for n in tensors])
    else:
        cache.pop(("$step",) + config, None)
    return layouts, tasks, meta, key


def tasks_of(layout: TensorLayout, boxes: Boxes, src: torch.Tensor) -> list[ChunkTask]:
    """The tasks of a plain tensor laid out as ``layout`` in ``boxes``, reading ``src``."""
    if len(boxes) == 1 and boxes[0][4] is None:
        i, c, o, shp, _, nb = boxes[0]
        return [ChunkTask(layout, i, c, o, shp, src, nb)]
    return [ChunkTask(layout, i, c, o, shp, src if box is None else src[box], nb) for i, c, o, shp, box, nb in boxes]


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
class StepMemo:
    """The last single-process plan of a writer, and what it was made from:
    a step whose tensors are all laid out as then gets its layouts and
    tasks back (issue 16: a step of 20,000 unchanged tensors cost ~30 ms to
    plan tensor by tensor; this is a few C-level passes over them), with
    the tasks of the tensors that are new objects renewed (issue 25: the
    RNG state is a new tensor at every step; see the module docstring).

    ``aliases``: each tensor detached at planning time, in the order of the
    flattened state; the tasks' sources are these (or views of them), so
    they read what the live tensors hold as long as each live tensor is
    :func:`same_view` as its alias. ``spans``: where each tensor's tasks
    are in the task list, and how they are cut (same order)."""

    names: list[str]
    kinds: list[str]
    aliases: list[torch.Tensor]
    result: Planned
    spans: list[Span]
    dtypes: list[torch.dtype] = field(default_factory=list)
    complex_at: list[int] = field(default_factory=list)  # (only a complex tensor has a conjugate bit)
    #: Some alias has its negative or conjugate bit set: compared tensor by
    #: tensor (same_view), not here.
    odd: bool = False

    def __post_init__(self) -> None:
        self.dtypes = list(map(_DTYPE, self.aliases))
        self.complex_at = [i for i, a in enumerate(self.aliases) if a.is_complex()]
        self.odd = any(map(_IS_NEG, self.aliases)) or any(self.aliases[i].is_conj() for i in self.complex_at)

    def reuse(self, tensors: dict[str, Any], kinds: dict[str, str]) -> Planned | None:
        """The remembered (layouts, tasks, meta arrays, key) if every
        tensor of ``tensors`` is :func:`same_view` as its alias, the same
        with the tasks of the others renewed if they are laid out alike
        (:meth:`_renew`), else None. The same list and task objects:
        read-only for everyone."""
        if self.odd or list(tensors) != self.names or list(kinds.values()) != self.kinds:
            return None
        values = list(tensors.values())
        try:
            # (dtypes first: a complex value then fails before is_conj matters)
            if not (all(map(operator.is_, map(type, values), itertools.repeat(torch.Tensor)))
                    and list(map(_DTYPE, values)) == self.dtypes
                    and not any(map(_IS_NEG, values))
                    and not any(values[i].is_conj() for i in self.complex_at)):
                return None
            same = list(map(_IS_SET_TO, values, self.aliases))
            if all(same):
                return self.result
            return self._renew(values, list(itertools.compress(range(len(same)), map(operator.not_, same))))
        except Exception:  # noqa: BLE001 - anything odd is planned the long way (which says what is wrong)
            return None

    def _renew(self, values: list[torch.Tensor], fresh: list[int]) -> Planned | None:
        """The remembered plan with new tasks for the tensors at ``fresh``
        (each a plain tensor of its alias's dtype, not negative or
        conjugate: checked by reuse), reading them; None if one is not laid
        out as its alias (shape, device, strided, not nested or meta).
        Remembered in place of the old: the next step compares with these."""
        aliases = self.aliases
        strided = torch.strided
        for i in fresh:
            v, a = values[i], aliases[i]
            if v.shape != a.shape or v.is_nested or v.layout is not strided or v.is_meta or v.device != a.device:
                return None
        layouts, tasks, meta, key = self.result
        tasks = list(tasks)
        aliases = list(aliases)
        for i in fresh:
            first, end, layout, boxes = self.spans[i]
            src = aliases[i] = values[i].detach()
            tasks[first:end] = tasks_of(layout, boxes, src)
        self.aliases = aliases
        self.result = (layouts, tasks, meta, key)
        return self.result


__all__ = ["Boxes", "Planned", "StepMemo", "plan_local", "same_view", "tasks_of"]
