"""Bounded waits: no wait of dstt goes on forever.

Every wait a call of the trainer can end up in (``snapshot``, the
optimizer hook, ``wait_staged``, ``wait``, ``close``, ``rewind``...) and
every wait of a background thread on another process (the capture
helper's answers) goes through :func:`until`. It waits as long as what it
waits for makes *progress* -- a step committed or failed, a chunk written,
a staging block freed, an answer of the capture helper (never its CPU
time or I/O: only its start-up counts by :func:`activity`) -- and gives
up with a :class:`~dstt.errors.CaptureError` naming what did not answer
once nothing moved for ``background_timeout_s`` (CaptureConfig; default
:data:`DEFAULT_TIMEOUT_S`). So a very large step on a slow disk is
waited for as long as it takes, and a stopped helper (SIGSTOP, a hung
filesystem) is given up on after the bound, never waited for forever.

Time is counted in polls of at most :data:`POLL_S`, each counted for what
it lasted up to that: a trainer and helper suspended together (a job
scheduler's SIGSTOP of the whole job) do not find their bound spent when
they are resumed.

The few waits that stay unbounded are background threads waiting for
work (their queue; they end on a sentinel) or for a write of their own
process that cannot be abandoned while its buffer is in use; every one is
marked ``# unbounded wait: <why>`` and ``tests/capture/test_bounded_waits.py``
fails on any other wait without a timeout in dstt/capture and dstt/store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dstt.errors import CaptureError

#: Default of CaptureConfig.background_timeout_s: how long a wait goes on
#: while nothing it waits for makes progress.
DEFAULT_TIMEOUT_S = 300.0
#: Longest single poll of a bounded wait (it returns as soon as the wait ends).
POLL_S = 0.5


_UNSEEN = object()


class Stalled(CaptureError):
    """A bounded wait gave up: nothing it waited for moved for its bound."""


def until(done: Callable[[float], bool], *, limit_s: float, what: str | Callable[[], str],
          progress: Callable[[], object] | None = None) -> None:
    """Call ``done(t)`` -- which waits at most ``t`` seconds and says whether
    the wait is over -- until it says so; raise :class:`Stalled` once
    ``progress()`` (any value; None: nothing counts as progress) did not
    change for ``limit_s`` seconds of polling. ``what`` (or what it returns)
    names the wait in the error.

    >>> import threading
    >>> ev = threading.Event(); ev.set()
    >>> until(ev.wait, limit_s=1, what="an event")
    >>> until(threading.Event().wait, limit_s=0.01, what="nothing")
    Traceback (most recent call last):
    dstt.capture.waits.Stalled: gave up waiting for nothing: no progress for 0.01 s
    """
    stalled = 0.0
    mark: object = _UNSEEN  # (sampled only once a poll found the wait not over: none on the fast path)
    while True:
        t0 = time.monotonic()
        if done(max(0.0, min(POLL_S, limit_s - stalled))):
            return
        now = progress() if progress is not None else None
        if progress is not None and mark is not _UNSEEN and now != mark:
            stalled = 0.0
        else:
            stalled += min(time.monotonic() - t0, POLL_S)
        mark = now
        if stalled >= limit_s:
            text = what() if callable(what) else what
            raise Stalled(f"gave up waiting for {text}: no progress for {limit_s:g} s")


@dataclass(frozen=True)
class Activity:
    """What a process has done so far (``/proc/<pid>``): its run state, CPU
    ticks and bytes read and written; two samples that differ mean it moved."""

    state: str
    cpu_ticks: int
    io_bytes: int

    def moved_since(self, other: Activity | None) -> bool:
        return other is None or (self.cpu_ticks, self.io_bytes) != (other.cpu_ticks, other.io_bytes)


#: Process states as /proc/<pid>/stat spells them, for messages.
STATES = {"T": "stopped by a signal", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
          "Z": "a zombie", "R": "running", "S": "sleeping"}


def activity(pid: int) -> Activity | None:
    """:class:`Activity` of process ``pid`` (Linux); None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rsplit(b")", 1)[-1].split()
        state, ticks = fields[0].decode(), int(fields[11]) + int(fields[12])  # utime + stime, every thread
    except (OSError, ValueError, IndexError):
        return None
    io = 0
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith((b"rchar:", b"wchar:")):
                    io += int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass  # (a sandbox may hide it: CPU time alone then)
    return Activity(state, ticks, io)


def describe_state(pid: int) -> str:
    """``"stopped by a signal"`` and the like, or "" where unknown."""
    act = activity(pid)
    return "" if act is None else STATES.get(act.state, f"state {act.state}")


def exists(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["DEFAULT_TIMEOUT_S", "POLL_S", "Activity", "Stalled", "activity", "describe_state", "exists",
           "until"]
