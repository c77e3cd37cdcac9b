"""The point-to-point transport of redundancy blocks (issue 26,
capture/transport.py): two ranks form a gloo group of their own on
127.0.0.1 (its rendezvous under a prefix of a real c10d TCPStore); blocks
of several MiB arrive intact while the store holds none of their bytes
(the store mailbox, for contrast, holds them all); a torn frame is refused;
a peer SIGKILLed in the middle of a send fails the transport within its
timeout -- the guard turns redundancy off with one warning, never hangs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dstt import knobs
from dstt.capture import peerguard
from dstt.capture import transport as T
from dstt.format import redundancy as RD


@pytest.fixture
def server() -> Any:
    from torch._C._distributed_c10d import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def pair_of_boxes(port: int, run: str, timeout_s: float = 10.0) -> list[Any]:
    """``open_box`` of ranks 0 and 1 (collective: on two threads)."""
    boxes: list[Any] = [None, None]

    def one(rank: int) -> None:
        boxes[rank] = peerguard.open_box(("127.0.0.1", port), run, rank, 2, timeout_s)

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return boxes


def held_in_store(server: Any) -> tuple[int, int]:
    """(the largest value, all values' bytes) the store server holds."""
    sizes = [len(server.get(k)) for k in server.list_keys()]
    return max(sizes, default=0), sum(sizes)


@pytest.mark.parametrize("how", ["p2p", "store"])
def test_blocks_of_several_mib_arrive_intact_and_the_store_holds_none(server: Any, how: str) -> None:
    blocks = {"blk/0/0": os.urandom(6 << 20), "blk/0/1": os.urandom(9 << 20) + b"x", "blk/0/2": b""}
    with knobs.override(DSTT_REDUNDANCY_TRANSPORT=how):
        sender, holder = pair_of_boxes(server.port, "run1")
    try:
        assert isinstance(sender, T.P2PBox) == (how == "p2p")
        for key, data in blocks.items():
            peerguard.post_block(sender, key, data, dst=1)
        deadline = time.monotonic() + 20  # every block received by the holder (or the store), not yet taken
        while time.monotonic() < deadline and not (holder.wire.received == len(blocks) if how == "p2p" else
                                                   server.check(["dstt-redundancy/run1//blk/0/2"])):
            time.sleep(0.01)
        largest, total = held_in_store(server)
        if how == "p2p":  # doorbells and the group's rendezvous only
            assert largest < 1024 and total < 16 << 10, (largest, total)
        else:  # the mailbox holds every byte until taken
            assert largest == peerguard.PART_BYTES and total >= (15 << 20), (largest, total)
        for key, data in blocks.items():
            assert peerguard.take_block(holder, key) == data
            assert peerguard.take_block(holder, key) is None
        assert held_in_store(server)[0] < 1024
    finally:
        for box in (sender, holder):
            getattr(box, "close", lambda: None)()


def test_a_torn_block_is_refused(server: Any, monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    """A frame torn before it is sent is refused by its frame's CRC; a payload
    torn on the wire (its transport CRC differs) arrives empty: refused too."""
    sender, holder = pair_of_boxes(server.port, "run2")
    try:
        good = RD.frame(os.urandom(3 << 20), run="run2", branch_id=1, step=4, rank=0)
        torn = bytearray(good)
        torn[len(torn) // 2] ^= 0x01
        peerguard.post_block(sender, "blk/0/0", bytes(torn), dst=1)
        got = [wait_take(holder, "blk/0/0")]
        real = T.pack_header
        monkeypatch.setattr(T, "pack_header", lambda key, data, src=0: real(key, good, src))  # (the CRC of other bytes)
        peerguard.post_block(sender, "blk/0/1", good[:-1] + b"?", dst=1)
        got.append(wait_take(holder, "blk/0/1"))
        assert got[0] == bytes(torn) and got[1] == b""
        for data in got:
            with pytest.raises(RD.BlockError, match="CRC|torn|short|header"):
                RD.unframe(data, run="run2", branch_id=1, step=4, rank=0)
        assert "arrived torn" in caplog.text
        sender.wire.check()  # (a torn payload fails nothing: the next block goes through)
        monkeypatch.setattr(T, "pack_header", real)
        peerguard.post_block(sender, "blk/0/2", good, dst=1)
        assert wait_take(holder, "blk/0/2") == good
    finally:
        sender.close()
        holder.close()


def wait_take(box: Any, key: str, timeout_s: float = 20) -> bytes | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = peerguard.take_block(box, key)
        if data is not None:
            return data
        time.sleep(0.01)
    return None


PEER = """
import os, signal, sys, torch
from dstt.capture import peerguard, transport as T
print("ready", flush=True)
box = peerguard.open_box(("127.0.0.1", int(sys.argv[1])), "run3", 1, 2, 3.0)
box.put("node/1", b"node-b")
peerguard.post_block(box, "blk/1/0", b"first" * 1000, dst=0)
while box.wire.pending() or box.wire.bytes_sent == 0:
    pass
# mid-send: the doorbell rung and the header of a 64 MiB block sent, then killed before its payload
box.wire._store.add("bell/0", 1)
head = torch.frombuffer(bytearray(T.pack_header("blk/1/1", bytes(64 << 20), 1)), dtype=torch.uint8)
box.wire._pg.send([head], 0, T.TAG_HEAD).wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_peer_killed_mid_send_turns_redundancy_off_once_and_never_hangs(
        server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(server.port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert peer.stdout is not None and peer.stdout.readline() == b"ready\n"  # (its imports done: it joins at once)
        box = peerguard.open_box(("127.0.0.1", server.port), "run3", 0, 2, 3.0)
        assert isinstance(box, T.P2PBox)
        assert wait_take(box, "blk/1/0") == b"first" * 1000
        peer.wait(30)
        assert peer.returncode == -9, peer.stderr.read() if peer.stderr else ""
        writer = SimpleNamespace(backend=SimpleNamespace(url=f"file://{tmp_path}", put_atomic=lambda k, v: None),
                                 branch=SimpleNamespace(name="main", id=1))
        ops = SimpleNamespace(steps={}, pools={}, ring_dir=tmp_path)
        with caplog.at_level(logging.WARNING, logger="dstt.capture"):
            g = peerguard.PeerGuard(RD.parse_scheme("pair"), "run3", 0, 2, ops, writer, box)
            slowest, deadline = 0.0, time.monotonic() + 20
            while g.failed is None and time.monotonic() < deadline:
                t = time.monotonic()
                g.pump([], force=True)
                slowest = max(slowest, time.monotonic() - t)
                time.sleep(0.01)
            assert g.failed is not None and "TransportError" in g.failed, g.failed
            assert slowest < 1.0  # (the helper's loop never waits on the peer)
            assert g.pump([1], force=True) is False
            t = time.monotonic()
            g.close(clean=True)
            assert time.monotonic() - t < T.CLOSE_S + 1
        assert caplog.text.count("peer redundancy off") == 1, caplog.text
    finally:
        peer.kill()
        peer.wait()
        for f in (peer.stdout, peer.stderr):
            if f is not None:
                f.close()


def test_a_group_that_cannot_form_falls_back_to_the_store_once(server: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1 never comes: the group does not form within its timeout, and
    the blocks go through the store instead, said once."""
    with caplog.at_level(logging.WARNING, logger="dstt.capture"):
        box = peerguard.open_box(("127.0.0.1", server.port), "run4", 0, 2, 0.5)
    assert isinstance(box, peerguard.Mailbox)
    assert caplog.text.count("go through the job's store instead") == 1, caplog.text


def test_headers_are_checked() -> None:
    head = T.pack_header("blk/3/7", b"abc")
    assert T.parse_header(head) == ("blk/3/7", 3, T.crc32c(b"abc"), 0)
    bad = bytearray(head)
    bad[12] ^= 1
    with pytest.raises(T.TransportError, match="torn"):
        T.parse_header(bytes(bad))
    with pytest.raises(ValueError, match="longer"):
        T.pack_header("k" * 300, b"")
