"""Capture and the process around it: os.fork() and interpreter exit.

* **fork**: the child gets a copy of every live Capture but none of its
  threads; it must neither wait for them nor release what the parent
  holds. Each copy is marked closed in the child (its calls raise), and
  store/lock.py forgets the branch lock there.
* **exit**: a Capture never closed would lose its queued steps with its
  daemon threads. Before the interpreter stops them, each is drained for
  up to ``exit_drain_s`` and closed; what does not commit in time is named
  on stderr (sealed steps stay in /dev/shm for the next Capture).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from typing import Any

from dstt.capture.ledger import steps_text

#: Captures not closed yet in this process (fork and exit hooks walk it).
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cap in list(LIVE):
        cap._after_fork_in_child()
    LIVE.clear()


def _drain_at_exit() -> None:
    """A Capture never closed: drain it (bounded by ``exit_drain_s``) before
    the interpreter stops its threads, or say on stderr what is lost."""
    for cap in list(LIVE):
        if cap._pid != os.getpid() or cap.closed:
            continue
        limit = cap.config.exit_drain_s
        led = cap.ledger
        with led.cond:
            drained = led.cond.wait_for(lambda led=led: led.pending == 0, limit)
            lost = sorted(led.queued_steps)
        if not drained:
            cap.drain.closed = True
            print(f"dstt: a Capture on {cap.writer.backend.url}@{cap.config.branch} was never closed; "
                  f"at exit {len(lost)} queued step(s) were not committed within exit_drain_s={limit} s "
                  f"and are lost unless they commit before the process ends: steps {steps_text(lost)} "
                  "(call Capture.close(), or use it as a context manager)", file=sys.stderr, flush=True)
            continue
        try:
            cap.close()
        except Exception as e:  # noqa: BLE001 - exit must go on; say it loudly
            print(f"dstt: a Capture closed at exit failed: {e}", file=sys.stderr, flush=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# threading's exit hooks run before the interpreter stops daemon threads and
# before concurrent.futures refuses new work (its hook was registered first,
# and these run last-registered first); atexit would be too late.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_drain_at_exit)
else:  # pragma: no cover - other Python implementations
    atexit.register(_drain_at_exit)
