"""``redundancy="parity:k"`` in the helpers, in one process (issue 26,
capture/paritygroup.py): three helpers' guards over an in-memory mailbox
send the stripes of their held steps, each keeps the complete parity of
the others' and acknowledges it; the steps are then recorded as
protected, and any one member's image is rebuilt bit-exact from the
others' images and parities. A member on a node alone (one node in all)
stays unprotected, with a warning."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from test_peerguard import DictBox, held  # noqa: F401 - a fixture

from dstt.capture import paritygroup, stepimage
from dstt.format import parityacc as PA
from dstt.format import redundancy as RD


def test_three_guards_keep_parity_and_any_image_is_rebuilt(held: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
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


def test_one_node_is_unprotected_with_a_warning(held: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
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


def test_group_members_one_rank_of_each_node() -> None:
    assert paritygroup.group_members([0, 1, 2, 3, 4], 4, 2) == [3, 4]  # (a remainder of one joins the last group)
    assert paritygroup.group_members([0, 1, 2, 3, 4, 5, 6], 4, 2) == [3, 4, 5, 6]
    assert paritygroup.group_members([0, 0, 1], 0, 1) == []  # nodes of a group with different rank counts
    assert paritygroup.group_members([0, 0], 1, 1) == []  # one node


def test_recovery_rebuilds_only_a_single_loss_with_every_survivors_image_and_parity() -> None:
    """What the restarted job agrees to rebuild (capture/parityrecover.py):
    a step of a group where one member's image is missing and every other
    member reported its image and a parity of that group -- never two
    missing, never with a parity missing or of another group."""
    from dstt.capture.parityrecover import rebuilds

    g = [0, 1, 2]

    def node(images: list[int], parity: list[int], members: list[int] = g) -> dict[str, Any]:
        return {"images": {"r": images}, "parity": [["r", s, members, [], []] for s in parity]}

    # rank 1 lost (no report at all: a fresh node)
    assert rebuilds([node([5, 6, 7], [5, 6, 7]), None, node([5, 6, 7], [5, 6])], 3) == \
        [("r", 5, 1, g), ("r", 6, 1, g)]  # (step 7: rank 2's parity incomplete, not rebuilt)
    assert rebuilds([node([5], [5]), None, None], 3) == []  # two of the group lost
    assert rebuilds([node([5], [5]), None, node([], [5])], 3) == []  # a survivor lacks its image
    assert rebuilds([node([5], [5]), None, node([5], [5], [0, 1, 3])], 4) == []  # parities of two groups
    assert rebuilds([node([5], [5]), node([5], [5]), node([5], [5])], 3) == []  # nothing lost
    assert rebuilds([node([5], [5]), None, node([5], [5], [0, 1, 7])], 3) == []  # a member outside the world
