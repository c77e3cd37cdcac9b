"""The reservation of a /dev/shm pool file's pages, in pieces, in the background.

Issue 23: a sparse pool file is backed page by page at the first copy into
each page, and /dev/shm filling up meanwhile killed the trainer with SIGBUS
at that copy. So every page of a pool file is reserved (``posix_fallocate``)
before anything is written to it. Reserving the whole pool before the first
copy made the first ``snapshot()`` wait for all of it (issue 25: a 2-step
pool of a 1 GB state, 0.29 s on an H100, 14x one pinned copy of the state;
the memory tier's 10-step pool, 1.3 s), though the first step needs only
its own bytes.

A :class:`Reservation` reserves the file front to back in pieces of
:data:`PIECE_BYTES` on a thread of its own and keeps a watermark
(:attr:`Reservation.upto`): bytes ``[0, upto)`` are reserved. The pool's
allocator (hostpool.py) hands out only blocks below the watermark, so no
page is ever written before it is reserved; an allocation above it waits
(bounded, through the ledger, like every wait for pool room) and is woken
as each piece lands. The first step's copies thus start as soon as the
first piece is reserved and run behind the reservation.

If a piece cannot be reserved (ENOSPC...), the watermark stays where it
is for good (:attr:`Reservation.error`) and the mapping's pages past it --
never written -- are replaced by process memory (``MAP_FIXED``): the file
is never written there (no SIGBUS), the steps already placed in the pool
are staged whole (one with a block past the watermark is not sealed:
seals.seal_record refuses it, so it is committed but not crash-safe, as a
step staged in process memory), and the pool is retired so that the next
step is staged in a new pool (crashsafe.new_pool: in process memory, with
a warning, if /dev/shm is still full).

Torch-free: the pool and its copies are hostpool.py's.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable

log = logging.getLogger("dstt.capture")

_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # (Linux's value: mmap.MAP_FIXED is Python 3.13+)

#: Bytes reserved per ``posix_fallocate`` call: small enough that the first
#: copies start early, large enough that the calls cost nothing (and the
#: size of the pieces the pool is registered with CUDA in: hostpool.py).
PIECE_BYTES = 16 << 20


class Reservation:
    """Reserve ``total`` bytes of the open file ``fd`` (taken over: closed
    when done) front to back in pieces, on a thread started by :meth:`start`.

    >>> import tempfile
    >>> f = tempfile.NamedTemporaryFile()
    >>> r = Reservation(os.dup(f.fileno()), 3 << 20, f.name, piece=1 << 20)
    >>> r.start(); r.wait_upto(3 << 20, 10.0), r.upto, r.error
    (True, 3145728, None)
    >>> os.fstat(f.fileno()).st_blocks * 512 >= 3 << 20
    True
    """

    def __init__(self, fd: int, total: int, path: str, *, piece: int | None = None, address: int | None = None,
                 before_op: Callable[[str, str], None] | None = None) -> None:
        self.total = total
        self.path = path
        #: Bytes [0, upto) of the file are reserved (grows to ``total``; stays put after a failure).
        self.upto = 0
        #: Why the reservation stopped short of ``total`` (an OSError's text), None while it may not.
        self.error: str | None = None
        self.done = threading.Event()  # set once it reached total, failed or was stopped
        #: Whether the mapping's pages past ``upto`` were replaced by process memory (a failure: :meth:`_remap`).
        self.remapped = False
        self._address = address  # where the file is mapped in this process (None: not mapped)
        self._fd = fd
        self._piece = max(int(PIECE_BYTES if piece is None else piece), 1)
        self._before_op = before_op
        self._cond = threading.Condition()
        self._stop = False
        self._listeners: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="dstt-reserve", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def listen(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` after each piece and at the end (from the
        reserving thread); at once if it already ended."""
        with self._cond:
            if not self.done.is_set():
                self._listeners.append(wake)
                return
        wake()

    def stop(self) -> None:
        """Stop after the current piece (the pool goes away)."""
        with self._cond:
            self._stop = True

    def wait_upto(self, nbytes: int, timeout: float | None) -> bool:
        """Wait until ``[0, nbytes)`` is reserved; False if it never will be
        (failed, stopped) or ``timeout`` passed first."""
        with self._cond:
            self._cond.wait_for(lambda: self.upto >= nbytes or self.done.is_set(), timeout)
            return self.upto >= nbytes

    def _run(self) -> None:
        try:
            reserve = getattr(os, "posix_fallocate", None)
            at = 0
            while at < self.total:
                with self._cond:
                    if self._stop:
                        raise InterruptedError("stopped: the pool goes")
                n = min(self._piece, self.total - at)
                if reserve is not None:
                    if self._before_op is not None:
                        self._before_op("reserve", self.path)
                    reserve(self._fd, at, n)
                at += n
                with self._cond:
                    self.upto = at
                    self._cond.notify_all()
                self._wake()
        except BaseException as e:  # noqa: BLE001 - never lost: said here, the pool goes on in process memory
            with self._cond:
                self.error = f"reserving bytes {self.upto}.. of the staging pool {self.path}: {e}"
            self.remapped = self._remap()
            log.warning("dstt: %s: %s", self.error,
                        "its blocks past that byte are process memory (no step staged there is sealed); later steps "
                        "are staged in a new pool" if self.remapped else "only the bytes reserved are used")
        finally:
            os.close(self._fd)
            with self._cond:
                self.done.set()
                self._cond.notify_all()
            self._wake()
            with self._cond:
                self._listeners = []

    def _remap(self) -> bool:
        """Replace the mapping's pages past the watermark (never written:
        the pool hands out none of them) by process memory, so the steps
        already placed in the pool can be staged whole; whether it could."""
        if self._address is None or self.upto % mmap.PAGESIZE:
            return False
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
            got = libc.mmap(self._address + self.upto, self.total - self.upto, mmap.PROT_READ | mmap.PROT_WRITE,
                            flags, -1, 0)
        except (OSError, AttributeError) as e:
            log.warning("dstt: could not map process memory over the unreserved staging pool: %s", e)
            return False
        return bool(got == self._address + self.upto)

    def _wake(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for wake in listeners:
            wake()


__all__ = ["PIECE_BYTES", "Reservation"]
