"""The incident watcher of the flight recorder (issue 14): ``Capture.incident``
from the trainer (:class:`Watcher`), and the thread that raises one when a
captured step holds NaN or Inf (:class:`NanWatch`, the memory tier's). An
incident stores every step still in the memory tier (tier.py forces them)
and is recorded in the store (``dstt.format.incidents``).

Phase protocol (who calls what, on which thread):

1. trainer, ``snapshot()``: the step is appended to ``Watcher.captured``;
2. stager: ``MemoryTier.staged`` appends a staged step to ``NanWatch.queue``;
3. watcher thread (or the trainer waiting for a slot: ``MemoryTier.place``):
   ``NanWatch.next`` checks the oldest unchecked step and settles the
   checked ones in step order, forcing the ring's steps at the first
   non-finite one (``MemoryTier.force_all``);
4. trainer, ``incident()`` or ``rewind()``: ``Watcher.raise_incident`` forces
   what the committer keeps in memory and records the incident;
5. trainer, ``close()``: ``MemoryTier.close_last`` checks every step left
   (``NanWatch.check_all``); ``MemoryTier.stop`` ends the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from dstt.capture.pipeline import Job
from dstt.errors import CaptureError, StepNotFoundError
from dstt.format import args as A
from dstt.format import layout as L
from dstt.format.incidents import Incident, record_incident
from dstt.format.manifest import memory_only_of, parse_commit
from dstt.format.root import committed_steps
from dstt.store.plan import ChunkTask

#: The facade (dstt.capture.engine.Capture), typed loosely: engine imports this module.
Capture = Any

log = logging.getLogger("dstt.capture")

#: Non-finite tensors named in an automatic incident's reason.
MAX_NAMED = 8
#: An incident's reason is recorded up to this many characters.
MAX_REASON = 1000


class Watcher:
    """``incident()`` of a :class:`~dstt.capture.engine.Capture` (every mode:
    without the memory tier only the record is written). Built once by the
    Capture; asks its committer which steps an incident stores
    (``Committer.force_all``, the memory tier's)."""

    def __init__(self, cap: Capture) -> None:
        self.cap = cap
        #: branch -> the latest steps queued on it by this Capture (appended by snapshot())
        self.captured: dict[str, deque[int]] = {}

    def incident(self, reason: str, step: int | None) -> Incident:
        """Capture.incident, its arguments checked here (see its docstring)."""
        cap = self.cap
        A.text("reason", reason, MAX_REASON)
        if step is not None:
            A.step(step)
        cap.raise_pending()
        branch = cap.writer.branch.name
        if step is None:
            log_ = self.captured.get(branch)
            step = log_[-1] if log_ else cap.writer.last_step
            if step is None:
                raise CaptureError("an incident needs a step: nothing was captured yet")
        elif not self._was_captured(branch, step):
            raise StepNotFoundError(f"incident: step {step} was never captured on branch {branch!r}; nothing was "
                                    "recorded (give a step this branch captured, or none for the latest)")
        return self.raise_incident(reason, step, "trainer")

    def _was_captured(self, branch: str, step: int) -> bool:
        """Whether this branch captured ``step``: this Capture queued it
        (recently), or the store has it committed or recorded as memory-only
        (in the commit of the first step stored after it)."""
        cap = self.cap
        if step in self.captured.get(branch, ()):
            return True
        with cap.ledger.cond:  # passed over by the memory tier, not yet recorded in a commit
            if step in cap.committer.passed_over(cap.writer):
                return True
        backend = cap.writer.backend
        if backend.exists(f"{L.step_dir(branch, step)}/{L.COMMIT_FILE}"):
            return True
        later = [s for s in committed_steps(backend, branch) if s > step]
        if not later:
            return False
        where = L.step_dir(branch, min(later))
        raw = backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        return raw is not None and any(a <= step <= b for a, b in memory_only_of(parse_commit(raw, where)))

    def raise_incident(self, reason: str, step: int | None, source: str) -> Incident:
        """Store what the committer keeps in memory (the memory tier's ring)
        and record the incident at ``step`` (default: the latest captured)."""
        cap = self.cap
        handled: Incident | None = cap.committer.incident_here(reason[:MAX_REASON], step, source)
        if handled is not None:  # (the memory tier in the capture helper records it: issue 25)
            log.warning("dstt: incident at step %d (%s): %r; storing steps %s", handled.step, source, reason,
                        ", ".join(map(str, handled.steps)) or "none")
            return handled
        with cap.ledger.cond:
            at = step if step is not None else cap.committer.latest_step()
            steps = cap.committer.force_all()
            cap.ledger.cond.notify_all()
        if at is None:
            last = cap.writer.last_step
            if last is None:
                raise CaptureError("an incident needs a step: nothing was captured yet")
            at = last
        inc = Incident(branch=cap.writer.branch.name, step=at, reason=reason[:MAX_REASON], source=source,
                       time=time.time(), steps=tuple(steps), tensors=())
        record_incident(cap.writer.backend, inc)
        log.warning("dstt: incident at step %d (%s): %r; storing steps %s", at, source, reason,
                    ", ".join(map(str, steps)) or "none")
        return inc


class NanWatch:
    """The NaN/Inf watcher of a memory tier (``watch_nonfinite``): checks
    every staged step, in step order, on its own thread (or the trainer's,
    when it would wait for a slot), and raises an incident at the first
    non-finite step after a clean one. Its queue is under the ledger's lock."""

    def __init__(self, tier: Any) -> None:  # (a tier.MemoryTier: tier.py imports this module)
        self.tier = tier
        self.ledger = tier.ledger
        self.queue: deque[Job] = deque()  # staged steps not checked yet, oldest first
        self.nonfinite_seen = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="dstt-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Check every staged step for NaN/Inf, never skipping one: a step
        keeps its slot until it is checked, and the K checked steps before the
        oldest unchecked one are kept too (MemoryTier.evict), so an
        incident at the first non-finite step stores the K steps that led up
        to it however far behind the watcher fell. A trainer that would wait
        for a slot checks the oldest steps itself (MemoryTier.place),
        even one this thread is still on: it never waits for a low-priority
        thread a busy machine may not schedule."""
        self.tier.cap.lower_priority()
        tier = self.tier
        while True:
            with self.ledger.cond:
                # unbounded wait: the watcher waiting for work; close() wakes it (MemoryTier._stopping)
                self.ledger.cond.wait_for(lambda: tier._stopping or _to_check(self.queue, False) is not None)
                if _to_check(self.queue, False) is None:
                    return
            self.next(steal=False)

    def next(self, steal: bool = True) -> bool:
        """Check the oldest staged step nobody checks yet -- with ``steal``
        (the trainer), else the oldest one not checked yet even if the
        watcher is on it -- then settle the checked steps in step order.
        False if there was none to check."""
        with self.ledger.cond:
            job = _to_check(self.queue, steal)
            if job is None:
                return False
            job.tier.checking = True
        try:
            bad = tuple(_nonfinite_tensors(job))
        except Exception as e:  # noqa: BLE001 - a watcher failure must not stop capture
            log.warning("dstt: could not check step %d for non-finite values: %s", job.plan.step, e)
            bad = ()
        freed: list[Job] = []
        with self.ledger.cond:
            if job.tier.nonfinite is None:  # (the first of two checkers to finish)
                job.tier.nonfinite = bad
            fired = self._settle(freed)
            self.ledger.cond.notify_all()
        self.tier.release(freed)
        for at, names, steps in fired:
            self._record_nonfinite(at, names, steps)
        return True

    def _settle(self, freed: list[Job]) -> list[tuple[Job, tuple[str, ...], list[int]]]:
        """Settle the checked steps at the head of the queue, in step order
        (under the ledger's lock): the first non-finite step after a clean one forces
        the K steps before it and every later one -- before the ring lets go
        of anything -- and is returned to be recorded."""
        tier = self.tier
        fired = []
        while self.queue and self.queue[0].tier.nonfinite is not None:
            job = self.queue.popleft()
            bad = job.tier.nonfinite or ()
            job.tier.watched = True
            job.spans = []
            if bad and not self.nonfinite_seen and not tier._stopping:
                fired.append((job, bad, tier.force_all(job)))
            self.nonfinite_seen = bool(bad)
            tier.unref(job, freed)
        tier.evict(freed)
        return fired

    def _record_nonfinite(self, job: Job, bad: tuple[str, ...], steps: list[int]) -> None:
        """Record the incident of a non-finite step (its steps already forced)."""
        names = bad[:MAX_NAMED]
        more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        reason = f"non-finite values in {', '.join(names)}{more}"
        try:
            inc = Incident(branch=job.writer.branch.name, step=job.plan.step, reason=reason, source="non-finite",
                           time=time.time(), steps=tuple(steps), tensors=names)
            record_incident(job.writer.backend, inc)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer's next call
            self.ledger.fail(job.plan.step, e)
            return
        log.warning("dstt: incident at step %d (non-finite): %r; storing steps %s", job.plan.step, reason,
                    ", ".join(map(str, steps)) or "none")

    def check_all(self) -> None:
        """Check every staged step not settled yet, on this thread."""
        while self.next():
            pass


def _to_check(queue: deque[Job], steal: bool) -> Job | None:
    """The oldest step of ``queue`` nobody checks yet, or (``steal``) the
    oldest one not checked yet."""
    for job in queue:
        if job.tier.nonfinite is None and not job.tier.checking:
            return job
    if steal:
        for job in queue:
            if job.tier.nonfinite is None:
                return job
    return None


def _nonfinite_tensors(job: Job) -> list[str]:
    """Names of the floating-point tensors of a staged ``job`` that hold a
    NaN or Inf: one reduction per staged copy (``job.spans``: a group of
    small tensors is one), the tensors named only when one is not finite.
    Read-only: two checkers may read one step at once."""
    for ev in job.cuda_eager:  # (eager CUDA copies: the host copy may still be landing)
        ev.synchronize()  # unbounded wait: this step's copies on the GPU (device work, no other party)
    if not any(map(_span_nonfinite, job.spans)):
        return []
    return _nonfinite(job.ring.views)


def _span_nonfinite(v: torch.Tensor) -> bool:
    """Whether the values of ``v`` include a NaN or Inf. One sum, no
    temporary: a NaN or Inf makes it non-finite (16-bit values summed in
    float32); a finite tensor whose sum overflows is then checked exactly."""
    if not (v.is_floating_point() or v.is_complex()) or v.numel() == 0:
        return False
    try:
        total = v.sum(dtype=torch.float32) if v.element_size() <= 2 and not v.is_complex() else v.sum()
        return not bool(torch.isfinite(total)) and not bool(torch.isfinite(v).all())
    except (RuntimeError, TypeError, NotImplementedError):  # a dtype without these kernels (float8, complex32)
        wide = v.to(torch.complex64 if v.is_complex() else torch.float32)
        return not bool(torch.isfinite(wide).all())


def _nonfinite(views: list[tuple[ChunkTask, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors with a NaN or Inf in these chunks."""
    bad: list[str] = []
    for t, v in views:
        if t.layout.name not in bad and _span_nonfinite(v):
            bad.append(t.layout.name)
    return bad


__all__ = ["MAX_NAMED", "NanWatch", "Watcher"]
