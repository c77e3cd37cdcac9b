"""Faults while a step is flushed: disk full, permission denied, a store that
fails partway through a step, a failing fsync. The error must reach the
trainer (directly from dstt.save, from the next call with dstt.Capture)
naming the step; earlier steps stay intact; nothing hangs; close() returns;
once the fault is cleared capture goes on."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import dstt
from dstt.errors import CaptureError
from dstt.format.backends import Data, LocalBackend
from dstt.format.verify import verify
from tests.conftest import bits_equal


class FaultBackend(LocalBackend):
    """A local store that raises OSError(errno) on chosen operations once
    ``after`` matching calls went through, until :meth:`clear`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, create=True)
        self.fault: tuple[int, set[str], str, int] | None = None
        self.failures = 0
        self._flock = threading.Lock()

    def arm(self, err: int, ops: set[str], key_part: str = "", after: int = 0) -> None:
        with self._flock:
            self.fault = (err, ops, key_part, after)

    def clear(self) -> None:
        with self._flock:
            self.fault = None

    def _check(self, op: str, key: str = "") -> None:
        with self._flock:
            if self.fault is None:
                return
            err, ops, part, after = self.fault
            if op not in ops or part not in key:
                return
            if after > 0:
                self.fault = (err, ops, part, after - 1)
                return
            self.failures += 1
        raise OSError(err, f"injected: {os.strerror(err)}", key)

    def put(self, key: str, data: Data) -> None:
        self._check("put", key)
        super().put(key, data)

    def put_atomic(self, key: str, data: Any) -> None:
        self._check("put_atomic", key)
        super().put_atomic(key, data)

    def sync(self) -> None:
        self._check("sync")
        super().sync()


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    model = {f"l{i}": torch.randn(16, 16, generator=g) for i in range(4)}
    return {"model": {"w": torch.randn(32, 32, generator=g), "b": torch.randn(7, generator=g), **model},
            "frozen": torch.ones(100), "step": step}


def assert_steps_exact(path: Path, steps: list[int]) -> None:
    run = dstt.open(path)
    assert run.steps() == steps
    for s in steps:
        got = run.state_dict(s, verify=True)
        want = state(s)
        assert bits_equal(got["model"]["w"], want["model"]["w"]) and got["step"] == s
    report = verify(path)
    assert report.ok, [str(p) for p in report.problems]


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


FAULTS = [
    pytest.param(errno.ENOSPC, {"put"}, "/c.", 0, id="enospc-first-chunk"),
    pytest.param(errno.ENOSPC, {"put"}, "/c.", 2, id="enospc-partway"),
    pytest.param(errno.EACCES, {"put"}, "/c.", 1, id="eacces-chunk"),
    pytest.param(errno.ENOSPC, {"put"}, "index.json", 0, id="enospc-index"),
    pytest.param(errno.EACCES, {"put_atomic"}, "commit.json", 0, id="eacces-commit-marker"),
    pytest.param(errno.EIO, {"sync"}, "", 0, id="eio-fsync"),
]


@pytest.mark.parametrize("err,ops,part,after", FAULTS)
def test_save_raises_naming_the_step_and_recovers(tmp_path: Path, err: int, ops: set[str], part: str, after: int) -> None:
    path = tmp_path / "run"
    b = FaultBackend(path)
    for s in (0, 1):
        dstt.save(b, s, state(s))
    b.arm(err, ops, part, after)
    with pytest.raises(CaptureError, match=r"step 2\b") as info:
        within(60, lambda: dstt.save(b, 2, state(2)))
    assert os.strerror(err) in str(info.value) or isinstance(info.value.__cause__, OSError)
    assert b.failures >= 1
    assert_steps_exact(path, [0, 1])  # nothing of step 2 is visible
    b.clear()
    dstt.save(b, 2, state(2))  # the failed step can be written again ...
    dstt.save(b, 3, state(3))  # ... and capture goes on
    assert_steps_exact(path, [0, 1, 2, 3])


