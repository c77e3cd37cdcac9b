"""How the stager copies small tensors together (issue 16: tens of
thousands of small tensors per step): :class:`StagedGroup`, runs of small
CPU tasks of one dtype staged in one pool block with one copy call;
:class:`LazySplit`, a step's tasks split into eager and lazy copies (with
the runs of its lazy ones); :func:`group_tasks`. Pure bookkeeping over a
step's tasks: the copies themselves are the Stager's (stager.py)."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from dstt.capture import policy
from dstt.capture.hooks import optimizer_storages, storage_key
from dstt.capture.hostpool import HostPool
from dstt.store.plan import ChunkTask, changed_positions

#: Small eager tensors of a held step are staged in groups of up to this many
#: bytes, one placement and one copy call each (Stager._stage_grouped).
GROUP_BYTES = 1 << 20
GROUP_TASK_BYTES = 64 << 10


class LazySplit:
    """A step's tasks copied in ``snapshot()`` (eager) and after it (lazy),
    the lazy sources and names for the mutation guard, and the pool bytes
    the lazy blocks take. Read-only (shared by the steps of one layout)."""

    __slots__ = ("eager", "lazy", "sources", "names", "lazy_bytes", "on_cpu", "_runs")

    def __init__(self, eager: list[ChunkTask], lazy: list[ChunkTask], lazy_blocks: list[int]) -> None:
        self.eager = eager
        self.lazy = lazy
        self.sources = [t.source for t in lazy]
        self.names = [t.layout.name for t in lazy]
        self.lazy_bytes = sum(lazy_blocks)
        self.on_cpu = all(s.is_cpu for s in self.sources)  # (Job.cpu_lazy)
        self._runs: dict[int, tuple[int, StagedGroup | None]] | None = None

    def with_eager(self, eager: list[ChunkTask]) -> LazySplit:
        """This split with ``eager`` as its eager tasks (renewed ones in
        place of old: TaskLists.split); the lazy part shared."""
        other = LazySplit.__new__(LazySplit)
        for name in LazySplit.__slots__:
            setattr(other, name, getattr(self, name))
        other.eager = eager
        return other

    def runs(self) -> dict[int, tuple[int, StagedGroup | None]]:
        """For the first lazy task of each run (run_end): the run's end,
        and the run as a StagedGroup when it has more than one task. Made
        on first use, then shared by the steps of this split."""
        if self._runs is None:
            runs: dict[int, tuple[int, StagedGroup | None]] = {}
            i = 0
            while i < len(self.lazy):
                j = run_end(self.lazy, i)
                runs[i] = (j, StagedGroup(self.lazy[i:j]) if j - i > 1 else None)
                i = j
            self._runs = runs
        return self._runs


class StagedGroup:
    """Small CPU tasks of one dtype staged in one pool block, back to back
    (the block holds ``nbytes``; task ``k`` its ``numels[k]`` elements)."""

    __slots__ = ("tasks", "dtype", "nbytes", "numels", "flat", "flat_views", "block_bytes")

    def __init__(self, tasks: list[ChunkTask]) -> None:
        self.tasks = tasks
        self.dtype = tasks[0].source.dtype
        self.numels = [math.prod(t.shape) for t in tasks]
        self.nbytes = sum(self.numels) * tasks[0].source.element_size()
        #: The pool bytes these tasks count for one by one (Capture._queued_bytes, Job.lazy_bytes).
        self.block_bytes = sum(HostPool.blocks_bytes([t.data_nbytes for t in tasks]))
        #: Each task's view is its part of the block as is (1-D parts).
        self.flat_views = all(len(t.shape) == 1 for t in tasks)
        #: The sources as 1-D tensors for one torch.cat into the block, or
        #: None (some source is not contiguous or needs autograd: copied
        #: with _foreach_copy_ into per-task views). The sources are the
        #: plan's detached aliases: their layout never changes.
        self.flat: list[torch.Tensor] | None = None
        if all(t.source.is_contiguous() and not t.source.requires_grad for t in tasks):
            self.flat = [s if s.dim() == 1 else s.view(-1) for s in (t.source for t in tasks)]

    def fill(self, block: torch.Tensor) -> torch.Tensor:
        """Copy the tasks' sources into ``block`` (a pool block of
        ``nbytes``) with one call; the block as the group's dtype."""
        dst = block.view(self.dtype)
        if self.flat is not None:
            torch.cat(self.flat, out=dst)
        else:
            torch._foreach_copy_(self.views(dst), [t.source for t in self.tasks])
        return dst

    def views(self, dst: torch.Tensor) -> list[torch.Tensor]:
        """Each task's view into ``dst`` (the group's block, as its dtype)."""
        parts = list(dst.split_with_sizes(self.numels))
        if self.flat_views:
            return parts
        return [p if len(t.shape) == 1 else p.view(t.shape) for p, t in zip(parts, self.tasks)]


