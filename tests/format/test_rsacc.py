"""The fragments a group member keeps under ``redundancy="parity:k+m"``
(issue 26, m >= 2, dstt.format.rsacc: Reed-Solomon through pyeclib):
stripes taken in any order, a torn or stale one refused (never coded in), a
duplicate ignored; any ``m`` lost members of a group rebuilt bit-exact from
the other ``k`` (their images and fragments), more than ``m`` refused, and a
survivor's image that is not the one the fragments were made of refused
rather than used. Skipped where pyeclib (the ``erasure`` extra) is absent."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from pathlib import Path

import pytest

from dstt.errors import ConfigError
from dstt.format import redundancy as RD

pytest.importorskip("pyeclib.ec_iface")
from dstt.format import rsacc as RS  # noqa: E402

RUN, BID = "run1", 7


def _images(members: list[int], seed: int) -> dict[int, bytes]:
    rnd = random.Random(seed)
    sizes = [0, 1, 15, 17, 999, 2048, 3001]
    return {x: rnd.randbytes(rnd.choice(sizes)) for x in members}


def _stripes(images: dict[int, bytes], members: list[int], m: int, step: int) -> list[tuple[int, int, bytes]]:
    """(src, holder, framed stripes) for every pair of members."""
    return [(s, h, RS.stripe_block(images[s], run=RUN, branch_id=BID, step=step, src=s, holder=h, members=members,
                                   m=m)) for s in members for h in members if h != s]


def _fragments(accs: dict[int, RS.RSAccumulator], step: int) -> dict[int, RS.Fragments]:
    return {h: RS.parse_fragments(a.complete(step), run=RUN, branch_id=BID, step=step, holder=h)
            for h, a in accs.items()}


def test_layout_every_member_data_of_k_codewords_holder_of_m() -> None:
    """Each image is protected by m parities on m other members; each member holds m stripes (m/k of an image)."""
    for g, m in [(4, 2), (5, 2), (6, 3), (7, 4)]:
        for i in range(g):
            assert len(RS.stripes_of(i, g, m)) == g - m and len(RS.held_by(i, g, m)) == m
            for c in RS.stripes_of(i, g, m):
                assert i not in RS.holders(c, g, m) and len(RS.data_of(c, g, m)) == g - m


@pytest.mark.parametrize(("members", "m"), [([0, 1, 2, 3], 2), ([3, 5, 9, 11, 12], 2), ([0, 1, 2, 3, 4, 5], 3),
                                            ([0, 1, 2], 2)])  # (k = 1: parity:2+2 on 3 nodes, one survivor)
def test_out_of_order_stripes_make_fragments_that_rebuild_any_m_lost(members: list[int], m: int) -> None:
    for seed in range(2):
        images = {s: _images(members, seed * 100 + s) for s in (5, 6)}
        accs = {h: RS.RSAccumulator(RUN, BID, h, members, m) for h in members}
        parts = _stripes(images[5], members, m, 5) + _stripes(images[6], members, m, 6)
        random.Random(seed).shuffle(parts)  # steps interleaved, contributors in any order
        seen: dict[tuple[int, int], str] = {}
        for src, h, data in parts:
            what, at = accs[h].add(data, src)
            seen[(h, at)] = what
        assert all(v == "complete" for v in seen.values()) and len(seen) == 2 * len(members)
        for step in (5, 6):
            frags = _fragments(accs, step)
            for n in range(1, m + 1):  # any k of the k + m
                for lost in itertools.combinations(members, n):
                    others = [x for x in members if x not in lost]
                    got = RS.rebuild_lost(list(lost), {x: images[step][x] for x in others},
                                          {x: frags[x] for x in others}, members, m)
                    assert got == {x: images[step][x] for x in lost}
            lost = members[:m + 1]  # one more than m: refused, nothing rebuilt
            with pytest.raises(RD.BlockError, match="cannot be rebuilt"):
                RS.rebuild_lost(lost, {x: images[step][x] for x in members[m + 1:]}, frags, members, m)
            assert accs[members[0]].complete(step) is None  # (taken once)


def test_a_torn_or_stale_stripe_is_refused_and_a_duplicate_ignored() -> None:
    members, m = [0, 1, 2, 3], 2
    images = _images(members, 1)
    acc = RS.RSAccumulator(RUN, BID, 1, members, m)

    def block(**kw: object) -> bytes:
        args: dict[str, object] = {"run": RUN, "branch_id": BID, "step": 4, "src": 0, "holder": 1,
                                   "members": members, "m": m, **kw}
        img = args.pop("image", images[0])
        return RS.stripe_block(img, **args)  # type: ignore[arg-type]

    good = block()
    bad = {
        "torn": good[:-3],
        "flipped": good[:-1] + bytes([good[-1] ^ 1]) if len(good) else good,
        "another run": block(run="run2"),
        "another branch": block(branch_id=BID + 1),
        "another holder": block(holder=2),
        "another group": block(members=[0, 1, 2, 4]),
        "another m": block(members=[0, 1, 2, 3], m=3),
    }
    for what, data in bad.items():
        with pytest.raises(RD.BlockError):
            acc.add(data, 0)
        assert acc.open == {}, what  # nothing taken
    with pytest.raises(RD.BlockError):  # a stripe block claiming another source
        acc.add(good, 2)
    assert acc.add(good, 0) == ("added", 4)
    assert acc.add(good, 0) == ("duplicate", 4)
    for s in (2, 3):
        acc.add(block(src=s, image=images[s]), s)
    frags = RS.parse_fragments(acc.complete(4), run=RUN, branch_id=BID, step=4, holder=1)
    assert frags.lengths == [len(images[0]), None, len(images[2]), len(images[3])]
    assert acc.add(good, 0) == ("duplicate", 4)  # (after it completed)
    acc.drop_below(6)
    assert acc.add(good, 0) == ("late", 4)


def test_a_stale_or_torn_fragment_or_a_changed_survivor_is_refused() -> None:
    members, m = [0, 1, 2, 3], 2
    images = _images(members, 3)
    accs = {h: RS.RSAccumulator(RUN, BID, h, members, m) for h in members}
    raw: dict[int, bytes] = {}
    for src, h, data in _stripes(images, members, m, 9):
        if accs[h].add(data, src)[0] == "complete":
            raw[h] = accs[h].complete(9) or b""
    for h, data in raw.items():
        with pytest.raises(RD.BlockError):
            RS.parse_fragments(data, run=RUN, branch_id=BID, step=8, holder=h)  # stale: another step
        with pytest.raises(RD.BlockError):
            RS.parse_fragments(data[:-1], run=RUN, branch_id=BID, step=9, holder=h)  # torn
        with pytest.raises(RD.BlockError):
            RS.parse_fragments(data, run=RUN, branch_id=BID, step=9, holder=(h + 1) % 4)  # another holder's
    frags = {h: RS.parse_fragments(d, run=RUN, branch_id=BID, step=9, holder=h) for h, d in raw.items()}
    assert {f.code for f in frags.values()} == {RS.code_name(2, 2)}
    other = {h: dataclasses.replace(f, code="liberasurecode_rs_vand" if f.code != "liberasurecode_rs_vand"
                                    else "isa_l_rs_cauchy") for h, f in frags.items()}
    with pytest.raises(RD.BlockError, match="coded with"):  # another backend's fragments: never decoded
        RS.rebuild_lost([0, 1], {2: images[2], 3: images[3]}, other, members, m)
    changed = dict(images)
    changed[2] = bytes([images[2][0] ^ 1]) + images[2][1:] if images[2] else b"x"
    with pytest.raises(RD.BlockError, match="CRC"):
        RS.rebuild_lost([0, 1], {2: changed[2], 3: images[3]}, frags, members, m)


def test_more_open_steps_than_the_bound_drop_the_oldest() -> None:
    members, m = [0, 1, 2, 3], 2
    acc = RS.RSAccumulator(RUN, BID, 0, members, m, max_open=16)
    for step in range(20):
        acc.add(RS.stripe_block(b"abc" * step, run=RUN, branch_id=BID, step=step, src=1, holder=0,
                                members=members, m=m), 1)
    assert sorted(acc.open) == list(range(4, 20))


def test_missing_pyeclib_is_a_config_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without pyeclib, ``redundancy="parity:2+2"`` is refused when the Capture is made, naming the extra."""
    import dstt

    monkeypatch.setitem(sys.modules, "pyeclib.ec_iface", None)
    RS.driver.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"dstt\[erasure\]"):
            RS.driver(2, 2)
        with pytest.raises(ConfigError, match=r"parity:2\+2.*dstt\[erasure\]"):
            dstt.Capture(tmp_path / "c", memory_steps=2, redundancy="parity:2+2")
    finally:
        RS.driver.cache_clear()


def test_scheme_parsing() -> None:
    assert RD.parse_scheme("parity:2+2") == RD.Scheme("parity", 2, 2)
    assert str(RD.parse_scheme("parity:4+3")) == "parity:4+3" and RD.parse_scheme("parity:4+3").extra_memory() == 0.75
    assert RD.parse_scheme("parity:3+1") == RD.parse_scheme("parity:3")  # m = 1 is XOR
    for bad in ("parity:2+9", "parity:30+3", "parity:2+0", "parity:2+", "parity:+2", "parity:2+2+2"):
        with pytest.raises(ConfigError):
            RD.parse_scheme(bad)