@pytest.mark.parametrize("err,ops,part,after", FAULTS[:3] + FAULTS[4:])
def test_capture_reports_on_next_call_and_goes_on(tmp_path: Path, err: int, ops: set[str], part: str, after: int) -> None:
    path = tmp_path / "run"
    b = FaultBackend(path)
    cap = dstt.Capture(b, max_chunk_bytes=1024)
    try:
        for s in (0, 1):
            cap.snapshot(s, rng=False, extra=state(s))
        within(60, cap.wait)
        b.arm(err, ops, part, after)
        cap.snapshot(2, rng=False, extra=state(2))
        with pytest.raises(CaptureError, match=r"step 2\b"):
            within(60, cap.wait)  # the trainer's next dstt call
        b.clear()
        cap.snapshot(3, rng=False, extra=state(3))
        cap.snapshot(4, rng=False, extra=state(4))
        within(60, cap.wait)
    finally:
        within(60, cap.close)
    run = dstt.open(path)
    assert run.steps() == [0, 1, 3, 4]
    for s in run.steps():
        assert bits_equal(run.state_dict(s, verify=True)["extra"]["model"]["w"], state(s)["model"]["w"])
    assert verify(path).ok


def test_capture_error_surfaces_from_snapshot_and_close_returns(tmp_path: Path) -> None:
    """The failure of step 0 is raised by the trainer's next dstt call
    (snapshot() or wait_staged(), whichever comes after the failure; not
    swallowed), and close() afterwards returns."""
    path = tmp_path / "run"
    b = FaultBackend(path)
    cap = dstt.Capture(b)
    b.arm(errno.ENOSPC, {"put"}, "/c.")
    cap.snapshot(0, rng=False, extra=state(0))
    raised = None
    for s in range(1, 200):  # each call is the trainer's "next dstt call"
        try:
            within(60, lambda: cap.snapshot(s, rng=False, extra=state(s)))
            within(60, cap.wait_staged)
        except CaptureError as e:
            raised = e
            break
        if s % 5 == 0:
            threading.Event().wait(0.05)
    assert raised is not None and "step 0" in str(raised)
    b.clear()
    try:
        within(60, cap.wait)
    except CaptureError:
        pass  # steps queued while the fault was armed fail too; each is reported once
    within(60, cap.close)


# ----------------------------------------------------------------------------- a real full filesystem


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A 3 MiB tmpfs (root only); skipped where mounting is not permitted."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        try:
            f.write(os.urandom(nbytes))
        except OSError:
            pass


@pytest.mark.parametrize("use_capture", [False, True], ids=["save", "capture"])
def test_real_disk_full(tiny_fs: Path, use_capture: bool) -> None:
    path = tiny_fs / "run"
    for s in (0, 1):
        dstt.save(path, s, state(s))
    filler = tiny_fs / "filler"
    _fill(filler, 3 << 20)  # fills the rest of the filesystem
    failed_step = None
    if use_capture:
        cap = dstt.Capture(path)
        try:
            for s in range(2, 40):
                cap.snapshot(s, rng=False, extra=state(s))
                within(60, cap.wait)
        except CaptureError as e:
            failed_step = e
        finally:
            try:
                within(60, cap.close)
            except CaptureError:
                pass
    else:
        try:
            for s in range(2, 40):
                within(60, lambda: dstt.save(path, s, state(s)))
        except CaptureError as e:
            failed_step = e
    assert failed_step is not None, "the filesystem never filled up"
    assert "No space left on device" in str(failed_step) or "ENOSPC" in str(failed_step), failed_step
    assert "step 2" in str(failed_step)
    run = dstt.open(path)
    assert run.steps()[:2] == [0, 1]
    assert verify(path).ok
    filler.unlink()  # the fault is cleared
    nxt = run.steps()[-1] + 1
    dstt.save(path, nxt, state(nxt))
    report = verify(path)
    assert report.ok and dstt.open(path).steps()[-1] == nxt
