"""Crash consistency: writer processes capturing every iteration are killed
with SIGKILL at random moments; after every kill the store must be exactly
the committed steps, each bit-exact and verified, and a new writer on the
same branch must continue appending."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import dstt
from dstt.api import gc
from dstt.errors import DsttError
from dstt.format import layout as L
from dstt.format.packs import pack_key
from dstt.format.verify import partial_steps, verify
from tests.conftest import bits_equal
from tests.crash_worker import MAX_CHUNK_BYTES, expected_state

ROOT = Path(__file__).resolve().parents[2]


class Zygote:
    """A real subprocess that imported torch once and forks writer processes."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.crash_worker", "zygote"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _ask(self, line: str, timeout: float = 60.0) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"zygote did not answer {line!r} within {timeout} s")
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"zygote exited (rc={self.proc.poll()})")
        return answer.split()[1]

    def fork(self, store: Path, branch: str = "main", n_steps: int = 0, mode: str = "auto", pause_s: float = 0.0) -> int:
        return int(self._ask(f"fork {store} {branch} {n_steps} {mode} {pause_s}", timeout=120))

    def wait(self, pid: int, timeout: float = 120.0) -> int:
        return int(self._ask(f"wait {pid}", timeout))

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote() -> Any:
    z = Zygote()
    yield z
    z.close()


def assert_step_exact(run: dstt.Run, step: int, branch: str = "main") -> None:
    got = run.state_dict(step, branch=branch, verify=True)["extra"]
    want = expected_state(step)["extra"]
    assert got["loop"] == want["loop"], step
    for group in ("model", "optim"):
        for name, t in want[group].items():
            assert bits_equal(got[group][name], t), f"step {step}: {group}/{name} differs"


def check_store(store: Path, checked: set[int], branch: str = "main") -> list[int]:
    """Everything a crash must leave true; the committed steps."""
    if not (store / "zarr.json").exists():
        return []  # killed before the store was created
    run = dstt.open(store)
    if branch not in run.branches():
        return []
    steps = run.steps(branch)
    # The writer always resumes right after the last commit: no gap, no partial step listed.
    assert steps == list(range(len(steps))), steps
    assert all(p > (steps[-1] if steps else -1) for p in partial_steps(run.backend, branch))
    report = verify(store)
    assert report.ok, [str(p) for p in report.problems]
    for s in steps:
        if s not in checked or s == steps[-1]:
            assert_step_exact(run, s, branch)
            checked.add(s)
    # Earlier steps are still read back through their chunk digests by verify.
    return steps


def newest_step(store: Path, branch: str = "main") -> int:
    """The newest committed step of ``branch`` (-1: none yet); read while a writer runs."""
    try:
        run = dstt.open(store)
        steps = run.steps(branch) if branch in run.branches() else []
    except (DsttError, OSError):
        return -1  # the store is being created
    return steps[-1] if steps else -1


def wait_for_commit(store: Path, after: int, pid: int, timeout_s: float = 60.0) -> None:
    """Until a step newer than ``after`` is committed (or the writer died)."""
    deadline = time.monotonic() + timeout_s
    while newest_step(store) <= after and alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"no step after {after} committed within {timeout_s} s")
        time.sleep(0.05)


def kill_trials(zygote: Zygote, store: Path, trials: int, seed: int, max_delay: float,
                gc_every: int = 0, mode: str = "auto", pause_s: float = 0.0,
                after_commit_every: int = 0) -> dict[str, int]:
    """``trials`` writers killed at random moments; every ``after_commit_every``-th
    one only once it committed a new step (then at a random moment after it),
    so kills after commits are trialled however slow the machine is."""
    rng = random.Random(seed)
    checked: set[int] = set()
    outcome = {"killed": 0, "finished_before_kill": 0, "steps": 0, "trials_with_progress": 0}
    before = -1
    for trial in range(trials):
        pid = zygote.fork(store, mode=mode, pause_s=pause_s)
        if after_commit_every and trial % after_commit_every == after_commit_every - 1:
            wait_for_commit(store, before, pid)
        time.sleep(rng.uniform(0.0, max_delay))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = zygote.wait(pid)
        wait_unlocked(store)  # its capture helper finishes the sealed steps, then frees the branch
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            outcome["killed"] += 1
        else:
            outcome["finished_before_kill"] += 1
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"writer failed: status {status}"
        steps = check_store(store, checked)
        if gc_every and outcome["killed"] % gc_every == 0:
            collect_orphans(store)
        last = steps[-1] if steps else -1
        outcome["trials_with_progress"] += last > before
        before = last
    outcome["steps"] = before + 1
    return outcome


