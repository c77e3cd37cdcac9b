"""The other ranks' helpers, as the memory tier sees them (issue 25): what
the ranks agree on, through the store (``dstt.format.tier``) -- no
collective between helpers, no process group of the trainers.

Every look is throttled (a few small reads a second per helper at most,
whatever the step rate), and every one is bounded: a store that cannot be
read makes a helper persist what it cannot decide, never wait forever."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from dstt.errors import DsttError
from dstt.format import tier as T
from dstt.format.layout import step_ranges

log = logging.getLogger("dstt.capture")

#: How often a helper looks for incident requests (seconds).
REQUEST_POLL_S = 0.05
#: How often a helper other than rank 0's looks for new persist decisions.
DECISION_POLL_S = 0.005
#: How often a helper publishes what its tier holds (seconds).
HELD_EVERY_S = 1.0


class StorePeers:
    """:class:`~dstt.capture.helpertier.Peers` over a store backend."""

    def __init__(self, backend: Any, branch: str, run: str, rank: int, world: int, *,
                 clock: Any = time.monotonic) -> None:
        self.backend, self.branch, self.run, self.rank, self.world = backend, branch, T.validate_run(run), rank, world
        self._clock = clock
        self._next_requests = 0.0
        self._next_decisions = 0.0
        self._next_held = 0.0
        self._held_last: list[int] | None = None
        self._decisions: T.Decisions | None = None
        self._requests: list[T.IncidentRequest] = []

    def request(self, ident: str, step: int, reason: str, source: str, steps: tuple[int, ...],
                tensors: tuple[str, ...]) -> T.IncidentRequest:
        return T.IncidentRequest(self.branch, self.run, ident, step, reason, source, self.rank, self.world,
                                 time.time(), steps, tensors)

    def publish_request(self, req: T.IncidentRequest) -> bool:
        self._next_requests = 0.0  # look again at once
        return T.publish_request(self.backend, req)  # (an error goes to the caller: the trainer hears of it)

    def requests(self) -> list[T.IncidentRequest]:
        now = self._clock()
        if now >= self._next_requests:
            self._next_requests = now + REQUEST_POLL_S
            try:
                self._requests = T.list_requests(self.backend, self.branch, self.run)
            except (DsttError, OSError) as e:
                log.warning("dstt helper (rank %d): could not list incident requests: %s", self.rank, e)
        return self._requests

    def publish_decisions(self, upto: int, persist: list[int]) -> None:
        T.write_decisions(self.backend, T.Decisions(self.branch, self.run, upto, frozenset(persist)))
        del persist[:-T.DECISION_WINDOW]

    def decisions(self) -> T.Decisions | None:
        now = self._clock()
        if now >= self._next_decisions:
            self._next_decisions = now + DECISION_POLL_S
            try:
                self._decisions = T.read_decisions(self.backend, self.branch, self.run)
            except (DsttError, OSError) as e:
                log.warning("dstt helper (rank %d): could not read rank 0's persist decisions: %s", self.rank, e)
        return self._decisions

    def publish_held(self, steps: list[int], force: bool = False) -> None:
        now = self._clock()
        if not force and (steps == self._held_last or now < self._next_held):
            return
        self._next_held = now + HELD_EVERY_S
        self._held_last = list(steps)
        try:
            if not steps and force:
                T.remove_held(self.backend, self.branch, self.rank)
                return
            T.write_held(self.backend, T.HeldRecord(self.branch, self.run, self.rank, self.world, os.getpid(),
                                                    socket.gethostname(), time.time(),
                                                    tuple(step_ranges(sorted(steps)))))
        except (DsttError, OSError) as e:  # (a listing shows it stale; the tier goes on)
            log.warning("dstt helper (rank %d): could not publish the steps held in memory: %s", self.rank, e)


    def opened(self, trainer_pid: int | None) -> None:
        """This helper starts serving the run: its mark (host, its own and
        its trainer's process identity), so that gc can tell once the run
        is over even if some helper of it dies (format/tierruns.py)."""
        from dstt.capture.ringowner import process_identity
        from dstt.format.tierruns import OpenMark, write_open

        try:
            write_open(self.backend, OpenMark(self.branch, self.run, self.rank, self.world, socket.gethostname(),
                                              process_identity(),
                                              process_identity(trainer_pid) if trainer_pid else {}))
        except (DsttError, OSError) as e:  # (gc then cannot prove the run over: its records stay)
            log.warning("dstt helper (rank %d): could not mark the run's start: %s", self.rank, e)

    def closed(self) -> None:
        """This helper closed cleanly (its tier stored and emptied): the
        last rank's helper to close removes the run's records."""
        try:
            if T.close_run(self.backend, self.branch, self.run, self.rank, self.world):
                log.debug("dstt helper (rank %d): removed the records of run %s", self.rank, self.run)
        except (DsttError, OSError) as e:  # (left for gc: it removes what no helper can need)
            log.warning("dstt helper (rank %d): could not remove the memory tier's records of this run: %s",
                        self.rank, e)


__all__ = ["DECISION_POLL_S", "HELD_EVERY_S", "REQUEST_POLL_S", "StorePeers"]
