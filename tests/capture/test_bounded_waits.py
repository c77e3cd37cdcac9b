"""Issue 23 (8): every wait of dstt is bounded, on every path including close().

``Capture.close()`` used to wait forever (> 240 s measured) behind a
SIGSTOPped capture helper: the committer thread read the helper's answer
with no bound, close() waited for the committer with no bound, and the
helper's own kill-on-close came after both. Now every wait gives up once
what it waits for made no progress for ``background_timeout_s``, naming
what did not answer (capture/waits.py); a helper that does not answer is
killed and its sealed steps are committed by the next Capture or
``dstt gc``. The last test lists the waits, so the class stays fixed.
"""

from __future__ import annotations

import ast
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
from conftest import bits_equal

import dstt
from dstt.errors import CaptureError
from dstt.format.lock import lock_holder
from dstt.format.verify import verify

ROOT = Path(__file__).resolve().parents[2]
#: A bound far beyond what any of these waits takes when the fix works
#: (a few seconds), far below "forever": the hang check of the tests.
HANG_S = 120.0


def _close_in_thread(cap: dstt.Capture) -> tuple[BaseException | None, float]:
    """close() on a thread, waited for at most HANG_S: (what it raised, seconds)."""
    out: list[Any] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            cap.close()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out.append(e)
        out.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"close() still waits after {HANG_S} s"
    return out[0], out[1]


