"""The memory tier in every rank's capture helper under torch.distributed
(issue 25): real torchrun/gloo runs on CPU (tests/dist/tier_ranks.py),
FSDP2-sharded and DDP-style replicated state; every persisted step reads
back bit-exact against the unsharded reference, every rank persisted the
same steps (one commit per step, memory-only ranges recorded once), and an
incident raised on one rank dumps every rank's tier and is recorded once."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from test_capture_dist import assert_bits, free_port  # noqa: F401  (free_port: the launcher's)

import dstt
from dstt import knobs
from dstt.format.verify import verify

WORKER = Path(__file__).parents[1] / "dist" / "tier_ranks.py"

pytestmark = pytest.mark.distributed


def kill_job(pid: int, helpers: bool = False) -> list[int]:
    """SIGKILL the job started as ``pid`` -- the launcher and every trainer
    below it -- and, with ``helpers``, their capture helpers too (which
    otherwise live on: they are in sessions of their own, by design).
    The pids killed."""
    import os
    import signal

    tree = _tree(pid)
    killed = []
    for p in tree:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                helper = b"dstt.capture.helper" in f.read()
        except OSError:
            continue
        if helper and not helpers:
            continue
        try:
            os.kill(p, signal.SIGKILL)
            killed.append(p)
        except OSError:
            pass
    return killed


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def run_tier(nproc: int, out: Path, layout: str, policy: str, incident: bool = False, worker: Path = WORKER,
             worker_args: tuple[str, ...] = ()) -> Path:
    import os
    import subprocess
    import sys

    args = [layout, policy, *(["incident"] if incident else [])] if worker == WORKER else list(worker_args)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(worker), str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]),
           "DSTT_RANK_WAIT_S": "60"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        kill_job(proc.pid, helpers=True)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun with {nproc} processes hung:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    return out


def _owner(ring: Path) -> str:
    """The store a ring directory in /dev/shm belongs to (its owner record), or ""."""
    try:
        return (ring / "owner.json").read_text()[:4096]
    except OSError:
        return ""


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
    # a clean close leaves no record of the run's memory tier (held steps,
    # decisions, incident requests) and nothing in /dev/shm
    assert not list((out / "run" / "meta" / "tier").rglob("*.json"))
    shm = knobs.shm_dir() or Path("/dev/shm")
    assert not [p for p in shm.glob(f"dstt-{os.getuid()}/*/*") if str(out) in _owner(p)]
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


@pytest.mark.slow
def test_collective_rewind_from_every_ranks_helper_tier(tmp_path: Path) -> None:
    """tests/dist/tier_rewind.py: an incident on rank 1, then ``rewind(6)``
    on both ranks (a step never persisted: read from both helpers' rings)
    restores every rank's shards bit for bit and training continues on one
    new branch -- its step 7 equal to the first run's step 7. A rewind to a
    step no rank holds, to different steps per rank, or to a step one
    rank's helper lost (and never stored) raises the same dstt error on
    every rank and changes nothing; nothing hangs."""
    out = run_tier(2, tmp_path, "", "", worker=WORKER.with_name("tier_rewind.py"))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert s["evicted"].startswith("StepNotFoundError: cannot rewind to step 1: it is neither in the memory "
                                       "tier of every rank nor stored on branch 'main'"), (r, s)
        assert s["different"].startswith("StepOrderError: rewind is collective") and "rank 0: 6, rank 1: 7" in \
            s["different"], (r, s)
        assert s["unchanged"] and s["restored"] and s["from_memory"], (r, s)
        assert s["lost_on_one_rank"].startswith("StepNotFoundError: cannot rewind to step 3") and \
            "no longer in the memory tier of rank(s) 1 (the others still hold it)" in s["lost_on_one_rank"], (r, s)
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    assert sorted(run.branches()) == ["main", "retry"]
    assert run.branch_info("retry").parent == dstt.StepRef("main", 6)
    assert run.steps("retry") == [7, 9]  # persist=100 on the new branch: its first step and the last (close)
    for branch in ("main", "retry"):
        for step in run.steps(branch):
            got = run.state_dict(step, branch=branch)
            assert_bits(expected[branch][step]["model"], got["model"], f"{branch} {step} model")
            assert_bits(expected[branch][step]["optim"], got["optim"], f"{branch} {step} optim")
    assert {0, 3, 4, 5, 6} <= set(run.steps("main"))  # the policy's, rank 1's incident's (2: if still held), the fork step
    assert_bits(expected["main"][7], expected["retry"][7], "the retry's step 7 vs the first run's")
    assert [(i.step, i.source) for i in run.incidents()] == [(5, "trainer"), (6, "rewind")]  # once each
    assert verify(out / "run").ok


@pytest.mark.slow
def test_a_stopped_helper_fails_every_rank_within_the_bound(tmp_path: Path) -> None:
    """tests/dist/tier_stopped.py: rank 0's helper SIGSTOPped with
    ``background_timeout_s=4``: rank 0's trainer fails with a dstt error
    within the bound (plus the ledger's grace and the time the steps took),
    rank 1's never waits past it either (its helper, polling for rank 0's
    decisions, does not count as progress), and the job ends."""
    out = run_tier(2, tmp_path, "", "", worker=WORKER.with_name("tier_stopped.py"))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0]["error"] and "no progress for" in seen[0]["error"], seen
    assert all(0 <= s["after_s"] <= 4 + 2 + 10 for s in seen), seen  # bound + grace + the 37 steps' loop
    # the steps sealed after the stop stay in the ring: gc commits them, and nothing is left in /dev/shm
    report = dstt.gc(out / "run")
    assert report.committed.get("main"), report
    assert verify(out / "run").ok


@pytest.mark.slow
def test_a_stopped_helper_without_the_tier_fails_every_rank_within_the_bound(tmp_path: Path) -> None:
    """The same without the memory tier (each step committed by the helpers):
    rank 0's helper SIGSTOPped, rank 1's helper alive but polling the store
    for rank 0's commit. Only a helper's answers (outcomes, ``busy`` lines)
    count as its progress, so every rank's trainer raises a dstt error within
    ~2x ``background_timeout_s`` (before: rank 1's helper's polls counted,
    and its trainer waited until its helper gave up on rank 0, DSTT_RANK_WAIT_S)."""
    out = run_tier(2, tmp_path, "", "", worker=WORKER.with_name("tier_stopped.py"), worker_args=("plain",))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["error"] for s in seen), seen
    assert all(0 <= s["after_s"] <= 2 * 4 + 2 for s in seen), seen  # ~2x the bound (+ the ledger's grace)
    report = dstt.gc(out / "run")  # the steps sealed after the stop stay in the rings: gc commits them
    assert report.committed.get("main"), report
    assert verify(out / "run").ok


@pytest.mark.slow
def test_gc_removes_the_records_of_a_run_whose_helper_was_killed(tmp_path: Path) -> None:
    """Rank 1's helper SIGKILLed mid-run: both trainers fail loudly (rank 0
    at its next collective) and end; rank 1's helper never closes, so the
    run's records stay under meta/tier (before: for ever, gc left them --
    its closed marks, decisions, the dead helper's held record). gc proves
    the run over -- every rank closed, or its helper and trainer gone and
    its ring salvaged -- and removes them all; the store verifies."""
    out = run_tier(2, tmp_path, "", "", worker=WORKER.with_name("tier_stopped.py"), worker_args=("killed",))
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[1]["error"] and "capture helper" in seen[1]["error"], seen
    tier = out / "run" / "meta" / "tier" / "main"
    runs = [p for p in tier.iterdir() if p.name != "held"]
    assert len(runs) == 1 and not (runs[0] / "closed-1.json").exists()
    assert (tier / "held" / "rank-00001.json").exists()  # (the dead helper's last word)
    report = dstt.gc(out / "run")
    assert report.tier_records_removed >= 3, report  # (the two open marks and a held record at least)
    assert not list(tier.rglob("*.json")), sorted(str(p) for p in tier.rglob("*.json"))
    assert verify(out / "run").ok


def _crash_run(out: Path, who: str) -> Any:
    """tests/dist/tier_crash.py under torchrun, in its own session; returns
    once every rank wrote its ready file (the process is still running)."""
    import os
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER.with_name("tier_crash.py")), str(out), who]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]),
           "DSTT_RANK_WAIT_S": "20", "DSTT_RANK_WAIT_DEAD_S": "20"}
    log = open(out / "torchrun.log", "w")  # noqa: SIM115 (the run outlives this function)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not all((out / f"ready{r}").exists() for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, "the trainers did not get ready"
        time.sleep(0.2)
    return proc


def _stored_bit_exact(out: Path, want: set[int], limit_s: float = 120) -> list[int]:
    """Wait (bounded) until the helpers stored ``want``; check every stored step."""
    import time

    deadline = time.monotonic() + limit_s
    while True:
        steps = set(dstt.open(out / "run").steps()) if (out / "run").exists() else set()
        if want <= steps or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert want <= steps, sorted(steps)
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    for step in sorted(steps):
        got = run.state_dict(step)
        assert_bits(expected[step]["model"], got["model"], f"step {step} model")
        assert_bits(expected[step]["optim"], got["optim"], f"step {step} optim")
    return sorted(steps)


@pytest.mark.slow
def test_sigkill_of_the_whole_job_after_an_incident(tmp_path: Path) -> None:
    """Every trainer (and the launcher) SIGKILLed after rank 1's incident at
    step 4, step 5 sealed after it: every rank's helper sees its trainer
    die and stores what its tier holds as one "crash" incident -- step 5
    included -- so the K steps up to the incident and every step sealed
    after it are in the store, bit-exact, the incident recorded once, and
    the store verifies. (Rank 1 may ask for step 1 too -- a helper one step
    behind holds K + 1 -- which rank 0's tier has let go of: rank 0 says so
    at once, and step 1 is not stored.)"""
    proc = _crash_run(tmp_path, "job")
    kill_job(proc.pid)
    proc.wait(30)
    _stored_bit_exact(tmp_path, {0, 2, 3, 4, 5})
    _helpers_gone(tmp_path)
    incs = dstt.open(tmp_path / "run").incidents()
    assert [(i.step, i.source) for i in incs if i.source == "trainer"] == [(4, "trainer")]
    assert [i.source for i in incs if i.source == "crash"] == ["crash"]  # once, for every rank
    assert verify(tmp_path / "run").ok


@pytest.mark.slow
def test_sigkill_of_the_whole_job_and_its_helpers_then_dstt_gc(tmp_path: Path) -> None:
    """Everything SIGKILLed -- launcher, trainers and helpers -- after rank
    1's incident at step 4 with step 5 sealed after it: the rings stay in
    /dev/shm; ``dstt gc`` (the CLI) commits every step every rank sealed
    and nobody stored (step 5), bit-exact, and the store verifies."""
    import subprocess
    import sys
    import time

    proc = _crash_run(tmp_path, "job")
    time.sleep(1.0)  # (the helpers idle: everything sealed is handed over)
    kill_job(proc.pid, helpers=True)
    proc.wait(30)
    before = set(dstt.open(tmp_path / "run").steps())
    assert 5 not in before, sorted(before)
    done = subprocess.run([sys.executable, "-m", "dstt.cli.main", "gc", str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300, env=_cli_env())
    assert done.returncode == 0, done.stdout + done.stderr
    steps = _stored_bit_exact(tmp_path, before | {5}, limit_s=1)
    assert "committed" in done.stdout and "5" in done.stdout, done.stdout
    assert 5 in steps
    assert verify(tmp_path / "run").ok
    # the crash is recorded by gc, once for the run (not per rank), naming both ranks (crashnote.py)
    crash = _one_crash(tmp_path, "dstt gc")
    assert "recorded a crash incident at step 5" in done.stdout, done.stdout
    assert dstt.gc(tmp_path / "run").committed == {}
    assert dstt.open(tmp_path / "run").incidents() == [*_trainer_incident(tmp_path), crash]  # a second gc: the same


def _one_crash(out: Path, finder: str) -> Any:
    """The one crash incident of the run at ``out``: at step 5, the last
    step every rank sealed, naming both ranks and step 5, found by ``finder``."""
    incs = dstt.open(out / "run").incidents()
    crashes = [i for i in incs if i.source == "crash"]
    assert len(crashes) == 1, incs
    crash = crashes[0]
    assert (crash.step, crash.ranks, crash.world) == (5, (0, 1), 2), crash
    assert 5 in crash.steps and set(crash.steps) <= set(dstt.open(out / "run").steps()), crash
    assert finder in crash.reason and crash.reason.endswith("(ranks 0, 1 of 2)"), crash.reason
    return crash


def _trainer_incident(out: Path) -> list[Any]:
    return [i for i in dstt.open(out / "run").incidents() if i.source == "trainer"]


@pytest.mark.slow
def test_sigkill_of_the_whole_job_and_its_helpers_then_a_new_capture(tmp_path: Path) -> None:
    """As above, but no gc: the restarted job's Capture (2 ranks under
    torchrun) salvages every rank's ring, commits step 5 bit-exact and
    records the crash once for the run, naming both ranks; a gc after it
    finds nothing more to commit or record."""
    import subprocess
    import sys
    import time

    proc = _crash_run(tmp_path, "job")
    time.sleep(1.0)  # (the helpers idle: everything sealed is handed over)
    kill_job(proc.pid, helpers=True)
    proc.wait(30)
    assert 5 not in dstt.open(tmp_path / "run").steps()
    assert [i.source for i in dstt.open(tmp_path / "run").incidents()] == ["trainer"]  # (nobody recorded the crash)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER.with_name("tier_crash.py")), str(tmp_path), "resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    recovered = [json.loads((tmp_path / f"recovered{r}.json").read_text()) for r in range(2)]
    assert recovered[0] == recovered[1] and 5 in recovered[0], recovered
    _stored_bit_exact(tmp_path, {5}, limit_s=1)
    crash = _one_crash(tmp_path, "the next Capture")
    assert dstt.gc(tmp_path / "run").committed == {}
    assert dstt.open(tmp_path / "run").incidents() == [*_trainer_incident(tmp_path), crash]


def _cli_env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}


def _helpers_gone(out: Path, limit_s: float = 60) -> None:
    """Every capture helper of the run at ``out`` exits (bounded)."""
    import os
    import time

    deadline = time.monotonic() + limit_s
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read()
                except OSError:
                    continue
                if b"dstt.capture.helper" in cmd and str(out).encode() in cmd:
                    left.append(int(entry))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"capture helpers {left} still run {limit_s:g} s after their trainers died"


@pytest.mark.slow
def test_sigkill_of_one_ranks_trainer(tmp_path: Path) -> None:
    """Rank 1's trainer SIGKILLs itself after step 5: rank 0's trainer,
    capturing on, fails with an error within the bound (no hang), and the
    incident's steps are in the store, bit-exact."""
    import os
    import signal
    import time

    proc = _crash_run(tmp_path, "rank1")
    deadline = time.monotonic() + 120
    while not (tmp_path / "rank0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        seen = json.loads((tmp_path / "rank0.json").read_text())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert seen["error"] and 0 <= seen["after_s"] <= 60, seen
    _stored_bit_exact(tmp_path, {0, 2, 3, 4})
    assert verify(tmp_path / "run").ok
