"""Incidents of the flight recorder (issue 14): ``Capture.incident`` from the
trainer, and the watcher thread that raises one when a captured step holds
NaN or Inf. An incident stores every step still in the memory tier
(recorder.py forces them) and is recorded in the store
(``dstt.store.incidents``). A mixin of :class:`~dstt.capture.engine.Capture`.
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
from dstt.store import args as A
from dstt.store import layout as L
from dstt.store.incidents import Incident, record_incident
from dstt.store.manifest import memory_only_of, parse_commit
from dstt.store.plan import ChunkTask
from dstt.store.root import committed_steps
from dstt.store.writer import Writer

log = logging.getLogger("dstt.capture")

#: Non-finite tensors named in an automatic incident's reason.
MAX_NAMED = 8
#: An incident's reason is recorded up to this many characters.
MAX_REASON = 1000


class Incidents:
    """``incident`` and the NaN/Inf watcher (a mixin; state on the Capture)."""

    config: Any
    writer: Writer
    _cond: threading.Condition
    _tier: bool
    _held: deque[Job]
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
        :class:`~dstt.store.incidents.Incident`. Without ``memory_steps``
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
        with self._cond:  # passed over by the memory tier, not yet recorded in a commit
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
        with self._cond:
            at = step if step is not None else self._latest_step
            steps = self._force_all()
            self._cond.notify_all()
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

    def _force_all(self) -> list[int]:
        """Force every step in the ring, and every queued one (under _cond)."""
        if not self._tier:
            return []
        steps = []
        for job in [*self._held, *self._unstaged]:
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
        """Check staged steps for NaN/Inf in step order (a watcher that falls
        more than K steps behind skips the oldest: only steps in the ring are
        checked, and they are what an incident stores)."""
        self._lower_priority()  # type: ignore[attr-defined]
        while True:
            with self._cond:
                # unbounded wait: the watcher waiting for work; close() wakes it (_stopping)
                self._cond.wait_for(lambda: self._watch_q or self._stopping)
                if not self._watch_q:
                    return
                job = self._watch_q.popleft()
            freed: list[Job] = []
            try:
                bad = _nonfinite(job.views) if job.error is None else []
            except Exception as e:  # noqa: BLE001 - a watcher failure must not stop capture
                log.warning("dstt: could not check step %d for non-finite values: %s", job.plan.step, e)
                bad = []
            with self._cond:
                self._unref(job, freed)
                fire = bool(bad) and not self._nonfinite_seen and not self._closed  # type: ignore[attr-defined]
                self._nonfinite_seen = bool(bad)
            self._release(freed)
            if fire:
                names = tuple(bad[:MAX_NAMED])
                more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
                try:
                    self._raise_incident(f"non-finite values in {', '.join(names)}{more}", job.plan.step,
                                         "non-finite", names)
                except BaseException as e:  # noqa: BLE001 - reported to the trainer's next call
                    self._fail(job.plan.step, e)  # type: ignore[attr-defined]


def _nonfinite(views: list[tuple[ChunkTask, torch.Tensor]]) -> list[str]:
    """Names of the floating-point tensors with a NaN or Inf in these chunks."""
    bad: list[str] = []
    for t, v in views:
        if not (v.is_floating_point() or v.is_complex()) or t.layout.name in bad:
            continue
        # One reduction, no temporary: a NaN or Inf makes the sum non-finite;
        # a finite tensor whose sum overflows is then checked exactly.
        if not bool(torch.isfinite(v.sum())) and not bool(torch.isfinite(v).all()):
            bad.append(t.layout.name)
    return bad


__all__ = ["Incidents", "MAX_NAMED"]
