"""Concurrency: readers (API and CLI) running beside a capturing writer see
only committed steps; one writer per branch (a lock a crashed writer's death
releases, breakable explicitly); writers on different branches proceed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import StoreLockedError
from dstt.format.backends import open_backend
from dstt.format.lock import acquire, acquire_all, break_lock, lock_holder
from dstt.format.verify import verify
from dstt.format.writeoptions import WriteOptions
from tests.conftest import bits_equal
from tests.crash_worker import expected_state

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def wait_for(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def committed(path: Path) -> list[int]:
    try:
        return dstt.open(path).steps()
    except dstt.DsttError:
        return []


def test_readers_beside_a_live_writer(tmp_path: Path) -> None:
    path = tmp_path / "run"
    writer = subprocess.Popen([sys.executable, "-m", "tests.crash_worker", "write", str(path), "main", "0", "auto", "0.05"],
                              cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    seen: dict[str, int] = {"reads": 0, "max_step": -1}
    errors: list[BaseException] = []

    def api_reader() -> None:
        try:
            while not stop.is_set():
                steps = committed(path)
                if not steps:
                    time.sleep(0.02)
                    continue
                run = dstt.open(path)
                s = steps[-1]  # the newest committed step: the one most at risk
                got = run.state_dict(s, verify=True)["extra"]
                want = expected_state(s)["extra"]
                assert bits_equal(got["model"]["w"], want["model"]["w"]), s
                assert got["loop"] == want["loop"]
                assert run.steps()[: len(steps)] == steps  # only ever grows
                seen["reads"] += 1
                seen["max_step"] = max(seen["max_step"], s)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    t = threading.Thread(target=api_reader, daemon=True)
    try:
        t.start()
        wait_for(lambda: len(committed(path)) >= 2 or writer.poll() is not None, 120, "the writer's first commits")
        assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
        # A second writer on the same branch is refused while the first lives ...
        with pytest.raises(StoreLockedError, match=f"pid {writer.pid}"):
            dstt.Writer(path)
        # ... one on another branch proceeds.
        with dstt.Writer(path, WriteOptions(branch="side")) as w:
            w.write(0, {"x": torch.ones(2)})
        # CLI readers in other processes, while the writer keeps committing.
        for _ in range(1):
            cli = subprocess.run([sys.executable, "-m", "dstt.cli.main", "verify", f"{path}:latest", "--json"],
                                 cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
            assert cli.returncode == 0, cli.stdout + cli.stderr
            doc = json.loads(cli.stdout)
            assert doc["ok"] and doc["steps"] == 1 and doc["tensors"] >= 5
        # The reader thread has read at least three steps while the writer
        # lives (waited for: on a loaded machine it may not have yet).
        wait_for(lambda: seen["reads"] >= 3 or bool(errors) or not t.is_alive(), 120, "three reads")
        wait_for(lambda: len(committed(path)) > 2 or writer.poll() is not None, 120, "a third commit")
        assert writer.poll() is None
        assert len(committed(path)) > 2
    finally:
        stop.set()
        t.join(60)
        if writer.poll() is None:
            os.kill(writer.pid, signal.SIGKILL)
        writer.wait(60)
    assert not errors, repr(errors[0])
    assert seen["reads"] >= 3, seen
    # The killed writer's lock is freed once its capture helper (own session,
    # sharing the flock) has committed what it sealed and exited: bounded.
    wait_for(lambda: lock_holder(path, "main") is None, 60, "the killed writer's helper to free the branch")
    n = len(dstt.open(path).steps())
    with dstt.Writer(path) as w:
        w.write(n, dstt.state_of(extra=expected_state(n)["extra"], rng=False))
    assert dstt.open(path).steps() == list(range(n + 1))
    assert verify(path).ok


def test_second_writer_same_branch_refused_other_branches_proceed(tmp_path: Path) -> None:
    path = tmp_path / "run"
    w1 = dstt.Writer(path)
    try:
        with pytest.raises(StoreLockedError) as info:
            dstt.Writer(path)
        assert f"pid {os.getpid()}" in str(info.value) and "dstt unlock" in str(info.value)
        with pytest.raises(StoreLockedError):
            dstt.save(path, 0, {"x": torch.ones(1)})
        with dstt.Writer(path, WriteOptions(branch="other")) as w2:  # different branch: fine
            w2.write(0, {"x": torch.ones(1)})
        w1.write(0, {"x": torch.zeros(1)})
    finally:
        w1.close()
    dstt.save(path, 1, {"x": torch.ones(1)})  # released by close()
    assert dstt.open(path).steps() == [0, 1]


def test_capture_takes_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "run"
    with dstt.Capture(path) as cap:
        cap.snapshot(0, rng=False, extra={"x": torch.ones(1)})
        with pytest.raises(StoreLockedError):
            dstt.Capture(path)
    with dstt.Capture(path) as cap:
        cap.snapshot(1, rng=False, extra={"x": torch.ones(1)})
    assert dstt.open(path).steps() == [0, 1]


def test_break_lock_and_cli_unlock(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dstt.cli.main import app

    path = tmp_path / "run"
    dstt.save(path, 0, {"x": torch.ones(1)})
    held = acquire(open_backend(path), "main")
    info = lock_holder(path, "main")
    assert info is not None and info.pid == os.getpid()
    res = CliRunner().invoke(app, ["unlock", f"{path}@main"])  # the holder is alive: refused
    assert res.exit_code == 1 and "live writer" in res.output and f"pid {os.getpid()}" in res.output
    res = CliRunner().invoke(app, ["unlock", "--force", f"{path}@main"])
    assert res.exit_code == 0 and f"pid {os.getpid()}" in res.output
    dstt.save(path, 1, {"x": torch.ones(1)})  # the broken lock no longer blocks
    held.release()  # the old holder releasing later does not remove the new writer's lock
    w = dstt.Writer(path)
    try:
        assert lock_holder(path, "main") is not None
        with pytest.raises(StoreLockedError, match="live writer"):
            break_lock(path, "main")
        assert break_lock(path, "main", force=True) is not None
    finally:
        w.close()
    assert CliRunner().invoke(app, ["unlock", f"{path}@nope"]).exit_code == 1
    assert CliRunner().invoke(app, ["unlock", str(path)]).exit_code == 2


def test_acquire_all_blocks_every_writer(tmp_path: Path) -> None:
    path = tmp_path / "run"
    for b in ("main", "a", "b"):
        dstt.save(path, 0, {"x": torch.ones(1)}, branch=b)
    with acquire_all(path) as locks:  # what prune and gc hold
        assert sorted(lk.branch for lk in locks) == ["_branches", "a", "b", "main"]
        for b in ("main", "a", "b"):
            with pytest.raises(StoreLockedError):
                dstt.save(path, 1, {"x": torch.ones(1)}, branch=b)
        # no branch can be created meanwhile (it could fork from a step being deleted)
        with pytest.raises(StoreLockedError, match="branches of .* are being changed"):
            dstt.branch(f"{path}:0", "late")
        with pytest.raises(StoreLockedError, match="branches of .* are being changed"):
            dstt.save(path, 1, {"x": torch.ones(1)}, branch="new", parent=("main", 0))
    assert dstt.open(path).branches() == ["a", "b", "main"]
    dstt.branch(f"{path}:0", "late")  # free again
    w = dstt.Writer(path, WriteOptions(branch="a"))
    try:
        with pytest.raises(StoreLockedError, match="'a'"):
            with acquire_all(path):
                pass
        assert lock_holder(path, "main") is None  # what it took before failing was released
    finally:
        w.close()


def _queue_behind_creators(backend: Any) -> float | None:
    """Six creators hold the branch-set lock one after another for 0.25 s
    each while this thread waits with a 1 s bound; how long it waited, or
    None where it took the lock in a gap between two creators (a polling
    lock hands nothing straight on: on a loaded machine the waiter may win
    the gap, which is right but does not try the bound)."""
    from dstt.format.lock import BRANCH_SET, branch_set_lock

    first = acquire(backend, BRANCH_SET)
    handoffs, failed = [0], []

    def creators() -> None:
        held = first
        try:
            for _ in range(5):
                time.sleep(0.25)
                held.release()
                held = acquire(backend, BRANCH_SET, timeout=30)
                handoffs[0] += 1
            time.sleep(0.25)
            held.release()
        except BaseException as e:  # (seen by the test, not lost in the thread)
            failed.append(e)

    t = threading.Thread(target=creators)
    t.start()
    try:
        start = time.monotonic()
        lock = branch_set_lock(backend, timeout=1.0)  # 1.5 s queued in all: it waits its turn
        waited, queued = time.monotonic() - start, handoffs[0] == 5
        lock.release()
    finally:
        t.join(60)
    assert not failed and not t.is_alive(), failed
    return waited if queued else None


def test_branch_creations_queue_for_the_branch_set_lock_a_long_holder_is_refused(tmp_path: Path) -> None:
    """Creators holding the branch-set lock one after another, each for less
    than the bound, make a waiter wait, not fail (racing branch creations on
    an object store, each a few requests long); one holder keeping it past
    the bound (a prune, a gc) is refused, naming it."""
    from dstt.format.lock import branch_set_lock

    backend = open_backend(tmp_path / "run", create=True)
    for _attempt in range(5):  # (a bound counting the whole queue raises here, at 1 s)
        waited = _queue_behind_creators(backend)
        if waited is not None:
            assert waited >= 1.0, waited  # past the bound, behind five holders in turn
            break
    else:
        pytest.fail("the waiter took the lock in a gap between creators 5 times: the queue was never tried")
    long = branch_set_lock(backend, timeout=0.3)  # now one holder keeps it
    try:
        with pytest.raises(StoreLockedError, match=f"branches of .* are being changed by .*pid {os.getpid()}"):
            branch_set_lock(backend, timeout=0.3)
    finally:
        long.release()
    branch_set_lock(backend, timeout=0.3).release()  # free again


def test_lease_lock_for_object_stores() -> None:
    from zarr.storage import MemoryStore

    backend = open_backend(MemoryStore())
    dstt.save(backend, 0, {"x": torch.ones(1)})
    lease = acquire(backend, "main", ttl=30)
    try:
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            dstt.Writer(backend)
    finally:
        lease.release()
    short = acquire(backend, "main", ttl=0.3)
    short._stop.set()  # type: ignore[union-attr]  # a writer that died: no more renewals
    with pytest.raises(StoreLockedError):
        acquire(backend, "main")
    time.sleep(0.5)
    dstt.save(backend, 1, {"x": torch.ones(1)})  # the expired lease is taken over
    assert dstt.open(backend).steps() == [0, 1]
