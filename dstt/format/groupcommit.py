"""Group commit: several planned steps of one writer committed with one
round of syncs (issue 16: a small model captured every iteration commits a
step every ~12 ms, and each commit's syncs took longer than the iteration).

Each step is committed as :meth:`CommitPhase.commit` commits it -- its own index
files, head and commit marker, written in step order -- but the syncs inside
are deferred and the commit markers held back; then, for the whole group:

1. the branch head the last step wrote is written (each step rewrites it:
   the earlier ones are never durable, so they are not written at all),
   every marker is written under a temporary name, and the store is synced
   once: every step's chunks, packs, index files and head, and the
   temporaries, are durable;
2. the markers are renamed into place, in step order, and the store is
   synced again: the steps are committed.

So no marker is visible before everything its step references is durable
(the order one commit keeps), and the caller acknowledges a step only once
this returns it (after the second sync). A crash before the renames leaves
the group's steps uncommitted (their seals stay for recovery); a crash
between renames and the sync may leave any subset of the group committed,
each one complete. Only for single-process writers on a backend whose
one ``sync`` makes the whole store durable and that can ``rename`` a key
(the ``group_sync`` capability: ``LocalBackend`` with ``syncfs``); anything
else commits the steps one by one. (``Writer.commit_group`` runs it on a
writer's commit phase.)
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Sequence, cast

from dstt.format import layout as L
from dstt.format.backends import Backend
from dstt.format.commit import ChunkResult, CommitInfo, CommitPhase, CommitPlan
from dstt.format.heads import HEADS

_HEADS = HEADS + "/"


class _Deferred:
    """The writer's backend while a group is committed: ``sync`` is deferred
    and commit markers are held back; everything else goes through."""

    def __init__(self, real: Backend) -> None:
        self.real = real
        self.markers: list[tuple[str, bytes]] = []
        self.head: tuple[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def sync(self) -> None:
        return None  # (the group syncs once, in publish())

    def put(self, key: str, data: Any) -> None:
        if key.startswith(_HEADS):
            # Each step rewrites the branch head; none is durable before the
            # group's first sync, so only the last one is written (before it).
            self.head = (key, data)
        else:
            self.real.put(key, data)

    def put_atomic(self, key: str, data: Any) -> None:
        if key.endswith("/" + L.COMMIT_FILE):
            self.markers.append((key, bytes(data)))
        else:
            self.real.put_atomic(key, data)


def can_group(phase: CommitPhase) -> bool:
    """Whether the steps of ``phase``'s writer can be committed as a group:
    a single process, on a backend with the ``group_sync`` capability."""
    return phase.backend.group_sync and not phase.coord.distributed and not phase.exchange.distributed


def commit_group(phase: CommitPhase, items: Sequence[tuple[CommitPlan, list[ChunkResult]]]
                 ) -> list[CommitInfo | BaseException]:
    """Commit ``items`` (each a planned step of ``phase``'s writer and its
    chunk results, in step order) as a group (module docstring); each step's
    CommitInfo, or the error that kept it from being committed."""
    if len(items) <= 1 or not can_group(phase):
        return [_one(phase, plan, results) for plan, results in items]
    real: Backend = phase.backend
    deferred = _Deferred(real)
    last_commit = phase.last_commit
    out: list[CommitInfo | BaseException] = []
    phase.backend = cast(Backend, deferred)
    try:
        for plan, results in items:
            out.append(_one(phase, plan, results))
    finally:
        phase.backend = real
    published = [i for i, o in enumerate(out) if not isinstance(o, BaseException)]
    if len(deferred.markers) != len(published):  # never expected: one marker per step committed
        error = RuntimeError(f"group commit: {len(deferred.markers)} commit markers for {len(published)} steps")
        _unpublished(phase, items, published, last_commit)
        return [error if i in published else o for i, o in enumerate(out)]
    try:
        if deferred.head is not None:
            real.put(*deferred.head)
        # A step predicted from an earlier step of the group (predflush.py)
        # must never be committed without it: its marker only once the
        # earlier ones are durable.
        publish(real, deferred.markers, ordered=any(plan.pred is not None for plan, _ in items))
    except BaseException as e:  # noqa: BLE001 - reported per step; none is acknowledged
        _unpublished(phase, items, published, last_commit)
        return [e if i in published else o for i, o in enumerate(out)]
    return out


def _unpublished(phase: CommitPhase, items: Sequence[tuple[CommitPlan, list[ChunkResult]]], published: list[int],
                 last_commit: Any) -> None:
    """The commit phase's record of its commits, without the group's steps
    that were not published after all."""
    phase.last_commit = last_commit
    phase.committed_recent.difference_update(items[i][0].step for i in published)


def _one(phase: CommitPhase, plan: CommitPlan, results: list[ChunkResult]) -> CommitInfo | BaseException:
    try:
        return phase.commit(plan, results)
    except Exception as e:  # noqa: BLE001 - this step's outcome; the others go on
        return e


def publish(backend: Backend, markers: list[tuple[str, bytes]], *, ordered: bool = False) -> None:
    """Write ``markers`` (key, document) so each appears atomically, all
    durable on return, with two syncs of the whole store (module docstring);
    the first also makes everything written before it durable. ``ordered``:
    a sync after each rename, so a crash leaves a prefix of the markers
    committed, never a later step without an earlier one."""
    temps = []
    try:
        for key, data in markers:
            tmp = f"{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # (a name gc knows as a temporary)
            backend.put(tmp, data)
            temps.append((tmp, key))
        backend.sync()
        for tmp, key in temps:
            backend.rename(tmp, key)
            if ordered:
                backend.sync()
        if not ordered:
            backend.sync()
    finally:
        for tmp, _ in temps:
            if backend.exists(tmp):
                backend.delete(tmp)
