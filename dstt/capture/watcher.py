"""The incident watcher of the flight recorder (issue 14): ``Capture.incident`` from the
trainer, and the watcher thread that raises one when a captured step holds
NaN or Inf. An incident stores every step still in the memory tier
(tier.py forces them) and is recorded in the store
(``dstt.format.incidents``). A mixin of :class:`~dstt.capture.engine.Capture`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from dstt.capture.ledger import Ledger
from dstt.capture.pipeline import Job
from dstt.errors import CaptureError, StepNotFoundError
from dstt.format import args as A
from dstt.format import layout as L
from dstt.format.incidents import Incident, record_incident
from dstt.format.manifest import memory_only_of, parse_commit
from dstt.format.root import committed_steps
from dstt.store.plan import ChunkTask
from dstt.store.writer import Writer

log = logging.getLogger("dstt.capture")

#: Non-finite tensors named in an automatic incident's reason.
MAX_NAMED = 8
#: An incident's reason is recorded up to this many characters.
MAX_REASON = 1000


class Watcher:
    """``incident`` and the NaN/Inf watcher (a mixin; state on the Capture)."""

    config: Any
    writer: Writer
    ledger: Ledger
    _held: deque[Job]
    _watch_tail: deque[Job]
    _unstaged: list[Job]
    _watch_q: deque[Job]
    _nonfinite_seen: bool
    _stopping: bool
    _latest_step: int | None
    _captured_log: dict[str, deque[int]]

    def incident(self, reason: str, *, step: int | None = None) -> Incident:
        """Something went wrong (a loss spike, a bad batch): store every step
        still in the memory tier -- the steps that led up to it -- and record
        the incident (``dstt ls``, ``dstt find`` and the report show it).

        ``step``: the step it concerns (default: the latest captured one): a
        step this branch captured -- queued, in the memory tier, stored, or
        passed over as memory-only -- else StepNotFoundError, and nothing is
        recorded or stored. Returns the recorded
        :class:`~dstt.format.incidents.Incident`. Without ``memory_steps``
        only the record is written.

        >>> import tempfile, torch, dstt
        >>> m = torch.nn.Linear(2, 2)
        >>> path = tempfile.mkdtemp() + "/run"
        >>> with dstt.Capture(path, memory_steps=4, persist=2) as cap:
        ...     for s in range(4):
        ...         _ = cap.snapshot(s, model=m)
        ...     cap.wait_staged()
        ...     print(cap.incident("loss spike").steps)
        (0, 1, 2, 3)
        >>> dstt.open(path).steps()
        [0, 1, 2, 3]
        """
        self._check_open()  # type: ignore[attr-defined]
        A.text("reason", reason, MAX_REASON)
        if step is not None:
            A.step(step)
        self.raise_pending()  # type: ignore[attr-defined]
        branch = self.writer.branch.name
        if step is None:
            log_ = self._captured_log.get(branch)
            step = log_[-1] if log_ else self.writer.last_step
            if step is None:
                raise CaptureError("an incident needs a step: nothing was captured yet")
        elif not self._was_captured(branch, step):
            raise StepNotFoundError(f"incident: step {step} was never captured on branch {branch!r}; nothing was "
                                    "recorded (give a step this branch captured, or none for the latest)")
        return self._raise_incident(reason, step, "trainer")

    def _was_captured(self, branch: str, step: int) -> bool:
        """Whether this branch captured ``step``: this Capture queued it
        (recently), or the store has it committed or recorded as memory-only
        (in the commit of the first step stored after it)."""
        if step in self._captured_log.get(branch, ()):
            return True
        with self.ledger.cond:  # passed over by the memory tier, not yet recorded in a commit
            if step in getattr(self, "_memory_only", {}).get(id(self.writer), ()):
                return True
        backend = self.writer.backend
        if backend.exists(f"{L.step_dir(branch, step)}/{L.COMMIT_FILE}"):
            return True
        later = [s for s in committed_steps(backend, branch) if s > step]
        if not later:
            return False
        where = L.step_dir(branch, min(later))
        raw = backend.get(f"{where}/{L.COMMIT_FILE}", max_bytes=L.MAX_DOC_BYTES)
        return raw is not None and any(a <= step <= b for a, b in memory_only_of(parse_commit(raw, where)))

    def _raise_incident(self, reason: str, step: int | None, source: str,
                        tensors: tuple[str, ...] = ()) -> Incident:
        with self.ledger.cond:
            at = step if step is not None else self._latest_step
            steps = self._force_all()
            self.ledger.cond.notify_all()
        if at is None:
            last = self.writer.last_step
            if last is None:
                raise CaptureError("an incident needs a step: nothing was captured yet")
            at = last
        inc = Incident(branch=self.writer.branch.name, step=at, reason=reason[:MAX_REASON], source=source,
                       time=time.time(), steps=tuple(steps), tensors=tensors)
        record_incident(self.writer.backend, inc)
        log.warning("dstt: incident at step %d (%s): %r; storing steps %s", at, source, reason,
                    ", ".join(map(str, steps)) or "none")
        return inc

    def _force_all(self, at: Job | None = None) -> list[int]:
        """Force every step in the ring (the last K staged) -- with ``at``,
        the watcher's non-finite step, the K before it and every later one,
        from the steps kept for the watcher (MemoryTier._tier_evict) --
        and every queued one (under _cond)."""
        kept = [*self._watch_tail, *self._held]  # (in step order)
        i = next((n for n, job in enumerate(kept) if job is at), None)
        ring = list(self._held) if i is None else kept[max(0, i - self.config.memory_steps):]
        steps = []
        for job in [*ring, *self._unstaged]:
            if job.writer is not self.writer or job.decision == "failed":
                continue
            if job.tier_staged:
                self._force(job)
            else:
                job.forced = True
            steps.append(job.plan.step)
        return sorted(set(steps))

    # ------------------------------------------------------------ the watcher

    def _watch_loop(self) -> None:
        """Check every staged step for NaN/Inf, never skipping one: a step
        keeps its slot until it is checked, and the K checked steps before the
        oldest unchecked one are kept too (MemoryTier._tier_evict), so an
        incident at the first non-finite step stores the K steps that led up
        to it however far behind the watcher fell. A trainer that would wait
        for a slot checks the oldest steps itself (MemoryTier._tier_pool),
        even one this thread is still on: it never waits for a low-priority
        thread a busy machine may not schedule."""
        self._lower_priority()  # type: ignore[attr-defined]
        while True:
            with self.ledger.cond:
                # unbounded wait: the watcher waiting for work; close() wakes it (_stopping)
                self.ledger.cond.wait_for(lambda: self._stopping or _to_check(self._watch_q, False) is not None)
                if _to_check(self._watch_q, False) is None:
                    return
            self._watch_next(steal=False)

    def _watch_next(self, steal: bool = True) -> bool:
        """Check the oldest staged step nobody checks yet -- with ``steal``
        (the trainer), else the oldest one not checked yet even if the
        watcher is on it -- then settle the checked steps in step order.
        False if there was none to check."""
        with self.ledger.cond:
            job = _to_check(self._watch_q, steal)
            if job is None:
                return False
            job.checking = True
        try:
            bad = tuple(_nonfinite_tensors(job))
        except Exception as e:  # noqa: BLE001 - a watcher failure must not stop capture
            log.warning("dstt: could not check step %d for non-finite values: %s", job.plan.step, e)
            bad = ()
        freed: list[Job] = []
        with self.ledger.cond:
            if job.nonfinite is None:  # (the first of two checkers to finish)
                job.nonfinite = bad
            fired = self._watch_settle(freed)
            self.ledger.cond.notify_all()
        self._release(freed)  # type: ignore[attr-defined]
        for at, names, steps in fired:
            self._record_nonfinite(at, names, steps)
        return True

    def _watch_settle(self, freed: list[Job]) -> list[tuple[Job, tuple[str, ...], list[int]]]:
        """Settle the checked steps at the head of the queue, in step order
        (under _cond): the first non-finite step after a clean one forces
        the K steps before it and every later one -- before the ring lets go
        of anything -- and is returned to be recorded."""
        fired = []
        while self._watch_q and self._watch_q[0].nonfinite is not None:
            job = self._watch_q.popleft()
            bad = job.nonfinite or ()
            job.watched = True
            job.spans = []
            if bad and not self._nonfinite_seen and not self._stopping:
                fired.append((job, bad, self._force_all(job)))
            self._nonfinite_seen = bool(bad)
            self._unref(job, freed)  # type: ignore[attr-defined]
        self._tier_evict(freed)  # type: ignore[attr-defined]
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

    def _watch_all(self) -> None:
        """Check every staged step not settled yet, on this thread."""
        while self._watch_next():
            pass


def _to_check(queue: deque[Job], steal: bool) -> Job | None:
    """The oldest step of ``queue`` nobody checks yet, or (``steal``) the
    oldest one not checked yet."""
    for job in queue:
        if job.nonfinite is None and not job.checking:
            return job
    if steal:
        for job in queue:
            if job.nonfinite is None:
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
    return _nonfinite(job.views)


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


__all__ = ["Watcher", "MAX_NAMED"]
