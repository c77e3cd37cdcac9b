"""Predictive coding of a planned step before its chunks are flushed (the
writer's half of docs/format.md "Predictive chunks"; issue 27).

:func:`prepare` runs the writer's :class:`~dstt.format.codecs.stepcoder.StepCoder`
over a step's chunks -- group by group (a parameter and its optimizer
state, chunk by chunk), in parallel on the given pool -- and leaves a
:class:`PredStep` on the plan: the encoded bytes of every chunk of a
predictively coded tensor (its residual, or the chunk whole at a keyframe).
The flush then stores those bytes (keyframes.code_chunk, batchflush) and
the commit records each predictive chunk's coding in the step index
(:func:`pred_info`).

Where it runs: on whichever thread flushes the step (``Writer.write``; the
capture helper, off the trainer's process; the in-process committer), once
per step and in plan order (the coder remembers the previous step's chunks).
A step it did not run on (a fast step, a chunk flushed alone) is stored as
before, its chunks whole.

A step is committed only when every step its predictive chunks were coded
against is committed (:func:`dangling`): a chunk coded against a step that
failed is stored whole instead, from the raw bytes the coder kept
(``Writer`` does it before the index is written), so no committed step
depends on a step that is not there.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from dstt.errors import DsttError
from dstt.format.codecs.delta import DELTA_ITEMSIZES
from dstt.format.codecs.predictors import Coding
from dstt.format.codecs.stepcoder import Decision, Group, StepCoder, counter_value, groups_of
from dstt.format.predcommit import PredStep, codable

if TYPE_CHECKING:
    from dstt.format.backends import Backend
    from dstt.format.geometry import TensorLayout
    from dstt.store.plan import ChunkTask, StepPlan

log = logging.getLogger("dstt")


def pred_layout(layout: TensorLayout) -> bool:
    """Whether a tensor's chunks may be predictively coded
    (:func:`dstt.format.predcommit.codable`)."""
    return codable(layout)


RawOf = Callable[["ChunkTask"], memoryview]


def prepare(coder: StepCoder, plan: StepPlan, raw_of: RawOf, pool: Executor | None = None, *,
            remember_only: bool = False) -> PredStep:
    """Code every chunk of ``plan``'s predictively coded tensors (see the
    module doc); ``raw_of(task)`` gives a chunk's raw bytes (its staged
    copy's). Sets and returns ``plan.pred``. ``remember_only``: a fast step
    (stored whole, uncompressed): its chunks are only remembered, as the
    keyframes the next step is coded against."""
    step = PredStep()
    tasks = {(t.layout.name, t.index): t for t in plan.tasks}
    layouts = {lay.name: lay for lay in plan.layouts}
    codable = {n: (lay.dtype.logical, tuple(lay.shape), tuple(lay.chunk_shape)) for n, lay in layouts.items()
               if pred_layout(lay)}
    groups = groups_of(plan.tree, codable)
    counters = {g.counter: counter_value(raw_of(tasks[g.counter, 0]), layouts[g.counter].dtype.logical)
                for g in groups if g.counter is not None and (g.counter, 0) in tasks}
    work: list[tuple[Group, dict[str, list[Coding]], int]] = []
    for g in groups:
        for m in g.members:  # (every group's: the committing rank writes the index of every rank's chunks)
            step.inputs[m.name] = g.inputs
        nchunks = layouts[g.members[0].name].nchunks
        # The chunks this writer holds of every member (under torch.distributed:
        # this rank's shards; a chunk of a parameter and of its optimizer state
        # cover the same elements, so they are on the same rank).
        mine = [i for i in range(nchunks) if all((m.name, i) in tasks for m in g.members)]
        if not mine:
            coder.forget_group(g)
            continue
        value = counter_value_of(g, counters)
        codings = coder.codings(g, value)
        work.extend((g, codings, i) for i in mine)

    def run(item: tuple[Group, dict[str, list[Coding]], int]) -> list[tuple[tuple[str, int], Decision]]:
        g, codings, i = item
        raws = {m.role: raw_of(tasks[m.name, i]) for m in g.members}
        out = coder.code_group(g, i, plan.step, raws, codings, remember_only=remember_only)
        return [((layouts[m.name].array, i), out[m.role]) for m in g.members if m.role in out]

    with torch.no_grad():
        done = map(run, work) if pool is None or len(work) < 2 else pool.map(run, work)
        for pairs in done:
            step.decisions.update(pairs)
    coder.last_step = plan.step
    if not remember_only:
        plan.pred = step
    return step


def counter_value_of(g: Group, counters: dict[str, float | None]) -> float | None:
    """The value of ``g``'s ``step`` counter: its own where this writer
    holds it, else (under torch.distributed a 0-d counter is written by one
    rank) one another parameter's counter of this step holds -- the
    parameters of an optimizer step together. A wrong guess costs bytes:
    the coding records the constants it used."""
    if g.counter is None:
        return None
    if g.counter in counters:
        return counters[g.counter]
    return next((v for v in counters.values() if v is not None), None)


def warm_start(coder: StepCoder, backend: Backend, branch: str, step: int) -> None:
    """Remember ``step`` of ``branch`` (the latest committed step, read back
    and decoded) as the previous coded step: a new writer of a branch
    (``dstt.save`` makes one per call, a restarted capture) codes its first
    step against it instead of storing keyframes. Each chunk's depth is its
    chain's length in the store, so keyframes still come every K steps."""
    from dstt.format.chunks import read_chunk
    from dstt.format.codecs.optimspec import ParamState
    from dstt.format.codecs.stepcoder import Prev
    from dstt.format.index import RunIndex

    run = RunIndex(backend, cache_steps=max(8, coder.keyframe_every + 2))
    rec = run.record(step, branch=branch)
    by_name = rec.by_name
    codable = {e.name: (e.dtype.logical, tuple(e.shape), tuple(e.chunk_shape)) for e in rec.entries
               if e.dtype.itemsize in DELTA_ITEMSIZES and not e.dtype.logical.startswith("complex")}

    def depth(name: str, i: int) -> int:
        d, at = 0, rec
        while d < coder.keyframe_every:
            e = at.by_name.get(name)
            c = None if e is None or e.pred is None else e.pred.chunks[i]
            if c is None:
                return d
            d += 1
            at = run.record(c.prev, branch=at.branch)
        return d

    for g in groups_of(rec.objects, codable):
        value = None
        if g.counter is not None and g.counter in by_name:
            value = counter_value(read_chunk(backend, by_name[g.counter], 0), by_name[g.counter].dtype.logical)
        dtypes = {m.role: m.dtype for m in g.members}
        with coder.lock:
            coder.states[g.key] = (ParamState(dtypes.get("param", ""), {r: d for r, d in dtypes.items()
                                                                        if r != "param"}, value), g.hyper)
        for m in g.members:
            e = by_name[m.name]
            for i in range(e.nchunks):
                raw = np.frombuffer(read_chunk(backend, e, i), np.uint8).copy()
                with coder.lock:
                    coder.remember((m.name, i), Prev(rec.step, raw, depth(m.name, i), raw.nbytes))


