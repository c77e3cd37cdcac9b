"""The capture helper: a process per trainer that writes and commits the
steps sealed in its ring, and finishes them if the trainer dies.

The trainer only plans, copies into the /dev/shm pool and seals each step
(ring.py). The helper does the rest -- stats, CRC-32C, dedup, encoding,
writes and the commit -- for each step the trainer hands it::

    trainer ── "commit <step>" ──▶ helper: read seal-<step>.json, flush
            ◀── "ok <step> <json>" │        every chunk, Writer.commit,
                "err <step> <msg>" │        remove the seal record

How it is started and why that way:

* ``os.fork()`` from the trainer when the Capture is built, before the
  Capture's own threads exist: no interpreter and torch start-up to wait
  for (a fresh ``python`` takes seconds here), and the helper has the same
  dstt and torch as the trainer. The child makes itself a session leader
  (``setsid``): torchrun and job schedulers kill the trainer's process
  group, not the helper.
* The branch lock is shared, not re-taken: the helper keeps a duplicate of
  the trainer's lock-file descriptor (one open file description, one
  ``flock``), so the branch stays locked until both are gone and no other
  writer can slip in between the trainer's death and the helper's last
  commit. (store/lock.py closes every *other* inherited lock descriptor in
  forked children.)
* It exits by itself: the command pipe reaches end-of-file when the
  trainer closes it or dies. On ``close`` the trainer waits for it; at
  end-of-file without ``close`` (trainer dead) the helper commits every
  sealed step left in the ring, in step order, removes the ring and exits,
  releasing the lock. No orphan, no lock left held.

If the helper dies too (the whole job killed), the ring stays in /dev/shm
and the next Capture on the store and branch commits it (ring.recover).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dstt.errors import CaptureError

log = logging.getLogger("dstt.capture")


class HelperHandle:
    """The trainer's end of a running helper."""

    def __init__(self, pid: int, cmd_fd: int, ack_fd: int) -> None:
        self.pid = pid
        self._cmd = cmd_fd
        self._ack = os.fdopen(ack_fd, "rb", buffering=0)
        self._buf = b""
        self.closed = False
        self.lost = False  # the helper died while the trainer lives

    def commit(self, step: int) -> dict[str, Any]:
        """Hand over sealed ``step`` and wait for its commit; the commit's
        figures, or CaptureError with the helper's message."""
        try:
            os.write(self._cmd, f"commit {step}\n".encode())
        except OSError as e:
            self.lost = True
            raise CaptureError(f"step {step} not committed: the capture helper (pid {self.pid}) is gone ({e}); "
                               "sealed steps stay in /dev/shm for the next Capture on this branch") from None
        line = self._readline()
        if not line:
            self.lost = True
            raise CaptureError(f"step {step} not committed: the capture helper (pid {self.pid}) exited; the "
                               "step stays sealed in /dev/shm for the next Capture on this branch")
        kind, got, rest = line.split(" ", 2)
        if int(got) != step:
            raise CaptureError(f"the capture helper answered for step {got}, expected {step}")
        if kind == "ok":
            doc: dict[str, Any] = json.loads(rest)
            return doc
        raise CaptureError(rest)

    def _readline(self) -> str:
        while b"\n" not in self._buf:
            part = self._ack.read(65536)
            if not part:
                return ""
            self._buf += part
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close(self, timeout_s: float = 120.0) -> None:
        """Tell the helper to stop (after the steps already handed over) and
        reap it; it is killed if it does not exit within ``timeout_s``."""
        if self.closed:
            return
        self.closed = True
        try:
            os.write(self._cmd, b"close\n")
        except OSError:
            pass
        os.close(self._cmd)
        self._ack.close()
        _reap(self.pid, timeout_s)

    def abandon(self) -> None:
        """Close our ends without ``close``: the helper treats it as the
        trainer's death (commits what is sealed, then exits). Not reaped."""
        if not self.closed:
            self.closed = True
            os.close(self._cmd)
            self._ack.close()


