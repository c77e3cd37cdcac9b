"""dstt.Capture under torch.distributed: real multi-process FSDP2 runs over
gloo on CPU (tests/dist/capture_fsdp.py), uneven shards included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.format.verify import verify

WORKER = Path(__file__).parents[1] / "dist" / "capture_fsdp.py"

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, out: Path, mode: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(WORKER), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    # A session of its own, so a hung run is killed with all its workers.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun with {nproc} processes hung:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]


def assert_bits(expected: Any, got: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert bits_equal(expected, got), f"{where} differs"
    elif isinstance(expected, dict):
        for k, v in expected.items():
            assert k in got, f"{where}/{k} missing"
            assert_bits(v, got[k], f"{where}/{k}")
    else:
        assert expected == got, f"{where}: {expected!r} vs {got!r}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process run (every mode), shared by the tests below."""
    out = tmp_path_factory.mktemp("dist2")
    torchrun(2, out, "ok,fail,pred,default,delta")  # (delta changes the process for what follows)
    return out


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist3")
    torchrun(3, out, "ok")
    return out


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fsdp2_capture_equals_unsharded_state(nproc: int, request: pytest.FixtureRequest) -> None:
    out = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[nproc]) / "ok"
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    assert run.steps() == [0, 1, 2, 3]
    for step, state in expected.items():
        got = run.state_dict(step)
        assert_bits(state, got, f"step {step}")
        assert bits_equal(got["extra"]["shared"], torch.arange(12.0).reshape(3, 4))
        assert sorted(got["rng"]) == [f"rank{r}" for r in range(nproc)]
    # the optimizer state really is there (and sharded over every rank)
    assert expected[3]["optim"]["0.weight"]["exp_avg"].shape == (10, 6)
    assert run.commit_info(3)["world_size"] == nproc
    # Committed by the capture helpers (one per rank) from per-rank records,
    # which are gone once the step is committed; the store verifies clean.
    assert [(out / f"helper{r}.txt").read_text() for r in range(nproc)] == ["True"] * nproc
    assert not list((out / "run" / "meta").rglob("rank-*.json"))
    report = verify(out / "run")
    assert report.ok and not report.partial, report


def test_fsdp2_capture_with_delta_coding_equals_unsharded_state(two_ranks: Path) -> None:
    """compression="delta" under FSDP2: each rank codes its own shards
    against its own keyframes; every step reads back exactly."""
    out = two_ranks / "delta"
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    assert run.steps() == [0, 1, 2, 3]
    for step, state in expected.items():
        assert_bits(state, run.state_dict(step), f"step {step}")
    # Diagnostics: what each tensor of step 3 was stored as, if none is a delta.
    entries = run.record(3).entries
    keys = [k for e in entries for k in (e.keyframes or [])]
    stored = [(e.name, e.codec.compression, e.keyframes, getattr(e, "packs", None)) for e in entries]
    assert any(k is not None for k in keys), f"no chunk of step 3 is delta coded: {stored}"


@pytest.mark.parametrize("mode", ["pred", "default"])
def test_fsdp2_predictive_coding_of_each_ranks_shards(two_ranks: Path, mode: str) -> None:
    """compression="predictive" under FSDP2 (2 ranks, gloo): each rank's
    capture helper codes its own shards (a parameter's chunk with its
    optimizer state's, against the rank's previous step); rank 0 commits
    every rank's pred records; the store is smaller than the raw state and
    every step reads back bit-exact against the unsharded reference.
    ``default``: the same with Capture's default options (no compression
    given): a distributed run is coded predictively by default too."""
    out = two_ranks / mode
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    assert run.steps() == list(range(8))
    assert [(out / f"helper{r}.txt").read_text() for r in range(2)] == ["True"] * 2
    raw = 0
    for step, state in expected.items():
        assert_bits(state, run.state_dict(step), f"step {step}")
        raw += sum(v.numel() * v.element_size() for v in flat_tensors(state))
    coded = [e for s in range(8) for e in run.record(s).entries if e.pred is not None]
    assert {c.predictor for e in coded for c in e.pred.codings} >= {"adam"}
    stored = sum(f.stat().st_size for d in ("tensors", "packs") if (out / "run" / d).exists()
                 for f in (out / "run" / d).rglob("*") if f.is_file() and f.name != "zarr.json")
    assert stored < raw, (stored, raw)
    assert verify(out / "run").ok


def flat_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in flat_tensors(v)]
    return []


def test_a_rank_failure_fails_the_step_everywhere(two_ranks: Path) -> None:
    out = two_ranks / "fail"
    run = dstt.open(out / "run")
    assert run.steps() == [0, 1]  # step 2 (and 3) not committed: rank 1's data is missing
    for rank in range(2):
        msg = (out / f"error{rank}.txt").read_text()
        assert "step 2" in msg and "rank 1" in msg and "No space left" in msg, msg
