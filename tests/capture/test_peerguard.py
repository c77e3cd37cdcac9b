"""Peer redundancy in the helpers, in one process (issue 26): a held
step's image rebuilt as a ring reads back bit-exact and its CRCs catch a
changed byte (capture/stepimage.py); two helpers' guards over an in-memory
mailbox copy, acknowledge and record the protected steps, and a torn or
stale block is refused, never kept (capture/peerguard.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import dstt
from dstt.capture import paritygroup, peerguard, stepimage
from dstt.capture import ring as R
from dstt.format import parityacc as PA
from dstt.format import redundancy as RD
from dstt.format.backends import open_backend


class DictBox:
    """The mailbox's three calls over a dict (the TCPStore's in tests)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> None:
        self.d[key] = bytes(data)

    def peek(self, key: str) -> bytes | None:
        return self.d.get(key)

    def take(self, key: str) -> bytes | None:
        return self.d.pop(key, None)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Capture's ring with steps sealed and held (memory tier), read as a helper reads them."""
    with pytest.MonkeyPatch.context() as mp:
        yield from _held(tmp_path_factory.mktemp("held"), mp)


def _held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("DSTT_SHM_DIR", str(shm))
    m = torch.nn.Linear(40, 30)
    cap = dstt.Capture(tmp_path / "run", memory_steps=3, persist=1000, max_chunk_bytes=256)
    for s in range(4):
        with torch.no_grad():
            m.weight += s
        cap.snapshot(s, model=m, rng=False)
    cap.wait_staged()
    ring = cap.parts.ring.dir
    steps, pools = {}, {}
    for name in sorted(os.listdir(ring)):
        if name.startswith("seal-"):
            record = R.read_record(R.read_bounded(ring / name))
            pools.setdefault(record["pool"], R.map_pool(ring, record["pool"]))
            steps[record["step"]] = (R.plan_of(record, pools[record["pool"]], verify=True), record)
    ops = SimpleNamespace(steps=steps, pools=pools, ring_dir=ring)
    writer = SimpleNamespace(backend=open_backend(str(tmp_path / "run"), create=False),
                             branch=SimpleNamespace(name="main", id=cap.writer.branch.id))
    yield ops, writer
    cap.close()


def test_image_rebuilt_as_a_ring_reads_back_bit_exact(held: Any, tmp_path: Path) -> None:
    ops, _ = held
    step = max(ops.steps)
    plan, record = ops.steps[step]
    owner = {"store": "s", "branch": "main", "branch_id": 1, "branch_created": 1.0, "rank": 1, "world": 2,
             "run": "r1"}
    data = stepimage.image(record, plan, ops.pools[record["pool"]], owner)
    (tmp_path / "other").mkdir()
    (tmp_path / "other2").mkdir()
    ring = stepimage.materialize(data, tmp_path / "other")
    seals = R.read_seals(ring, complete=False)
    assert [s["step"] for s in seals] == [step]
    pool = R.map_pool(ring, seals[0]["pool"])
    rebuilt = R._replay(seals[0], pool)
    for a, b in zip(plan.tasks, rebuilt.tasks):
        assert a.layout.name == b.layout.name and torch.equal(a.source.view(torch.uint8), b.source.view(torch.uint8))
    # a changed byte in the copy: its seal's CRC refuses it at recovery
    head, seal, parts = stepimage.parse(data)
    bad = bytearray(data)
    bad[len(data) - 3] ^= 0x10
    ring2 = stepimage.materialize(bytes(bad), tmp_path / "other2")
    seal2 = R.read_seals(ring2, complete=False)[0]
    with pytest.raises(R.StaleSeal):
        R._replay(seal2, R.map_pool(ring2, seal2["pool"]))
    with pytest.raises(RD.BlockError):
        stepimage.parse(data[:-1])