def _reap(pid: int, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            log.error("dstt: capture helper %d did not exit within %s s; killing it", pid, timeout_s)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def start(writer_options: dict[str, Any], store: Any, ring_dir: Path, lock_fd: int, nice: int) -> HelperHandle:
    """Fork the helper (see the module docstring). Call it before the
    Capture starts threads."""
    cmd_r, cmd_w = os.pipe()
    ack_r, ack_w = os.pipe()
    lock_dup = os.dup(lock_fd)  # survives lock.py's at-fork close of the trainer's own descriptor
    pid = os.fork()
    if pid == 0:  # the helper; never returns into the trainer's code
        code = 1
        try:
            os.setsid()
            os.close(cmd_w)
            os.close(ack_r)
            os.write(ack_w, b"R")  # in its own session now: the trainer may go on
            if nice > 0:
                os.nice(nice)
            code = serve(writer_options, store, ring_dir, lock_dup, cmd_r, ack_w)
        except BaseException:  # noqa: BLE001 - reported, then the process ends
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(cmd_r)
    os.close(ack_w)
    os.close(lock_dup)
    handle = HelperHandle(pid, cmd_w, ack_r)
    if handle._ack.read(1) != b"R":  # Capture() returns once the helper is out of the trainer's session
        handle.lost = True
        log.error("dstt: the capture helper (pid %d) did not start", pid)
    return handle


def serve(writer_options: dict[str, Any], store: Any, ring_dir: Path, lock_fd: int, cmd_fd: int,
          ack_fd: int) -> int:
    """The helper's loop; its exit code."""
    import torch

    from dstt.capture import ring as R
    from dstt.store.lock import BranchLock
    from dstt.store.writer import Writer

    torch.set_num_threads(1)
    lock = BranchLock.inherited(store, writer_options["branch"], lock_fd)
    writer = Writer(store, lock=lock, threads=1, **writer_options)
    pools: dict[str, Any] = {}
    flush = ThreadPoolExecutor(2, thread_name_prefix="dstt-helper")
    commands = os.fdopen(cmd_fd, "rb")
    closed_by_trainer = False

    def commit(step: int, verify: bool) -> Any:
        record = json.loads(R.read_bounded(ring_dir / f"seal-{step:020d}.json"))
        name = record["pool"]
        if name not in pools:
            pools.clear()  # an older pool file is not used by later steps
            pools[name] = R.map_pool(ring_dir, name)
        plan = writer.adopt(R.plan_of(record, pools[name], verify=verify))
        writer.ensure_arrays(plan)
        results = list(flush.map(lambda t: writer.flush_chunk(plan, t, t.source), plan.tasks))
        info = writer.commit(plan, results)
        R.unseal_file(ring_dir, step)
        return info

    try:
        for raw in commands:
            cmd = raw.decode().split()
            if cmd == ["close"]:
                closed_by_trainer = True
                break
            if len(cmd) != 2 or cmd[0] != "commit":
                continue
            step = int(cmd[1])
            try:
                reply = f"ok {step} {json.dumps(asdict(commit(step, verify=False)))}"
            except Exception as e:  # noqa: BLE001 - the trainer reports it, naming the step
                msg = e if isinstance(e, CaptureError) and f"step {step}" in str(e) else \
                    f"step {step} on branch {writer.branch.name!r} not committed: {type(e).__name__}: {e}"
                reply = f"err {step} {msg}".replace("\n", " ")
            try:
                os.write(ack_fd, (reply + "\n").encode())
            except OSError:
                pass  # the trainer is gone: the step is committed or stays sealed
        if not closed_by_trainer:
            # The trainer died: finish what it sealed, then leave nothing behind.
            for step in R.sealed_steps(ring_dir):
                if writer.last_step is None or step > writer.last_step:
                    try:
                        commit(step, verify=True)
                    except R.StaleSeal as e:  # its blocks were reused after its commit failed
                        print(f"dstt helper: step {step} not committed: {e}", file=sys.stderr, flush=True)
                    except Exception as e:  # noqa: BLE001 - the next Capture retries from the ring
                        print(f"dstt helper: step {step} not committed: {e}", file=sys.stderr, flush=True)
                        return 1
            pools.clear()
            R.remove_ring(ring_dir)
        return 0
    finally:
        flush.shutdown(wait=True)
        writer.close()
