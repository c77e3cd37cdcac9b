"""Point-to-point transport of redundancy blocks (issue 26): the capture
helpers of a run (or the ranks of a recovery) form a gloo process group of
their own and send each block straight from its sender to its holder,
never through the job's rendezvous server.

The group: a ``ProcessGroupGloo`` built directly on a ``PrefixStore`` of
the job's c10d store (``MASTER_ADDR:MASTER_PORT`` or
``DSTT_REDUNDANCY_STORE``) under a prefix of the run -- never the
trainer's default group, never ``init_process_group``: nothing of
``torch.distributed``'s globals is touched (it is an object of its own,
dropped when closed). Forming it is collective over every rank of the run
and bounded by its timeout.

A block on the wire: a fixed-size header (``HEADER_BYTES``: magic, the
payload's length and CRC-32C, the key, the header's own CRC-32C) then the
payload, as uint8 tensors (gloo ``send``/``recv``, tags of their own). The
store holds only a doorbell per holder (``bell/<rank>``: how many blocks
were sent to it; a gloo receive is only posted once one is due, because a
gloo wait that times out closes the group). A payload whose CRC does not
match is delivered empty (torn: refused by its frame, as the store
mailbox's missing part is). Both directions run on threads of their own:
the helper's loop never waits on a peer.

Every wait is bounded (the group's timeout, ``timeout_s``); a peer that
dies mid-send, a torn header or a wait that times out fail the transport:
every later call raises :class:`TransportError` (the guard then turns
redundancy off for this helper, with one warning).
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
from datetime import timedelta
from typing import Any

from dstt.format.codecs.spec import crc32c

log = logging.getLogger("dstt.capture")

#: Bytes of a block's header on the wire.
HEADER_BYTES = 256
MAGIC = b"DSTTP2P1"
_HEAD = struct.Struct("<8sQIIH")  # magic, length, CRC-32C of the payload, sender, key length (the key; CRC last)
_CRC = struct.Struct("<I")
#: The longest key a header carries.
MAX_KEY_BYTES = HEADER_BYTES - _HEAD.size - _CRC.size
#: The largest block (a step image of one rank).
MAX_BLOCK_BYTES = 64 << 30
#: Bytes received and not yet taken, at most (more: the transport fails rather than grow).
MAX_INBOX_BYTES = 64 << 30
#: How often a receiver looks at its doorbell after a block (seconds), and at most when idle.
POLL_S = 0.005
IDLE_POLL_S = 0.05
#: How long close() waits for the queued sends and the threads (seconds).
CLOSE_S = 5.0
TAG_HEAD, TAG_BODY = 0x6473, 0x6474


class TransportError(ConnectionError):
    """The point-to-point transport failed (a peer died, a wait timed out,
    a header was torn); it is unusable from then on."""


def pack_header(key: str, data: bytes, src: int = 0) -> bytes:
    """The header of ``data`` sent under ``key`` by rank ``src``."""
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"key {key[:60]!r}... longer than {MAX_KEY_BYTES} bytes")
    if len(data) > MAX_BLOCK_BYTES:
        raise ValueError(f"block of {len(data)} bytes over {MAX_BLOCK_BYTES}")
    body = (_HEAD.pack(MAGIC, len(data), crc32c(data), src, len(raw)) + raw).ljust(HEADER_BYTES - _CRC.size, b"\0")
    return body + _CRC.pack(crc32c(body))


def parse_header(head: bytes) -> tuple[str, int, int, int]:
    """``(key, payload length, payload CRC-32C, sender)`` of a header;
    TransportError if it is not one (torn, or not ours)."""
    if len(head) != HEADER_BYTES:
        raise TransportError(f"a block header of {len(head)} bytes")
    body, (crc,) = head[:-_CRC.size], _CRC.unpack(head[-_CRC.size:])
    if crc32c(body) != crc:
        raise TransportError("a block header failed its CRC (torn)")
    magic, length, data_crc, src, n = _HEAD.unpack_from(body)
    if magic != MAGIC or n > MAX_KEY_BYTES or length > MAX_BLOCK_BYTES:
        raise TransportError("a block header is not dstt's")
    return body[_HEAD.size:_HEAD.size + n].decode(errors="replace"), length, data_crc, src


class Transport:
    """The wire between the ranks of one group (see the module docstring).

    ``addr``: the c10d store's ``(host, port)``; ``prefix``: the run's
    prefix in it (the group's rendezvous and doorbells live under it);
    ``rank`` of ``world``: this process's place. Collective: returns once
    every rank joined (TransportError after ``timeout_s``)."""

    def __init__(self, addr: tuple[str, int], prefix: str, rank: int, world: int, timeout_s: float) -> None:
        import torch  # noqa: F401 - (the c10d classes below need torch loaded)
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        try:
            client = TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
            self._store = PrefixStore(f"{prefix}p2p/", client)
            self._pg: Any = ProcessGroupGloo(PrefixStore("pg", self._store), rank, world, timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001 - one error class for the caller to fall back on
            raise TransportError(f"the point-to-point group of {world} ranks did not form: "
                                 f"{type(e).__name__}: {str(e)[:300]}") from e
        self._lock = threading.Lock()  # (the store client, shared by the two threads)
        self._inbox: dict[str, bytes] = {}
        self._inbox_bytes = 0
        self._box_lock = threading.Lock()
        self._out: queue.Queue[tuple[int, bytes, bytes] | None] = queue.Queue()  # (to, header, payload)
        self._stop = threading.Event()
        self.failed: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.received = 0  # (blocks)
        self._threads = [threading.Thread(target=self._guarded, args=(self._send_loop, "sending"),
                                          name="dstt-p2p-send", daemon=True),
                         threading.Thread(target=self._guarded, args=(self._recv_loop, "receiving"),
                                          name="dstt-p2p-recv", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ the interface

    def check(self) -> None:
        """Raise TransportError if the transport failed."""
        if self.failed is not None:
            raise TransportError(self.failed)

    def send(self, dst: int, key: str, data: bytes) -> None:
        """Queue ``data`` for rank ``dst`` under ``key`` (sent on the
        transport's own thread, in order)."""
        self.check()
        if not 0 <= dst < self.world or dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to rank {dst} of {self.world}")
        head = pack_header(key, data, self.rank)  # (refused here, not on the thread)
        self._out.put((dst, head, data if isinstance(data, bytes) else bytes(data)))

    def take(self, key: str) -> bytes | None:
        """The block received under ``key`` (taken out), None if not (yet)."""
        self.check()
        with self._box_lock:
            data = self._inbox.pop(key, None)
            if data is not None:
                self._inbox_bytes -= len(data)
        return data

    def pending(self) -> int:
        """Blocks queued, not yet handed to the wire."""
        return self._out.qsize()

    def close(self, drain: bool = True) -> None:
        """Stop (``drain``: after the queued blocks are sent, within CLOSE_S);
        never waits longer than that for a peer."""
        self._out.put(None)
        if not drain:
            self._stop.set()
        self._threads[0].join(CLOSE_S)
        self._stop.set()
        self._threads[1].join(CLOSE_S)
        if not any(t.is_alive() for t in self._threads):
            self._pg = None  # (freed now, not at the interpreter's exit)
        # (a thread still inside a gloo wait ends with its timeout: it is a daemon, holding the group and its tensors)

    # ------------------------------------------------------------ the threads

    def _guarded(self, loop: Any, what: str) -> None:
        try:
            loop()
        except Exception as e:  # noqa: BLE001 - the transport fails; the caller says so once
            if not self._stop.is_set() and self.failed is None:
                self.failed = f"{what} blocks: {type(e).__name__}: {str(e)[:300]}"
            self._stop.set()

    def _send_loop(self) -> None:
        import torch

        while not self._stop.is_set():
            try:
                item = self._out.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            if item is None or self._stop.is_set():
                return
            dst, head, data = item
            with self._lock:
                self._store.add(f"bell/{dst}", 1)  # (the holder posts its receive: one block is due)
            works = [self._pg.send([torch.frombuffer(bytearray(head), dtype=torch.uint8)], dst, TAG_HEAD)]
            if data:
                works.append(self._pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, TAG_BODY))
            for w in works:
                w.wait()  # bounded: the group's timeout
            self.bytes_sent += len(data)

    def _recv_loop(self) -> None:
        got, idle = 0, POLL_S
        while not self._stop.is_set():
            with self._lock:
                due = int(self._store.add(f"bell/{self.rank}", 0))
            if due <= got:
                self._stop.wait(idle)
                idle = min(idle * 2, IDLE_POLL_S)  # (an idle holder asks the store less often)
                continue
            idle = POLL_S
            while got < due and not self._stop.is_set():
                self._receive_one()
                got += 1

    def _receive_one(self) -> None:
        import torch

        head = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self._pg.recv_anysource([head], TAG_HEAD).wait()  # bounded: the group's timeout
        key, length, crc, src = parse_header(head.numpy().tobytes())
        if not 0 <= src < self.world or src == self.rank:
            raise TransportError(f"a block header names rank {src} as its sender")
        data = b""
        if length:
            body = torch.empty(length, dtype=torch.uint8)
            self._pg.recv([body], src, TAG_BODY).wait()  # bounded: the group's timeout
            data = body.numpy().tobytes()
        if crc32c(data) != crc:
            log.warning("dstt: the block %s from rank %d arrived torn (its CRC-32C differs): refused", key, src)
            data = b""  # (a torn block: its frame refuses it)
        with self._box_lock:
            old = self._inbox.pop(key, None)
            self._inbox_bytes += len(data) - (len(old) if old is not None else 0)
            if self._inbox_bytes > MAX_INBOX_BYTES:
                raise TransportError(f"more than {MAX_INBOX_BYTES} bytes received and not taken")
            self._inbox[key] = data
        self.bytes_received += len(data)
        self.received += 1


class P2PBox:
    """A mailbox whose blocks go point to point: the small control records
    (``put``/``peek``/``take``: node, ack, low, done) through ``mailbox``
    (the store), the blocks (:meth:`send_block`, :meth:`take_block`)
    through ``wire``."""

    def __init__(self, mailbox: Any, wire: Transport) -> None:
        self.mailbox, self.wire = mailbox, wire

    def put(self, key: str, data: bytes) -> None:
        self.mailbox.put(key, data)

    def peek(self, key: str) -> bytes | None:
        return self.mailbox.peek(key)  # type: ignore[no-any-return]

    def take(self, key: str) -> bytes | None:
        return self.mailbox.take(key)  # type: ignore[no-any-return]

    def send_block(self, dst: int, key: str, data: bytes) -> None:
        self.wire.send(dst, key, data)

    def take_block(self, key: str) -> bytes | None:
        return self.wire.take(key)

    def check(self) -> None:
        self.wire.check()

    @property
    def failed(self) -> str | None:
        return self.wire.failed

    def close(self, drain: bool = True) -> None:
        self.wire.close(drain)


__all__ = ["HEADER_BYTES", "P2PBox", "Transport", "TransportError", "pack_header", "parse_header"]
