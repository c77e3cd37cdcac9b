"""Capture and the process around it (issue 12, issue 16 defects 2 and 3):
the mutation guard in a training loop, os.fork() beside a live Capture
(plain fork, DataLoader workers, a multiprocessing helper outliving a
SIGKILLed writer) and a Capture never closed at interpreter exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.errors import CaptureError, ConfigError
from dstt.format.lock import lock_holder
from dstt.format.verify import verify

ROOT = Path(__file__).resolve().parents[2]


def run_script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def slow_writes(cap: dstt.Capture, seconds: float) -> None:
    real = cap.writer.flush_chunk

    def slow(plan: Any, task: Any, staged: Any = None) -> Any:
        time.sleep(seconds)
        return real(plan, task, staged)

    cap.writer.flush_chunk = slow  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- mutation guard


def test_mutation_outside_the_optimizer_without_wait_staged_fails_the_step(tmp_path: Path) -> None:
    """Weight clipping in place right after snapshot(), no wait_staged(): the
    step is never committed silently wrong, the next dstt call names the
    tensor; the same loop with wait_staged() commits every step bit-exact."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()

    store = tmp_path / "run"
    with dstt.Capture(store) as cap:
        release = threading.Event()
        cap.before_copy = lambda step, index, lazy: lazy and step == 0 and release.wait(10)  # injection point
        train()
        cap.snapshot(0, model=model, optimizer=opt, rng=False)
        with torch.no_grad():
            model.weight.clamp_(-0.01, 0.01)  # in place, outside optimizer.step(), no wait_staged()
        release.set()
        with pytest.raises(CaptureError, match=r"step 0 not captured: tensor 'model/weight'.*wait_staged"):
            train()
            cap.snapshot(1, model=model, optimizer=opt, rng=False)
        for step in range(2, 5):
            train()
            ref = model.weight.detach().clone()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            cap.wait_staged()
            with torch.no_grad():
                model.weight.clamp_(-0.01, 0.01)
            cap.wait()
            assert bits_equal(dstt.open(store).state_dict(step)["model"]["weight"], ref)
    assert 0 not in dstt.open(store).steps()
    assert dstt.open(store).steps() == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- fork


FORKING_WRITER = """
    import os, sys, time, torch, dstt
    from dstt.errors import CaptureError, StoreLockedError
    from dstt.format.lock import lock_holder

    store = sys.argv[1]
    cap = dstt.Capture(store, max_chunk_bytes=4096, helper=False)  # steps queued in this process's threads
    real = cap.writer.flush_chunk
    def slow(plan, task, staged=None):
        time.sleep(0.05)
        return real(plan, task, staged)
    cap.writer.flush_chunk = slow
    for step in range(3):
        cap.snapshot(step, extra={"w": torch.full((4096,), float(step))}, rng=False)
    for queued in (True, False):
        if not queued:
            cap.wait()
        pid = os.fork()
        if pid == 0:  # the child closes what it inherited and ends with sys.exit()
            cap.close()
            try:
                cap.snapshot(99, extra={"w": torch.ones(1)}, rng=False)
                sys.exit(4)
            except CaptureError as e:
                sys.exit(0 if "forked child" in str(e) else 5)
        deadline = time.monotonic() + 30
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                sys.exit("child hung")
            time.sleep(0.02)
        print("queued" if queued else "idle", "child exited", flush=True)
        assert lock_holder(store, "main").pid == os.getpid()
        try:
            dstt.Capture(store)
            sys.exit("a second writer was accepted")
        except StoreLockedError:
            print("second writer refused", flush=True)
    cap.snapshot(3, extra={"w": torch.full((4096,), 3.0)}, rng=False)
    cap.close()
"""


def test_forked_child_never_hangs_nor_releases_the_parents_lock(tmp_path: Path) -> None:
    """Issue 16 defect 2: a child forked with steps queued hung in close();
    with nothing queued its exit deleted the parent's lock file and a second
    writer was accepted."""
    store = tmp_path / "run"
    done = run_script(FORKING_WRITER, str(store))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("second writer refused") == 2, done.stdout
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2, 3]
    assert all(bits_equal(run.state_dict(s)["extra"]["w"], torch.full((4096,), float(s))) for s in range(4))
    assert lock_holder(store, "main") is None


