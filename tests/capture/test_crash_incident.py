"""A crash when the capture helpers died too (issue 25, crash semantics):
the trainer AND its helper SIGKILLed, nobody left to record the crash.
Whoever salvages the ring later -- the next Capture on the branch, or
``dstt gc`` -- commits its sealed steps and records one ``"crash"``
incident for it, at the last sealed step, once (capture/crashnote.py).
Real processes, real SIGKILLs; every stored step read back bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.format.backends import open_backend
from dstt.format.incidents import INCIDENTS_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm for the staging ring")

#: Two stores, a Capture on each with its memory tier in the helper
#: (persist=100: only step 0 is persisted, so steps 5-8 are held sealed in
#: the ring when both processes die); once step 0 is stored (each helper
#: serves its tier), the states as snapshot, then each helper's pid; then
#: it waits to be killed.
TRAINER = textwrap.dedent("""
    import sys, torch, dstt
    ref = sys.argv[1]
    torch.manual_seed(0)
    m = torch.nn.Linear(48, 48)
    opt = torch.optim.Adam(m.parameters())
    caps = [dstt.Capture(p, memory_steps=4, persist=100, background_timeout_s=60) for p in sys.argv[2:]]
    states = {}
    for s in range(9):
        m(torch.randn(8, 48)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        for cap in caps:
            cap.snapshot(s, model=m, optimizer=opt)
        states[s] = {k: v.clone() for k, v in m.state_dict().items()}
    for cap in caps:
        cap.wait()  # (step 0 stored: each helper runs its tier, holding 5-8 sealed)
    torch.save(states, ref)
    print(" ".join(str(cap.parts.helper.pid) for cap in caps), flush=True)
    import time; time.sleep(600)
""")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _crash_all(tmp_path: Path, stores: list[str]) -> dict[int, dict[str, torch.Tensor]]:
    """Run TRAINER on ``stores``; once every step is staged, stop the
    trainer, SIGKILL each helper, then the trainer: nothing of the run is
    left alive to store or record anything. The states it snapshot."""
    script, ref = tmp_path / "trainer.py", tmp_path / "ref.pt"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dstt.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(ref), *stores], stdout=subprocess.PIPE, env=env,
                            text=True)
    helpers: list[int] = []
    try:
        assert proc.stdout is not None
        helpers = [int(p) for p in proc.stdout.readline().split()]
        assert len(helpers) == len(stores), helpers
        os.kill(proc.pid, signal.SIGSTOP)  # (it cannot react to its helpers' death)
        for pid in helpers:
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    finally:
        proc.kill()
        proc.wait(30)
    for pid in helpers:  # (its own session: not our child; gone once /proc says so)
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.02)
    states: dict[int, dict[str, torch.Tensor]] = torch.load(ref)
    return states


def _check(path: str, ref: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    run = dstt.open(path)
    steps = run.steps()
    for s in steps:
        for k, v in ref[s].items():
            assert _bits(run.read("model/" + k, s)) == _bits(v), (s, k)
    return steps


def _one_crash(path: str) -> Any:
    incs = dstt.open(path).incidents()
    assert [(i.step, i.source) for i in incs] == [(8, "crash")], incs
    inc = incs[0]
    assert {5, 6, 7, 8} <= set(inc.steps) <= set(dstt.open(path).steps())
    assert "trainer" in inc.reason and "capture helper died" in inc.reason, inc.reason
    return inc


def _records(path: str) -> dict[str, bytes]:
    b = open_backend(path)
    prefix = f"{INCIDENTS_DIR}/main"
    return {n: bytes(b.get(f"{prefix}/{n}") or b"") for n in b.list_dir(prefix)}


def test_a_crash_of_trainer_and_helper_is_recorded_once_by_the_next_capture_or_gc(tmp_path: Path) -> None:
    """One trainer process, two stores: both its helpers and itself
    SIGKILLed. Store a: the next Capture salvages the ring and records the
    crash; store b: ``dstt gc`` does, and a second gc records nothing more.
    Each: exactly one crash incident, at step 8, naming the sealed steps,
    every step bit-exact; ``dstt ls`` and ``dstt find`` show it."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ref = _crash_all(tmp_path, [a, b])
    assert dstt.open(a).incidents() == [] and dstt.open(b).incidents() == []  # (nobody recorded it)

    with dstt.Capture(a, helper=False) as cap:
        assert {5, 6, 7, 8} <= set(cap.recovered)
    inc = _one_crash(a)
    assert "the next Capture" in inc.reason
    assert {5, 6, 7, 8} <= set(_check(a, ref))
    assert dstt.gc(a).committed == {}  # nothing left: recorded once
    assert dstt.open(a).incidents() == [inc]

    runner = CliRunner()
    dry = runner.invoke(app, ["gc", "--dry-run", b])
    assert dry.exit_code == 0 and "would record a crash incident at step 8" in dry.stdout, dry.stdout
    assert dstt.open(b).incidents() == []  # (a dry run records nothing)
    gc = runner.invoke(app, ["gc", b])
    assert gc.exit_code == 0 and "recorded a crash incident at step 8" in gc.stdout, gc.stdout
    inc = _one_crash(b)
    assert "dstt gc" in inc.reason
    assert {5, 6, 7, 8} <= set(_check(b, ref))
    before = _records(b)
    report = dstt.gc(b)
    assert report.committed == {} and report.incidents == []
    assert _records(b) == before  # a second gc: the same one record, untouched

    ls = runner.invoke(app, ["ls", b])
    assert ls.exit_code == 0 and "1 incident" in ls.stdout and "crash" in ls.stdout, ls.stdout
    find = runner.invoke(app, ["find", b])
    assert find.exit_code == 0 and "crash" in find.stdout + find.stderr, find.stdout + find.stderr
