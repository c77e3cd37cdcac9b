"""The waits of :class:`dstt.Capture` and its ``close()``: every one bounded.

A component of the Capture (:class:`Drain`). ``wait_staged``, ``wait``,
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
import queue
import threading
from typing import TYPE_CHECKING

from dstt.capture.crashsafe import CrashSafe
from dstt.capture.current import Current
from dstt.capture.ledger import Ledger, steps_text
from dstt.capture.pipeline import Job
from dstt.capture.rewind import Rewinder
from dstt.capture.stager import Stager
from dstt.capture.waits import Stalled
from dstt.errors import CaptureError

if TYPE_CHECKING:
    from dstt.format.commit import CommitInfo
    from dstt.store.coord import Coordinator

log = logging.getLogger("dstt.capture")



class Drain:
    """``wait_staged``/``wait``/``raise_pending``/``close`` of a
    :class:`~dstt.capture.engine.Capture` (see the module docstring): built
    once by it with the parts it waits for and stops -- the stager, the
    crash-safe part, the rewinder, the committer thread and its queue, the
    coordinators -- and the Capture's ``config``/``writer``/``committer`` as
    they are now (:class:`~dstt.capture.current.Current`).

    Phase protocol (all on the trainer's thread):

    1. ``snapshot()``, ``wait()``, ``incident()``...: :meth:`raise_pending`;
    2. ``wait_staged()``, ``wait()``: bounded waits on the ledger;
    3. ``close()``: :meth:`close` -- the rewind's branch, the committer's
       ``before_drain``, the drain, the threads stopped (:meth:`_stop_threads`),
       then everything released (:meth:`_release_all`) or left to a reaper.
    """

    def __init__(self, current: Current, ledger: Ledger, *, stager: Stager, crashsafe: CrashSafe,
                 rewinder: Rewinder, commit_q: queue.SimpleQueue[Job | None], commit_thread: threading.Thread,
                 coordinators: tuple[Coordinator, Coordinator]) -> None:
        self.current = current
        self.ledger = ledger
        self.stager = stager
        self.crashsafe = crashsafe
        self.rewinder = rewinder
        self.commit_q = commit_q
        self.commit_thread = commit_thread
        self.coordinators = coordinators
        self.closed = False

    # ------------------------------------------------------------ the trainer's waits

    def wait_staged(self) -> None:
        """Block until every queued step is copied to host memory and, where
        the pool is in /dev/shm, sealed there: from then on the step is
        committed even if this process dies (by the next Capture on the
        branch). Call it before mutating captured tensors in place outside
        ``optimizer.step()`` (which waits by itself); raises a pending
        failure (such as the mutation guard's)."""
        job = self.stager.last
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
        self.stager.scan_guard()
        errors = self.ledger.take_errors()
        if errors:
            more = f" (and {len(errors) - 1} later failure(s))" if len(errors) > 1 else ""
            raise CaptureError(f"{errors[0]}{more}") from errors[0].__cause__

    # ------------------------------------------------------------ close

    def close(self) -> None:
        """Drain every queued step, stop the threads, release the pool and hooks.

        Raises the first unreported background failure after releasing
        everything. Safe to call twice. Never hangs: see the module docstring."""
        if self.closed:
            return
        self.closed = True
        gave_up: Stalled | None = None
        try:
            self.rewinder.switch_if_forked()  # a rewind with no snapshot after it
            self.current.committer.before_drain()  # (the memory tier: every step checked, the last one stored)
            with self.ledger.cond:
                self.ledger.wait_cond(lambda: self.ledger.pending == 0, self.ledger.pending_text)
        except Stalled as e:
            gave_up = e
        finally:
            stuck = self._stop_threads(gave_up)
            self.stager.remove_fence()  # whatever happens: the trainer's optimizer must not wait for us any more
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
            self.current.committer.on_gave_up(gave_up)
        self.stager.stop()
        self.commit_q.put(None)
        threads = {"stager": self.stager.thread, "committer": self.commit_thread}
        stuck: list[str] = []
        try:
            self.ledger.wait_thread(self.stager.thread, "the stager thread to stop")
        except Stalled:
            stuck.append("stager")
        threads.update(self.current.committer.stop_threads())  # (the memory tier's NaN/Inf watcher)
        for name, thread in threads.items():
            if name in stuck:
                continue
            try:
                self.ledger.wait_thread(thread, f"the {name} thread to stop")
            except Stalled:
                stuck.append(name)
        if not stuck:
            self.current.committer.after_threads()
        # Every flush of a committed or failed step was drained by the committer.
        self.stager.flush.shutdown(wait=not stuck)  # unbounded wait: none left once the committer stopped
        return stuck

    def _release_all(self) -> None:
        """Everything is settled: let go of the helper, pool, ring, writer (its lock) and groups."""
        self.current.committer.release()  # (the capture helper)
        self.stager.release()  # (its pool, from the ring)
        self.crashsafe.close_ring()  # removed, unless a seal in it must outlive this Capture
        self.current.writer.close()
        for coord in self.coordinators:
            coord.close()

    def _leave_to_reaper(self, stuck: list[str]) -> None:
        """Threads that do not stop may still use the writer, the pool and
        the ring: a daemon thread finishes closing once they return."""
        threads = [t for t in (self.stager.thread, self.commit_thread, *self.current.committer.threads().values())
                   if t is not None and t.is_alive()]

        def reap() -> None:
            for t in threads:
                t.join()  # unbounded wait: a daemon nobody waits for; it ends with the stuck thread
            try:
                self.current.committer.after_threads()
                self.stager.flush.shutdown(wait=True)  # unbounded wait: (as above)
                self._release_all()
                log.warning("dstt: the Capture on %s@%s finished closing (its %s thread(s) returned)",
                            self.current.writer.backend.url, self.current.config.branch, ", ".join(stuck))
            except Exception as e:  # noqa: BLE001 - nobody to raise to: say it
                log.error("dstt: finishing the close of a Capture failed: %s", e)

        threading.Thread(target=reap, name="dstt-reaper", daemon=True).start()

    def _close_error(self, gave_up: Stalled | None, stuck: list[str]) -> CaptureError:
        """One error naming what did not answer, what was left and where."""
        with self.ledger.cond:
            steps = sorted(self.ledger.queued_steps)
        errors = self.ledger.take_errors()
        parts = [f"close() of the Capture on branch {self.current.config.branch!r} gave up: "
                 f"{gave_up if gave_up is not None else 'its threads did not stop'}"]
        if steps:
            parts.append(f"{len(steps)} step(s) not committed: {steps_text(steps)}")
        parts.extend(self.current.committer.close_notes())
        if self.crashsafe.ring is not None:
            parts.append(f"steps sealed in {self.crashsafe.ring.dir} stay there for the next Capture on this branch "
                         "or `dstt gc`")
        if stuck:
            parts.append(f"the {', '.join(stuck)} thread(s) still run: this Capture finishes closing -- and frees "
                         "the branch lock -- when they return (or this process exits)")
        if errors:
            parts.append(f"first failure: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        err = CaptureError("; ".join(parts))
        err.__cause__ = errors[0] if errors else gave_up
        return err


__all__ = ["Drain"]
