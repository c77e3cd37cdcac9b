"""The memory tier in the capture helper, the trainer's side (issue 25).

The trainer plans, copies each step into its /dev/shm ring pool (sized
for ``memory_steps + 4`` steps), seals it and hands it over (``tier
<step>``): nothing else. The helper (helperops.py, helpertier.py) keeps
the last K steps, decides, checks, writes and commits; its answers are
read by one thread of this process, blocked on the pipe between them:

* ``ok <step> <commit>`` / ``err <step> <why>`` / ``mem <step>``: the
  step's outcome -- the committer thread, which takes the steps in order,
  settles it in the ledger (``wait()`` returns once every step chosen for
  storing is stored);
* ``free <step>``: the step left the helper's tier; its pool blocks go
  back (its seal removed first, by the helper);
* ``incident ...`` / ``held ...``: answers to :meth:`incident_here` and a
  rewind's hold, handed to the trainer's call waiting for them.

Every wait on the helper is bounded: ``background_timeout_s`` without an
answer from it (:meth:`HelperTierCommitter._heard_from`). Only answers
count -- each step's outcome, ``free``, and the ``busy <step>`` line the
helper writes after each batch of chunks of a step it is writing -- never
its CPU time or I/O, which a helper spinning on a wait of its own (the
store's records, its 50 ms command polls) shows without doing anything
for this trainer; its start-up (importing torch) alone counts by its CPU
time, until it says ``ready``. A helper silent for the bound (stopped by
SIGSTOP, wedged) is killed, and its trainer fails loudly at its next dstt
call; its ring stays for the next Capture or ``dstt gc``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from dstt.capture.committers import HAND_OVER_LOCK, HelperCommitter, StagingNeeds
from dstt.capture.pipeline import Job
from dstt.capture.waits import until
from dstt.errors import CaptureError, StepOrderError
from dstt.format.incidents import Incident

if TYPE_CHECKING:
    from dstt.capture.helper import HelperHandle
    from dstt.format.commit import CommitInfo
    from dstt.store.writer import Writer

log = logging.getLogger("dstt.capture")

#: Step slots of the ring pool beyond K (as the in-process tier: the step
#: being staged, one being written, its predecessor, one being checked).
EXTRA_STEPS = 4
#: Per step, room beyond its bytes for the pool's block alignment.
STEP_SLACK_BYTES = 1 << 20


class HelperTierCommitter(HelperCommitter):
    """``memory_steps`` with the capture helper (see the module docstring)."""

    needs = StagingNeeds(flush_now=False, keep_groups=False, keep_spans=False)
    track_plan = False

    def __init__(self, cap: Any, helper: HelperHandle) -> None:
        super().__init__(cap, helper)
        self.k = int(cap.config.memory_steps or 1)
        self._outcome: dict[int, tuple[str, str]] = {}  # step -> (ok|err|mem, rest): read, not yet taken
        self._settled: set[int] = set()  # steps the committer settled (a later "ok": a forced one)
        self._jobs: dict[int, Job] = {}  # handed over, not yet freed
        self._memory_only: list[int] = []  # answered "mem", not yet in a commit
        self._latest: int | None = None
        self._replies: queue.Queue[tuple[str, int, str]] = queue.Queue()
        self._ended: str | None = None  # why no more answers come
        self._reader = threading.Thread(target=self._read_loop, name="dstt-tier-answers", daemon=True)
        #: Why the last rewind read its step from the store though some rank held it (its error says so).
        self.rewind_note = ""
        self._unread_incidents = 0  # rewinds' incident answers not waited for (helper answers in order)
        self._heard = 0  # lines read from the helper: its answers, the progress its waits count

    def start(self) -> None:
        """The answers' reader (also started by the first :meth:`place`: a
        committer chosen again for a rewind's branch is not ``start``-ed)."""
        with self.cap.ledger.cond:
            if self._reader.ident is None:
                self._reader.start()

    # ------------------------------------------------------------ trainer

    def place(self, job: Job, sizes: list[int], cuda: bool, held_bytes: int) -> None:
        cap = self.cap
        self.start()
        cap.crashsafe.refuse_without_helper(self.helper, job.plan.step)
        if self._ended is not None:
            raise CaptureError(f"step {job.plan.step} not captured: the capture helper's memory tier ended "
                               f"({self._ended}); sealed steps stay for the next Capture or `dstt gc`")
        step_bytes = held_bytes + STEP_SLACK_BYTES
        want = -(-step_bytes * (self.k + EXTRA_STEPS) // (1 << 20)) * (1 << 20)
        pool = cap.stager.pool
        if pool is None or pool.capacity < want or (cuda and not pool.wants_pin) or pool.retired is not None:
            if pool is not None:
                cap.ledger.wait(pool.wait_idle, "every staging block to be freed before the pool grows")
            pool = cap.stager.replace_pool(want, cuda)
        job.ring.pool = pool
        job.ring.hold = True
        with cap.ledger.cond:
            self._latest = job.plan.step

    def staged(self, job: Job) -> None:
        """Sealed, then handed to the helper's tier at once (stager thread)."""
        cap = self.cap
        super(HelperCommitter, self).staged(job)  # (the seal: Committer.staged)
        if job.error is not None or not job.ring.sealed:
            return  # (the committer fails it: the tier takes sealed steps only)
        with HAND_OVER_LOCK:
            try:
                self.helper.send_command(f"tier {job.plan.step}", job.plan.step)
            except CaptureError as e:
                job.error = job.error or e
                return
            with cap.ledger.cond:
                self._jobs[job.plan.step] = job
                job.ring.sent = True

    # ------------------------------------------------------------ committer thread

    def finish(self, job: Job) -> None:
        cap = self.cap
        step = job.plan.step
        try:
            cap.ledger.wait_event(job.submitted, lambda: f"step {step} to be staged and sealed")
            if job.error is not None:
                raise job.error
            if not job.ring.sent:
                raise CaptureError(f"step {step} not captured into the memory tier: it could not be sealed in the "
                                   f"staging ring ({job.ring.seal_error}); the capture helper takes sealed steps only")
            kind, rest = self._wait_outcome(step)
            if kind == "ok":
                info = _commit_info(rest)
                job.info = info
                if info is not None:
                    cap.ledger.committed(info)
            elif kind == "err":
                raise CaptureError(rest)
        except BaseException as e:
            with cap.ledger.cond:
                reported, job.reported = job.reported, True
            if not reported:
                cap.ledger.fail(step, e)
        finally:
            with cap.ledger.cond:
                self._settled.add(step)
                handed = job.ring.sent
            if not handed:
                cap.crashsafe.settle(job)  # never handed over: its blocks back now (else at "free")
            cap.ledger.settled(step)

    def commit(self, job: Job) -> CommitInfo:
        raise AssertionError("the helper's memory tier answers each step (HelperTierCommitter.finish)")

    def _wait_outcome(self, step: int) -> tuple[str, str]:
        cap, helper = self.cap, self.helper

        def arrived(t: float) -> bool:
            with cap.ledger.cond:
                return bool(cap.ledger.cond.wait_for(lambda: step in self._outcome or self._ended is not None,
                                                     min(t, 0.2)))

        try:
            self._wait_helper(arrived, lambda: f"the capture helper's answer for step {step} (memory tier)")
        except CaptureError:
            self.helper.kill(f"made no progress on step {step} of its memory tier for "
                             f"{cap.config.background_timeout_s:g} s and was killed")
            raise
        with cap.ledger.cond:
            if step in self._outcome:
                return self._outcome.pop(step)
        raise CaptureError(f"step {step} not committed: the capture helper (pid {helper.pid}) {self._ended}; "
                           "sealed steps stay for the next Capture on this branch or `dstt gc`")

    # ------------------------------------------------------------ the answers

    def _read_loop(self) -> None:
        cap, helper = self.cap, self.helper
        while True:
            try:
                line = helper.read_answer()
            except OSError as e:  # (its end closed by close())
                line, why = None, f"closed its answers ({e})"
            else:
                why = helper.lost_why or "exited"
            if line is None:
                with cap.ledger.cond:
                    self._ended = why
                    cap.ledger.cond.notify_all()
                self._replies.put(("end", -1, why))
                cap.ledger.bump()
                return
            self._heard += 1  # (an answer: the progress the waits on the helper count)
            kind, _, rest = line.partition(" ")
            word, _, rest = rest.partition(" ")
            if kind in ("ready", "busy") or not word.lstrip("-").isdigit():
                cap.ledger.bump()
                continue
            step = int(word)
            freed: Job | None = None
            with cap.ledger.cond:
                if kind in ("ok", "err", "mem"):
                    job = self._jobs.get(step)
                    if job is not None and kind != "mem":
                        job.tier.decision = "done" if kind == "ok" else "failed"
                        job.tier.done.set()  # (stored, or failed: a rewind's fork step waits for this)
                    if kind == "mem":
                        self._memory_only.append(step)
                    elif kind == "ok":
                        self._memory_only = [s for s in self._memory_only if s > step]
                    if step in self._settled:  # stored after all (an incident, close): counted now
                        info = _commit_info(rest) if kind == "ok" else None
                        if info is not None:
                            cap.ledger.recent.append(info)
                            cap.ledger.n_committed += 1
                            cap.ledger.bytes_written += info.bytes_written
                            if cap.ledger.last_commit is None or info.step >= cap.ledger.last_commit.step:
                                cap.ledger.last_commit = info
                    else:
                        self._outcome[step] = (kind, rest)
                elif kind == "free":
                    freed = self._jobs.pop(step, None)
                else:
                    self._replies.put((kind, step, rest))
                cap.ledger.cond.notify_all()
            if freed is not None:
                cap.crashsafe.settle(freed)
            cap.ledger.bump()

    def _reply(self, kind: str, what: str) -> tuple[int, str]:
        """The next ``kind`` answer (bounded by the helper's progress)."""
        got: list[tuple[str, int, str]] = []

        def arrived(t: float) -> bool:
            try:
                got.append(self._replies.get(timeout=min(t, 0.2)))
            except queue.Empty:
                return False
            return True

        while True:
            self._wait_helper(arrived, what)
            k, step, rest = got.pop()
            if k == "end":
                raise CaptureError(f"{what}: the capture helper (pid {self.helper.pid}) {rest}")
            if k == "incident" and self._unread_incidents > 0:  # a rewind's, not waited for: not this one
                with self.cap.ledger.cond:
                    self._unread_incidents -= 1
                continue
            if k == kind:
                return step, rest

    # ------------------------------------------------------------ incidents and rewind

    def incident_here(self, reason: str, step: int | None, source: str) -> Incident | None:
        """The helper's tier stores its steps and records the incident
        (rank 0's helper under torch.distributed, for every rank)."""
        at = "-" if step is None else str(step)
        self._handed_over()
        self.helper.send_command(f"incident {at} {reason.encode().hex()} {source}", step or 0)
        got, rest = self._reply("incident", "the capture helper's incident record")
        doc = json.loads(rest)
        return Incident(str(doc.get("branch", self.cap.writer.branch.name)), int(doc.get("step", got)),
                        str(doc.get("reason", reason)), str(doc.get("source", source)),
                        float(doc.get("time", time.time())), tuple(doc.get("steps", ())),
                        tuple(doc.get("tensors", ())), doc.get("rank"), doc.get("world"))

    def rewind_job(self, step: int) -> Job | None:
        cap = self.cap
        self._handed_over()
        self.helper.send_command(f"hold {step}", step)
        _, rest = self._reply("held", f"the capture helper's answer to holding step {step}")
        held = rest.strip() == "yes"
        self.rewind_note = ""
        if cap.plan_coord.distributed:  # collective: from memory only where every rank holds it
            held = self._agree(step, held)
        with cap.ledger.cond:
            job = self._jobs.get(step) if held else None
        if job is None and rest.strip() == "yes":
            self.helper.send_command(f"unhold {step}", step)
        return job

    def _agree(self, step: int, held: bool) -> bool:
        """Every rank's (step, held): the same step everywhere, else a
        StepOrderError on every rank (nothing changed); from memory only if
        every rank's helper holds it, else from the store on every rank
        (:attr:`rewind_note` names the ranks that lost it)."""
        got = [tuple(x) for x in self.cap.plan_coord.all_gather((step, held))]
        asked = sorted({s for s, _ in got})
        if len(asked) > 1:
            if held:
                self.helper.send_command(f"unhold {step}", step)
            per = ", ".join(f"rank {r}: {s}" for r, (s, _) in enumerate(got))
            raise StepOrderError(f"rewind is collective: every rank must rewind to the same step, but the ranks "
                                 f"asked for different steps ({per}); nothing was changed on any rank")
        lost = [r for r, (_, h) in enumerate(got) if not h]
        if lost and len(lost) < len(got):
            self.rewind_note = (f"step {step} is no longer in the memory tier of rank(s) "
                                f"{', '.join(map(str, lost))} (the others still hold it), so every rank reads it "
                                "from the store")
            log.warning("dstt: rewind: %s", self.rewind_note)
        return not lost

    def _wait_helper(self, done: Any, what: Any) -> None:
        """Wait until ``done(t)`` says so, while the helper answers (see the
        module docstring); Stalled (a CaptureError) after
        ``background_timeout_s`` without any answer."""
        until(done, limit_s=self.cap.config.background_timeout_s, what=what, progress=self._heard_from)

    def _heard_from(self) -> object:
        """The progress the waits on the helper count: the lines it wrote
        (answers, ``busy``); before its ``ready``, its start-up's CPU time."""
        if not self.helper.ready:
            self.helper.sample()
            return (self._heard, self.cap.ledger.progress)
        return self._heard

    def _handed_over(self) -> None:
        """Wait (bounded) until every step queued so far is handed to the
        helper: a command about a step (``hold``, ``incident``) must reach
        it after the step's ``tier`` command, else the helper answers "not
        held" for a step the trainer just captured (a rewind to it raised
        StepNotFoundError)."""
        last = self.cap.stager.last
        if last is not None:
            self.cap.ledger.wait_event(last.submitted, f"step {last.plan.step} to be staged and handed to the "
                                       "capture helper")

    def rewind_done(self, job: Job) -> None:
        self.helper.send_command(f"unhold {job.plan.step}", job.plan.step)

    def rewind_incident(self, step: int) -> None:
        """Asked, not waited for: the helper stores its tier's steps and
        records the incident after the step it is writing now (waiting for
        its answer was most of a rewind's time: a whole step's write); the
        branch switch at the next snapshot waits for the fork step."""
        reason = f"rewind to step {step}".encode().hex()
        with self.cap.ledger.cond:
            self._unread_incidents += 1  # (its answer is skipped by _reply)
        self.helper.send_command(f"incident {step} {reason} rewind", step)

    def joined_branch(self, old: Writer) -> None:
        super().joined_branch(old)
        self.cap.committer.start()  # (the new branch's: its answers read before any snapshot, for a rewind)

    def after_rewind(self) -> None:
        """(The branch switches at the next snapshot, as with the in-process
        tier: the helper stores the fork step and the incident's steps while
        the trainer computes its next step; the old branch's helper is
        closed and the new branch's started then -- Rewinder.switch_branch.)"""

    # ------------------------------------------------------------ what it keeps

    def latest_step(self) -> int | None:
        return self._latest

    def passed_over(self, writer: Writer) -> list[int]:
        return list(self._memory_only) if writer is self.cap.writer else []

    def memory_bytes(self) -> int | None:
        pool = self.cap.stager.pool
        return None if pool is None else pool.capacity

    def threads(self) -> dict[str, threading.Thread]:
        return {"memory-tier answers": self._reader}

    # ------------------------------------------------------------ close

    def release(self) -> None:
        """``close`` to the helper: it stores the last step, writes what is
        decided, frees every slot and exits; its answers are read to the end
        (bounded by its progress), then its process is waited for."""
        helper = self.helper
        self.start()  # (a rewind's branch closed before any snapshot of it: its answers were never read)
        if not helper.lost and self._ended is None:
            try:
                helper.send_command("close", self._latest or 0)
                def ended(t: float) -> bool:
                    return _joined(self._reader, min(t, 0.2))

                self._wait_helper(ended, "the capture helper to store the memory tier's last steps")
            except CaptureError as e:
                helper.kill(f"did not finish its memory tier at close ({e})")
        helper.close()
        if self._reader.is_alive():
            self._reader.join(5)
        with self.cap.ledger.cond:
            left = list(self._jobs.values())
            self._jobs.clear()
        for job in left:  # (the helper is gone: their seals stay for the next Capture)
            self.cap.crashsafe.settle(job, keep=True)

    def stop_threads(self) -> dict[str, threading.Thread]:
        return {}


def _joined(thread: threading.Thread, timeout: float) -> bool:
    thread.join(timeout)
    return not thread.is_alive()


def _commit_info(rest: str) -> CommitInfo | None:
    from dstt.format.commit import CommitInfo

    doc = json.loads(rest) if rest.strip() else {}
    return CommitInfo(**doc) if doc else None  # (empty: a rank other than 0 recorded it; rank 0 commits)


__all__ = ["EXTRA_STEPS", "HelperTierCommitter"]
