"""Issue 16, the bad day round two: locks broken under a live writer,
hostile files that hang or eat memory, step numbers out of range, late
errors, temp files and orphans left by kills. Each test failed before its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.errors import StoreLockedError
from dstt.store.lock import acquire, break_lock, lock_holder
from dstt.store.verify import verify
from tests.conftest import bits_equal

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def cli(*args: str):  # type: ignore[no-untyped-def]
    from dstt.cli.main import app

    return CliRunner().invoke(app, list(args))


def state(k: int) -> dict:
    return {"model": {"w": torch.full((64,), float(k)), "frozen": torch.arange(8.0)}, "k": k}


# --------------------------------------------------------------------------- 1. unlock and lost locks

_STOPPED_WRITER = r"""
import sys, torch, dstt
from dstt.store.writer import Writer
from tests.test_bad_day import state
w = Writer(sys.argv[1])
w.write(0, state(0))
plan = w.plan(1, state(1))
w.ensure_arrays(plan)
results = [w.flush_chunk(plan, t) for t in plan.tasks]
print("flushed", flush=True)
sys.stdin.readline()  # the test stops us here with SIGSTOP, breaks the lock, resumes us
try:
    w.commit(plan, results)
except dstt.DsttError as e:
    print("ERR", type(e).__name__, e, flush=True)
    sys.exit(3)
print("COMMITTED", flush=True)
"""


def test_unlock_refuses_a_live_holder_and_a_writer_that_lost_its_lock_does_not_commit(tmp_path: Path) -> None:
    path = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_WRITER, str(path)], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "flushed", proc.stderr.read() if proc.stderr else ""
        os.kill(proc.pid, signal.SIGSTOP)  # alive, holding its flock, not running
        res = cli("unlock", f"{path}@main")
        assert res.exit_code == 1, res.output
        assert "live writer" in res.output and f"pid {proc.pid}" in res.output
        assert lock_holder(path, "main").pid == proc.pid  # still locked
        with pytest.raises(StoreLockedError):
            break_lock(path, "main")
        res = cli("unlock", "--force", f"{path}@main")
        assert res.exit_code == 0, res.output
        # A new writer takes the branch and commits (it reuses the slot the
        # stopped writer wrote its chunks into: the risk --force names).
        dstt.save(path, 5, state(5))
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, (out, err)
    assert "lost the write lock" in out
    run = dstt.open(path)
    assert run.steps() == [0, 5]
    assert bits_equal(run.read("model/w", 5), state(5)["model"]["w"])
    assert verify(path).ok


def test_lease_writer_notices_a_broken_or_expired_lease() -> None:
    from zarr.storage import MemoryStore

    from dstt.store.backends import open_backend

    b = open_backend(MemoryStore())
    lock = acquire(b, "main", ttl=60)
    lock.check()
    with pytest.raises(StoreLockedError, match="live writer"):
        break_lock(b, "main")  # unexpired lease: presumed alive
    break_lock(b, "main", force=True)
    with pytest.raises(StoreLockedError, match="lost the write lock"):
        lock.check()
    lock.release()
    short = acquire(b, "main", ttl=0.3)
    short._stop.set()  # type: ignore[union-attr]  # a writer paused past its ttl: no renewals
    time.sleep(0.4)
    with pytest.raises(StoreLockedError, match="expired"):
        short.check()
    short.release()


def test_capture_whose_lock_was_broken_fails_the_step(tmp_path: Path) -> None:
    path = tmp_path / "run"
    cap = dstt.Capture(path)
    try:
        cap.snapshot(0, extra=state(0))
        cap.wait()
        break_lock(path, "main", force=True)
        held = acquire(path, "main")  # another writer owns the branch now
        try:
            with pytest.raises(StoreLockedError, match="lost the write lock"):
                cap.snapshot(1, extra=state(1))
        finally:
            held.release()
    finally:
        try:
            cap.close()
        except dstt.DsttError:
            pass
    assert dstt.open(path).steps() == [0]


# --------------------------------------------------------------------------- 5. resuming writers and branch heads


def _damage_index_slot(path: Path, step: int, name: str, slot: int) -> None:
    import json

    from dstt.store import layout as L

    f = path / L.step_dir("main", step) / "index.json"
    doc = json.loads(f.read_text())
    entry = next(t for t in doc["tensors"] if t["name"] == name)
    entry["slots"][0] = slot
    f.write_text(json.dumps(doc, separators=(",", ":")))  # not re-signed: commit.json no longer matches


def test_a_writer_resuming_checks_the_latest_index_against_its_commit(tmp_path: Path) -> None:
    from dstt.errors import ChecksumMismatchError

    path = tmp_path / "run"
    for s in (0, 1):
        dstt.save(path, s, state(s))  # model/frozen is deduplicated at step 1 (sha256 recorded)
    _damage_index_slot(path, 1, "model/frozen", 999)
    with pytest.raises(ChecksumMismatchError, match="does not match its commit record"):
        dstt.save(path, 2, state(2))
    assert dstt.open(path).steps() == [0, 1]  # nothing committed on top of the damaged step


class _CountingBackend:
    """Counts list_dir calls on a branch's steps directory."""


