"""``memory_steps`` with the capture helper, the default (issue 25): the
trainer only copies into ring slots and seals; the helper keeps the last K
steps, persists by policy, watches for NaN/Inf, dumps the tier on
incidents, and a rewind reads the step from the ring slot it still holds.
Everything read back bit for bit against clones taken at snapshot time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import CaptureError

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm for the staging ring")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, poison: bool = False) -> None:
    m(torch.randn(16, 32)).pow(2).mean().backward()
    if poison:
        next(m.parameters()).grad[0, 0] = float("nan")
    opt.step()
    opt.zero_grad()


def _clone(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _check(path: str, ref: dict[int, dict[str, torch.Tensor]], branch: str = "main") -> list[int]:
    run = dstt.open(path)
    steps = run.steps(branch=branch)
    for s in steps:
        for k, v in ref[s].items():
            assert _bits(run.read("model/" + k, s, branch=branch)) == _bits(v), (s, k)
    return steps


@pytest.mark.parametrize("policy", [pytest.param("all", marks=pytest.mark.slow), "newest",
                                    pytest.param(3, marks=pytest.mark.slow)])
def test_the_tier_runs_in_the_helper_and_persists_by_policy(tmp_path: Path, policy: Any) -> None:
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, memory_steps=3, persist=policy, background_timeout_s=60) as cap:
        assert cap.tier_where == "helper"
        for s in range(10):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
            ref[s] = _clone(m)
        cap.wait()
        assert cap.memory_bytes is not None
    steps = _check(path, ref)
    spans, persisted = dstt.open(path).captured()
    assert spans == [(0, 9)] and persisted == steps
    if policy == "all":
        assert steps == list(range(10))
    elif policy == 3:
        assert steps == [0, 3, 6, 9]  # the 1st, 4th, 7th captured and the last (close)
    else:
        assert steps[-1] == 9 and len(steps) >= 1


def test_an_incident_and_a_nan_are_stored_by_the_helper(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, memory_steps=3, persist=5, background_timeout_s=60) as cap:
        for s in range(8):
            _train(m, opt, poison=(s == 7))
            cap.snapshot(s, model=m, optimizer=opt)
            ref[s] = _clone(m)
            if s == 4:
                cap.wait_staged()
                inc = cap.incident("loss spike at 4")
                assert inc.step == 4 and inc.source == "trainer" and 4 in inc.steps
    steps = _check(path, ref)
    incs = dstt.open(path).incidents()
    assert [(i.step, i.source) for i in incs] == [(4, "trainer"), (7, "non-finite")]
    assert incs[1].tensors and set(incs[1].steps) == {4, 5, 6, 7}  # the K steps before the NaN, and itself
    assert {1, 2, 3, 4, 5, 6, 7} <= set(steps)


def test_rewind_from_the_helpers_memory_continues_on_a_new_branch(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, memory_steps=4, persist="newest", background_timeout_s=60) as cap:
        for s in range(7):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt, extra={"s": s})
            ref[s] = _clone(m)
        cap.wait_staged()
        helper = cap.parts.helper
        assert cap.rewind(5, model=m, optimizer=opt) == {"s": 5}
        assert all(_bits(v) == _bits(ref[5][k]) for k, v in m.state_dict().items())
        # the branch switches at the next snapshot (as with the in-process tier), not in the rewind
        assert cap.parts.helper is helper and cap.writer.branch.name == "main"
        for s in range(6, 9):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
            ref[s] = _clone(m)
    run = dstt.open(path)
    assert sorted(run.branches()) == ["main", "main-rewind-5"]
    assert 5 in _check(path, ref)  # the fork step stored on the old branch (the rewind's incident)
    assert _check(path, ref, "main-rewind-5")[-1] == 8
    assert [i.source for i in run.incidents()] == ["rewind"]


TRAINER = textwrap.dedent("""
    import sys, torch, dstt
    path, ref = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(m.parameters())
    cap = dstt.Capture(path, memory_steps=4, persist="newest", background_timeout_s=60)
    states = {}
    for s in range(9):
        m(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        cap.snapshot(s, model=m, optimizer=opt)
        states[s] = {k: v.clone() for k, v in m.state_dict().items()}
    cap.wait_staged()
    torch.save(states, ref)
    print("staged", flush=True)
    import time; time.sleep(600)
""")


@pytest.mark.slow
def test_sigkill_of_the_trainer_stores_the_helpers_tier(tmp_path: Path) -> None:
    path, ref = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dstt.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), path, ref], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "staged"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    # the helper (its own session) sees end-of-file: it stores every held step and exits
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        incs = dstt.open(path).incidents() if os.path.isdir(path) else []
        if incs and set(incs[0].steps) <= set(dstt.open(path).steps()):
            break
        time.sleep(0.2)
    states = torch.load(ref)
    incs = dstt.open(path).incidents()
    assert [i.source for i in incs] == ["crash"]
    # under the run's crash id (its ring's name): a later salvage of the ring merges into it (crashnote.py)
    import re

    names = os.listdir(os.path.join(path, "meta", "incidents", "main"))
    assert len(names) == 1 and re.fullmatch(r"[0-9]{20}-crash-[0-9]+-[0-9a-f]{12}\.json", names[0]), names
    stored = _check(path, states)
    assert {5, 6, 7, 8} <= set(stored)
    # nothing left for the next Capture: it opens cleanly and the branch continues
    with dstt.Capture(path, memory_steps=2) as cap:
        assert cap.recovered == []


RESUMED = textwrap.dedent("""
    import sys, torch, dstt
    path, first = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(first)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(m.parameters())
    cap = dstt.Capture(path, memory_steps=4, persist="newest", background_timeout_s=60)
    for s in range(first, first + 9):
        m(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        cap.snapshot(s, model=m, optimizer=opt)
    cap.wait_staged()
    print("staged", flush=True)
    import time; time.sleep(600)
""")


@pytest.mark.slow
def test_a_resumed_run_that_crashes_again_records_its_own_crash(tmp_path: Path) -> None:
    """Two real SIGKILLs: a run crashes at step 8 (its helper stores the
    tier and records the crash), a resumed run on the same branch crashes at
    step 28: its crash is recorded too, once, with the steps it stored --
    each crash once, never folded into the first."""
    import time

    path = str(tmp_path / "run")
    script = tmp_path / "trainer.py"
    script.write_text(RESUMED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dstt.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    for first in (0, 20):
        proc = subprocess.Popen([sys.executable, str(script), path, str(first)], stdout=subprocess.PIPE, env=env,
                                text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "staged"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(30)
        deadline = time.monotonic() + 120  # the helper stores the tier, records the crash, exits
        while time.monotonic() < deadline:
            incs = dstt.open(path).incidents()
            if incs and incs[-1].step == first + 8 and set(incs[-1].steps) <= set(dstt.open(path).steps()):
                break
            time.sleep(0.2)
    incs = dstt.open(path).incidents()
    assert [(i.step, i.source) for i in incs] == [(8, "crash"), (28, "crash")], incs
    assert {5, 6, 7, 8, 25, 26, 27, 28} <= set(dstt.open(path).steps())
    assert set(incs[1].steps) == {25, 26, 27, 28}


@pytest.mark.slow
def test_a_killed_helper_fails_the_trainer_loudly(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    m, opt = _model()
    cap = dstt.Capture(path, memory_steps=2, persist="all", background_timeout_s=20)
    try:
        for s in range(3):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
        cap.wait()
        assert cap.parts.helper is not None
        os.kill(cap.parts.helper.pid, signal.SIGKILL)
        with pytest.raises(CaptureError, match="capture helper"):
            for s in range(3, 12):
                _train(m, opt)
                cap.snapshot(s, model=m, optimizer=opt)
                cap.wait()
    finally:
        try:
            cap.close()
        except CaptureError:
            pass
    dstt.gc(path)  # a step sealed before the trainer saw its helper gone stays in the ring: committed now


def test_a_stopped_helper_fails_the_trainer_within_the_bound(tmp_path: Path) -> None:
    """A helper SIGSTOPped while the trainer goes on capturing: the steps
    handed over meanwhile are no answer from it, so the trainer's next dstt
    call fails naming the helper within ~2x ``background_timeout_s`` (before:
    every step handed over counted as progress, and the loop went on for as
    long as the pool had room); the ring keeps the sealed steps, and the next
    Capture commits them bit-exact."""
    import time

    path, bound = str(tmp_path / "run"), 2.0
    m, opt = _model()
    ref: dict[int, dict[str, torch.Tensor]] = {}
    cap = dstt.Capture(path, memory_steps=2, persist="newest", background_timeout_s=bound)
    helper = cap.parts.helper
    assert helper is not None
    try:
        for s in range(3):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
            ref[s] = _clone(m)
        cap.wait()
        os.kill(helper.pid, signal.SIGSTOP)
        t0, failed_after = time.monotonic(), None
        try:
            for s in range(3, 1000):
                _train(m, opt)
                cap.snapshot(s, model=m, optimizer=opt)
                ref[s] = _clone(m)
                if time.monotonic() - t0 > 6 * bound:
                    break
                time.sleep(0.02)
        except CaptureError as e:
            failed_after = time.monotonic() - t0
            assert "capture helper" in str(e)
        assert failed_after is not None and failed_after < 2.5 * bound, failed_after
    finally:
        with __import__("contextlib").suppress(OSError):
            os.kill(helper.pid, signal.SIGCONT)
        try:
            cap.close()
        except CaptureError:
            pass
    assert helper.proc.poll() is not None  # killed and reaped
    with dstt.Capture(path, memory_steps=2) as again:  # the sealed steps, committed from the ring
        assert again.recovered
    _check(path, ref)
