"""The host staging pool and the copies into it.

The pool is one host buffer (pinned when CUDA is in use) allocated once and
reused for every step: a fresh multi-GB allocation costs about a second of
page faults here, a copy into a warm buffer a tenth of that. Blocks are
handed out in ring order and returned when their chunk is written; since
chunks are written roughly in the order they were staged, a ring has no
fragmentation worth the name and needs no free lists.

Invariants:

* a block is never handed out twice while live: [tail, head) (wrapping) is
  the live region, allocations only come from outside it;
* ``allocate`` blocks while the pool lacks room (backpressure) and wakes on
  every ``release``; ``abort()`` wakes every waiter with an error so nothing
  waits for a pool that will never drain;
* every block is 64-byte aligned, so a block can be viewed as any dtype;
  large blocks are page aligned, so the store can write them with O_DIRECT;
* a pool over a /dev/shm file hands out only bytes whose pages are
  reserved (reserve.py's watermark): none is written before it is.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dstt.capture.reserve import Reservation
from dstt.errors import CaptureError


def _cudart() -> Any:
    """torch's CUDA runtime bindings (torch.cuda.cudart is untyped)."""
    get: Callable[[], Any] = torch.cuda.cudart
    return get()


log = logging.getLogger("dstt.capture")

#: Every block starts on a multiple of ALIGN, so it can be viewed as any dtype.
ALIGN = 64
#: Blocks of at least PAGE_BLOCK_BYTES start on a page boundary, so the store
#: can hand them to the disk with O_DIRECT, straight from the pool.
PAGE = 4096
PAGE_BLOCK_BYTES = 64 << 10
#: A /dev/shm pool is registered with CUDA in pieces of this size (HostPool._register).
REGISTER_PIECE_BYTES = 64 << 20
#: The registration waits at most this long for ``register_go``: the first
#: step's copies on the GPU are issued first (each piece holds the CUDA
#: driver's lock, which every CUDA call of the trainer's snapshot() needs).
REGISTER_HOLD_S = 0.5


