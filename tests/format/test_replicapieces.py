"""redundancy="replicas" (issue 26): a lost rank's part assembled from the
pieces several survivors hold (dstt.format.replicapieces.decide) -- who
assembles, who provides each chunk, and every reason a part is refused."""

from __future__ import annotations

from typing import Any

from dstt.format.replicapieces import decide

NEED = [(0, 0), (0, 1), (1, 0)]


def offer(rank: int, step: int, held: dict[tuple[int, int], int], need: list[Any] = NEED) -> Any:
    return ((rank, step), (need, held))


def test_a_part_spread_over_three_survivors_is_assembled_by_the_one_holding_most() -> None:
    offers = [[offer(3, 7, {(0, 0): 1})],                      # rank 0: one chunk of rank 3's part
              [offer(3, 7, {(0, 1): 2, (1, 0): 3})],           # rank 1: the two others
              [offer(3, 7, {(0, 0): 1, (1, 0): 3})]]           # rank 2: two, one of them also rank 1's
    [a], refused = decide(offers, lambda rank, step: False)
    assert refused == []
    assert (a.rank, a.step, a.assembler) == (3, 7, 1)  # (a tie between ranks 1 and 2: the lower)
    assert a.providers == {(0, 0): 0, (0, 1): 1, (1, 0): 1}  # its own where it holds them, else the lowest holder
    assert a.crcs == {(0, 0): 1, (0, 1): 2, (1, 0): 3}


def test_holders_of_the_same_chunk_that_disagree_refuse_the_part_and_are_named() -> None:
    offers = [[offer(3, 7, {(0, 0): 1, (0, 1): 2})], [offer(3, 7, {(0, 1): 9, (1, 0): 3})]]
    plans, refused = decide(offers, lambda rank, step: False)
    assert plans == [] and refused == ["step 7 (the replicas of rank 3's part differ: chunk (0, 1) on ranks 0, 1)"]


def test_a_chunk_nobody_holds_refuses_the_part() -> None:
    offers = [[offer(3, 7, {(0, 0): 1})], [offer(3, 7, {(0, 1): 2})], [offer(3, 8, {(0, 0): 1, (0, 1): 2,
                                                                                    (1, 0): 3})]]
    plans, refused = decide(offers, lambda rank, step: False)
    assert [(a.rank, a.step, a.assembler) for a in plans] == [(3, 8, 2)]
    assert refused == ["step 7 (rank 3's part: 1 of its 3 chunks are held by no survivor)"]


def test_parts_their_own_rank_recorded_and_disagreements_on_the_part() -> None:
    offers = [[offer(3, 7, {(0, 0): 1}), offer(2, 7, {(0, 0): 1, (0, 1): 2, (1, 0): 3})],
              [offer(3, 7, {(0, 1): 2}, need=[(0, 0), (0, 1)])]]
    plans, refused = decide(offers, lambda rank, step: rank == 2)  # rank 2's node survived: it recorded its own
    assert plans == []
    assert refused == ["step 7 (the survivors disagree on what rank 3's part is: ranks 0, 1)"]