def test_writer_start_and_latest_read_the_head_not_every_step(tmp_path: Path) -> None:
    from dstt.store.backends import LocalBackend

    class Counting(LocalBackend):
        listed = 0

        def list_dir(self, prefix: str) -> list[str]:
            if prefix.rstrip("/").startswith("meta/steps"):
                Counting.listed += 1
            return super().list_dir(prefix)

    path = tmp_path / "run"
    for s in range(5):
        dstt.save(path, s * 10, state(s))
    Counting.listed = 0
    b = Counting(path)
    dstt.save(b, 50, state(5))
    assert dstt.open(b).latest() == 50
    assert Counting.listed == 0
    assert verify(path).ok


def test_a_stale_or_damaged_head_never_reuses_a_slot_or_hides_a_step(tmp_path: Path) -> None:
    from dstt.store.backends import open_backend
    from dstt.store.heads import head_key, head_record, latest_committed

    path = tmp_path / "run"
    for s in range(3):
        dstt.save(path, s, state(s))
    head = path / head_key("main")
    old = head.read_bytes()
    # A writer that writes no head (an older dstt) appends step 3: the head is stale.
    dstt.save(path, 3, state(3))
    head.write_bytes(old)
    b = open_backend(path)
    assert head_record(b, "main") is None  # the steps directory changed since the head was written
    assert latest_committed(b, "main").step == 3
    dstt.save(path, 4, state(4))  # must take slot seq 4, not 3
    run = dstt.open(path)
    assert run.steps() == [0, 1, 2, 3, 4]
    for s in (3, 4):
        assert bits_equal(run.read("model/w", s), state(s)["model"]["w"])
    assert verify(path).ok
    # Damaged heads: garbage, a seq that the marker does not record, a future step.
    import json

    good = json.loads(head.read_text())
    for bad in (b"\x00garbage", json.dumps({**good, "seq": good["seq"] - 1}).encode(),
                json.dumps({**good, "step": 10**6}).encode(), b"[]"):
        head.write_bytes(bad)
        assert latest_committed(b, "main").step == 4
        assert dstt.open(path).latest() == 4
    dstt.save(path, 5, state(5))
    assert bits_equal(dstt.open(path).read("model/w", 4), state(4)["model"]["w"])
    assert verify(path).ok


def test_a_step_failing_after_its_head_was_written_resumes_from_the_previous_commit(tmp_path: Path) -> None:
    import errno

    from dstt.errors import CaptureError
    from dstt.store.backends import LocalBackend, open_backend
    from dstt.store.heads import head_record

    class FailCommit(LocalBackend):
        def put_atomic(self, key: str, data) -> None:  # type: ignore[no-untyped-def]
            if key.endswith("commit.json"):
                raise OSError(errno.EIO, "injected")
            super().put_atomic(key, data)

    path = tmp_path / "run"
    dstt.save(path, 0, state(0))
    with pytest.raises(CaptureError):
        dstt.save(FailCommit(path), 1, state(1))
    head = head_record(open_backend(path), "main")
    assert head is not None and head.step == 0  # the head names step 1, its marker is missing: prev
    dstt.save(path, 2, state(2))
    assert dstt.open(path).steps() == [0, 2] and verify(path).ok


# --------------------------------------------------------------------------- 6. step numbers


@pytest.mark.parametrize("bad", [-1, True, 1.0, "3", 10**20, 10**30])
def test_out_of_range_steps_are_refused_up_front(tmp_path: Path, bad: object) -> None:
    from dstt.errors import StepOrderError

    path = tmp_path / "run"
    dstt.save(path, 0, state(0))
    with pytest.raises(StepOrderError, match="step must be an integer in 0..99999999999999999999"):
        dstt.save(path, bad, state(1))  # type: ignore[arg-type]
    cap = dstt.Capture(path, every=3)
    try:
        with pytest.raises(StepOrderError):
            cap.snapshot(bad, extra=state(1))  # type: ignore[arg-type]  # (not silently skipped by every=3)
    finally:
        cap.close()
    with pytest.raises(StepOrderError, match="parent step"):
        dstt.save(path, 5, state(5), branch="b", parent=("main", bad))  # type: ignore[arg-type]
    assert dstt.open(path).steps() == [0] and dstt.open(path).branches() == ["main"]


def test_step_references_beyond_twenty_digits_are_reference_errors(tmp_path: Path) -> None:
    from dstt.errors import InvalidReferenceError
    from dstt.refs import Ref

    path = tmp_path / "run"
    dstt.save(path, 10**20 - 1, state(0))  # the largest step fits its directory
    assert dstt.open(path).steps() == [10**20 - 1]
    with pytest.raises(InvalidReferenceError, match="out of range"):
        Ref.parse(f"{path}:{10**20}")
    res = cli("branch", str(path), "b", "--from", f":{10**25}")
    assert res.exit_code == 2 and "out of range" in res.output
    res = cli("ls", f"{path}:{10**20}")
    assert res.exit_code == 2 and "out of range" in res.output