def test_dataloader_fork_workers_beside_a_live_capture(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context="fork")
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = {}
    with dstt.Capture(tmp_path / "run") as cap:
        step = 0
        for _epoch in range(2):  # workers forked twice, each time with steps in flight
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                refs[step] = model.weight.detach().clone()
                cap.snapshot(step, model=model, optimizer=opt, rng=False)
                step += 1
    run = dstt.open(tmp_path / "run")
    assert run.steps() == list(range(8))
    for s, ref in refs.items():
        assert bits_equal(run.state_dict(s)["model"]["weight"], ref)


def test_a_multiprocessing_child_does_not_keep_a_killed_writers_lock(tmp_path: Path) -> None:
    """The writer starts a fork-based multiprocessing child that outlives it,
    then is SIGKILLed: the branch is free at once (the child had inherited
    the lock file's descriptor and kept the flock, naming a dead pid)."""
    store = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import multiprocessing as mp, sys, time, torch, dstt
        cap = dstt.Capture(sys.argv[1])
        cap.snapshot(0, extra={"w": torch.ones(4)}, rng=False)
        cap.wait()
        child = mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=False)
        child.start()
        print(child.pid, flush=True)
        time.sleep(60)
        """), str(store)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20  # the writer's capture helper may still be finishing its commits
        while lock_holder(store, "main") is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock_holder(store, "main") is None  # (the fork child sleeps 60 s: it holds nothing)
        with dstt.Capture(store) as cap:  # the branch is writable again
            cap.snapshot(1, extra={"w": torch.ones(4)}, rng=False)
        assert dstt.open(store).steps() == [0, 1]
    finally:
        proc.kill()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ----------------------------------------------------------------------------- exit


NEVER_CLOSED = """
    import sys, time, torch, dstt
    from dstt.format.backends import LocalBackend

    class Slow(LocalBackend):
        def put(self, key, data):
            if key.startswith("tensors/") and "/c." in key:
                time.sleep(0.1)
            super().put(key, data)

    cap = dstt.Capture(Slow(sys.argv[1], create=True), max_chunk_bytes=1024, exit_drain_s=float(sys.argv[2]))
    for step in range(5):
        cap.snapshot(step, extra={"w": torch.full((1024,), float(step))}, rng=False)
    print("queued", flush=True)
    # no close(): the interpreter exits with steps queued
"""


def test_a_capture_never_closed_drains_at_exit_or_says_what_it_lost(tmp_path: Path) -> None:
    done = run_script(NEVER_CLOSED, str(tmp_path / "a"), "60")
    assert done.returncode == 0, done.stderr
    run = dstt.open(tmp_path / "a")
    assert run.steps() == list(range(5))
    assert all(bits_equal(run.state_dict(s)["extra"]["w"], torch.full((1024,), float(s))) for s in range(5))
    lost = run_script(NEVER_CLOSED, str(tmp_path / "b"), "0")
    assert "never closed" in lost.stderr and "not committed" in lost.stderr, lost.stderr
    listed = {int(x) for x in lost.stderr.split("steps ")[1].split(" (")[0].split(", ")}
    assert set(range(5)) - set(dstt.open(tmp_path / "b").steps()) <= listed  # every loss was named
    assert verify(tmp_path / "b").ok


# ----------------------------------------------------------------------------- the helper process


#: Imported by the helper's interpreter (its PYTHONPATH): a disk that is full
#: for chunk files, so the failure happens in the helper process itself.
FULL_DISK = """
import errno, os
from dstt.format.backends import local

_put = local.LocalBackend.put

def put(self, key, data):
    if key.startswith("tensors/") and "/c." in key:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _put(self, key, data)

