"""The capture helper's CPU: how its coding shares the host with the trainer
(issue 27).

* :func:`single_threaded_codecs` -- Blosc (numcodecs) compresses on the
  calling thread only. numcodecs' default runs Blosc's own thread pool (up
  to 8 threads) for calls made on a process's main thread: the helper's
  main thread flushes small steps and codes steps of one group, so those
  threads competed with the helper's ``encode_threads`` and with the
  trainer's cores. Set once in the helper's process (``helper.serve``),
  never in the trainer's: the trainer's libraries keep their settings.
* :class:`CpuWatch` -- ``compression="auto"`` backs off on CPU contention,
  not only on queue depth. A helper runs below the trainer's priority, yet
  its coding still slows a trainer that uses every core (its OpenMP
  threads wait at each barrier for the one a coding thread displaced:
  +0.6 against +0.35 per step, ``bench_scale --cases loop_threads``,
  issue 27). The rule, measured per step over windows of at least
  :data:`WINDOW_S`: the idle time of the CPUs the helper may run on
  (``/proc/stat``: what nobody -- trainer, helper, other processes -- used)
  in cores' worth. While coding, a window with less than
  ``DSTT_AUTO_SPARE_CORES`` idle (default 0.5) means the host has no core
  to spare: the next steps are stored fast (uncompressed, recorded per step
  as ``coding: fast`` in commit.json, as when the helper falls behind).
  While storing fast, coding resumes once the idle cores minus what coding
  cost the helper when it stopped (its own CPU rate then) still leave that
  margin, so it does not flap. Nothing of the trainer is set or changed:
  the helper reads the host's counters and its own CPU time. Where
  ``/proc/stat`` cannot be read the rule is off (queue depth only).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from dstt import knobs

log = logging.getLogger("dstt.capture")

#: Shortest window (seconds) a decision is measured over (/proc/stat counts
#: in ticks of 10 ms: 50 per CPU in a window).
WINDOW_S = 0.5
#: The most bytes of /proc/stat read (a line per CPU: ~100 bytes each).
MAX_STAT_BYTES = 1 << 20


def single_threaded_codecs() -> None:
    """Blosc compresses and decompresses on the calling thread in this
    process (numcodecs' ``blosc.use_threads = False``). The capture
    helper's process only (see the module doc)."""
    from numcodecs import blosc

    blosc.use_threads = False


def read_proc_stat() -> str | None:
    """The text of /proc/stat (bounded), None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            return f.read(MAX_STAT_BYTES).decode("ascii", "replace")
    except OSError:
        return None


def idle_seconds(text: str, cpus: set[int], tick_s: float) -> float | None:
    """Idle + iowait seconds of ``cpus`` summed, from /proc/stat's ``cpuN``
    lines; None if none of them is there (a text it cannot read)."""
    total, seen = 0, 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        if len(fields) < 5 or not all(f.isdigit() for f in fields[3:5]):
            continue
        total += int(fields[3]) + int(fields[4])
        seen += 1
    return total * tick_s if seen else None


@dataclass(frozen=True)
class Sample:
    """One reading: when (monotonic seconds), the watched CPUs' idle
    seconds, and this process's CPU seconds."""

    t: float
    idle: float
    own: float


class CpuWatch:
    """Whether the helper's next step may be coded (see the module doc).
    The clock, the counters and the knob are parameters, so a test drives
    it through any contention it likes."""

    def __init__(self, spare: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 own: Callable[[], float] = time.process_time,
                 stat: Callable[[], str | None] = read_proc_stat, cpus: set[int] | None = None) -> None:
        self.spare = knobs.auto_spare_cores() if spare is None else spare
        self.clock, self.own, self.stat = clock, own, stat
        self.cpus = cpus if cpus is not None else _cpus()
        self.tick_s = 1.0 / _ticks_per_second()
        self.coding = True
        #: The helper's CPU (cores' worth) in the window that stopped coding.
        self.coding_cores = 0.0
        self.last = self._sample()

    def _sample(self) -> Sample | None:
        text = self.stat()
        idle = None if text is None else idle_seconds(text, self.cpus, self.tick_s)
        return None if idle is None else Sample(self.clock(), idle, self.own())

    def budget(self) -> float:
        """The encoding CPU budget of the helper's Writer for its next step
        (``Writer.auto_cpu_cores``: a step is stored fast when coding uses
        more): unbounded while the host has cores to spare, ``-inf`` (every
        step fast) while it has not. Called once per step, before the step
        is planned; reads the counters only once a window has passed."""
        if self.spare <= 0 or self.last is None:
            return math.inf
        if self.clock() - self.last.t >= WINDOW_S:
            now = self._sample()
            if now is not None and now.t > self.last.t:
                self._decide(self.last, now)
            self.last = now
        return math.inf if self.coding else -math.inf

    def _decide(self, a: Sample, b: Sample) -> None:
        dt = b.t - a.t
        idle, own = (b.idle - a.idle) / dt, (b.own - a.own) / dt
        if self.coding and idle < self.spare:
            self.coding, self.coding_cores = False, own
            log.info("dstt: compression='auto': %.2f idle cores (< %.2f, DSTT_AUTO_SPARE_CORES) while coding: "
                     "storing steps fast", idle, self.spare)
        elif not self.coding and idle - self.coding_cores >= self.spare:
            self.coding = True
            log.info("dstt: compression='auto': %.2f idle cores: coding steps again", idle)


class PersistPace:
    """``persist="newest"`` yields to a busy host: while fewer than
    ``DSTT_AUTO_SPARE_CORES`` cores were idle (the :class:`CpuWatch` rule),
    the deciding helper picks its next newest step only once it has rested
    ``rest`` times as long as its last such write took (its writes then take
    at most ``1 / (1 + rest)`` of the wall clock); with cores to spare it
    persists as soon as its writer is free, as before. Forced steps
    (incidents, close, every-N, ``all``) never wait for it.

    >>> t = [0.0]
    >>> p = PersistPace(None, clock=lambda: t[0]); p.ready()  # nothing measured: never held back
    True
    """

    def __init__(self, watch: CpuWatch | None, rest: float = 3.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.watch, self.rest, self.clock = watch, rest, clock
        self._ended = -math.inf
        self._took = 0.0

    def wrote(self, started: float, ended: float) -> None:
        """A newest step was written from ``started`` to ``ended`` (this clock)."""
        self._ended, self._took = ended, max(0.0, ended - started)

    def ready(self) -> bool:
        """Whether the next newest step may be decided now."""
        if self.watch is None:
            return True
        self.watch.budget()  # (the idle cores, read once a window has passed)
        if self.watch.coding:
            return True
        return self.clock() >= self._ended + self.rest * self._took


def _cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this platform: every CPU)
        return set(range(os.cpu_count() or 1))


def _ticks_per_second() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK")) or 100.0
    except (AttributeError, ValueError, OSError):
        return 100.0


__all__ = ["CpuWatch", "PersistPace", "Sample", "WINDOW_S", "idle_seconds", "read_proc_stat", "single_threaded_codecs"]
