"""``redundancy="parity:k"`` (issue 26): which ranks form a parity group
(capture/paritygroup.py) and which steps a restarted job agrees to rebuild
(capture/parityrecover.py). The guards themselves, over a real ring's held
steps, are tested in test_peerguard.py (which builds that ring once)."""

from __future__ import annotations

from typing import Any

from dstt.capture import paritygroup


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