class TaskLists:
    """What the stager works out once per layout of a step's task list --
    its split into eager and lazy copies, its sizes, its groups of small
    tasks -- kept for the next step that brings the same list, or a list
    of the same layout token (``StepPlan.layout_token``: plan.py hands a step
    laid out as the previous one the same tasks, those of tensors that are
    new objects, such as the RNG state, renewed; tens of thousands of
    tensors: issues 16 and 25). What depends on the tasks' sources is redone
    only at the renewed positions (plan.changed_positions). Used by the
    trainer's thread only."""

    def __init__(self) -> None:
        #: (tasks, token, optimizer, its parameters, split, {id(eager task): its position} or None)
        self._split: tuple[list[ChunkTask], object, Any, list[Any], LazySplit, dict[int, int] | None] | None = None
        #: What the copy groups of the latest split's eager tasks key on: new
        #: whenever a split is made afresh (its eager tasks may then be others
        #: at a position), kept while only renewed tasks take old ones' places.
        self._eager_key: object = None
        self._sizes: tuple[object, list[int], bool, int] | None = None
        #: (eager tasks, token, groups, rest, each eager task's (group, place) or (-1, place in rest) or None)
        self._grouping: tuple[list[ChunkTask], object, list[StagedGroup], list[ChunkTask],
                              list[tuple[int, int]] | None] | None = None

    @property
    def latest_split(self) -> LazySplit | None:
        """The split :meth:`split` made or found last."""
        return None if self._split is None else self._split[4]

    def split(self, tasks: list[ChunkTask], optimizer: Any, token: object = None) -> LazySplit:
        """The step's tasks split into eager ones and lazy ones (those whose
        storage ``optimizer.step()`` alone mutates: hooks.optimizer_storages),
        kept for the next step that brings the same task list (or layout
        ``token``), optimizer and parameters (tens of thousands of tensors:
        ~3 us each per step).

        (A task's source is a plan alias of the storage it had when planned,
        and a reused task list means every one still views it. Should the
        optimizer's state change without the task list changing, the split
        stays safe: a lazy copy is still checked by the mutation guard, and
        an eager one is always right. A renewed task takes the place of an
        eager one only -- eager is always right; where a lazy one was
        renewed the split is made again.)"""
        token = tasks if token is None else token
        params = [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]
        cached = self._split
        if (cached is not None and cached[1] is token and cached[2] is optimizer and len(cached[3]) == len(params)
                and all(map(operator.is_, params, cached[3]))):
            if cached[0] is tasks:
                return cached[4]
            renewed = self._renewed_split(cached, tasks)
            if renewed is not None:
                return renewed
        self._eager_key = object()
        if optimizer is None:
            split = LazySplit(tasks, [], [])
            self._split = (tasks, token, None, params, split, None)
            return split
        protected = optimizer_storages(optimizer)
        eager: list[ChunkTask] = []
        lazy: list[ChunkTask] = []
        for t in tasks:
            (lazy if storage_key(t.source) in protected else eager).append(t)
        split = LazySplit(eager if lazy else tasks, lazy, HostPool.blocks_bytes([t.data_nbytes for t in lazy]))
        self._split = (tasks, token, optimizer, params, split, None)
        return split

    def _renewed_split(self, cached: tuple[list[ChunkTask], object, Any, list[Any], LazySplit, dict[int, int] | None],
                       tasks: list[ChunkTask]) -> LazySplit | None:
        """The cached split with the tasks renewed in ``tasks`` (a list of
        the cached one's token) in place of the old ones, if every old one
        was eager; else None."""
        old, token, optimizer, params, split, places = cached
        changed = changed_positions(old, tasks)
        if not split.lazy:
            renewed = split.with_eager(tasks)
        else:
            if places is None:
                places = {id(t): j for j, t in enumerate(split.eager)}
            eager = list(split.eager)
            for i in changed:
                j = places.get(id(old[i]))
                if j is None:
                    return None  # a lazy task renewed
                eager[j] = tasks[i]
            renewed = split.with_eager(eager)
            places = dict(places)
            for i in changed:
                places[id(tasks[i])] = places.pop(id(old[i]))
        self._split = (tasks, token, optimizer, params, renewed, places)
        return renewed

    def sizes(self, tasks: list[ChunkTask], token: object = None) -> tuple[list[int], bool, int]:
        """The data bytes of each task, whether any source is on a CUDA
        device, and the pool bytes the step takes held whole
        (policy.step_need_bytes); kept for the next step that brings the
        same task list or layout ``token`` (whose tasks keep their device
        and size: StepPlan.layout_key)."""
        token = tasks if token is None else token
        cached = self._sizes
        if cached is not None and cached[0] is token:
            return cached[1], cached[2], cached[3]
        sizes = [t.data_nbytes for t in tasks]
        cuda = any(t.source.is_cuda for t in tasks)
        held_bytes = policy.step_need_bytes(HostPool.blocks_bytes(sizes))
        self._sizes = (token, sizes, cuda, held_bytes)
        return sizes, cuda, held_bytes

    def groups(self, tasks: list[ChunkTask]) -> tuple[list[StagedGroup], list[ChunkTask]]:
        """:func:`group_tasks` of ``tasks`` (the list of groups shared; the
        rest a fresh list). For the eager tasks of the latest split, kept
        while that split is only renewed (TaskLists.split): a renewed task
        (same dtype, size and device) takes its old one's place, and only
        its group is made again."""
        split = self._split
        token = self._eager_key if split is not None and split[4].eager is tasks else tasks
        cached = self._grouping
        if cached is not None and cached[1] is token:
            if cached[0] is tasks:
                return cached[2], list(cached[3])
            if len(cached[0]) == len(tasks):
                return self._renewed_groups(cached, tasks)
        groups, rest = group_tasks(tasks)
        self._grouping = (tasks, token, groups, list(rest), None)
        return groups, rest

    def _renewed_groups(self, cached: tuple[list[ChunkTask], object, list[StagedGroup], list[ChunkTask],
                                            list[tuple[int, int]] | None],
                        tasks: list[ChunkTask]) -> tuple[list[StagedGroup], list[ChunkTask]]:
        old, token, groups, rest, places = cached
        if places is None:
            places = _places(old, groups, rest)
        changed = changed_positions(old, tasks)
        groups, rest = list(groups), list(rest)
        remade: dict[int, list[ChunkTask]] = {}
        for i in changed:
            g, k = places[i]
            if g < 0:
                rest[k] = tasks[i]
            else:
                members = remade.get(g)
                if members is None:
                    members = remade[g] = list(groups[g].tasks)
                members[k] = tasks[i]
        for g, members in remade.items():
            groups[g] = StagedGroup(members)
        self._grouping = (tasks, token, groups, rest, places)
        return groups, list(rest)


