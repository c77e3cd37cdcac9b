"""One step of the in-process memory tier written and committed (tier.py's
committer thread, issue 14): its chunks flushed from the slot it was staged
in -- each compared with the previous captured step's for the update
statistics, coded against it where predictive coding is on -- then the
commit, with the memory-only ranges it records."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import torch

from dstt.capture.pipeline import Job
from dstt.store.flusher import batches
from dstt.store.plan import ChunkTask, StepPlan
from dstt.store.writer import Writer

if TYPE_CHECKING:
    from dstt.format.commit import ChunkResult, CommitInfo


def persist_step(job: Job, flush: Executor, memory_only: Callable[[Writer, int], list[tuple[int, int]]]
                 ) -> CommitInfo:
    """Write and commit ``job`` (a staged step of the tier) on ``flush``'s
    threads; ``memory_only(writer, step)``: the steps passed over before it,
    as ranges, recorded in its commit (not for a backfill: it is older than
    the branch's latest step)."""
    w: Writer = job.writer
    plan = job.plan
    if job.error is not None:
        raise job.error
    w.relink(plan)  # a step passed over and stored after all (an incident)
    w.settle_before(plan)  # steps passed over before it: compared with what came before them
    prev: dict[tuple[str, int], torch.Tensor] = {}
    if job.tier.prev_job is not None:
        prev = {(t.layout.array, t.index): v for t, v in job.tier.prev_job.ring.views}
    error: BaseException | None = None
    results: list[ChunkResult] = []
    try:
        w.ensure_arrays(plan)
        # The staged views stay in the step's slot until it is committed
        # (its persist holds the slot): packed where they lie (packs.py).
        plan.packs.borrow = True
        views = {(t.layout.array, t.index): v for t, v in job.ring.views}
        w.prepare_pred(plan, lambda t: views.get((t.layout.array, t.index)))  # (store/predflush.py)
        futures = [flush.submit(_flush_views, w, plan, batch, prev)
                   for batch in batches(job.ring.views, lambda item: item[0].nbytes)]
        for f in futures:
            try:
                done, err = f.result()  # unbounded wait: a chunk write of this process (its slot is in use)
                results.extend(done)
                error = error or err
            except BaseException as e:  # drain every one: no flush outlives its step
                error = error or e
    except BaseException as e:
        error = error or e
    backfill = w.last_commit is not None and plan.step < w.last_commit[0]
    ranges = None if backfill else memory_only(w, plan.step)
    info: CommitInfo = w.commit(plan, results, error, memory_only=ranges)
    return info


def _flush_views(w: Writer, plan: StepPlan, batch: list[tuple[ChunkTask, torch.Tensor]],
                 prev: dict[tuple[str, int], torch.Tensor]) -> tuple[list[ChunkResult], BaseException | None]:
    # (small chunks in groups: store/batchflush.py; every chunk flushed or failed)
    prevs: list[torch.Tensor | None] = []
    for t, view in batch:
        p = prev.get((t.layout.array, t.index))
        prevs.append(None if p is None or p.shape != view.shape else p)
    return w.flush_chunks(plan, [t for t, _ in batch], [v for _, v in batch], prevs)


__all__ = ["persist_step"]
