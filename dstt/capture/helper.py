"""The capture helper: a process per trainer that writes and commits the
steps sealed in its ring, and finishes them if the trainer dies.

The trainer only plans, copies into the /dev/shm pool and seals each step
(ring.py). The helper does the rest -- stats, CRC-32C, dedup, encoding,
writes and the commit -- for each step the trainer hands it::

    trainer ── "commit <step>" ──▶ helper: read seal-<step>.json, flush
            ◀── "ready" (once)     │        every chunk, Writer.commit,
                "ok <step> <json>" │        remove the seal record
                "err <step> <msg>" │

How it is started and why that way:

* A fresh, exec'ed interpreter (``python -m dstt.capture.helper``), not a
  fork of the trainer: with a fork the trainer's first optimizer step paid
  copy-on-write for every page (docs/benchmarks.md). It is started in its own session (``start_new_session``): torchrun and job
  schedulers kill the trainer's process group, not the helper.
* Its start-up (importing torch: seconds) is off the trainer's path:
  ``start`` returns as soon as the process exists. Steps sealed meanwhile
  wait in the ring; the pipe buffers the commands. The helper says
  ``ready`` once it can serve; the trainer's committer thread waits for
  that at most ``HELPER_START_S`` (then the helper is killed and every
  step fails naming it; sealed steps stay for the next Capture).
* Every wait on it is bounded (capture/waits.py): an answer is waited for
  while the helper answers -- each step's outcome, and a ``busy <step>``
  line after each batch of a step's chunks written -- never counting its
  CPU time or I/O: a helper spinning on a wait of its own (under
  torch.distributed, polling the store for rank 0's commit; its command
  polls) does nothing for its trainer. One that did not answer for
  ``background_timeout_s`` (a helper stopped by SIGSTOP, hung on a
  filesystem or on another rank's helper) fails the step naming the
  helper, which is killed -- its sealed steps stay in the ring for the next Capture or
  ``dstt gc``. Commands are written without blocking (a helper that
  stopped reading cannot block the trainer either).
* The branch lock is shared, not re-taken: the trainer passes its lock
  file's descriptor (``pass_fds``; one open file description, one
  ``flock``), so the branch stays locked until both are gone and no other
  writer can slip in between the trainer's death and the helper's last
  commit. Only the three descriptors it needs are passed.
* It exits by itself: the command pipe reaches end-of-file when the
  trainer closes it or dies, and its parent pid tells it the trainer died
  even where the pipe does not (capture/parentwatch.py). On ``close`` the trainer waits for it to exit
  (so the lock is free when ``Capture.close()`` returns); at end-of-file
  without ``close`` (trainer dead) the helper commits every sealed step
  left in the ring, in step order, removes the ring and exits, releasing
  the lock. No orphan, no lock left held.

If the helper dies too, the ring stays in /dev/shm: the next Capture on the branch commits it (ring.recover).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dstt.capture.parentwatch import Commands, ParentWatch
from dstt.capture.waits import DEFAULT_TIMEOUT_S, POLL_S, Activity, Stalled, activity, describe_state, until
from dstt.errors import CaptureError

log = logging.getLogger("dstt.capture")

#: How long the trainer waits for a new helper to say it is ready (its
#: interpreter and torch start-up) before failing the steps handed to it.
HELPER_START_S = 120.0
#: The helper's cyclic-GC thresholds (Python's default: 700, 10, 10): a step allocates
#: thousands of acyclic objects, each 700 a generation-0 pass (~0.3 ms of a small step's ~7 ms).
HELPER_GC_THRESHOLDS = (20_000, 20, 50)


class HelperHandle:
    """The trainer's end of a running helper."""

    def __init__(self, proc: subprocess.Popen[bytes], cmd_fd: int, ack_fd: int,
                 start_timeout_s: float | None = None, *, ring_dir: Path | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, on_progress: Callable[[], None] | None = None) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._cmd = cmd_fd
        self._ack = ack_fd
        self._buf = b""
        self._start_timeout_s = HELPER_START_S if start_timeout_s is None else start_timeout_s
        #: An answer is given up on after this many seconds without progress of the helper.
        self.timeout_s = timeout_s
        #: Called whenever the helper is seen making progress while an answer is awaited.
        self.on_progress = on_progress
        self.ring_dir = ring_dir
        self.ready = False
        self.sent = False  # a step was handed over
        self.closed = False
        self.lost = False  # the helper died (or never came up) while the trainer lives
        self._killed_why: str | None = None  # why this process killed it (kill)
        self._seen: Activity | None = None  # its latest activity sample (_sample: its start-up only)
        self._heard = 0  # lines read from it after ready: the progress the waits on its answers count
        self._line: str | None = ""  # the latest line read (_next_line)
        self.lost_why: str | None = None  # how it was found lost, first ("exited (exit status -9...)")

    def _gone(self, step: int, why: str) -> CaptureError:
        self.lost = True
        self.lost_why = self.lost_why or why
        where = f"in {self.ring_dir}" if self.ring_dir is not None else "in /dev/shm"
        return CaptureError(f"step {step} not committed: the capture helper (pid {self.pid}) {why}; sealed steps "
                            f"stay {where} for the next Capture on this branch or `dstt gc`")

    def commit(self, step: int) -> dict[str, Any]:
        """Hand over sealed ``step`` and wait for its commit; the commit's
        figures, or CaptureError with the helper's message."""
        self.send(step)
        return self.receive(step)  # bounded: by the helper's progress (_answer)

    def send(self, step: int) -> None:
        """Hand over sealed ``step`` without waiting: the helper commits the
        steps handed to it in order, several at once when they queue up
        (group commit); :meth:`receive` each answer in the same order."""
        if self.lost:
            raise self._gone(step, "is not serving")
        try:
            os.write(self._cmd, f"commit {step}\n".encode())  # (non-blocking: start() made it so)
        except BlockingIOError:
            self.kill("stopped reading its commands (its pipe is full) and was killed")
            raise self._gone(step, self._killed_why or "") from None
        except OSError as e:
            if not self.ready and self.proc.poll() is not None:
                raise self._gone(step, f"exited while starting{self._exit_text()}") from None
            raise self._gone(step, f"is gone ({e})") from None
        self.sent = True

    def receive(self, step: int) -> dict[str, Any]:
        """The answer for ``step`` (handed over with :meth:`send`, answers
        come in order): its commit's figures, or CaptureError."""
        if self.lost:
            raise self._gone(step, "is not serving")
        if not self.ready:
            self._await_ready(step)
        line = self._answer(step)
        if line is None:
            raise self._gone(step, self._killed_why or f"exited{self._exit_text()}")
        kind, got, rest = line.split(" ", 2)
        if int(got) != step:
            raise CaptureError(f"the capture helper answered for step {got}, expected {step}")
        if kind == "ok":
            doc: dict[str, Any] = json.loads(rest)
            return doc
        raise CaptureError(rest)

    def _await_ready(self, step: int) -> None:
        """The helper's first line; bounded: a helper that never comes up is
        killed (the ring keeps what was sealed), never waited for forever.
        Its start-up (importing torch: seconds) counts as progress for the
        trainer's own bounded waits meanwhile."""
        waited = 0.0
        while True:
            t0 = time.monotonic()
            line = self._readline(max(0.0, min(POLL_S, self._start_timeout_s - waited)))
            if line != "":
                break
            self._sample()
            waited += min(time.monotonic() - t0, POLL_S)
            if waited >= self._start_timeout_s:
                break
        if line == "ready":
            self.ready = True
            return
        if line is None:
            raise self._gone(step, f"exited while starting{self._exit_text()}")
        if line == "":  # timed out
            self._kill()
            raise self._gone(step, f"did not come up within {self._start_timeout_s:g} s and was killed")
        self._kill()
        raise self._gone(step, f"said {line[:200]!r} instead of ready")

    def _answer(self, step: int) -> str | None:
        """The next answer line (None at end-of-file), waited for while the
        helper answers: a ``busy`` line (a batch of chunks written) is
        progress, not an answer. After ``timeout_s`` without a line (a
        stopped or hung helper, or one spinning on a wait of its own) it is
        killed and the step fails naming it."""
        def arrived(t: float) -> bool:
            self._line = self._readline(t)
            if self._line is not None and self._line.startswith("busy "):
                self._heard += 1  # (the helper writing a step: progress, and the trainer's waits see it)
                if self.on_progress is not None:
                    self.on_progress()
                self._line = ""
            return self._line != ""

        self._line = ""
        try:
            until(arrived, limit_s=self.timeout_s, what=f"the capture helper's answer for step {step}",
                  progress=lambda: self._heard)
        except Stalled:
            state = describe_state(self.pid)
            self.kill(f"did not answer for {self.timeout_s:g} s (no answer and no chunk written meanwhile"
                      f"{'; ' + state if state else ''}) and was killed")
            raise self._gone(step, self._killed_why or "") from None
        return self._line

    def _sample(self) -> object:
        """The helper's activity now, as a comparable value (None: unknown);
        tells ``on_progress`` when it moved since the last sample."""
        act = activity(self.pid)
        if act is not None and act.moved_since(self._seen):
            if self._seen is not None and self.on_progress is not None:
                self.on_progress()  # (the trainer's own waits see the helper working)
            self._seen = act
        return None if self._seen is None else (self._seen.cpu_ticks, self._seen.io_bytes)

    @property
    def killed_why(self) -> str | None:
        """Why this process killed the helper (:meth:`kill`); None if it did not."""
        return self._killed_why

    def send_command(self, text: str, step: int) -> None:
        """Write one command line (the memory tier's: helperops.py) without
        blocking; CaptureError naming ``step`` if the helper cannot take it."""
        if self.lost:
            raise self._gone(step, "is not serving")
        try:
            os.write(self._cmd, (text + "\n").encode())
        except BlockingIOError:
            self.kill("stopped reading its commands (its pipe is full) and was killed")
            raise self._gone(step, self._killed_why or "") from None
        except OSError as e:
            raise self._gone(step, f"is gone ({e})") from None
        self.sent = True

    def read_answer(self) -> str | None:
        """The next answer line, waiting for it (the memory tier's reader
        thread: the helper's progress bounds the waits of whoever needs
        it); None at end of file."""
        line = self._readline(None)
        if line == "ready":
            self.ready = True
        return line

    def sample(self) -> None:
        """Look at the helper's CPU time and I/O (progress: ``on_progress``)."""
        self._sample()

    def kill(self, why: str) -> None:
        """Kill the helper (``why`` goes into every error about it from now
        on). Its sealed steps stay in the ring: the next Capture on the
        branch, or ``dstt gc``, commits them. SIGKILL ends a stopped process too."""
        if self._killed_why is None:
            self._killed_why = why
        self.lost = True
        log.error("dstt: the capture helper (pid %d) %s", self.pid, why)
        self._kill()

    def _exit_text(self) -> str:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return ""
        return f" (exit status {code}; its stderr says why)"

    def _readline(self, timeout_s: float | None) -> str | None:
        """The next line; None at end-of-file, "" when ``timeout_s`` passed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._ack], [], [], left)[0]:
                    return ""
            part = os.read(self._ack, 65536)
            if not part:
                return None
            self._buf += part
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def close(self, timeout_s: float | None = None) -> None:
        """Tell the helper to stop (after the steps already handed over) and
        wait until it has exited -- so the branch lock it shares is released
        when this returns; it is killed if it does not exit within
        ``timeout_s`` (default: :attr:`timeout_s`)."""
        if self.closed:
            return
        self.closed = True
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not self.sent:
            # Never handed a step: it has nothing to finish. Do not wait for
            # its start-up (seconds) only to tell it to stop.
            self._kill()
        with contextlib.suppress(OSError):  # (non-blocking: a full pipe is a helper that stopped reading)
            os.write(self._cmd, b"close\n")
        os.close(self._cmd)
        os.close(self._ack)
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            log.error("dstt: the capture helper (pid %d) did not exit within %g s of close() (%s); killing it",
                      self.pid, limit, describe_state(self.pid) or "state unknown")
            self._kill()

    def abandon(self) -> None:
        """Close our ends without ``close`` (in a forked child of the
        trainer): the helper must still see end-of-file when the trainer
        dies. Not waited for: it is not this process's child."""
        if not self.closed:
            self.closed = True
            os.close(self._cmd)
            os.close(self._ack)
            self.proc.returncode = 0  # Popen must never waitpid() for it from here


