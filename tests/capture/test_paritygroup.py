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


def test_reed_solomon_recovery_rebuilds_up_to_m_lost_with_every_survivors_part() -> None:
    """``parity:k+m`` (capture/rsrecover.py): a step of a group is rebuilt
    where 1 to m members' images are missing and every other member
    reported its image and fragments of that group (same members, same m)."""
    from dstt.capture.rsrecover import rebuilds

    g = [0, 1, 2, 3]

    def node(images: list[int], parity: list[int], members: list[int] = g, m: int = 2) -> dict[str, Any]:
        return {"images": {"r": images}, "parity": [["r", s, members, [], [], m] for s in parity]}

    full = node([5, 6], [5, 6])
    assert rebuilds([full, None, None, node([5, 6], [5])], 4) == [("r", 5, [1, 2], g, 2)]  # two lost at once
    assert rebuilds([full, full, None, full], 4) == [("r", 5, [2], g, 2), ("r", 6, [2], g, 2)]  # one lost
    assert rebuilds([full, None, None, None], 4) == []  # three lost: more than m
    assert rebuilds([full, None, None, node([5, 6], [5, 6], m=3)], 4) == []  # survivors disagree on m
    assert rebuilds([full, None, None, node([], [5, 6])], 4) == []  # a survivor lacks its image
    assert rebuilds([node([5], [5], m=1), None, node([5], [5], m=1), node([5], [5], m=1)], 4) == []  # XOR's parity
    assert paritygroup.group_members([0, 1, 2, 3], 1, 2, 2) == g
    assert paritygroup.group_members([0, 1, 2], 1, 2, 2) == [0, 1, 2]  # (3 nodes: k = 1, m = 2)
    assert paritygroup.group_members([0, 1], 1, 2, 2) == []  # m nodes cannot hold m parities of another