def _places(tasks: list[ChunkTask], groups: list[StagedGroup], rest: list[ChunkTask]) -> list[tuple[int, int]]:
    """Where each of ``tasks`` went in :func:`group_tasks`'s result: (its
    group, its place there), or (-1, its place in the rest)."""
    where: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for k, t in enumerate(group.tasks):
            where[id(t)] = (g, k)
    for k, t in enumerate(rest):
        where[id(t)] = (-1, k)
    return [where[id(t)] for t in tasks]


def group_tasks(tasks: list[ChunkTask]) -> tuple[list[StagedGroup], list[ChunkTask]]:
    """Runs of small CPU tasks of one dtype (at most GROUP_BYTES each), and
    the tasks staged one by one (empty, large or not on the CPU)."""
    rest: list[ChunkTask] = []
    groups: list[StagedGroup] = []
    group: list[ChunkTask] = []
    size = 0
    dtype = None  # the group's
    for t in tasks:
        nbytes = t.data_nbytes
        src = t.source
        if not _groupable(nbytes, src):
            rest.append(t)
            continue
        if group and (src.dtype is not dtype or size + nbytes > GROUP_BYTES):
            groups.append(StagedGroup(group))
            group, size = [], 0
        if not group:
            dtype = src.dtype
        group.append(t)
        size += nbytes
    if group:
        groups.append(StagedGroup(group))
    return groups, rest


def _groupable(nbytes: int, src: torch.Tensor) -> bool:
    """A task of ``nbytes`` from ``src`` may be copied in a group of small
    CPU tasks (group_tasks, run_end): not empty, small, in host memory."""
    return 0 < nbytes < GROUP_TASK_BYTES and src.is_cpu


def run_end(tasks: list[ChunkTask], i: int) -> int:
    """The end of the run of small CPU tasks of one dtype starting at ``i``
    (at most GROUP_BYTES), copied together; ``i + 1`` when task ``i`` is not small."""
    first = tasks[i].source
    nbytes = tasks[i].data_nbytes
    if not _groupable(nbytes, first):
        return i + 1
    size, j, dtype = nbytes, i + 1, first.dtype
    while j < len(tasks):
        src = tasks[j].source
        nbytes = tasks[j].data_nbytes
        if not _groupable(nbytes, src) or src.dtype != dtype or size + nbytes > GROUP_BYTES:
            break
        size += nbytes
        j += 1
    return j


__all__ = ["GROUP_BYTES", "GROUP_TASK_BYTES", "LazySplit", "StagedGroup", "TaskLists", "group_tasks", "run_end"]
