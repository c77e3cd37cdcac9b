"""The parity a group member keeps under ``redundancy="parity:k"`` (issue 26,
dstt.format.parityacc): stripes taken in any order, a torn or stale one
refused (never XORed in), a duplicate ignored; the rebuilt image is
bit-exact, and a survivor's image that is not the one the parity was made
of is refused rather than used."""

from __future__ import annotations

import random

import pytest

from dstt.format import parityacc as PA
from dstt.format import redundancy as RD

RUN, BID = "run1", 7


def _images(members: list[int], seed: int) -> dict[int, bytes]:
    rnd = random.Random(seed)
    return {m: rnd.randbytes(rnd.randrange(0, 3000)) for m in members}


def _stripes(images: dict[int, bytes], members: list[int], step: int) -> list[tuple[int, int, bytes]]:
    """(src, holder, framed stripe) for every pair of members."""
    return [(s, h, PA.stripe_block(images[s], run=RUN, branch_id=BID, step=step, src=s, holder=h, members=members))
            for s in members for h in members if h != s]


@pytest.mark.parametrize("members", [[0, 1], [0, 1, 2], [3, 5, 9, 11, 12]])
def test_out_of_order_stripes_make_the_parity_that_rebuilds_any_member(members: list[int]) -> None:
    for seed in range(5):
        images = {s: _images(members, seed * 100 + s) for s in (5, 6)}
        accs = {h: PA.ParityAccumulator(RUN, BID, h, members) for h in members}
        parts = _stripes(images[5], members, 5) + _stripes(images[6], members, 6)
        random.Random(seed).shuffle(parts)  # steps interleaved, contributors in any order
        seen: dict[tuple[int, int], str] = {}
        for src, h, data in parts:
            what, step = accs[h].add(data, src)
            seen[(h, step)] = what
        assert all(v == "complete" for v in seen.values()) and len(seen) == 2 * len(members)
        for step in (5, 6):
            parities = {h: PA.parse_parity(accs[h].complete(step), run=RUN, branch_id=BID, step=step, holder=h)
                        for h in members}
            for lost in members:
                others = {m: images[step][m] for m in members if m != lost}
                assert PA.rebuild_lost(lost, others, parities, members) == images[step][lost]
            assert accs[members[0]].complete(step) is None  # (taken once)


def test_a_torn_or_stale_stripe_is_refused_and_a_duplicate_ignored() -> None:
    members = [0, 1, 2]
    images = _images(members, 1)
    acc = PA.ParityAccumulator(RUN, BID, 1, members)
    good = PA.stripe_block(images[0], run=RUN, branch_id=BID, step=4, src=0, holder=1, members=members)

    def stripe(**kw: object) -> bytes:
        args: dict[str, object] = {"run": RUN, "branch_id": BID, "step": 4, "src": 0, "holder": 1,
                                   "members": members, **kw}
        img = args.pop("image", images[0])
        return PA.stripe_block(img, **args)  # type: ignore[arg-type]

    bad = {
        "torn": good[:-3],
        "flipped": good[:-1] + bytes([good[-1] ^ 1]),
        "another run": stripe(run="run2"),
        "another branch": stripe(branch_id=BID + 1),
        "another holder": stripe(holder=2),
        "another group": stripe(members=[0, 1, 3]),
        "not a block": b"\0" * 64,
    }
    for name, data in bad.items():
        with pytest.raises(RD.BlockError):
            acc.add(data, 0)
        assert not acc.open, name  # nothing was XORed in
    with pytest.raises(RD.BlockError):
        acc.add(good, 2)  # framed as rank 0's, delivered as rank 2's
    with pytest.raises(RD.BlockError):
        acc.add(good, 1)  # the holder does not contribute to itself
    assert acc.add(good, 0) == ("added", 4)
    before = acc.open[4].acc.copy()
    assert acc.add(good, 0) == ("duplicate", 4)  # the same stripe again: not XORed twice
    assert acc.add(stripe(image=images[2]), 0) == ("duplicate", 4)  # another one from the same rank: ignored
    assert (acc.open[4].acc == before).all()
    two = PA.stripe_block(images[2], run=RUN, branch_id=BID, step=4, src=2, holder=1, members=members)
    assert acc.add(two, 2) == ("complete", 4)
    assert acc.add(two, 2) == ("duplicate", 4)  # after completion too
    parity = PA.parse_parity(acc.complete(4), run=RUN, branch_id=BID, step=4, holder=1)
    assert parity.lengths == [len(images[0]), None, len(images[2])]
    # a step below what the members still hold: late, dropped, not an error
    acc.drop_below(10)
    assert acc.add(stripe(step=9), 0) == ("late", 9) and not acc.open
    # a stale parity (another step, another holder) is refused at recovery
    acc2 = PA.ParityAccumulator(RUN, BID, 1, members)
    acc2.add(stripe(step=11), 0)
    acc2.add(PA.stripe_block(images[2], run=RUN, branch_id=BID, step=11, src=2, holder=1, members=members), 2)
    framed = acc2.complete(11)
    for kw in ({"step": 12, "holder": 1}, {"step": 11, "holder": 2}):
        with pytest.raises(RD.BlockError):
            PA.parse_parity(framed, run=RUN, branch_id=BID, **kw)  # type: ignore[arg-type]


def test_a_survivors_changed_image_is_refused_not_used() -> None:
    members = [0, 1, 2]
    images = _images(members, 3)
    accs = {h: PA.ParityAccumulator(RUN, BID, h, members) for h in members}
    for src, h, data in _stripes(images, members, 2):
        accs[h].add(data, src)
    parities = {h: PA.parse_parity(accs[h].complete(2), run=RUN, branch_id=BID, step=2, holder=h) for h in members}
    changed = {0: images[0][:-1] + bytes([images[0][-1] ^ 0x40]) if images[0] else b"x", 2: images[2]}
    with pytest.raises(RD.BlockError, match="not the one the parities were made of"):
        PA.rebuild_lost(1, changed, parities, members)
    with pytest.raises(RD.BlockError, match="missing"):
        PA.rebuild_lost(1, {0: images[0]}, parities, members)  # two lost in one group: refused, never guessed
    with pytest.raises(RD.BlockError, match="missing"):
        PA.rebuild_lost(1, {0: images[0], 2: images[2]}, {0: parities[0]}, members)


def test_the_oldest_open_step_gives_way_when_too_many_are_open() -> None:
    members = [0, 1, 2]
    acc = PA.ParityAccumulator(RUN, BID, 0, members, max_open=3)
    for step in range(6):
        acc.add(PA.stripe_block(b"abc" * step, run=RUN, branch_id=BID, step=step, src=1, holder=0, members=members),
                1)
    assert sorted(acc.open) == [3, 4, 5]
