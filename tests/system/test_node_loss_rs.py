"""``redundancy="parity:2+2"`` (issue 26, Reed-Solomon through pyeclib)
in the node-failure harness (tests/system/test_node_loss.py): 4 nodes x 1
rank, one group of k + m = 4. Two nodes lost at once are rebuilt bit-exact
against the unsharded reference; three fall back to the store with one
message naming the steps; a node lost while the fragments are updated
loses nothing silently. Skipped where pyeclib (the ``erasure`` extra) is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_node_loss import check_bits, lose_nodes, named_steps, no_parity_left

import dstt

pytest.importorskip("pyeclib.ec_iface")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("lost", [[1, 2], [0, 3]], ids=["data-nodes", "node0-and-last"])
def test_rs_four_nodes_lose_two_at_once_after_the_parity(tmp_path: Path, lost: list[int]) -> None:
    """``parity:2+2``: two nodes lost together once every held step's
    fragments are complete; the restarted job decodes both lost ranks'
    images of steps 5-7 from the two survivors (their images and fragments)
    and commits them, bit-exact and verify-clean."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2+2", lost, n=4)
    assert recovered[0]["recovered"] == [5, 6, 7], nodes.logs()
    assert all(r["warnings"] == [] for r in recovered), recovered
    check_bits(tmp_path, [0, 5, 6, 7])
    assert no_parity_left(nodes)


def test_rs_three_of_four_lost_falls_back_and_names_the_steps(tmp_path: Path) -> None:
    """Three nodes lost (m = 2 parities cover two): nothing is rebuilt or
    committed wrong, and one warning names steps 5-7."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2+2", [1, 2, 3], n=4)
    assert recovered[0]["recovered"] == [], nodes.logs()
    assert {5, 6, 7} <= named_steps(recovered[0]["warnings"]) <= set(range(1, 8))
    check_bits(tmp_path, [0])
    assert no_parity_left(nodes)


def test_rs_lose_a_node_during_the_fragment_update(tmp_path: Path) -> None:
    """Node 2 lost right after the last snapshot (stripes possibly in the
    mailbox, fragments incomplete): each of steps 5-7 is either rebuilt
    bit-exact or named as lost, never committed wrong."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2+2", [2], n=4, nowait=True)
    got = set(recovered[0]["recovered"])  # type: ignore[call-overload]
    warned = [w for w in recovered[0]["warnings"] if "were held" in w]  # type: ignore[union-attr]
    named = named_steps(warned) if warned else set()
    assert got <= set(range(8)) and not got & named, (got, named, nodes.logs())
    assert set(range(5, 8)) <= got | named, (got, named)
    committed = dstt.open(tmp_path / "run").steps()
    assert set(committed) - {0} == got - {0}
    check_bits(tmp_path, committed)


def test_rs_a_corrupted_fragment_is_never_used(tmp_path: Path) -> None:
    """Nodes 1 and 2 lost, and a bit of node 0's fragments of step 7
    flipped where it keeps them: those fragments are refused (named in a
    warning on node 0), step 7 is not rebuilt and is named; steps 5-6 are,
    bit-exact."""
    nodes, recovered = lose_nodes(tmp_path, "parity:2+2", [1, 2], n=4, corrupt=True)
    assert recovered[0]["recovered"] == [5, 6], nodes.logs()
    warned = recovered[0]["warnings"]
    assert 7 in named_steps([w for w in warned if "were held" in w])  # type: ignore[union-attr]
    assert any("is not used" in w and "CRC" in w for w in warned)  # type: ignore[union-attr]
    check_bits(tmp_path, [0, 5, 6])
    assert no_parity_left(nodes)
