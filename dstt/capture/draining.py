"""The waits of :class:`dstt.Capture` and its ``close()``: every one bounded.

A mixin (the state lives on the Capture). ``wait_staged``, ``wait``,
``close`` and the internal waits of the trainer's calls go through
:meth:`Ledger.wait <dstt.capture.ledger.Ledger.wait>`: they wait while the capture makes progress (a
step settled, a chunk written, a staging block or slot freed, the capture
helper using CPU time or doing I/O: ``Ledger.bump``) and give up
after ``background_timeout_s`` without any (capture/waits.py). The trainer's
waits get a little longer than the helper's own bound (ledger.GRACE_S), so
a helper that stopped answering is named and killed by the committer
first, and the trainer's wait then ends with that step's error.

``close()`` never hangs:

* it drains what is queued (bounded); if that gives up, the helper (if
  any) is killed, so the committer's wait on it ends at once;
* it stops its threads (bounded); threads that still do not stop (a write
  of this process hung in the kernel) are left to a *reaper* thread, which
  finishes closing -- the writer, the ring, the branch lock -- once they
  return; until then the branch stays locked by this process;
* it raises one CaptureError naming what did not answer, the steps not
  committed and where the sealed ones are (the ring in /dev/shm: the next
  Capture on the branch or ``dstt gc`` commits them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dstt.capture.committers import Committer
from dstt.capture.ledger import Ledger, steps_text
from dstt.capture.lifecycle import LIVE
from dstt.capture.rewind import Rewinder
from dstt.capture.waits import Stalled
from dstt.errors import CaptureError

if TYPE_CHECKING:
    from dstt.format.commit import CommitInfo

log = logging.getLogger("dstt.capture")



class Draining:
    """Bounded waits, ``wait_staged``/``wait``/``close`` of :class:`~dstt.capture.engine.Capture` (a mixin)."""

    config: Any
    writer: Any
    pool: Any
    ledger: Ledger
    _closed: bool
    _last: Any
    _helper: Any
    _ring: Any
    committer: Committer
    rewinder: Rewinder
    # (the facade's, engine.py; the crash-safe part's, crashsafe.py)
    _scan_guard: Callable[[], None]
    _close_ring: Callable[[], None]
    _stage_q: Any
    _commit_q: Any
    _stager: threading.Thread
    _committer: threading.Thread
    _flush: Any
    _fence: Any
    _pool_in_ring: bool
    _plan_coord: Any
    _commit_coord: Any
    _copier: Any

    # ------------------------------------------------------------ the trainer's waits

    def wait_staged(self) -> None:
        """Block until every queued step is copied to host memory and, where
        the pool is in /dev/shm, sealed there: from then on the step is
        committed even if this process dies (by the next Capture on the
        branch). Call it before mutating captured tensors in place outside
        ``optimizer.step()`` (which waits by itself); raises a pending
        failure (such as the mutation guard's)."""
        job = self._last
        if job is not None:  # copied, and sealed in the ring where it has one
            self.ledger.wait_event(job.submitted, f"step {job.plan.step} to be staged")
        self.raise_pending()

    def wait(self, timeout: float | None = None) -> list[CommitInfo]:
        """Block until every queued step is committed and durable; raise the
        first background failure as :class:`CaptureError`. Returns the
        commits so far. ``timeout``: give up after that many seconds; without
        it, after ``background_timeout_s`` in which no step progressed."""
        with self.ledger.cond:
            if timeout is None:
                self.ledger.wait_cond(lambda: self.ledger.pending == 0, self.ledger.pending_text)
            elif not self.ledger.cond.wait_for(lambda: self.ledger.pending == 0, timeout):
                raise CaptureError(f"timed out after {timeout} s waiting for {self.ledger.pending} step(s) to commit")
        self.raise_pending()
        return self.ledger.commits()  # (Capture.committed)

    def raise_pending(self) -> None:
        """Raise the first background failure not yet reported, if any
        (a lazily copied tensor already changed in place counts: the step fails)."""
        self._scan_guard()
        errors = self.ledger.take_errors()
        if errors:
            more = f" (and {len(errors) - 1} later failure(s))" if len(errors) > 1 else ""
            raise CaptureError(f"{errors[0]}{more}") from errors[0].__cause__

    # ------------------------------------------------------------ close

    def close(self) -> None:
        """Drain every queued step, stop the threads, release the pool and hooks.

        Raises the first unreported background failure after releasing
        everything. Safe to call twice. Never hangs: see the module docstring."""
        if self._closed:
            return
        self._closed = True
        LIVE.discard(self)
        gave_up: Stalled | None = None
        try:
            self.rewinder.switch_if_forked()  # a rewind with no snapshot after it
            self.committer.before_drain()  # (the memory tier: every step checked, the last one stored)
            with self.ledger.cond:
                self.ledger.wait_cond(lambda: self.ledger.pending == 0, self.ledger.pending_text)
        except Stalled as e:
            gave_up = e
        finally:
            stuck = self._stop_threads(gave_up)
            self._fence.remove()  # whatever happens: the trainer's optimizer must not wait for us any more
            if stuck:
                self._leave_to_reaper(stuck)
            else:
                self._release_all()
        if gave_up is not None or stuck:
            raise self._close_error(gave_up, stuck)
        self.raise_pending()

    def _stop_threads(self, gave_up: Stalled | None) -> list[str]:
        """Stop the stager, committer and watcher threads (bounded); the names
        of those that did not stop. A drain that gave up kills the helper
        first: the committer may be waiting for its answer."""
        if gave_up is not None:
            self.committer.on_gave_up(gave_up)
        self._stage_q.put(None)
        self._commit_q.put(None)
        threads = {"stager": self._stager, "committer": self._committer}
        stuck: list[str] = []
        try:
            self.ledger.wait_thread(self._stager, "the stager thread to stop")
        except Stalled:
            stuck.append("stager")
        threads.update(self.committer.stop_threads())  # (the memory tier's NaN/Inf watcher)
        for name, thread in threads.items():
            if name in stuck:
                continue
            try:
                self.ledger.wait_thread(thread, f"the {name} thread to stop")
            except Stalled:
                stuck.append(name)
        if not stuck:
            self.committer.after_threads()
        # Every flush of a committed or failed step was drained by the committer.
        self._flush.shutdown(wait=not stuck)  # unbounded wait: none left once the committer stopped
        return stuck

    def _release_all(self) -> None:
        """Everything is settled: let go of the helper, pool, ring, writer (its lock) and groups."""
        self.committer.release()  # (the capture helper)
        if self.pool is not None and self._pool_in_ring:
            self.pool.unregister()
        self._close_ring()  # removed, unless a seal in it must outlive this Capture
        self.writer.close()
        self._plan_coord.close()
        self._commit_coord.close()
        self.pool = None
        self._copier = None
        self._last = None

    def _leave_to_reaper(self, stuck: list[str]) -> None:
        """Threads that do not stop may still use the writer, the pool and
        the ring: a daemon thread finishes closing once they return."""
        threads = [t for t in (self._stager, self._committer, *self.committer.threads().values())
                   if t is not None and t.is_alive()]

        def reap() -> None:
            for t in threads:
                t.join()  # unbounded wait: a daemon nobody waits for; it ends with the stuck thread
            try:
                self.committer.after_threads()
                self._flush.shutdown(wait=True)  # unbounded wait: (as above)
                self._release_all()
                log.warning("dstt: the Capture on %s@%s finished closing (its %s thread(s) returned)",
                            self.writer.backend.url, self.config.branch, ", ".join(stuck))
            except Exception as e:  # noqa: BLE001 - nobody to raise to: say it
                log.error("dstt: finishing the close of a Capture failed: %s", e)

        threading.Thread(target=reap, name="dstt-reaper", daemon=True).start()

    def _close_error(self, gave_up: Stalled | None, stuck: list[str]) -> CaptureError:
        """One error naming what did not answer, what was left and where."""
        with self.ledger.cond:
            steps = sorted(self.ledger.queued_steps)
        errors = self.ledger.take_errors()
        parts = [f"close() of the Capture on branch {self.config.branch!r} gave up: "
                 f"{gave_up if gave_up is not None else 'its threads did not stop'}"]
        if steps:
            parts.append(f"{len(steps)} step(s) not committed: {steps_text(steps)}")
        parts.extend(self.committer.close_notes())
        if self._ring is not None:
            parts.append(f"steps sealed in {self._ring.dir} stay there for the next Capture on this branch "
                         "or `dstt gc`")
        if stuck:
            parts.append(f"the {', '.join(stuck)} thread(s) still run: this Capture finishes closing -- and frees "
                         "the branch lock -- when they return (or this process exits)")
        if errors:
            parts.append(f"first failure: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        err = CaptureError("; ".join(parts))
        err.__cause__ = errors[0] if errors else gave_up
        return err


__all__ = ["Draining"]