local.LocalBackend.put = put
"""


def test_helper_runs_in_its_own_session_and_reports_write_failures(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper (an exec'ed ``python -m dstt.capture.helper`` in its own
    session: a process-group kill of the trainer does not reach it) writes
    and commits; a write that fails there is raised here naming the step,
    nothing is committed with missing data, and close() reaps the helper."""
    cap = dstt.Capture(tmp_path / "run", helper=True, max_chunk_bytes=1024)
    try:
        helper = cap.parts.helper.pid  # type: ignore[union-attr]
        assert helper != os.getpid() and os.getsid(helper) == helper != os.getsid(0)
        cap.snapshot(0, extra={"w": torch.ones(1024)}, rng=False)
        assert cap.wait()[-1].step == 0
    finally:
        cap.close()
    assert not os.path.exists(f"/proc/{helper}")  # reaped by close()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    cap = dstt.Capture(tmp_path / "run", helper=True, max_chunk_bytes=1024)
    cap.snapshot(1, extra={"w": torch.zeros(1024)}, rng=False)
    with pytest.raises(CaptureError, match=r"step 1 .*No space left on device"):
        cap.wait()
    cap.close()
    assert dstt.open(tmp_path / "run").steps() == [0]
    assert verify(tmp_path / "run").ok


def test_helper_needs_a_store_path(tmp_path: Path) -> None:
    """A Backend object cannot move into the exec'ed helper: helper=True
    with a subclass is refused clearly, auto falls back to the threads."""
    from dstt.format.backends import LocalBackend

    class Mine(LocalBackend):
        pass

    with pytest.raises(ConfigError, match="helper=True: .*Mine"):
        dstt.Capture(Mine(tmp_path / "run", create=True), helper=True)
    with dstt.Capture(Mine(tmp_path / "run", create=True)) as cap:
        assert cap.parts.helper is None
        cap.snapshot(0, extra={"w": torch.ones(4)}, rng=False)
    assert dstt.open(tmp_path / "run").steps() == [0]


def test_a_helper_killed_under_a_live_trainer_commits_here_and_loses_no_step(tmp_path: Path) -> None:
    """Issue 23: once the capture helper is gone, the Capture commits in its
    own process (a warning says why), instead of failing every later step
    while reusing the pool under the sealed ones."""
    store = tmp_path / "run"
    cap = dstt.Capture(store, helper=True, max_chunk_bytes=1024)
    try:
        cap.snapshot(0, extra={"w": torch.full((1024,), 0.0)}, rng=False)
        cap.wait()
        os.kill(cap.parts.helper.pid, signal.SIGKILL)  # type: ignore[union-attr]
        cap.snapshot(1, extra={"w": torch.full((1024,), 1.0)}, rng=False)
        with pytest.warns(RuntimeWarning, match=r"capture helper \(pid \d+\) .*from step 1 on, this Capture commits in"):
            cap.wait()
        cap.snapshot(2, extra={"w": torch.full((1024,), 2.0)}, rng=False)
    finally:
        cap.close()
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2]
    assert all(bits_equal(run.state_dict(s)["extra"]["w"], torch.full((1024,), float(s))) for s in (1, 2))
    assert verify(store).ok


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_helper_is_a_fresh_process_not_a_fork_of_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked helper kept every page of the trainer's state alive: the
    trainer's first optimizer step after it paid copy-on-write for all of
    them, and peak memory doubled. The helper is an exec'ed interpreter
    (its command line runs dstt.capture.helper) and holds no copy of the
    trainer's state (coarse: anonymous memory, not a timing). (Without
    predictive coding: that keeps one copy of the previous step in the
    helper by design, bounded by a quarter of the available memory --
    tests/format/test_predchain.py; and without the update statistics'
    copy of each chunk it flushed, also one step's worth by design,
    bounded by DSTT_UPDATE_STATS_BYTES -- tests/capture/test_update_stats_every_mode.py.)"""
    monkeypatch.setenv("DSTT_UPDATE_STATS_BYTES", "0")  # (the helper inherits it)
    model = torch.nn.Linear(4096, 8192, bias=False)  # 128 MiB of parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()  # gradients and momentum exist: 384 MiB of state in this process
    state_kib = 3 * model.weight.numel() * 4 // 1024
    trainer_before = _status_kib(os.getpid(), "RssAnon")
    with dstt.Capture(tmp_path / "run", helper=True, compression="none") as cap:
        helper = cap.parts.helper.pid  # type: ignore[union-attr]
        with open(f"/proc/{helper}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"dstt.capture.helper" in argv, (argv, cap.parts.helper.proc.poll())  # type: ignore[union-attr]
        for step in range(2):
            model(torch.randn(2, 4096)).sum().backward()
            opt.step()  # the first one after the helper started: no copy on write of the state
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
        cap.wait()
        helper_anon = _status_kib(helper, "RssAnon")
        trainer_growth = _status_kib(os.getpid(), "RssAnon") - trainer_before
    assert helper_anon < state_kib // 2, (helper_anon, state_kib)  # a fork held all of it
    assert trainer_growth < state_kib // 2, (trainer_growth, state_kib)
    run = dstt.open(tmp_path / "run")
    assert run.steps() == [0, 1]
    assert bits_equal(run.state_dict(1)["model"]["weight"], model.weight.detach())


@pytest.mark.parametrize("hook, why", [("import os; os._exit(3)", "exited while starting"),
                                       ("import time; time.sleep(120)", "did not come up within 1 s")])
def test_a_helper_that_never_comes_up_never_hangs_and_loses_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str, why: str) -> None:
    """The trainer does not wait for the helper's start-up; if the helper
    dies while starting or never says it is ready (bounded wait; a stuck
    helper is killed), the Capture says so and commits in its own process
    (issue 23); close() returns, no helper is left behind."""
    from dstt.capture import helper as helper_module

    store = tmp_path / "run"
    with monkeypatch.context() as m:
        (tmp_path / "sitecustomize.py").write_text(hook + "\n")
        m.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        m.setattr(helper_module, "HELPER_START_S", 1.0)
        cap = dstt.Capture(store, helper=True, max_chunk_bytes=1024)
        pid = cap.parts.helper.pid  # type: ignore[union-attr]
        cap.snapshot(0, extra={"w": torch.full((1024,), 7.0)}, rng=False)
        with pytest.warns(RuntimeWarning, match=rf"the capture helper \(pid {pid}\) {why}.*from step 0 on"):
            cap.wait()
        cap.close()
    assert not os.path.exists(f"/proc/{pid}")  # no helper left behind
    assert bits_equal(dstt.open(store).state_dict(0)["extra"]["w"], torch.full((1024,), 7.0))
    assert verify(store).ok


ABANDON = """
import os, signal, sys, time, torch, dstt
from dstt.format.localio import pid_alive
cap = dstt.Capture(sys.argv[1], helper=True, max_chunk_bytes=1024)
cap.snapshot(0, extra={"w": torch.full((1024,), 1.0)}, rng=False)
cap.wait()
os.kill(cap.parts.helper.pid, signal.SIGKILL)  # the helper dies first: step 1 stays sealed in the ring
while pid_alive(cap.parts.helper.pid):
    time.sleep(0.01)
