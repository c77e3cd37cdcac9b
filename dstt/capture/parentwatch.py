"""The capture helper's command pipe and its watch on its trainer: a
helper never outlives its trainer by more than a poll.

The helper learns that its trainer died from two things, whichever comes
first:

* **end of file** on the command pipe: the kernel closes the trainer's end
  when it dies (the usual way; a forked child closes its copy at fork:
  capture/lifecycle.py);
* **its parent**: the trainer started it, so its parent pid changes (to
  init or a subreaper) when the trainer dies. ``PR_SET_PDEATHSIG`` (Linux,
  via ctypes, where available) sends the helper SIGUSR2 at that moment,
  and every wait on the pipe is a poll of at most :data:`POLL_S` that looks
  at the parent pid too -- so a write end kept open by a process the
  trainer left behind (a child made without Python's fork hooks) cannot
  keep the helper waiting for commands that will never come.

The signal is only a hint: PR_SET_PDEATHSIG fires when the *thread* that
started the helper exits, which may be a thread of a living trainer, so
the parent pid decides.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal

#: Longest wait on the command pipe between two looks at the parent.
POLL_S = 1.0
#: prctl(2) option: the signal sent to this process when its parent dies.
PR_SET_PDEATHSIG = 1


class ParentWatch:
    """Whether the trainer (``trainer_pid``, this process's parent) is gone;
    None: no trainer to watch (never gone)."""

    def __init__(self, trainer_pid: int | None) -> None:
        self.trainer_pid = trainer_pid
        self.hinted = False  # SIGUSR2 came (PR_SET_PDEATHSIG): look at the parent now
        if trainer_pid is not None:
            self._arm()

    def _arm(self) -> None:
        with contextlib.suppress(ValueError, OSError, AttributeError):  # (not the main thread; not Linux)
            signal.signal(signal.SIGUSR2, self._hint)
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR2), 0, 0, 0)

    def _hint(self, signum: int, frame: object) -> None:
        self.hinted = True

    def gone(self) -> bool:
        """The trainer died (this process was handed to another parent)."""
        return self.trainer_pid is not None and os.getppid() != self.trainer_pid


class Commands:
    """The command pipe, read in batches: the first line waited for, then
    every complete line already queued behind it (the steps to commit as a
    group). End of file, or the trainer gone (``watch``), ends it."""

    def __init__(self, fd: int, watch: ParentWatch | None = None) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False
        self.watch = watch

    def available(self, timeout_s: float | None = None) -> list[list[str]] | None:
        """The commands queued now (each split into words), waiting for at
        least one (at most ``timeout_s`` when given: then maybe none); None
        at end of file (or the trainer gone) with none left."""
        while b"\n" not in self.buf and not self.eof:
            wait = POLL_S if timeout_s is None else min(timeout_s, POLL_S)
            if not select.select([self.fd], [], [], wait)[0]:
                if self.watch is not None and self.watch.gone():
                    self.eof = True  # (nobody will write again: as end of file)
                    break
                if timeout_s is not None and wait >= timeout_s:
                    return []
                if timeout_s is not None:
                    timeout_s -= wait
                continue
            self._read()
        while not self.eof and select.select([self.fd], [], [], 0)[0]:
            self._read()
        if b"\n" not in self.buf:
            return None
        head, _, self.buf = self.buf.rpartition(b"\n")
        lines = [line.decode().split() for line in head.split(b"\n")]
        if ["close"] in lines:  # nothing after close counts
            lines = lines[:lines.index(["close"]) + 1]
        return lines

    def _read(self) -> None:
        part = os.read(self.fd, 65536)
        if not part:
            self.eof = True
        self.buf += part


__all__ = ["POLL_S", "Commands", "ParentWatch"]
