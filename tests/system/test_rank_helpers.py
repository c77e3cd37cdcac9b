"""A capture helper per rank under torch.distributed (issue 12 item 2):
real torchrun/gloo runs of 2 ranks (tests/dist/capture_helpers.py) whose
helpers record each rank's chunks in the store and commit every step
without the trainers' process group -- also after the trainers (and the
helpers) were SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.capture import ranks
from dstt.capture.ring import ring_root
from dstt.format import layout as L
from dstt.format import rankparts
from dstt.format.localio import pid_alive
from dstt.format.verify import verify
from dstt.store.writer import Writer

WORKER = Path(__file__).parents[1] / "dist" / "capture_helpers.py"
ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.distributed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(out: Path, mode: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    # Its own session: the trainers' whole process group is killed at once
    # (what torchrun or a job scheduler does); the helpers have their own.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def finish(proc: subprocess.Popen[str], what: str) -> None:
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{what} hung:\n{output[-3000:]}")
    assert proc.returncode == 0, f"{what}:\n{output[-4000:]}"


def kill_trainers(proc: subprocess.Popen[str], out: Path) -> None:
    """SIGKILL torchrun and each rank's whole process group (torchrun starts
    every worker in a session of its own; the helpers have theirs)."""
    for r in range(2):
        pid_file = out / f"trainer{r}.pid"
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # torchrun may already have exited, its workers killed
        pass


def kill_when_staged(proc: subprocess.Popen[str], out: Path) -> None:
    """SIGKILL the trainers once every rank's step 3 is sealed."""
    deadline = time.monotonic() + 150
    while not (out / "staged").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_trainers(proc, out)
            output, _ = proc.communicate()
            pytest.fail(f"the trainers exited or hung before staging step 3:\n{output[-4000:]}")
        time.sleep(0.05)
    kill_trainers(proc, out)
    proc.communicate()