def test_guards_copy_acknowledge_and_refuse_torn_or_stale(held: Any, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ops, writer = held
    box = DictBox()
    scheme = RD.parse_scheme("pair")
    monkeypatch.setenv("DSTT_NODE_ID", "a")
    g0 = peerguard.PeerGuard(scheme, "run1", 0, 2, ops, writer, box)
    monkeypatch.setenv("DSTT_NODE_ID", "b")
    g1 = peerguard.PeerGuard(scheme, "run1", 1, 2, SimpleNamespace(steps={}, pools={}, ring_dir=ops.ring_dir),
                             writer, box)
    steps = sorted(ops.steps)
    for _ in range(6):
        g0.pump(steps, force=True)
        g1.pump([], force=True)
    assert g0.holder == 1 and g1.sources == [0]
    assert g0.acked == set(steps) and not g0.pending
    kept = sorted(p.name for p in (g1.dir / "rank-0").iterdir())
    assert kept == [f"step-{s:020d}.blk" for s in steps]
    recs = {r.rank: r for r in RD.read_protected(writer.backend, "main")}
    assert recs[0].steps == ((steps[0], steps[-1]),)
    # a torn block and a stale one (another run): refused, never kept or acknowledged
    good = (g1.dir / "rank-0" / kept[-1]).read_bytes()
    n, bid = g1.next_in[0], int(writer.branch.id)
    peerguard.post_block(box, f"blk/0/{n}", good)  # a replay of a step already kept
    peerguard.post_block(box, f"blk/0/{n + 1}", RD.frame(b"y" * 100, run="run1", branch_id=bid, step=50, rank=0)[:-5])
    peerguard.post_block(box, f"blk/0/{n + 2}", RD.frame(b"x", run="run2", branch_id=bid, step=99, rank=0))
    with caplog.at_level(logging.WARNING, logger="dstt.capture"):
        for _ in range(3):
            g1.pump([], force=True)
    assert f"step {steps[-1]} after step {steps[-1]}" in caplog.text
    assert "torn" in caplog.text and "run 'run2'" in caplog.text
    assert not any((g1.dir / "rank-0" / f"step-{s:020d}.blk").exists() for s in (50, 99))
    assert not any(k.startswith(("ack/0/99", "ack/0/50")) for k in box.d)
    # the sender moves on: copies below its oldest held step are dropped by the holder
    g0.pump(steps[-1:], force=True)
    g1.pump([], force=True)
    assert sorted(p.name for p in (g1.dir / "rank-0").iterdir()) == [f"step-{steps[-1]:020d}.blk"]
    g1.close(clean=True)
    assert not g1.dir.exists()


def test_blocks_go_in_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TCPStore refuses values over 8 MiB: a block goes in parts, whole once its count is posted."""
    monkeypatch.setattr(peerguard, "PART_BYTES", 10)
    box = DictBox()
    data = bytes(range(95))
    peerguard.post_block(box, "blk/0/0", data)
    assert max(len(v) for v in box.d.values()) <= 10 and len(box.d) == 11
    assert peerguard.take_block(box, "blk/0/0") == data and not box.d
    assert peerguard.take_block(box, "blk/0/0") is None


def test_redundancy_option_is_validated(tmp_path: Path) -> None:
    from dstt.errors import ConfigError

    with pytest.raises(ConfigError, match="redundancy must be one of"):
        dstt.Capture(tmp_path / "a", memory_steps=2, redundancy="raid")
    with pytest.raises(ConfigError, match="needs memory_steps"):
        dstt.Capture(tmp_path / "b", redundancy="pair")
    with pytest.raises(ConfigError, match="needs memory_steps"):
        dstt.Capture(tmp_path / "c", redundancy="parity:4")
    with pytest.raises(ConfigError, match="this Capture runs alone"):
        dstt.Capture(tmp_path / "c2", memory_steps=2, redundancy="parity:4")  # (built: needs torch.distributed)
    with pytest.raises(ConfigError, match="this Capture runs alone"):
        dstt.Capture(tmp_path / "d", memory_steps=2, redundancy="pair")


def test_a_real_tcpstore_carries_a_block_over_its_value_limit() -> None:
    """The job's c10d TCPStore (libuv) refuses a value over 8 MiB: a 9 MiB
    block still goes through, in parts (found by bench_redundancy.py:
    every copy of a 12.6 MB step was refused and redundancy turned off)."""
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    box = peerguard.Mailbox(("127.0.0.1", server.port), "run1", timeout_s=10)
    data = os.urandom(9 << 20)
    peerguard.post_block(box, "blk/0/0", data)
    assert peerguard.take_block(box, "blk/0/0") == data
    assert peerguard.take_block(box, "blk/0/0") is None


def test_a_mailbox_that_cannot_be_reached_turns_redundancy_off(held: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Connecting runs on a thread of its own (never holding up the helper's
    loop); if it fails, the guard says so once and does nothing more."""
    import time

    ops, writer = held

    def unreachable() -> Any:
        time.sleep(0.2)
        raise OSError("connection refused")

    with caplog.at_level(logging.WARNING, logger="dstt.capture"):
        t = time.monotonic()
        g = peerguard.PeerGuard(RD.parse_scheme("pair"), "run1", 0, 2, ops, writer, unreachable)
        assert g.pump(sorted(ops.steps), force=True) is False and time.monotonic() - t < 0.2
        deadline = time.monotonic() + 10
        while g.failed is None and time.monotonic() < deadline:
            time.sleep(0.02)
    assert g.failed == "OSError: connection refused" and g.pump([1], force=True) is False
    assert "peer redundancy off: OSError: connection refused" in caplog.text


# ----------------------------------------------------------------------------- parity:k (capture/paritygroup.py)


def test_three_guards_keep_parity_and_any_image_is_rebuilt(held: Any, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    ops, writer = held
    box = DictBox()
    scheme = RD.parse_scheme("parity:2")
    guards = []
    for r in range(3):
        monkeypatch.setenv("DSTT_NODE_ID", f"n{r}")
        guards.append(paritygroup.ParityGuard(scheme, "run1", r, 3, ops, writer, box))
    steps = sorted(ops.steps)
    for _ in range(8):
        for g in guards:
            g.pump(steps, force=True)
    assert [g.members for g in guards] == [[0, 1, 2]] * 3
    assert all(g.acked == set(steps) and not g.pending for g in guards)
    recs = {r.rank: r for r in RD.read_protected(writer.backend, "main")}
    assert RD.protected_steps(list(recs.values())) == ("parity:2", [(steps[0], steps[-1])])
    assert not any(k.startswith("pst/") for k in box.d)  # every stripe taken out of the mailbox
    step = steps[-1]
    plan, record = ops.steps[step]
    img = stepimage.image(record, plan, ops.pools[record["pool"]], guards[0]._ring_owner())
    bid = int(writer.branch.id)
    parities = {g.rank: PA.parse_parity(paritygroup.parity_file(g.run_dir, g.rank, step).read_bytes(), run="run1",
                                        branch_id=bid, step=step, holder=g.rank) for g in guards}
    assert all(len(img) // 2 <= len(p.payload) <= -(-len(img) // 2) for p in parities.values())  # 1/k of an image
    for lost in range(3):
        assert PA.rebuild_lost(lost, {m: img for m in range(3) if m != lost}, parities, [0, 1, 2]) == img
    # a torn stripe posted to rank 1: refused with a warning, nothing acknowledged for it
    n = guards[1].in_seq[0]
    paritygroup.post_block(box, f"pst/0/1/{n}", PA.stripe_block(img, run="run1", branch_id=bid, step=99, src=0,
                                                                holder=1, members=[0, 1, 2])[:-4])
    with caplog.at_level(logging.WARNING, logger="dstt.capture"):
        guards[1].pump(steps, force=True)
    assert "a stripe of rank 0 refused" in caplog.text and not any("/99/" in k for k in box.d)
    # the members move on: parities of steps they no longer hold are dropped
    for _ in range(3):
        for g in guards:
            g.pump(steps[-1:], force=True)
    assert sorted(p.name for p in guards[2].pdir.iterdir()) == [f"step-{step:020d}.par"]
    for g in guards:
        g.close(clean=True)
    assert not guards[0].run_dir.exists()


def test_one_node_is_unprotected_with_a_warning(held: Any, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    ops, writer = held
    box = DictBox()
    monkeypatch.setenv("DSTT_NODE_ID", "same")
    guards = [paritygroup.ParityGuard(RD.parse_scheme("parity:1"), "run2", r, 2, ops, writer, box) for r in range(2)]
    with caplog.at_level(logging.WARNING, logger="dstt.capture"):
        for _ in range(3):
            for g in guards:
                g.pump(sorted(ops.steps), force=True)
    assert "needs at least 2 nodes" in caplog.text
    assert not any(g.acked for g in guards) and not box.d.keys() - {"node/0", "node/1", "low/0", "low/1"}


# ----------------------------------------------------------------------------- parity:k+m (capture/rsgroup.py)


def test_four_guards_keep_reed_solomon_fragments_and_any_two_lost_are_rebuilt(
        held: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``parity:2+2`` over 4 nodes: every step protected once all 3 others
    acknowledged it, each node keeping m/k = 1 image of fragments a step;
    any 2 of the 4 images rebuilt bit-exact from the other 2 and their fragments."""
    pytest.importorskip("pyeclib.ec_iface")
    import itertools

    from dstt.capture import rsgroup
    from dstt.format import rsacc as RS

    ops, writer = held
    box = DictBox()
    guards = []
    for r in range(4):
        monkeypatch.setenv("DSTT_NODE_ID", f"n{r}")
        guards.append(rsgroup.RSGuard(RD.parse_scheme("parity:2+2"), "run3", r, 4, ops, writer, box))
    steps = sorted(ops.steps)
    for _ in range(8):
        for g in guards:
            g.pump(steps, force=True)
    assert [g.members for g in guards] == [[0, 1, 2, 3]] * 4
    assert all(g.acked == set(steps) and not g.pending for g in guards)
    assert RD.protected_steps(RD.read_protected(writer.backend, "main")) == ("parity:2+2", [(steps[0], steps[-1])])
    assert not any(k.startswith("pst/") for k in box.d)
    step = steps[-1]
    plan, record = ops.steps[step]
    img = stepimage.image(record, plan, ops.pools[record["pool"]], guards[0]._ring_owner())
    raw = {g.rank: paritygroup.parity_file(g.run_dir, g.rank, step).read_bytes() for g in guards}
    assert all(len(d) < len(img) + 2048 for d in raw.values())  # m/k = 1 image (+ headers)
    frags = {r: RS.parse_fragments(d, run="run3", branch_id=int(writer.branch.id), step=step, holder=r)
             for r, d in raw.items()}
    for lost in itertools.combinations(range(4), 2):
        others = [r for r in range(4) if r not in lost]
        got = RS.rebuild_lost(list(lost), {r: img for r in others}, {r: frags[r] for r in others}, [0, 1, 2, 3], 2)
        assert got == {r: img for r in lost}
    for g in guards:
        g.close(clean=True)
    assert not guards[0].run_dir.exists()