def referenced_keys(store: Path) -> set[str]:
    run = dstt.open(store)
    keys = set()
    for b in run.branches():
        for s in run.steps(b):
            for e in run.record(s, branch=b).entries:
                for i in range(e.nchunks):
                    packed = e.pack(i)
                    if packed is not None:  # small chunks live in packs (format 3)
                        keys.add(pack_key(e.slots[i], packed.rank, packed.n))
                        continue
                    key = e.keyframe(i)  # delta coded: the delta and its keyframe
                    keys.add(L.chunk_key(e.array if key is None else e.delta_array or "", e.slots[i], e.coords(i)))
                    if key is not None:
                        keys.add(L.chunk_key(e.array, key, e.coords(i)))
    return keys


def chunk_files(store: Path) -> set[str]:
    """Chunk files and packs of small chunks in ``store``."""
    return {str(p.relative_to(store)) for p in (store / "tensors").rglob("*")
            if p.is_file() and p.name != "zarr.json" and "/c." in str(p.relative_to(store))} | \
        {str(p.relative_to(store)) for p in (store / "packs").glob("p.*") if p.is_file()}


def collect_orphans(store: Path) -> None:
    """gc (issue 5) after a kill removes the partial step and its chunks, and
    nothing any committed step needs (committing first, issue 23, the steps
    the killed writer left sealed)."""
    if not (store / "zarr.json").exists():
        return  # killed before the store existed
    run = dstt.open(store)
    has_main = "main" in run.branches()  # killed before the branch existed: still collectable
    before = run.steps() if has_main else []
    gc(store)  # (dstt.gc: first commits what the killed writer left sealed in its ring)
    run = dstt.open(store)
    after = run.steps() if has_main else []
    assert after[:len(before)] == before and after == list(range(len(after))), (before, after)
    assert not has_main or partial_steps(run.backend, "main") == []
    assert chunk_files(store) == referenced_keys(store)  # no orphaned chunk left, none needed removed
    assert verify(store).ok