def _no_ring_left(store: Path) -> bool:
    """No staging ring in /dev/shm is left for ``store`` (recovered and removed)."""
    from dstt.capture.ring import ring_root

    return not [o for o in ring_root().glob("*/*/owner.json") if str(store) in o.read_text()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[-1].split()[0] == b"Z"


def test_close_behind_a_stopped_helper_returns_and_commits_the_step_here(tmp_path: Path) -> None:
    """The helper SIGSTOPped with a sealed step handed to it: close() returns
    within the bound; the helper is named (pid, stopped by a signal) and
    killed, and -- since a dead helper's steps are committed by the trainer's
    own process (issue 23 item 3, capture/fallback.py) -- the sealed step is
    committed bit-exact by this Capture, nothing left in /dev/shm."""
    store = tmp_path / "run"
    cap = dstt.Capture(store, helper=True, max_chunk_bytes=1024, background_timeout_s=2)
    pid = cap.parts.helper.pid  # type: ignore[union-attr]
    stopped = False
    try:
        cap.snapshot(0, extra={"w": torch.full((1024,), 0.0)}, rng=False)
        cap.wait()  # the helper is up and serving
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        cap.snapshot(1, extra={"w": torch.full((1024,), 1.0)}, rng=False)
        cap.wait_staged()  # sealed in the ring, handed to the stopped helper
        with pytest.warns(RuntimeWarning) as warned:
            error, took = _close_in_thread(cap)
    finally:
        if stopped and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert error is None, error
    text = " ".join(str(w.message) for w in warned)
    assert f"the capture helper (pid {pid}) did not answer for 2 s" in text, text
    assert "stopped by a signal" in text and "killed" in text and "from step 1 on" in text, text
    assert _gone(pid)
    assert lock_holder(store, "main") is None  # the branch is free again
    run = dstt.open(store)
    assert run.steps() == [0, 1]
    assert bits_equal(run.state_dict(1)["extra"]["w"], torch.full((1024,), 1.0))
    assert verify(store).ok and _no_ring_left(store)


#: In the helper: when it is about to put step 1's commit marker into place
#: (every chunk and index file of the step written), spin on a wait of its
#: own for up to 60 s -- as a rank's helper polls the store for rank 0's
#: commit: CPU time and reads every millisecond, nothing done for its trainer.
SPIN_MID_COMMIT = """
import os, time
from dstt.format.backends import local
_put_atomic, _rename = local.LocalBackend.put_atomic, os.rename
def spin():
    end = time.monotonic() + 60
    while time.monotonic() < end:
        with open("/proc/self/stat", "rb") as f:
            f.read()
        time.sleep(0.001)
def put_atomic(self, key, data, *a, **k):
    if key.endswith("00000000000000000001/commit.json"):
        spin()
    return _put_atomic(self, key, data, *a, **k)
local.LocalBackend.put_atomic = put_atomic
def rename(src, dst, *a, **k):
    if str(dst).endswith("00000000000000000001/commit.json"):
        spin()
    return _rename(src, dst, *a, **k)
os.rename = rename
"""


def test_a_helper_stuck_mid_commit_is_killed_within_the_bound_and_the_step_committed_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper gets stuck in the middle of committing step 1 (its data
    written, the commit marker not), spinning on a wait of its own: only its
    answers count as its progress (issue 25, without the memory tier too),
    so within ~2x the bound it is killed and this Capture commits step 1
    itself, exactly once (the helper's half-written step is not taken for a
    commit); `dstt gc` then finds nothing left to commit. (Before, its CPU
    time and reads counted as progress: wait() returned after its 60 s spin,
    with no warning.)"""
    store, bound = tmp_path / "run", 1.0
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SPIN_MID_COMMIT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    cap = dstt.Capture(store, helper=True, max_chunk_bytes=1024, background_timeout_s=bound)
    pid = cap.parts.helper.pid  # type: ignore[union-attr]
    try:
        cap.snapshot(0, extra={"w": torch.full((1024,), 5.0)}, rng=False)
        cap.wait()
        cap.snapshot(1, extra={"w": torch.full((1024,), 6.0)}, rng=False)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match=rf"capture helper \(pid {pid}\) did not answer for 1 s"):
            cap.wait()
        took = time.monotonic() - t0
        error, _took = _close_in_thread(cap)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert error is None, error
    assert took < 2.5 * bound, took
    assert _gone(pid)
    run = dstt.open(store)
    assert run.steps() == [0, 1]
    assert bits_equal(run.state_dict(1)["extra"]["w"], torch.full((1024,), 6.0))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    gc = subprocess.run([sys.executable, "-m", "dstt.cli.main", "gc", str(store)], env=env, capture_output=True,
                        text=True, timeout=HANG_S)
    assert gc.returncode == 0, gc.stderr
    assert "committed 1 step" not in gc.stdout and gc.stdout.startswith("freed "), gc.stdout
    assert dstt.open(store).steps() == [0, 1]
    assert verify(store).ok and _no_ring_left(store)


def test_close_gives_up_on_a_write_hung_in_this_process_and_finishes_later(tmp_path: Path) -> None:
    """Without the helper, a chunk write that hangs (a filesystem that does
    not answer) made close() wait forever. Now close() raises within the
    bound naming the step and the thread, keeps the branch locked while
    that thread may still write, and finishes closing once it returns."""
    store = tmp_path / "run"
    cap = dstt.Capture(store, helper=False, shm=False, background_timeout_s=1)
    release = threading.Event()

    def hang(real: Any) -> Any:
        def hung(plan: Any, *a: Any, **k: Any) -> Any:
            if plan.step == 1:
                release.wait(HANG_S)  # the "filesystem" answers when the test says so
            return real(plan, *a, **k)
        return hung

    cap.writer.flush_chunk = hang(cap.writer.flush_chunk)  # type: ignore[method-assign]
    cap.writer.flush_chunks = hang(cap.writer.flush_chunks)  # type: ignore[method-assign]
    try:
        cap.snapshot(0, extra={"w": torch.full((64,), 0.0)}, rng=False)
        cap.wait()
        cap.snapshot(1, extra={"w": torch.full((64,), 1.0)}, rng=False)
        error, took = _close_in_thread(cap)
        assert isinstance(error, CaptureError), error
        text = str(error)
        assert "close() of the Capture on branch 'main' gave up" in text and "1 step(s) not committed: 1" in text
        assert "committer thread(s) still run" in text and "frees the branch lock" in text, text
        assert lock_holder(store, "main") is not None  # that thread may still write: not released under it
    finally:
        release.set()
    deadline = time.monotonic() + HANG_S
    while lock_holder(store, "main") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock_holder(store, "main") is None  # the reaper finished closing
    run = dstt.open(store)
    assert run.steps() == [0, 1]  # the late write committed its step, in order
    assert bits_equal(run.state_dict(1)["extra"]["w"], torch.full((64,), 1.0))
    assert verify(store).ok


def test_a_loop_and_wait_behind_a_stopped_helper_end_within_the_bound(tmp_path: Path) -> None:
    """A training loop that goes on capturing behind a stopped helper (more
    steps than the pool holds: snapshot() would wait for room) and wait()
    without a timeout: nothing hangs; the helper is named and killed within
    the bound, and every step -- the ones the stopped helper held and every
    later one -- is committed by this Capture, bit-exact."""
    store = tmp_path / "run"
    cap = dstt.Capture(store, helper=True, max_chunk_bytes=1024, background_timeout_s=2)
    pid = cap.parts.helper.pid  # type: ignore[union-attr]
    try:
        cap.snapshot(0, extra={"w": torch.zeros(1024)}, rng=False)
        cap.wait()
        os.kill(pid, signal.SIGSTOP)
        with pytest.warns(RuntimeWarning, match=rf"capture helper \(pid {pid}\)"):
            for step in range(1, 40):
                cap.snapshot(step, extra={"w": torch.full((1024,), float(step))}, rng=False)
            cap.wait()
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
        error, _took = _close_in_thread(cap)
    assert error is None, error
    assert _gone(pid)
    run = dstt.open(store)
    assert run.steps() == list(range(40))
    for step in range(40):
        assert bits_equal(run.state_dict(step)["extra"]["w"], torch.full((1024,), float(step)))
    assert verify(store).ok and _no_ring_left(store)


def test_snapshot_waiting_for_staging_room_gives_up_naming_the_step(tmp_path: Path) -> None:
    """snapshot() waits for pool room while earlier steps are written
    (backpressure). Behind a write that hangs, that wait used to be
    forever; now snapshot() returns within the bound with the step failed
    (reported by the next call, naming the step and the pool), and capture
    goes on once the write returns."""
    store = tmp_path / "run"
    cap = dstt.Capture(store, helper=False, shm=False, host_buffer_bytes=64 << 10, max_chunk_bytes=64 << 10,
                       background_timeout_s=1)
    release = threading.Event()
    real = cap.writer.flush_chunk

    def hung(plan: Any, *a: Any, **k: Any) -> Any:
        if plan.step == 1:
            release.wait(HANG_S)
        return real(plan, *a, **k)

    cap.writer.flush_chunk = hung  # type: ignore[method-assign]
    w = {s: torch.full((12 << 10,), float(s)) for s in range(4)}  # 48 KiB each: one step at a time fits
    try:
        cap.snapshot(0, extra={"w": w[0]}, rng=False)
        cap.wait()
        cap.snapshot(1, extra={"w": w[1]}, rng=False)  # its write hangs, holding its block
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(_raises(lambda: cap.snapshot(2, extra={"w": w[2]},
                                                                                      rng=False))), daemon=True)
        t.start()
        t.join(HANG_S)
        assert not t.is_alive(), f"snapshot() still waits for staging room after {HANG_S} s"
        assert out == [None]  # queued as failed (its report follows the steps before it)
    finally:
        release.set()
    with pytest.raises(CaptureError, match=r"step 2 .*gave up waiting for 49152 bytes of staging pool for step 2"):
        cap.wait()
    cap.snapshot(3, extra={"w": w[3]}, rng=False)
    cap.close()
    run = dstt.open(store)
    assert run.steps() == [0, 1, 3]
    for s in (0, 1, 3):
        assert bits_equal(run.state_dict(s)["extra"]["w"], w[s])
    assert verify(store).ok


def _raises(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e
    return None


# ----------------------------------------------------------------------------- the list of waits

#: Method names that block (with their timeout's position and keyword).
WAITS = {"wait": (0, "timeout"), "wait_for": (1, "timeout"), "join": (0, "timeout"), "result": (0, "timeout"),
         "get": (0, "timeout"), "acquire": (0, "timeout"), "wait_idle": (0, "timeout"),
         "wait_all_free": (0, "timeout"), "allocate": (1, "timeout"), "communicate": (1, "timeout"),
         "synchronize": (None, None), "shutdown": (None, None), "receive": (None, None)}
#: A comment on the call's lines (or the comment lines right above it) that
#: says why a wait without a timeout is fine: it is bounded inside the callee,
#: or it is one that cannot be abandoned (and nothing of the trainer waits on it unboundedly).
MARKS = ("unbounded wait:", "bounded:")


def _unbounded_calls(path: Path) -> list[str]:
    """Blocking calls in ``path`` without a timeout and without a MARK comment on their lines."""
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WAITS):
            continue
        name = node.func.attr
        pos, kw = WAITS[name]
        kws = {k.arg for k in node.keywords}
        if name == "get" and (node.args or "block" in kws):
            continue  # dict.get / a non-blocking queue get
        if name == "shutdown" and any(k.arg == "wait" and isinstance(k.value, ast.Constant) and k.value.value is False
                                      for k in node.keywords):
            continue
        if name == "acquire" and ({"blocking", "timeout"} & kws):
            continue
        bounded = pos is not None and (len(node.args) > pos or kw in kws)
        text = " ".join(lines[node.lineno - 1:(node.end_lineno or node.lineno)])
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):  # the comment block right above
            text += " " + lines[i]
            i -= 1
        if not bounded and not any(m in text for m in MARKS):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return out


def test_every_wait_in_capture_and_store_is_bounded_or_says_why_not() -> None:
    """Each blocking call in dstt/capture and dstt/store has a timeout, or a
    ``# unbounded wait: <why>`` comment (a thread's own work queue, a write
    of this process whose buffer is in use, device work): a new bare wait
    fails here until it is bounded or explained."""
    found = [c for folder in ("dstt/capture", "dstt/store", "dstt/format")
             for path in sorted((ROOT / folder).rglob("*.py")) for c in _unbounded_calls(path)]
    assert not found, "waits without a bound:\n" + "\n".join(found)


def test_the_list_of_waits_catches_a_bare_wait(tmp_path: Path) -> None:
    """The check above is not vacuous: it finds bare waits of each kind."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(ev, cond, th, fut, q, lock, d, pool):\n"
                      "    ev.wait()\n    cond.wait_for(p)\n    th.join()\n    fut.result()\n    q.get()\n"
                      "    lock.acquire()\n    pool.shutdown(wait=True)\n"
                      "    ev.wait(1)\n    d.get('k')\n    ', '.join(d)\n    q.get()  # unbounded wait: (marked)\n")
    found = [line.split(": ", 1)[1] for line in _unbounded_calls_outside(sample)]
    assert found == ["ev.wait()", "cond.wait_for(p)", "th.join()", "fut.result()", "q.get()", "lock.acquire()",
                     "pool.shutdown(wait=True)"]


def _unbounded_calls_outside(path: Path) -> list[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return _unbounded_calls(path)
    finally:
        ROOT = saved