def _helper_env() -> dict[str, str]:
    """The trainer's environment, with the directory this dstt was imported
    from first on PYTHONPATH: the helper runs the same dstt as the trainer."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def start(writer_options: dict[str, Any], store_path: str, ring_dir: Path, lock_fd: int | None, nice: int,
          dist: dict[str, Any] | None = None, *, idle: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
          on_progress: Callable[[], None] | None = None, tier: dict[str, Any] | None = None) -> HelperHandle:
    """Start the helper (see the module docstring); returns at once, without
    waiting for its start-up. ``dist`` (``rank``, ``world``, ``run``): the
    helper of one rank of a distributed Capture (ranks.py); only rank 0's
    shares the branch lock (``lock_fd``). ``idle``: once started, it runs
    under SCHED_IDLE (pipeline.lower_thread_priority says why).
    ``timeout_s``, ``on_progress``: see :class:`HelperHandle`. ``tier``:
    the memory tier runs in the helper (helperops.py; ``k``, ``policy``,
    ``watch``, ``run``)."""
    cmd_r, cmd_w = os.pipe()
    ack_r, ack_w = os.pipe()
    args = {"store": store_path, "ring": str(ring_dir), "options": writer_options, "nice": nice, "idle": idle,
            "lock_fd": lock_fd, "cmd_fd": cmd_r, "ack_fd": ack_w, "dist": dist, "trainer": os.getpid(), "tier": tier}
    fds = (cmd_r, ack_w) if lock_fd is None else (lock_fd, cmd_r, ack_w)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dstt.capture.helper", json.dumps(args)],
            stdin=subprocess.DEVNULL, close_fds=True, pass_fds=fds,
            start_new_session=True, env=_helper_env())
    except BaseException:
        for fd in (cmd_r, cmd_w, ack_r, ack_w):
            os.close(fd)
        raise
    os.close(cmd_r)
    os.close(ack_w)
    os.set_blocking(cmd_w, False)  # a helper that stops reading must not block the trainer's write
    return HelperHandle(proc, cmd_w, ack_r, ring_dir=ring_dir, timeout_s=timeout_s, on_progress=on_progress)


def main(argv: list[str]) -> int:
    """``python -m dstt.capture.helper ARGS_JSON`` (started by :func:`start`)."""
    args = json.loads(argv[0])
    if args["nice"] > 0:
        os.nice(args["nice"])
    return serve(args["options"], args["store"], Path(args["ring"]), args["lock_fd"], args["cmd_fd"],
                 args["ack_fd"], dist=args.get("dist"), trainer_pid=args.get("trainer"), idle=bool(args.get("idle")),
                 tier=args.get("tier"))


def serve(writer_options: dict[str, Any], store: Any, ring_dir: Path, lock_fd: int | None, cmd_fd: int,
          ack_fd: int, dist: dict[str, Any] | None = None, trainer_pid: int | None = None, idle: bool = False,
          tier: dict[str, Any] | None = None) -> int:
    """The helper's loop; its exit code. ``tier`` (``k``, ``policy``,
    ``watch``, ``run``): the memory tier lives in this helper (helperops.py)."""
    import torch

    from dstt.capture import helpercpu, ranks
    from dstt.capture import ring as R
    from dstt.capture.ringowner import hold
    from dstt.format.lock import BranchLock
    from dstt.format.rankparts import plan_doc
    from dstt.format.writeoptions import WriteOptions
    from dstt.store.flusher import batches
    from dstt.store.writer import Writer

    hold(ring_dir)  # the ring is this helper's too while it lives: never adopted under it (ringowner.py)
    torch.set_num_threads(1)
    helpercpu.single_threaded_codecs()  # (this process's Blosc: no thread pool of its own)
    lock = None if lock_fd is None else BranchLock.inherited(store, writer_options["branch"], lock_fd)
    records: ranks.RecordCoordinator | None = None
    if dist is None:
        writer = Writer(store, WriteOptions(**writer_options), lock=lock)
    else:
        # One rank of a distributed Capture: this rank's chunks, then a record
        # in the store; rank 0's helper commits once every rank's is there.
        rank, world = int(dist["rank"]), int(dist["world"])
        writer = Writer(store, WriteOptions(**writer_options), lock=lock, coordinator=ranks.FixedRank(rank, world))
        records = ranks.RecordCoordinator(writer.backend, writer.branch.name, rank, world, str(dist["run"]),
                                          alive=lambda: trainer_pid is None or os.getppid() == trainer_pid)
        writer.commit_coord = records
    # compression="auto": steps stored fast when they queue up (commit_steps) or no core is spare (helpercpu.py)
    cpu = helpercpu.CpuWatch() if writer.codec.compression == "auto" else None
    if writer.coder is not None:
        # Predictive coding keeps the previous step's chunks (one copy of the
        # state): at most a quarter of the memory available now; beyond it a
        # parameter's chunks are stored whole (store/predflush.py). With the
        # memory tier here (helperops.py) no copy while the tier still holds
        # the previous persisted step (persist="all": always): the coder
        # remembers views of its ring slot and copies them only when the slot
        # goes back before the next persisted step is coded (persist=N,
        # "newest"); only such copies count against the bound.
        from dstt.capture.tiersize import available_memory_bytes

        avail = available_memory_bytes()
        writer.coder.memory_limit = None if avail is None else avail // 4
    # What start-up made (torch's modules and the like: hundreds of
    # thousands of objects) lives as long as this process: moved out of the
    # collector's generations, so the full collections a step's garbage
    # triggers no longer walk it (~1 ms of every ~10 ms step; issue 16).
    # A step's objects (plans, results, index entries: thousands, no
    # cycles) are freed by reference counting: the collector runs rarely.
    gc.freeze()
    gc.set_threshold(HELPER_GC_THRESHOLDS[0], HELPER_GC_THRESHOLDS[1], HELPER_GC_THRESHOLDS[2])
    if idle:  # (after start-up, which ran at its nice value only; threads started later inherit it)
        from dstt.capture.pipeline import set_idle_policy

        with contextlib.suppress(OSError):
            for tid in os.listdir("/proc/self/task"):  # (torch's own threads too)
                set_idle_policy(int(tid))
    with contextlib.suppress(OSError):  # (the trainer may have died while this started: serve the ring)
        os.write(ack_fd, b"ready\n")  # the trainer's committer waits for this line first
    pools: dict[str, Any] = {}
    flush = ThreadPoolExecutor(2, thread_name_prefix="dstt-helper")
    commands = Commands(cmd_fd, ParentWatch(trainer_pid))  # end of file or the trainer gone (parentwatch.py)
    closed_by_trainer = False

    def commit(step: int, verify: bool) -> Any:
        try:
            plan, results, record = prepare(step, verify)
        except Exception as e:
            if records is not None:  # no record would come: rank 0's helper would wait RANK_WAIT_S for it
                records.fail_unrecorded(step, _seal_seq(ring_dir, step), e)
            raise
        if records is not None:
            records.begin(step, plan.seq, plan_doc(record) if records.rank == 0 else None)
        try:
            info = writer.commit(plan, results)
        except ranks.Recorded:  # (after the trainer died, ranks other than 0 only record)
            info = None
        R.unseal_file(ring_dir, step)
        return info

    def prepare(step: int, verify: bool) -> tuple[Any, list[Any], dict[str, Any]]:
        """Adopt sealed ``step`` and write its chunks: (plan, results, record)."""
        record = R.read_record(R.read_bounded(ring_dir / f"seal-{step:020d}.json"))
        name = record["pool"]
        if name not in pools:
            pools.clear()  # an older pool file is not used by later steps
            pools[name] = R.map_pool(ring_dir, name)
        if records is not None:
            writer.next_seq = int(record["seq"])  # the trainers' sequence number: the same on every rank
        writer.auto_cpu_cores = math.inf if cpu is None else cpu.budget()
        plan = writer.adopt(R.plan_of(record, pools[name], verify=verify))
        writer.ensure_arrays(plan)
        # predictive coding (compression "predictive"/"auto"): the step's
        # chunks coded against the previous step here, off the trainer's
        # process, on the writer's encode_threads (store/predflush.py)
        writer.prepare_pred(plan)
        # small chunks in groups (store/batchflush.py), large ones one per task;
        # a step of one batch (a small model) on this thread: no hand-over
        def flush_batch(tasks: list[Any]) -> Any:
            done = writer.flush_chunks(plan, tasks)
            reply(f"busy {step}")  # progress the trainer's waits count (a long step's write)
            return done

        parts = batches(plan.tasks)
        flushed = [flush_batch(parts[0])] if len(parts) == 1 else list(flush.map(flush_batch, parts))
        results = [r for done, _ in flushed for r in done]
        error = next((e for _, e in flushed if e is not None), None)
        if error is not None:
            raise error
        return plan, results, record

    def reply_for(step: int, outcome: Any) -> str:
        if not isinstance(outcome, BaseException):
            return f"ok {step} {json.dumps(asdict(outcome))}"
        msg = outcome if isinstance(outcome, CaptureError) and f"step {step}" in str(outcome) else \
            f"step {step} on branch {writer.branch.name!r} not committed: {type(outcome).__name__}: {outcome}"
        return f"err {step} {msg}".replace("\n", " ")

    def commit_steps(steps: list[int]) -> list[Any]:
        """Commit the steps handed over, in order: each step's CommitInfo or
        its error. Several steps queued at once (the writer is behind) are
        committed as a group, with one round of syncs (format/groupcommit.py);
        a distributed Capture's steps one by one (their records)."""
        if records is not None or len(steps) == 1:
            out: list[Any] = []
            for step in steps:
                try:
                    out.append(commit(step, verify=False))
                except Exception as e:  # noqa: BLE001 - the trainer reports it, naming the step
                    out.append(e)
            return out
        prepared: dict[int, Any] = {}
        for i, step in enumerate(steps):
            writer.backlog = len(steps) - 1 - i  # (steps queued behind it: the helper is behind)
            try:
                prepared[step] = prepare(step, verify=False)[:2]
            except Exception as e:  # noqa: BLE001
                prepared[step] = e
        writer.backlog = 0
        ready = [(step, p) for step, p in prepared.items() if not isinstance(p, BaseException)]
        done = dict(zip([s for s, _ in ready], writer.commit_group([p for _, p in ready])))
        for step, outcome in done.items():
            if not isinstance(outcome, BaseException):
                R.unseal_file(ring_dir, step)
        return [done.get(step, prepared[step]) for step in steps]

    def reply(line: str) -> None:
        try:
            os.write(ack_fd, (line + "\n").encode())
        except OSError:
            pass  # the trainer is gone: the helper finishes alone

    try:
        if tier is not None:  # the memory tier lives here (helperops.py, issue 25)
            from dstt.capture.helperops import serve_tier

            if not serve_tier({**tier, "trainer": trainer_pid}, writer, records, ring_dir, pools, commands, reply, flush):
                pools.clear()
                R.remove_ring(ring_dir)  # (the trainer died: every held step stored, nothing left sealed)
            return 0
        while True:
            batch = commands.available()  # blocks for the first; takes what else is queued
            if batch is None:
                break  # end of file: the trainer died
            steps = [int(c[1]) for c in batch if len(c) == 2 and c[0] == "commit" and c[1].isdigit()]
            closed_by_trainer = ["close"] in batch
            replies = [reply_for(step, outcome) for step, outcome in zip(steps, commit_steps(steps))]
            try:
                os.write(ack_fd, "".join(r + "\n" for r in replies).encode())
            except OSError:
                pass  # the trainer is gone: the steps are committed or stay sealed
            if closed_by_trainer:
                break
        if not closed_by_trainer:
            # The trainer died: finish what it sealed, then leave nothing behind.
            if records is not None and records.rank != 0:
                records.mode = "record"  # nobody waits for this rank's answers any more
            for step in R.sealed_steps(ring_dir):
                if writer.last_step is None or step > writer.last_step:
                    try:
                        commit(step, verify=True)
                    except R.StaleSeal as e:  # its blocks were reused after its commit failed
                        print(f"dstt helper: step {step} not committed: {e}", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - the next Capture retries from the ring
                        print(f"dstt helper: step {step} not committed: {e}", file=sys.stderr, flush=True)
                        if records is None or records.recorded != step:
                            return 1
                        # (recorded: the next Capture or dstt gc commits it from the records)
            pools.clear()
            R.remove_ring(ring_dir)
        return 0
    finally:
        flush.shutdown(wait=True)  # unbounded wait: the helper's own flush threads, drained by then
        writer.close()


def _seal_seq(ring_dir: Path, step: int) -> int | None:
    """The sequence number in ``step``'s seal record; None if unreadable."""
    from dstt.capture import ring as R

    try:
        seq = R.read_record(R.read_bounded(ring_dir / f"seal-{step:020d}.json"))["seq"]
    except Exception:  # noqa: BLE001 - the trainer records the failure then (crashsafe.py)
        return None
    return seq if isinstance(seq, int) else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
