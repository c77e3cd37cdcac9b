"""Peer redundancy in the capture helpers (issue 26): each helper copies
the steps its memory tier holds to its partner node's helper, which keeps
them in its own node-local memory directory, and says which steps are
protected (acknowledged copies) in the store.

Runs entirely in the helpers: the trainer only seals. Blocks (a rank's
n-th framed step image, dstt.format.redundancy.frame, under
``blk/<rank>/<n>``) go point to point from sender to holder over a gloo
group of the run's helpers (capture/transport.py: its own rendezvous
under the run's prefix of the job's c10d store, ``MASTER_ADDR:MASTER_PORT``
or ``DSTT_REDUNDANCY_STORE``). The store keeps only the small control
records, under a prefix of the run: ``node/<rank>`` (each helper's node),
``ack/<rank>/<step>`` (its holder kept it), ``low/<rank>`` (the oldest
step a rank still holds: older copies are dropped), and the transport's
doorbells. Where the group cannot form (said once), or with
``DSTT_REDUNDANCY_TRANSPORT=store``, the store itself is the mailbox of
the blocks too (:class:`Mailbox`: in parts of 4 MiB under
``blk/<rank>/<n>/<i>``, taken out by the holder). Every call is bounded;
one that fails turns redundancy off for this helper with one warning (its
steps count as unprotected), never stops the tier. At most
:data:`MAX_INFLIGHT` blocks of a rank are unacknowledged.

Copies live under ``<DSTT_SHM_DIR or /dev/shm>/dstt-<uid>-copies/<group>/
<run>/rank-<r>/step-<step>.blk``, framed, written atomically; recovery
(capture/nodeloss.py) rebuilds a lost rank's ring from them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from dstt import knobs
from dstt.capture import ringowner as O
from dstt.capture import stepimage, transport
from dstt.format import redundancy as RD
from dstt.format.layout import step_ranges

log = logging.getLogger("dstt.capture")

#: Framed blocks of one rank in the mailbox, not yet taken by its holder.
MAX_INFLIGHT = 4
#: Seconds every mailbox call may take, and the node exchange at the start.
STORE_TIMEOUT_S = 30.0
#: A block is posted in parts of this many bytes (the TCPStore's limit is 8 MiB a value).
PART_BYTES = 4 << 20
#: Parts a block may have (64 GiB).
MAX_PARTS = 1 << 14
#: How often the mailbox is looked at (seconds).
POLL_S = 0.005
#: How often the protection record is rewritten at most (seconds).
PUBLISH_S = 0.5
_BLK_RE = re.compile(r"step-([0-9]{20})\.blk")


def copies_root(base: Path | None = None) -> Path:
    return O.shm_base(base) / f"dstt-{os.getuid()}-copies"


def copies_group(store_url: str, branch: str, base: Path | None = None) -> Path:
    return copies_root(base) / hashlib.sha256(f"{store_url}\0{branch}".encode()).hexdigest()[:24]


class Mailbox:
    """The TCPStore the helpers exchange blocks through (bounded calls)."""

    def __init__(self, addr: tuple[str, int], run: str, timeout_s: float = STORE_TIMEOUT_S) -> None:
        from torch._C._distributed_c10d import TCPStore
        from torch.distributed import distributed_c10d as c10d

        store = TCPStore(addr[0], addr[1], is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        self.store = c10d.PrefixStore(f"dstt-redundancy/{run}/", store)

    def put(self, key: str, data: bytes) -> None:
        self.store.set(key, data)  # type: ignore[arg-type]  # (bytes are taken as they are)

    def peek(self, key: str) -> bytes | None:
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def take(self, key: str) -> bytes | None:
        data = self.peek(key)
        if data is not None:
            self.store.delete_key(key)
        return data


def post_block(box: Any, key: str, data: bytes, dst: int | None = None) -> None:
    """Send ``data`` under ``key`` to rank ``dst``: point to point where
    ``box`` is a :class:`~dstt.capture.transport.P2PBox` (queued: sent on
    its thread); else (or without ``dst``) through the store, in parts of
    at most PART_BYTES (the TCPStore refuses a value over 8 MiB), the part
    count last: a block is whole once its count is there."""
    if hasattr(box, "send_block"):
        if dst is not None:
            box.send_block(dst, key, data)
            return
        _through_store_once(key)
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
    for i, part in enumerate(parts):
        box.put(f"{key}/{i}", part)
    box.put(key, str(len(parts)).encode())


def take_block(box: Any, key: str) -> bytes | None:
    """The block sent under ``key`` (taken out), None if not there yet --
    from the point-to-point transport where ``box`` has one, else (or not
    there) from the store; a part missing or a payload torn on the wire
    reads as a torn block (refused by its frame)."""
    if hasattr(box, "take_block"):
        data: bytes | None = box.take_block(key)
        if data is not None:
            return data
    count = box.take(key)
    if count is None:
        return None
    n = int(count) if count.isdigit() and int(count) <= MAX_PARTS else 0
    return b"".join(box.take(f"{key}/{i}") or b"" for i in range(n))


_warned: set[str] = set()


def _through_store_once(key: str) -> None:
    kind = key.split("/", 1)[0]
    if kind not in _warned:
        _warned.add(kind)
        log.warning("dstt: blocks %r are posted without their destination: they go through the job's store", kind)


def open_box(addr: tuple[str, int], run: str, rank: int, world: int, timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """The mailbox of ``run``'s ``world`` ranks (collective: every rank of
    the run calls it): a P2PBox (blocks point to point over a gloo group of
    their own, control records in the store); the store alone
    (:class:`Mailbox`) with ``DSTT_REDUNDANCY_TRANSPORT=store`` or where the
    group does not form within ``timeout_s`` (said once)."""
    box = Mailbox(addr, run, timeout_s)
    if knobs.redundancy_transport() == "store":
        return box
    try:
        return transport.P2PBox(box, transport.Transport(addr, f"dstt-redundancy/{run}/", rank, world, timeout_s))
    except transport.TransportError as e:
        log.warning("dstt (rank %d): %s; redundancy blocks go through the job's store instead (it holds them in "
                    "memory until taken)", rank, e)
        return box


class PeerGuard:
    """One helper's part of ``redundancy="pair"`` (see the module docstring).

    ``ops``: the helper's HelperOps (its held steps' plans and seal
    records, its ring); ``writer``: its Writer (store, branch)."""

    def __init__(self, scheme: RD.Scheme, run: str, rank: int, world: int, ops: Any, writer: Any,
                 mailbox: Any) -> None:
        """``mailbox``: a Mailbox, or a function making one -- then called on a
        thread of its own (connecting never holds up the helper's loop: the
        guard does nothing until it is connected)."""
        self.scheme, self.run, self.rank, self.world, self.ops, self.writer = scheme, run, rank, world, ops, writer
        self.box: Any = None if callable(mailbox) else mailbox
        if callable(mailbox):
            import threading

            threading.Thread(target=self._connect, args=(mailbox,), name="dstt-redundancy-connect",
                             daemon=True).start()
        self.branch_id = int(writer.branch.id)
        self.nodes: list[int] | None = None
        self.holder: int | None = None  # the rank keeping this rank's copies
        self.sources: list[int] = []  # the ranks whose copies this rank keeps
        self.last_sent = -1
        self.pending: set[int] = set()  # sent, not answered yet
        self.acked: set[int] = set()
        self.next_out = 0
        self.next_in: dict[int, int] = {}
        self.last_in: dict[int, int] = {}
        self.low_sent = -1
        self.failed: str | None = None
        self.node_name = knobs.node_id()
        self.dir = copies_group(str(writer.backend.url), writer.branch.name) / run
        self._next_poll = 0.0
        self._next_publish = 0.0
        self._published: list[tuple[int, int]] | None = None
        self._owner: dict[str, Any] | None = None
        self.bytes_sent = 0
        self._asked_nodes = False

    # ------------------------------------------------------------ the loop

    def pump(self, held: list[int], force: bool = False) -> bool:
        """Send held steps not sent yet, take blocks for this rank to keep,
        read acknowledgements; whether anything was done."""
        if self.failed is not None or self.box is None:
            return False
        now = time.monotonic()
        if not force and now < self._next_poll and not (held and held[-1] > self.last_sent):
            return False
        self._next_poll = now + POLL_S
        try:
            if self.nodes is None and not self._place():
                return False
            did = self._receive()
            did = self._send(held) or did
            did = self._acks() or did
            self._publish(held, force)
            return did
        except Exception as e:  # noqa: BLE001 - redundancy off, the tier goes on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("dstt helper (rank %d): peer redundancy off: %s (its steps are unprotected)",
                        self.rank, self.failed)
            return False

    def close(self, clean: bool) -> None:
        """The tier closed (``clean``: the trainer's close; its copies of the
        others are no longer needed) or the trainer died (kept)."""
        self.pump([], force=True)
        self.close_box(clean)
        if clean:
            _remove_tree(self.dir)

    def close_box(self, clean: bool) -> None:
        """Stop the transport (the queued blocks sent first unless ``clean``: nobody needs them then)."""
        close = getattr(self.box, "close", None)
        if close is not None:
            close(drain=not clean)

    # ------------------------------------------------------------ internals

    def _connect(self, make: Any) -> None:
        try:
            self.box = make()
        except Exception as e:  # noqa: BLE001 - unprotected, said once; the tier runs
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("dstt helper (rank %d): peer redundancy off: %s (its steps are unprotected)", self.rank,
                        self.failed)

    def _learn_nodes(self) -> list[int] | None:
        """Every helper's node id, by rank (bounded: STORE_TIMEOUT_S at
        most); None while some have not said it yet."""
        if not self._asked_nodes:
            self.box.put(f"node/{self.rank}", self.node_name.encode())
            self._asked_nodes = True
            self._deadline = time.monotonic() + STORE_TIMEOUT_S
        names = [self.box.peek(f"node/{r}") for r in range(self.world)]
        if any(n is None for n in names):
            if time.monotonic() > self._deadline:
                raise TimeoutError(f"not every rank's helper said its node within {STORE_TIMEOUT_S:.0f} s")
            return None
        return RD.node_ids([bytes(n or b"").decode(errors="replace") for n in names])

    def _place(self) -> bool:
        """Learn every helper's node, then this rank's holder and sources."""
        nodes = self._learn_nodes()
        if nodes is None:
            return False
        self.nodes = nodes
        n_nodes = max(self.nodes) + 1
        self.holder = self._holder_of(self.rank, n_nodes)
        self.sources = [r for r in range(self.world) if r != self.rank and self._holder_of(r, n_nodes) == self.rank]
        self.next_in = {s: 0 for s in self.sources}
        if self.holder is None:
            log.warning("dstt helper (rank %d): redundancy=%r needs at least 2 nodes; this job runs on 1: its "
                        "steps are unprotected", self.rank, str(self.scheme))
        return True

    def _holder_of(self, rank: int, n_nodes: int) -> int | None:
        assert self.nodes is not None
        if n_nodes < 2:
            return None
        node = self.nodes[rank]
        mine = [r for r in range(self.world) if self.nodes[r] == node]
        target = [r for r in range(self.world) if self.nodes[r] == RD.partner(node, n_nodes)]
        return target[mine.index(rank) % len(target)]

    def _send(self, held: list[int]) -> bool:
        """Post the images of the held steps not sent yet (at most
        MAX_INFLIGHT unacknowledged), then publish the lowest step held."""
        if not self._sends():
            return False
        did = False
        for step in held:
            if step <= self.last_sent:
                continue
            if len(self.pending) >= MAX_INFLIGHT:
                break
            entry = self.ops.steps.get(step)
            if entry is None:
                continue  # (it left the tier already: unprotected)
            plan, record = entry
            self._post(step, stepimage.image(record, plan, self.ops.pools[record["pool"]], self._ring_owner()))
            self.pending.add(step)
            self.last_sent = step
            did = True
        low = min(held) if held else self.last_sent + 1
        if low > self.low_sent:
            self.box.put(f"low/{self.rank}", str(low).encode())
            self.low_sent = low
        return did

    def _sends(self) -> bool:
        """Whether this rank sends its steps anywhere (it has a holder)."""
        return self.holder is not None

    def _post(self, step: int, image: bytes) -> None:
        """Send ``step``'s image to its holder (framed)."""
        data = RD.frame(image, run=self.run, branch_id=self.branch_id, step=step, rank=self.rank)
        post_block(self.box, f"blk/{self.rank}/{self.next_out}", data, dst=self.holder)
        self.bytes_sent += len(data)
        self.next_out += 1

    def _ring_owner(self) -> dict[str, Any]:
        if self._owner is None:
            import json

            self._owner = json.loads(O.read_regular(self.ops.ring_dir / O.OWNER_FILE, O.OWNER_MAX_BYTES))
        return self._owner

    def _acks(self) -> bool:
        did = False
        for step in sorted(self.pending):
            answer = self.box.take(f"ack/{self.rank}/{step}")
            if answer is None:
                continue
            did = True
            self.pending.discard(step)
            if answer == b"ok":
                self.acked.add(step)
            else:
                log.warning("dstt helper (rank %d): step %d's copy was refused by rank %s: %s", self.rank, step,
                            self.holder, answer[:200].decode(errors="replace"))
        self.acked = {s for s in self.acked if s >= self.low_sent}  # (what left the tier: forgotten)
        return did

    def _receive(self) -> bool:
        did = False
        for src in self.sources:
            data = take_block(self.box, f"blk/{src}/{self.next_in[src]}")
            if data is None:
                self._drop_below(src)
                continue
            self.next_in[src] += 1
            did = True
            try:
                head, _ = RD.read_head(data)
                if head.step <= self.last_in.get(src, -1):
                    raise RD.BlockError(f"step {head.step} after step {self.last_in[src]}")
                RD.unframe(data, run=self.run, branch_id=self.branch_id, step=head.step, rank=src)
            except RD.BlockError as e:
                log.warning("dstt helper (rank %d): a block of rank %d refused: %s", self.rank, src, e)
                continue
            self.last_in[src] = head.step
            where = self.dir / f"rank-{src}"
            try:
                for d in (copies_root(), where.parents[1], where.parent, where):
                    O.make_private(d)
                O.write_atomic(where / f"step-{head.step:020d}.blk", data)
                answer = b"ok"
            except OSError as e:
                answer = f"not kept: {e}".encode()
            self.box.put(f"ack/{src}/{head.step}", answer)
            self._drop_below(src)
        return did

    def _drop_below(self, src: int) -> None:
        low = self.box.peek(f"low/{src}")
        if low is None or not low.isdigit():
            return
        where = self.dir / f"rank-{src}"
        try:
            names = os.listdir(where)
        except OSError:
            return
        for name in names:
            m = _BLK_RE.fullmatch(name)
            if m and int(m.group(1)) < int(low):
                try:
                    os.unlink(where / name)
                except OSError:
                    pass

    def _publish(self, held: list[int], force: bool) -> None:
        ranges = step_ranges(sorted(s for s in held if s in self.acked))
        now = time.monotonic()
        if ranges == self._published or (not force and now < self._next_publish):
            return
        self._next_publish = now + PUBLISH_S
        self._published = ranges
        try:
            RD.write_protected(self.writer.backend, RD.Protected(
                self.writer.branch.name, self.run, self.rank, self.world,
                0 if self.nodes is None else self.nodes[self.rank], str(self.scheme), tuple(ranges)))
        except OSError as e:
            log.warning("dstt helper (rank %d): could not record the protected steps: %s", self.rank, e)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    for parent in (path.parent, path.parent.parent):
        try:
            parent.rmdir()
        except OSError:
            break


def start(tier_args: dict[str, Any], records: Any, writer: Any, ops: Any,
          kind: type[PeerGuard] | None = None) -> PeerGuard | None:
    """The guard of this helper (``kind``: a PeerGuard's subclass), if
    ``tier_args`` asks for redundancy under torch.distributed; None (with a
    warning) where it cannot run."""
    text = tier_args.get("redundancy")
    if not text or text == "none" or records is None:
        return None
    scheme = RD.parse_scheme(text)
    try:
        addr = knobs.redundancy_store()
        if addr is None:
            raise OSError("no MASTER_ADDR/MASTER_PORT or DSTT_REDUNDANCY_STORE to meet the other helpers at")
    except Exception as e:  # noqa: BLE001 - unprotected, said once; the tier runs
        log.warning("dstt helper (rank %d): peer redundancy off: %s", records.rank, e)
        return None
    run = str(tier_args["run"])
    rank, world = records.rank, records.world
    return (kind or PeerGuard)(scheme, run, rank, world, ops, writer, lambda: open_box(addr, run, rank, world))


__all__ = ["MAX_INFLIGHT", "Mailbox", "PeerGuard", "copies_group", "copies_root", "open_box", "post_block", "start",
           "take_block"]