def helpers_gone(out: Path, timeout_s: float = 120.0) -> None:
    pids = [int((out / f"helper{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"capture helpers {pids} still running"
        time.sleep(0.05)


def assert_state(run: dstt.Run, step: int, expected: dict[int, Any]) -> None:
    got = run.state_dict(step)
    for group in ("model", "optim"):
        check(expected[step][group], got[group], f"step {step}: {group}")


def check(want: Any, got: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert bits_equal(want, got), f"{where} differs"
    elif isinstance(want, dict):
        for k, v in want.items():
            check(v, got[k], f"{where}/{k}")


def no_records(store: Path) -> None:
    """Committed steps keep no per-rank records (removed after the commit)."""
    assert not list((store / L.META / "steps").rglob("rank-*.json"))


def test_trainers_killed_after_staging_helpers_commit_the_step(tmp_path: Path) -> None:
    # (steps committed by live helpers, bit-exact: tests/system/test_capture_dist.py, FSDP2 over 2 and 3 ranks)
    kill_when_staged(torchrun(tmp_path, "kill"), tmp_path)
    helpers_gone(tmp_path)  # they finish step 3 by themselves, then exit
    run = dstt.open(tmp_path / "run")
    assert run.steps() == [0, 1, 2, 3]
    expected = torch.load(tmp_path / "expected.pt")
    for step in range(4):
        assert_state(run, step, expected)
    assert verify(tmp_path / "run").ok
    no_records(tmp_path / "run")
    with Writer(tmp_path / "run") as w:  # the branch is writable again (the lock went with the helpers)
        w.write(4, {"x": torch.ones(2)})


def test_helpers_killed_too_the_next_capture_recovers(tmp_path: Path) -> None:
    kill_when_staged(torchrun(tmp_path, "killall"), tmp_path)
    store = tmp_path / "run"
    assert dstt.open(store).steps() == [0, 1, 2]  # step 3 lives in the two rings only
    finish(torchrun(tmp_path, "resume"), "torchrun resume")
    assert (tmp_path / "recovered0.json").read_text() == "[3]"
    assert (tmp_path / "recovered1.json").read_text() == "[3]"
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2, 3, 4]
    expected = torch.load(tmp_path / "expected.pt")
    for step in range(4):
        assert_state(run, step, expected)
    report = verify(store)
    assert report.ok and not report.partial, report
    no_records(store)
    assert not [g for g in ring_root().glob("*/*") if g.joinpath("owner.json").exists()
                and str(store) in g.joinpath("owner.json").read_text()]


def test_recorded_on_one_rank_only_is_not_committed(tmp_path: Path) -> None:
    """Records that are not complete (one rank's only, or another run's) commit nothing."""
    store = tmp_path / "run"
    with Writer(store) as w:
        w.write(0, {"x": torch.ones(2)})
        plan = {"step": 1, "seq": 1, "tree": {}, "layouts": [], "meta": []}
        ranks.write_record(w.backend, "main", 1, 1, "run-a", 0, 2, results=[], plan=ranks.plan_doc(plan))
        ranks.write_record(w.backend, "main", 1, 1, "run-b", 1, 2, results=[])  # another run's
        assert ranks.commit_recorded(w) == []
        ranks.write_record(w.backend, "main", 1, 1, "run-a", 1, 2, results=[])
        assert ranks.commit_recorded(w, dry_run=True) == [1]
        assert ranks.commit_recorded(w) == [1]
        # A record is read from the store: one whose plan does not check out commits nothing, raises nothing.
        ranks.write_record(w.backend, "main", 2, 2, "run-a", 0, 1, results=[], plan={"layouts": 7})
        assert ranks.commit_recorded(w) == []
    assert dstt.open(store).steps() == [0, 1]
    assert not (store / L.step_dir("main", 1) / "rank-00000.json").exists()


def test_gc_commits_what_dead_ranks_left_in_their_rings(tmp_path: Path) -> None:
    """Trainers and helpers dead, no new Capture: `dstt gc` writes and
    records each rank's sealed step from its ring, commits it, then collects."""
    import json

    kill_when_staged(torchrun(tmp_path, "killall"), tmp_path)
    store = tmp_path / "run"
    cli = [sys.executable, "-m", "dstt.cli.main", "gc", str(store), "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    dry = subprocess.run([*cli, "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["committed"] == [{"branch": "main", "step": 3}]
    assert dstt.open(store).steps() == [0, 1, 2]
    real = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr
    assert json.loads(real.stdout)["committed"] == [{"branch": "main", "step": 3}]
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2, 3] and run.commit_info(3)["world_size"] == 2
    expected = torch.load(tmp_path / "expected.pt")
    assert_state(run, 3, expected)
    report = verify(store)
    assert report.ok and not report.partial, report
    no_records(store)


def test_the_gc_api_commits_a_step_every_rank_recorded_as_the_command_does(tmp_path: Path) -> None:
    """Issue 23 item 7: ``dstt.gc()`` from Python did not salvage as ``dstt
    gc`` does, and deleted a step sealed on every rank and recorded in the
    store (rank 0's helper could not commit it: its index write failed,
    injected), taking its uncommitted directory for a crash's leftovers.
    Now both run one path (salvage, then collect): the step is committed,
    bit-exact."""
    faults = tmp_path / "faults"
    faults.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(  # (the capture helpers get the faults through PYTHONPATH)
        f"import sys\nsys.path.insert(0, {str(WORKER.parent)!r})\nimport faults\nfaults.install()\n")
    env = {"DSTT_TEST_FAULTS": str(faults), "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    kill_when_staged(torchrun(tmp_path, "recorded", env), tmp_path)
    helpers_gone(tmp_path)  # they recorded step 3 (rank 0's failed to commit it), then exited
    (faults / "index-put").unlink()
    store = tmp_path / "run"
    step3 = store / L.step_dir("main", 3)
    assert dstt.open(store).steps() == [0, 1, 2]
    assert (step3 / "rank-00000.json").exists() and (step3 / "rank-00001.json").exists()
    assert not [r for r in ring_root().glob("*/*") if r.joinpath("owner.json").exists()
                and str(store) in r.joinpath("owner.json").read_text()]  # the step is in the records only
    report = dstt.gc(store)
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2, 3] and run.commit_info(3)["world_size"] == 2
    assert report.committed == {"main": [3]} and report.to_dict()["committed"] == [{"branch": "main", "step": 3}]
    assert_state(run, 3, torch.load(tmp_path / "expected.pt"))
    check = verify(store)
    assert check.ok and not check.partial, check
    no_records(store)


def test_a_chunk_result_survives_its_record() -> None:
    """What rank 0 commits from a record is what the rank's writer returned:
    every field, a sha256, a keyframe, a pack range and non-finite stats."""
    import math

    from dstt.format.commit import ChunkResult
    from dstt.format.packs import PackRange

    r = ChunkResult("model/w", 3, 0xDEADBEEF, bytes(range(32)), 5 << 24 | 7, 120, 256,
                    [1.5, float("inf"), float("-inf"), float("nan"), -0.0], keyframe=(5 << 24) | 1,
                    pack=PackRange(1, 0, 64, 120))
    back = rankparts.decode_result(rankparts.encode_result(r), "test")
    assert (back.name, back.index, back.crc, back.sha256, back.slot, back.written, back.nbytes, back.keyframe,
            back.pack) == (r.name, r.index, r.crc, r.sha256, r.slot, r.written, r.nbytes, r.keyframe, r.pack)
    assert back.partial[:3] == [1.5, float("inf"), float("-inf")] and math.isnan(back.partial[3])
    assert math.copysign(1.0, back.partial[4]) == -1.0
    with pytest.raises(dstt.errors.CorruptStoreError):
        rankparts.decode_result(["model/w", "3"], "test")