def finish_and_collect(zygote: Zygote, store: Path) -> None:
    """gc removes orphans; then a new writer continues appending."""
    collect_orphans(store)
    n_before = len(dstt.open(store).steps()) if (store / "zarr.json").exists() else 0
    pid = zygote.fork(store, n_steps=3)
    status = zygote.wait(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    steps = check_store(store, set())
    # its 3 steps, after any that the last killed writer had sealed (committed first)
    assert steps == list(range(len(steps))) and len(steps) >= n_before + 3, (steps, n_before)


def test_sigkill_random_moments_quick(zygote: Zygote, tmp_path: Path) -> None:
    store = tmp_path / "run"
    # 10 ms of "training" between steps: kills land in snapshot, staging and
    # background commits alike, and the store stays ~100 steps, not ~1000
    # (every trial verifies the whole store). 8 trials, every second one
    # killed only after a new commit (4 with progress), gc after the 4th and
    # 8th kill; 240 trials without pauses: -m slow.
    out = kill_trials(zygote, store, trials=8, seed=6, max_delay=0.6, gc_every=4, pause_s=0.01,
                      after_commit_every=2)
    print("kill trials:", out)
    assert out["killed"] >= 7, out  # a writer never finishes on its own (infinite loop)
    assert out["trials_with_progress"] >= 3, out  # kills landed after commits, not only at startup
    finish_and_collect(zygote, store)


@pytest.mark.slow  # (the quick trial above covers the default coding under kills)
def test_sigkill_random_moments_with_delta_coding(zygote: Zygote, tmp_path: Path) -> None:
    """The same trials with compression="delta": every committed step reads
    back exactly (deltas against keyframes a killed writer wrote, and a new
    writer's keyframes), gc keeps what kept deltas need."""
    store = tmp_path / "run"
    out = kill_trials(zygote, store, trials=8, seed=8, max_delay=0.5, gc_every=4, mode="delta", pause_s=0.01,
                      after_commit_every=3)
    # (progress across trials is the quick trial's subject; here: committed delta steps survive)
    assert out["killed"] >= 6 and out["steps"] >= 2, out
    run = dstt.open(store)
    assert any(k is not None for s in run.steps() for k in (run.entry("extra/model/smooth", s).keyframes or []))
    finish_and_collect(zygote, store)


def test_kill_during_store_creation_is_recoverable(zygote: Zygote, tmp_path: Path) -> None:
    """Kills in the first milliseconds (creating the store and branch) never
    leave a store the next writer refuses."""
    store = tmp_path / "run"
    out = kill_trials(zygote, store, trials=6, seed=1, max_delay=0.02)
    assert out["killed"] == 6
    finish_and_collect(zygote, store)


def wait_unlocked(store: Path, branch: str = "main", timeout: float = 60.0) -> None:
    """A killed trainer's capture helper commits what was sealed, then exits
    and frees the branch: no helper is left after its work."""
    from dstt.format.lock import lock_holder

    deadline = time.monotonic() + timeout
    while (store / "zarr.json").exists() and lock_holder(store, branch) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"branch {branch} still locked {timeout} s after its writer was killed")
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_stopped(pid: int, timeout: float = 60.0) -> None:
    """Wait until ``pid`` stopped itself (SIGSTOP: state T in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        if state == "Z":
            raise AssertionError(f"writer {pid} exited instead of stopping")
        time.sleep(0.005)
    raise TimeoutError(f"writer {pid} did not reach wait_staged() within {timeout} s")


def leftover_rings(store: Path) -> list[Path]:
    from dstt.capture.ring import group_dir

    group = group_dir(str(store), "main")
    return sorted(group.iterdir()) if group.exists() else []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_sigkill_right_after_wait_staged_loses_no_step(zygote: Zygote, tmp_path: Path) -> None:
    """Issue 12: a trainer SIGKILLed right after wait_staged() (before the
    background commit) lost the step in 6 trials out of 6. Now every step
    staged is committed bit-exact and verified: by its capture helper when
    only the trainer dies (even trials; the helper then exits and frees the
    branch), by the next Capture on the branch when the helper is killed
    too (odd trials). No ring is left behind, the branch is writable again."""
    store = tmp_path / "run"
    marks = Path(f"{store}.staged")
    checked: set[int] = set()
    recovered = 0
    for trial in range(12):
        pid = zygote.fork(store, n_steps=0, mode="staged")
        wait_stopped(pid)
        staged, helper = map(int, marks.read_text().split("\n")[-2].split())
        assert helper and alive(helper), "no capture helper running beside the trainer"
        if trial % 2:
            os.kill(helper, signal.SIGKILL)  # the whole job dies: the helper first, the trainer stopped
        os.kill(pid, signal.SIGKILL)
        assert os.WIFSIGNALED(zygote.wait(pid))
        wait_unlocked(store)
        deadline = time.monotonic() + 30
        while alive(helper) and time.monotonic() < deadline:  # reaped by init once it exits
            time.sleep(0.01)
        assert not alive(helper), "the capture helper outlived its work"
        if trial % 2:
            assert leftover_rings(store)  # the sealed steps wait in /dev/shm ...
            # ... for the next Capture (it recovers in its own process before starting any
            # helper: none is started here, it would only be closed again)
            with dstt.Capture(store, max_chunk_bytes=MAX_CHUNK_BYTES, helper=False) as cap:
                recovered += len(cap.recovered)
        assert leftover_rings(store) == []
        steps = check_store(store, checked)
        assert steps[-1] >= staged, (steps, staged)
    print("steps recovered from the rings of killed jobs:", recovered)
    assert recovered >= 3  # kills landed while sealed steps were not committed yet
    finish_and_collect(zygote, store)
    assert leftover_rings(store) == []


@pytest.mark.slow
def test_sigkill_random_moments_many(zygote: Zygote, tmp_path: Path) -> None:
    total = {"killed": 0, "trials_with_progress": 0}
    for seed in range(4):
        store = tmp_path / f"run{seed}"
        out = kill_trials(zygote, store, trials=60, seed=100 + seed, max_delay=0.8, gc_every=5)
        print("kill trials:", out)
        total["killed"] += out["killed"]
        total["trials_with_progress"] += out["trials_with_progress"]
        finish_and_collect(zygote, store)
    assert total["killed"] >= 200


@pytest.mark.slow
def test_sigkill_two_branches_concurrently(zygote: Zygote, tmp_path: Path) -> None:
    """Writers on two branches of one store, killed at random moments."""
    store = tmp_path / "run"
    pid = zygote.fork(store, "main", n_steps=1)
    assert os.WEXITSTATUS(zygote.wait(pid)) == 0
    rng = random.Random(7)
    checked: dict[str, set[int]] = {"main": set(), "side": set()}
    for _ in range(20):
        pids = [zygote.fork(store, b) for b in ("main", "side")]
        time.sleep(rng.uniform(0.05, 0.6))
        for p in pids:
            os.kill(p, signal.SIGKILL)
        for p in pids:
            zygote.wait(p)
        for b in ("main", "side"):
            check_store(store, checked[b], b)
