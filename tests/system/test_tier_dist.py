"""The memory tier in every rank's capture helper under torch.distributed
(issue 25): real torchrun/gloo runs on CPU (tests/dist/tier_ranks.py),
FSDP2-sharded and DDP-style replicated state; every persisted step reads
back bit-exact against the unsharded reference, every rank persisted the
same steps (one commit per step, memory-only ranges recorded once), and an
incident raised on one rank dumps every rank's tier and is recorded once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_capture_dist import assert_bits, free_port  # noqa: F401  (free_port: the launcher's)

import dstt
from dstt.format.verify import verify

WORKER = Path(__file__).parents[1] / "dist" / "tier_ranks.py"

pytestmark = pytest.mark.distributed


def run_tier(nproc: int, out: Path, layout: str, policy: str, incident: bool = False) -> Path:
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER), str(out), layout, policy, *(["incident"] if incident else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]),
           "DSTT_RANK_WAIT_S": "60"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun with {nproc} processes hung:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    return out


def check(out: Path, nproc: int) -> list[int]:
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    steps = run.steps()
    for step in steps:
        got = run.state_dict(step)
        assert_bits(expected[step]["model"], got["model"], f"step {step} model")
        assert_bits(expected[step]["optim"], got["optim"], f"step {step} optim")
        assert run.commit_info(step)["world_size"] == nproc
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert {r["tier_where"] for r in ranks} == {"helper"}
    # the memory bound per rank: (K + 4) step slots of this rank's shards (+1 MiB of slack each), in MiB
    assert all(0 < r["memory_bytes"] <= 8 << 20 for r in ranks), ranks
    assert not list((out / "run" / "meta" / "tier").rglob("rank-*.json"))  # held records removed at close
    report = verify(out / "run")
    assert report.ok, report
    return steps


def test_two_ranks_fsdp2_every_nth_with_an_incident_on_one_rank(tmp_path: Path) -> None:
    out = run_tier(2, tmp_path, "fsdp", "4", incident=True)
    steps = check(out, 2)
    run = dstt.open(out / "run")
    incs = run.incidents()
    assert [(i.step, i.source, i.rank, i.world) for i in incs] == [(6, "trainer", 1, 2)]  # recorded once
    assert {3, 4, 5, 6} <= set(steps)  # every rank's tier dumped: the steps stored whole
    assert {0, 4, 8, 9} <= set(steps)  # the policy's (1st, 5th, 9th) and the last
    spans, persisted = run.captured()
    assert spans == [(0, 9)] and persisted == steps


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("layout", ["fsdp", "replicated"])
@pytest.mark.parametrize("policy", ["all", "newest", "3"])
def test_every_policy_bit_exact_on_every_layout(tmp_path: Path, nproc: int, layout: str, policy: str) -> None:
    out = run_tier(nproc, tmp_path, layout, policy)
    steps = check(out, nproc)
    spans, persisted = dstt.open(out / "run").captured()
    assert spans == [(0, 9)] and persisted == steps and steps[-1] == 9
    if policy == "all":
        assert steps == list(range(10))
    elif policy == "3":
        assert steps == [0, 3, 6, 9]