cap.parts.crashsafe.retire_helper = lambda *a: time.sleep(600)  # this trainer dies before it commits step 1 itself
try:
    cap.snapshot(1, extra={"w": torch.full((1024,), 2.0)}, rng=False)
    cap.wait_staged()
except dstt.CaptureError:
    pass  # (its helper is gone: the step fails here, sealed all the same)
assert cap.parts.last_job.ring.sealed
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_gc_commits_an_abandoned_ring_and_dry_run_only_says_so(tmp_path: Path) -> None:
    """`dstt gc` first commits the sealed step a dead trainer and helper left
    in /dev/shm (its chunks would otherwise never be stored); --dry-run names it."""
    import json

    from dstt.capture.ring import ring_root

    store = tmp_path / "run"
    proc = run_script(ABANDON, str(store))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert dstt.open(store).steps() == [0]
    cli = [sys.executable, "-m", "dstt.cli.main", "gc", str(store)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    dry = subprocess.run([*cli, "--dry-run", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["committed"] == [{"branch": "main", "step": 1}]
    assert dstt.open(store).steps() == [0]  # a dry run commits nothing
    real = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert real.returncode == 0, real.stderr
    assert "committed 1 step(s) of branch 'main'" in real.stdout and ": 1" in real.stdout, real.stdout
    run = dstt.open(store)
    assert run.steps() == [0, 1]
    assert bits_equal(run.state_dict(1)["extra"]["w"], torch.full((1024,), 2.0))
    assert verify(store).ok
    assert not [o for o in ring_root().glob("*/*/owner.json") if str(store) in o.read_text()]
