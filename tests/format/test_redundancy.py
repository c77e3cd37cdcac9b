"""Peer redundancy's torch-free core (dstt/format/redundancy.py, issue 26):
placement (one node's loss never takes a block and its copy or parity,
checked exhaustively for small node counts), XOR parity over unequal
blocks (every single loss rebuilt bit-exact; two losses in a group
refused), framing (torn, stale and corrupted blocks refused), and the
protection records."""

from __future__ import annotations

import itertools
import random

import pytest

from dstt.errors import ConfigError
from dstt.format import redundancy as RD


def test_schemes_parse_and_refuse() -> None:
    assert [str(RD.parse_scheme(s)) for s in ("none", "pair", "replicas", "parity:1", "parity:64")] == \
        ["none", "pair", "replicas", "parity:1", "parity:64"]
    for bad in ("parity:0", "parity:65", "parity", "PAIR", "", None, 3, "parity:-1", "parity:4x"):
        with pytest.raises(ConfigError, match="redundancy must be one of"):
            RD.parse_scheme(bad)
    assert RD.parse_scheme("parity:4").extra_memory() == 0.25 and RD.parse_scheme("pair").extra_memory() == 1.0


@pytest.mark.parametrize("nodes", range(2, 13))
def test_pair_never_loses_both_copies(nodes: int) -> None:
    for lost in range(nodes):
        held_by = RD.partner(lost, nodes)
        assert held_by != lost and RD.holders_of(held_by, nodes) == lost
    assert sorted(RD.partner(n, nodes) for n in range(nodes)) == list(range(nodes))  # each holds one copy


def test_pair_refuses_one_node() -> None:
    with pytest.raises(ConfigError, match="at least 2 nodes"):
        RD.partner(0, 1)


def _blocks(rng: random.Random, n: int) -> list[bytes]:
    return [bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 5, 17, 64, 101]))) for _ in range(n)]


@pytest.mark.parametrize("nodes", range(2, 11))
def test_parity_rebuilds_any_single_loss_exhaustively(nodes: int) -> None:
    rng = random.Random(nodes)
    for k in range(1, nodes):
        groups = RD.parity_groups(nodes, k)
        assert sorted(itertools.chain(*groups)) == list(range(nodes)) and all(len(g) >= 2 for g in groups)
        for group in groups:
            blocks = _blocks(rng, len(group))
            parities = {h: RD.encode_parity(blocks, h) for h in range(len(group))}
            # memory: each parity block is about 1/(g-1) of the largest block
            longest = max(len(b) for b in blocks)
            assert all(len(p) <= -(-longest // (len(group) - 1)) for p in parities.values())
            for lost in range(len(group)):
                alive = {m: b for m, b in enumerate(blocks) if m != lost}
                kept = {h: p for h, p in parities.items() if h != lost}  # its own parity goes with it
                assert RD.rebuild(lost, len(blocks[lost]), alive, kept, len(group)) == blocks[lost]
            if len(group) >= 3:  # two losses in one group: refused, never guessed
                alive = {m: b for m, b in enumerate(blocks) if m > 1}
                with pytest.raises(RD.BlockError, match="cannot be rebuilt"):
                    RD.rebuild(0, len(blocks[0]), alive, {h: p for h, p in parities.items() if h > 1}, len(group))


def test_node_ids_in_order_of_first_rank() -> None:
    assert RD.node_ids(["b", "b", "a", "c", "a"]) == [0, 0, 1, 2, 1]


def test_frame_round_trip_and_refusals() -> None:
    payload = bytes(range(256)) * 3
    blk = RD.frame(payload, run="r1", branch_id=4, step=7, rank=1, meta={"x": 1})
    head, got = RD.unframe(blk, run="r1", branch_id=4, step=7, rank=1)
    assert got == payload and head.meta == {"x": 1}
    for kw, what in (({"step": 8}, "step 7"), ({"run": "r2"}, "run 'r1'"), ({"branch_id": 5}, "branch_id 4"),
                     ({"rank": 0}, "rank 1")):
        args = {"run": "r1", "branch_id": 4, "step": 7, "rank": 1, **kw}
        with pytest.raises(RD.BlockError, match=f"stale block: {what}"):
            RD.unframe(blk, **args)  # type: ignore[arg-type]
    with pytest.raises(RD.BlockError, match="kind 'copy'"):
        RD.unframe(blk, run="r1", branch_id=4, step=7, kind="parity")
    for cut in (0, 5, 20, len(blk) - 1):
        with pytest.raises(RD.BlockError):
            RD.unframe(blk[:cut], run="r1", branch_id=4, step=7)
    flipped = bytearray(blk)
    flipped[-10] ^= 1
    with pytest.raises(RD.BlockError, match="CRC-32C"):
        RD.unframe(bytes(flipped), run="r1", branch_id=4, step=7)
    flipped = bytearray(blk)
    flipped[20] ^= 1  # in the header
    with pytest.raises(RD.BlockError):
        RD.unframe(bytes(flipped), run="r1", branch_id=4, step=7)
    rng = random.Random(0)
    for _ in range(200):  # any bytes: BlockError, never another exception
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        with pytest.raises(RD.BlockError):
            RD.unframe(RD.MAGIC + junk, run="r1", branch_id=4, step=7)


def test_protection_records(tmp_path: object) -> None:
    import zarr.storage

    from dstt.format.backends.zarr_store import ZarrStoreBackend

    b = ZarrStoreBackend(zarr.storage.MemoryStore())
    RD.write_protected(b, RD.Protected("main", "run1", 0, 2, 0, "pair", ((3, 9),)))
    assert RD.protected_steps(RD.read_protected(b, "main")) == ("pair", [])  # rank 1 has said nothing yet
    RD.write_protected(b, RD.Protected("main", "run1", 1, 2, 1, "pair", ((1, 4), (6, 7))))
    assert RD.protected_steps(RD.read_protected(b, "main")) == ("pair", [(3, 4), (6, 7)])
    b.put_atomic(RD.protect_key("main", 1), b'{"format": "dstt-redundancy-protected", "steps": [[5, 2]]}')
    assert RD.protected_steps(RD.read_protected(b, "main")) == ("pair", [])  # the bad record skipped