class Backfills:
    """Predictive coding of *backfills*: steps stored after newer ones (a
    memory tier's incident persists the steps it held but had passed over).
    The writer's own coder stays on the newest chain; a backfill is coded by
    a coder of its own against the previous captured step where that step
    is stored -- read back from the store for the first backfill of a run
    (:func:`warm_start`: its chain depth included, so keyframes still come
    every K steps), remembered from the backfill just coded for the next
    one (backfills are persisted oldest first). Where the previous step is
    not stored (passed over for good) the backfill's chunks are keyframes.
    The decoder needs nothing new: every predictive chunk names the step it
    was coded against (docs/format.md "Predictive chunks")."""

    def __init__(self) -> None:
        self.coder: StepCoder | None = None

    def prepare(self, writer: Any, plan: StepPlan, prev: int | None) -> None:
        """Code backfill ``plan`` against stored step ``prev`` (None:
        keyframes) with ``writer``'s (a :class:`~dstt.store.writer.Writer`)
        ``prepare_pred``, the writer's coder set aside meanwhile."""
        main = writer.coder
        if main is None:
            return
        c = self.coder
        if c is None or prev is None or c.last_step != prev:
            c = StepCoder(main.keyframe_every, main.codec, memory_limit=main.memory_limit)
            if prev is not None:
                try:
                    warm_start(c, writer.backend, writer.branch.name, prev)
                except DsttError as e:  # unreadable: keyframes
                    c.forget()
                    log.warning("dstt: step %s not read back to code backfill %s (%s): keyframes instead",
                                prev, plan.step, e)
            c.last_step = prev
        self.coder = c
        writer.coder = c
        try:
            writer.prepare_pred(plan)
        finally:
            writer.coder = main

    def drop(self) -> None:
        """Forget the last backfill (its copy of a step): a newer step was coded."""
        self.coder = None


def decision_of(plan: StepPlan, task: ChunkTask) -> Decision | None:
    """The chunk's decision, if :func:`prepare` ran on the step (not fast)."""
    pred: PredStep | None = plan.pred
    if pred is None or plan.fast:
        return None
    return pred.decisions.get((task.layout.array, task.index))


__all__ = ["Backfills", "PredStep", "counter_value_of", "decision_of", "pred_layout", "prepare", "warm_start"]