def _round_up(n: int, k: int = ALIGN) -> int:
    return -(-n // k) * k


def _alignment(nbytes: int) -> int:
    return PAGE if nbytes >= PAGE_BLOCK_BYTES else ALIGN


@dataclass
class Block:
    """A live reservation of ``nbytes`` at ``start`` in the pool buffer."""

    start: int
    nbytes: int
    freed: bool = False

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class HostPool:
    """A bounded ring of host memory, allocated once.

    >>> pool = HostPool(1 << 12)
    >>> t = pool.stage(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    >>> t.tolist(), pool.in_use > 0
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], True)
    >>> pool.release(t); pool.in_use
    0
    """

    def __init__(self, capacity: int, *, pin: bool = False, buffer: torch.Tensor | None = None,
                 reservation: Reservation | None = None, base: int = 0) -> None:
        self.capacity = _round_up(max(int(capacity), ALIGN))
        #: The pages of ``buffer`` (a /dev/shm file's, from byte ``base`` of
        #: it on) being reserved in the background (reserve.py): only blocks
        #: below its watermark are handed out; None once all are reserved.
        self._reservation = reservation
        self._reserving = reservation  # (kept: file_bytes)
        self._base = base
        #: Whether device-to-host copies into the pool run at pinned speed.
        #: A ``buffer`` (a /dev/shm mapping, capture/ring.py) is registered
        #: with CUDA in a background thread; until then it is pageable.
        self.pinned = pin and buffer is None
        self.wants_pin = pin  # pinned, or being registered in the background
        self.registered = threading.Event()
        #: Set once the first step's GPU copies are issued (Stager.queue_lazy): the registration starts then.
        self.register_go = threading.Event()
        self._pieces: list[int] = []  # offsets of the pieces registered with CUDA (_register)
        self._stop_registering = False  # unregister() before _register finished: stop between pieces
        #: Non-zero for a pool registered with CUDA in pieces of this size (see copy_mode).
        self._piece_bytes = REGISTER_PIECE_BYTES if (pin and buffer is not None) else 0
        if buffer is not None:
            if buffer.numel() < self.capacity or buffer.data_ptr() % PAGE:
                raise CaptureError(f"a staging buffer of {buffer.numel()} bytes cannot hold a {self.capacity}-byte pool")
            self.buffer = buffer[: self.capacity]
            if pin:
                threading.Thread(target=self._register, name="dstt-pin", daemon=True).start()
            else:
                self.registered.set()
        else:
            # Allocated once, reused for every step. Pinned memory is faulted in
            # and locked here; an unpinned buffer is left untouched: its pages are
            # faulted in by the first copies into it, which run on the stager
            # thread (zeroing it here cost the trainer ~0.5 s per GB of pool).
            raw = torch.empty(self.capacity + PAGE, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % PAGE
            self.buffer = raw[skip : skip + self.capacity]
            self.registered.set()
        self._blocks: collections.deque[Block] = collections.deque()
        self._by_ptr: dict[int, Block] = {}
        self._cond = threading.Condition()
        self._in_use = 0
        self._error: str | None = None
        #: The /dev/shm ring's file this pool maps (ring.py), None in process memory.
        self.ring_name: str | None = None
        self.slot_index = -1  # its slot of a memory tier's SlotPool (tier.py); -1: not a slot
        #: Why no new step should be staged here (:meth:`retire`), None while it may.
        self.retired: str | None = None
        #: Ranges [start, end) of blocks that are never released (:meth:`pin`).
        self._holes: list[tuple[int, int]] = []
        if reservation is not None:
            reservation.listen(self._wake)

    def _register(self) -> None:
        """Page-lock the mapping for CUDA off the trainer's thread (~0.55 s
        per GiB measured on an H100); copies issued before it finishes are
        correct, only slower.

        In pieces of :data:`REGISTER_PIECE_BYTES`: ``cudaHostRegister``
        holds the CUDA driver's lock for its whole call, so every CUDA call
        of the trainer (a kernel launch, an event record) waits behind it.
        Measured on an H100: one call for a 4.8 GiB pool blocked the first
        ``snapshot()`` 2.7 s. Between pieces the trainer's calls get in."""
        try:
            self.register_go.wait(REGISTER_HOLD_S)  # (bounded: starts anyway after REGISTER_HOLD_S)
            cudart = _cudart()
            base = self.buffer.data_ptr()
            reserving = self._reservation
            for start in range(0, self.capacity, self._piece_bytes):
                if self._stop_registering:
                    break
                end = min(start + self._piece_bytes, self.capacity)
                # (never a page not reserved yet: pinning it would back it. Unbounded wait:
                # the reserving thread's pieces, each a bounded system call; False if it stops.)
                if reserving is not None and not reserving.wait_upto(self._base + end, None):
                    break
                rc = cudart.cudaHostRegister(base + start, end - start, 0)
                code = getattr(rc, "value", rc)
                if code != 0:
                    log.warning("dstt: cudaHostRegister of the staging pool failed (error %s): copies stay pageable",
                                code)
                    break
                self._pieces.append(start)
                time.sleep(0)  # let a waiting trainer thread take the GIL and the driver's lock
            else:
                self.pinned = True
        except Exception as e:  # noqa: BLE001 - pinning is an optimization
            log.warning("dstt: could not register the staging pool with CUDA: %s", e)
        finally:
            if not self.pinned:  # stopped, failed or raised: no piece stays registered
                self._unregister_pieces()
            self.registered.set()

    def _unregister_pieces(self) -> None:
        base = self.buffer.data_ptr()
        for start in self._pieces:
            try:
                _cudart().cudaHostUnregister(base + start)
            except Exception:  # noqa: BLE001 - the mapping is going away; nothing to keep consistent
                pass
        self._pieces = []

    def unregister(self) -> None:
        """Undo :meth:`_register` (before the mapping goes away)."""
        self._stop_registering = True
        self.registered.wait()  # unbounded wait: the registering thread stops after its current piece (64 MiB)
        self.pinned = False
        if self.buffer.data_ptr():
            self._unregister_pieces()

    def copy_mode(self, view: torch.Tensor) -> str:
        """How a device-to-host copy into ``view`` (a block of this pool)
        runs: ``"pinned"`` (asynchronous), ``"pageable"`` (synchronous), or
        ``"bounce"``: the block straddles two pieces registered with CUDA
        separately, which one copy cannot target (measured on an H100:
        ``cudaErrorInvalidValue``), so it goes through a pinned buffer."""
        nbytes = view.numel() * view.element_size()
        if self._piece_bytes and nbytes:
            start = view.data_ptr() - self.buffer.data_ptr()
            if start // self._piece_bytes != (start + nbytes - 1) // self._piece_bytes:
                return "bounce"
        return "pinned" if self.pinned else "pageable"

    # -------------------------------------------------------------- reservation (reserve.py)

    @property
    def reservation(self) -> Reservation | None:
        """The reservation still under way of this pool's file (None: all reserved, or not a file)."""
        with self._cond:
            self._limit()
            return self._reservation

    def reserving(self, nbytes: int) -> bool:
        """Whether bytes of the pool are still being reserved and a block of
        ``nbytes`` fits it (one that does not fit now may once they are)."""
        r = self.reservation
        return r is not None and not r.done.is_set() and self.block_bytes(nbytes) <= self.capacity

    def _wake(self) -> None:
        """Another piece is reserved (or the reservation ended): look again."""
        with self._cond:
            self._cond.notify_all()

    def _limit(self) -> int:
        """Bytes from the start of the buffer that may be handed out: those
        reserved, or all once the reservation ended (short: the rest is
        process memory now, reserve.py) (caller holds the lock)."""
        r = self._reservation
        if r is None:
            return self.capacity
        upto = r.upto - self._base
        if upto >= self.capacity or (r.done.is_set() and r.remapped):
            self._reservation = None  # no need to look again
            return self.capacity
        return max(0, upto)

    @property
    def file_bytes(self) -> int:
        """Bytes from the start of the buffer that are the pool file's (a
        seal may name them): all but those past a reservation that ended
        short (process memory: seals.seal_record refuses a block there)."""
        r = self._reserving
        if r is None or r.error is None:
            return self.capacity
        return min(self.capacity, max(0, r.upto - self._base))

    # -------------------------------------------------------------- accounting

    @property
    def in_use(self) -> int:
        """Bytes of live blocks (padding included)."""
        with self._cond:
            return self._in_use

    def idle(self) -> bool:
        with self._cond:
            return not self._blocks

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every block is released (or the pool is retired);
        False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._blocks or self._error is not None or self.retired is not None, timeout)

    # -------------------------------------------------------------- allocation

    def _fit(self, n: int, align: int) -> int | None:
        """Start (a multiple of ``align``) of a free range of ``n`` bytes, or
        None (caller holds the lock)."""
        cap = self._limit()  # (the bytes reserved so far: reserve.py)
        if self._holes:
            return self._fit_around_holes(n, align, cap)
        if not self._blocks:
            return 0 if n <= cap else None
        tail = self._blocks[0].start
        head = _round_up(self._blocks[-1].end, align)
        if self._blocks[0].start <= self._blocks[-1].start:
            # live region is [tail, head): free space is [head, cap) then [0, tail)
            if head + n <= cap:
                return head
            return 0 if n <= tail else None
        # wrapped: live is [tail, cap) + [0, head); free is [head, tail)
        return head if head + n <= tail else None

    def _fit_around_holes(self, n: int, align: int, cap: int) -> int | None:
        """:meth:`_fit` with pinned blocks: the free ranges in ring order from
        the head, less the holes (an allocation past a hole still follows
        the head in ring order, so the live blocks stay in ring order)."""
        if not self._blocks:
            ranges = [(0, cap)]
        else:
            tail, head = self._blocks[0].start, self._blocks[-1].end
            ranges = [(head, cap), (0, tail)] if tail <= self._blocks[-1].start else [(head, tail)]
        for lo, hi in ranges:
            for a, b in self._minus_holes(lo, hi):
                start = _round_up(a, align)
                if start + n <= b:
                    return start
        return None

    def _minus_holes(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) less the holes, in order (caller holds the lock)."""
        out, at = [], lo
        for h0, h1 in sorted(self._holes):
            if h1 <= at or h0 >= hi:
                continue
            if h0 > at:
                out.append((at, h0))
            at = max(at, h1)
        if at < hi:
            out.append((at, hi))
        return out

    def _never_fits(self, nbytes: int) -> bool:
        """Whether no block of ``nbytes`` can ever be placed, even with
        every releasable block released (caller holds the lock)."""
        size = self.block_bytes(nbytes)
        return not any(_round_up(a) + size <= b for a, b in self._minus_holes(0, self.capacity))

    def pin(self, views: list[torch.Tensor]) -> None:
        """The blocks holding ``views`` are never released nor handed out
        again (a seal describes their bytes: capture/keeper.py); unlike a
        live block they do not hold back the ring's tail: allocations go
        around them."""
        ptrs = [v.data_ptr() for v in views]
        with self._cond:
            for ptr in ptrs:
                block = self._by_ptr.pop(ptr, None)
                if block is not None:
                    block.freed = True  # (for the ring's bookkeeping; its bytes stay counted in use)
                    self._holes.append((block.start, block.end))
            while self._blocks and self._blocks[0].freed:
                self._blocks.popleft()
            self._cond.notify_all()

    def block_bytes(self, nbytes: int) -> int:
        """Pool bytes a block of ``nbytes`` takes (its padding included)."""
        return _round_up(max(nbytes, 1), ALIGN)

    @staticmethod
    def blocks_bytes(sizes: list[int]) -> list[int]:
        """:meth:`block_bytes` of each of ``sizes`` (one comprehension, no
        call per block: a step may have tens of thousands).

        >>> HostPool.blocks_bytes([0, 1, 64, 65])
        [64, 64, 64, 128]
        """
        return [-(-(n or 1) // ALIGN) * ALIGN for n in sizes]

    def _place(self, nbytes: int) -> tuple[int, int] | None:
        """(start, size) for a block of ``nbytes`` now, or None if it must wait.
        Large blocks go on a page boundary (for O_DIRECT) where that fits;
        where only a 64-byte aligned place fits, that is taken: alignment
        is an optimization, never a reason to wait or refuse."""
        small = _round_up(max(nbytes, 1), ALIGN)
        if _alignment(nbytes) == PAGE:
            paged = _round_up(nbytes, PAGE)
            start = self._fit(paged, PAGE) if paged <= self.capacity else None
            if start is not None:
                return start, paged
        start = self._fit(small, ALIGN)
        return None if start is None else (start, small)

    def try_allocate(self, nbytes: int) -> torch.Tensor | None:
        """A block of ``nbytes`` if one is free now, else None (never waits)."""
        with self._cond:
            if self._error is not None:
                raise CaptureError(self._error)
            placed = self._place(nbytes)
            return None if placed is None else self._take(placed, nbytes)

    def allocate(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """A uint8 block of ``nbytes``, waiting while the pool is full."""
        block = self.allocate_within(nbytes, timeout)
        if block is None:
            raise CaptureError(f"timed out waiting {timeout} s for {nbytes} bytes of staging pool")
        return block

    def allocate_within(self, nbytes: int, timeout: float | None) -> torch.Tensor | None:
        """:meth:`allocate`, but None once ``timeout`` seconds passed without room."""
        if self.block_bytes(nbytes) > self.capacity:
            raise CaptureError(f"a {nbytes}-byte chunk does not fit the {self.capacity}-byte staging pool")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise CaptureError(self._error)
                placed = self._place(nbytes)
                if placed is not None:
                    return self._take(placed, nbytes)
                if self._holes and self._never_fits(nbytes):
                    raise CaptureError(f"a {nbytes}-byte chunk no longer fits the staging pool around the bytes "
                                       f"kept for seals ({self.retired})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)  # (woken by every release)

    def _take(self, placed: tuple[int, int], nbytes: int) -> torch.Tensor:
        """Record a block at ``placed`` (caller holds the lock)."""
        start, n = placed
        block = Block(start, n)
        self._blocks.append(block)
        self._in_use += n
        view = self.buffer[start : start + nbytes]
        self._by_ptr[view.data_ptr()] = block
        return view

    def try_allocate_parts(self, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Adjacent blocks of ``numels`` elements of ``dtype`` (each > 0),
        placed at once, as flat views; None if there is no room now (never
        waits). Each is a block of its own (released on its own), so a
        release can never free a later allocation at the same address.

        >>> pool = HostPool(1 << 12)
        >>> a, b = pool.try_allocate_parts([3, 5], torch.float32)
        >>> b.data_ptr() - a.data_ptr(), pool.in_use >= 32
        (12, True)
        >>> pool.release(a); pool.release(b); pool.in_use
        0
        """
        itemsize = torch.empty(0, dtype=dtype).element_size()
        total = sum(numels) * itemsize
        with self._cond:
            if self._error is not None:
                raise CaptureError(self._error)
            placed = self._place(total)
            if placed is None:
                return None
            start, taken = placed
            parts = list(self.buffer[start:start + total].view(dtype).split_with_sizes(numels))
            off = start
            last = len(numels) - 1
            for k, (n, part) in enumerate(zip(numels, parts)):
                nbytes = n * itemsize
                block = Block(off, nbytes if k < last else start + taken - off)  # the last takes the padding
                self._blocks.append(block)
                self._by_ptr[part.data_ptr()] = block
                off += nbytes
            self._in_use += taken
            return parts

    def stage(self, src: torch.Tensor) -> torch.Tensor:
        """Synchronously copy a CPU tensor into a new block (returned as ``src``'s
        dtype and shape)."""
        # unbounded wait: a synchronous helper (tests); the capture's copies wait in Stager._allocate (bounded)
        dst = self.view_as(self.allocate(src.numel() * src.element_size()), src)
        dst.copy_(src)
        return dst

    @staticmethod
    def view_as(block: torch.Tensor, like: torch.Tensor | Any, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """``block`` reinterpreted with ``like``'s dtype and ``shape`` (default: like's)."""
        dtype = like.dtype
        shape = tuple(like.shape) if shape is None else shape
        return block.view(dtype).view(shape)

    def release(self, t: torch.Tensor) -> None:
        """Return the block holding ``t`` (any view starting at the block)."""
        with self._cond:
            block = self._by_ptr.pop(t.data_ptr(), None)
            if block is None:
                return  # an empty tensor, or a double release: nothing to free
            block.freed = True
            self._in_use -= block.nbytes
            while self._blocks and self._blocks[0].freed:
                self._blocks.popleft()
            self._cond.notify_all()

    def release_many(self, views: list[torch.Tensor]) -> None:
        """:meth:`release` each of ``views``, under one lock and with one
        wake-up (a committed step's blocks go back at once).

        >>> pool = HostPool(1 << 12)
        >>> parts = pool.try_allocate_parts([3, 5], torch.float32)
        >>> pool.release_many(parts); pool.in_use
        0
        """
        ptrs = [v.data_ptr() for v in views]
        with self._cond:
            for ptr in ptrs:
                block = self._by_ptr.pop(ptr, None)
                if block is not None:
                    block.freed = True
                    self._in_use -= block.nbytes
            while self._blocks and self._blocks[0].freed:
                self._blocks.popleft()
            self._cond.notify_all()

    def retire(self, why: str) -> None:
        """Some blocks will never be released (:meth:`pin`): no new step is
        staged here (the Capture makes another pool, with all its room);
        the steps already in it go on."""
        with self._cond:
            self.retired = why
            self._cond.notify_all()

    def abort(self, message: str) -> None:
        """Wake every waiter with ``message`` as a CaptureError."""
        with self._cond:
            self._error = message
            self._cond.notify_all()


class SlotPool:
    """``nslots`` slots of ``slot_bytes`` in one host buffer, handed out whole
    and returned in any order (a ring allocator would wait for the oldest
    step, and the oldest may be the one being written).

    >>> master = HostPool(4 * 8192)
    >>> pool = SlotPool(master, 8192)
    >>> a = pool.acquire(); b = pool.acquire()
    >>> pool.free_slots, a.capacity
    (2, 8192)
    >>> pool.release(a); pool.free_slots
    3
    """

    def __init__(self, master: HostPool, slot_bytes: int) -> None:
        if slot_bytes % PAGE or slot_bytes <= 0:
            raise CaptureError(f"slot size {slot_bytes} is not a positive multiple of {PAGE}")
        self.master = master
        self.slot_bytes = slot_bytes
        self.nslots = master.capacity // slot_bytes
        self._free = list(range(self.nslots))[::-1]
        self._cond = threading.Condition()
        self._extra: dict[int, torch.Tensor] = {}  # slots in process memory replacing retired ones (retire)

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> HostPool | None:
        """A free slot (a HostPool over it), waiting while none is free (at
        most ``timeout`` s: then None)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                return None
            i = self._free.pop()
            extra = self._extra.get(i)
        buf = self.master.buffer[i * self.slot_bytes:(i + 1) * self.slot_bytes] if extra is None else extra
        reserving = self.master.reservation if extra is None else None  # (a slot not reserved yet waits for it)
        slot = HostPool(self.slot_bytes, buffer=buf, reservation=reserving, base=i * self.slot_bytes)
        slot.pinned = self.master.pinned and extra is None
        slot.slot_index = i
        slot.ring_name = self.master.ring_name if extra is None else None  # (a step in it can be sealed)
        return slot

    def retire(self, slot: HostPool) -> None:
        """``slot`` is never handed out again: a seal that could be neither
        removed nor rewritten describes its bytes (capture/keeper.py). A
        slot in process memory takes its place, so the tier keeps its size
        (the keeper stops sealing at the first such seal: this happens at
        most once per slot sealed then)."""
        raw = torch.empty(self.slot_bytes + PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE
        with self._cond:
            i = self.nslots + len(self._extra)
            while i in self._extra:
                i += 1
            self._extra[i] = raw[skip:skip + self.slot_bytes]
            self._free.append(i)
            self._cond.notify_all()

    def release(self, slot: HostPool) -> None:
        with self._cond:
            self._free.append(slot.slot_index)
            self._cond.notify_all()

    def wait_free(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a free slot; whether one is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._free), timeout)

    def wait_all_free(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._free) == self.nslots, timeout)
