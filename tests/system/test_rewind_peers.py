"""The collective rewind from memory of replicated state reads the other
ranks' share of the step from their rings on the same host (issue 25,
capture/peerring.py, capture/rewindpeers.py): real torchrun/gloo runs on
CPU, every restore compared bit for bit with the step's state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tier_dist import WORKER, run_tier

pytestmark = pytest.mark.distributed


@pytest.mark.slow  # (~25 s: a torchrun, a Capture with its helpers, three rewinds each opening a branch)
def test_two_ranks_rewind_from_memory_reads_the_other_ranks_ring_in_place(tmp_path: Path) -> None:
    """tests/dist/tier_rewind_peers.py, DDP-style state over 2 ranks, three
    rewinds from memory: (1) the other rank's chunks are read in place from
    its /dev/shm pool (nothing crosses gloo); (2) rank 1's read of rank 0's
    ring torn on purpose -- its mapped bytes overwritten and rank 0's lease
    rewritten after the mapping -- so rank 1 takes them again over gloo and
    restores again; (3) each rank its own node id (other hosts): everything
    over gloo; (4) rank 1's mapping of rank 0's ring fails: rank 1 restores
    after the last collective, from those chunks sent over gloo. Every rank's live state is the step's, bit for bit, after
    each, and no lease is left in a ring."""
    out = run_tier(2, tmp_path, "", "", worker=WORKER.with_name("tier_rewind_peers.py"))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        for name in ("inplace", "changed", "other_host", "unmapped"):
            assert s[name]["bit_exact"], (r, name, s)
            assert s[name]["leases_left"] == [], (r, name, s)
        inplace = s["inplace"]["exchanged"]
        assert inplace["mapped"] > 0 and inplace["gloo"] == 0 and inplace["again"] == 0, (r, s)
        other = s["other_host"]["exchanged"]
        assert other["mapped"] == 0 and other["gloo"] == inplace["mapped"], (r, s)
    # rank 1 mapped rank 0's share, saw it change and took all of it again; rank 0 saw nothing change
    assert seen[1]["changed"]["exchanged"]["again"] == seen[1]["changed"]["exchanged"]["mapped"] > 0, seen
    assert seen[0]["changed"]["exchanged"]["again"] == 0, seen
    assert seen[1]["unmapped"]["exchanged"] == {"mapped": 0, "gloo": seen[1]["inplace"]["exchanged"]["mapped"],
                                                "again": 0}, seen
    assert seen[0]["unmapped"]["exchanged"] == seen[0]["inplace"]["exchanged"], seen  # (rank 0 mapped rank 1's)
