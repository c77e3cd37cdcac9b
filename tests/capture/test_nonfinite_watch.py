"""The flight recorder's NaN/Inf watcher checks every captured step, never
skipping one, and raises its incident at the first non-finite step with the
K steps before it stored bit-exact -- however little CPU the watcher thread
gets (issue 23 item 2: with the trainer on every core it fired late, stored
0-6 of the steps before the NaN, and once raised nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import dstt
from dstt.capture.engine import Capture
from dstt.format.backends import open_backend
from dstt.format.incidents import list_incidents
from tests.conftest import bits_equal

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/nan_watch.py"


def _check_incident(store: Path, ref: dict[int, dict[str, torch.Tensor]], nan_at: int, k: int, tensor: str) -> None:
    (inc,) = list_incidents(open_backend(str(store)), "main")
    assert (inc.step, inc.source) == (nan_at, "non-finite"), inc
    assert any(tensor in t for t in inc.tensors), inc.tensors
    want = list(range(nan_at - k, nan_at + 1))  # the K steps before it, and itself
    assert set(want) <= set(inc.steps), (want, inc.steps)
    run = dstt.open(store)
    assert set(want) <= set(run.steps())
    for s in want:
        got = run.state_dict(s)["model"]
        assert all(bits_equal(got[name], v) for name, v in ref[s].items()), s


@pytest.mark.parametrize("nan_at", [9, 15])
def test_a_starved_watcher_thread_skips_no_step(tmp_path: Path, monkeypatch, nan_at: int) -> None:  # type: ignore[no-untyped-def]
    """The watcher thread gets no CPU at all until training is over (as on a
    machine whose cores the trainer takes): the steps are still checked in
    order -- by the trainer, once no slot is free, and by ``close()`` -- and
    the incident is at the planted step (also the last one), not at
    whatever step the watcher reached."""
    released = threading.Event()
    lower = Capture.lower_priority

    def starve_the_watcher(self: Capture) -> None:
        lower(self)
        if threading.current_thread().name == "dstt-watch":
            released.wait(120)

    monkeypatch.setattr(Capture, "lower_priority", starve_the_watcher)
    store, k = tmp_path / "run", 3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref: dict[int, dict[str, torch.Tensor]] = {}
    cap = dstt.Capture(store, helper=False, memory_steps=k, persist="newest")
    try:
        for step in range(16):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == nan_at:  # (it spreads to every weight at the next step: all later steps are non-finite)
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            cap.snapshot(step, model=model, optimizer=opt)
            ref[step] = {name: v.detach().clone() for name, v in model.state_dict().items()}
    finally:
        released.set()
        cap.close()
    _check_incident(store, ref, nan_at, k, "0.weight")


def test_nonfinite_incident_at_the_planted_step_with_the_trainer_on_every_core(tmp_path: Path) -> None:
    """Two trainers at once, each with torch at the machine's default
    thread count (every core; no OMP_NUM_THREADS: twice as many busy threads
    as cores), a NaN planted at a known step of each (early, late): every
    one raises exactly one incident, at that step, with the K steps before
    it stored bit-exact. (A watcher that gets no CPU at all until the end:
    test_a_starved_watcher_thread_skips_no_step.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    k, steps = 4, 20
    runs = {1: 7, 3: 15}  # seed: the step the NaN is planted at
    procs = {seed: subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path / f"run{seed}"),
                                     str(tmp_path / f"ref{seed}.pt"), "--nan-at", str(nan_at), "--steps", str(steps),
                                     "--k", str(k), "--seed", str(seed)], cwd=tmp_path, env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for seed, nan_at in runs.items()}
    errors = {}
    try:
        for seed, p in procs.items():
            _out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                errors[seed] = err[-3000:]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert not errors, errors
    for seed, nan_at in runs.items():
        ref = torch.load(tmp_path / f"ref{seed}.pt", weights_only=True)
        _check_incident(tmp_path / f"run{seed}", ref, nan_at, k, "2.weight")


@pytest.mark.parametrize("where", ["big weight", "small bias", "buffer", "float16 extra", "bfloat16 extra"])
def test_every_kind_of_staged_copy_is_checked(tmp_path: Path, where: str) -> None:
    """A NaN/Inf is found wherever it lands: a large parameter (a copy of its
    own, lazy), a small one (a group of small tensors copied together), a
    buffer (eager), an extra tensor of a 16-bit dtype -- and named."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    extra = {"h": torch.ones(64, dtype=torch.float16), "b": torch.ones(64, dtype=torch.bfloat16)}
    target = {"big weight": "0.weight", "small bias": "2.bias", "buffer": "1.running_var",
              "float16 extra": "extra/h", "bfloat16 extra": "extra/b"}[where]
    with dstt.Capture(tmp_path / "run", helper=False, memory_steps=2, persist="newest") as cap:
        for step in range(6):
            model(torch.randn(8, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 4:
                with torch.no_grad():
                    if where == "big weight":
                        model[0].weight[7, 7] = float("nan")
                    elif where == "small bias":
                        model[2].bias[1] = float("inf")
                    elif where == "buffer":
                        model[1].running_var[3] = float("inf")
                    else:
                        extra["h" if where.startswith("float16") else "b"][5] = float("nan")
            cap.snapshot(step, model=model, optimizer=opt, extra={k: v.clone() for k, v in extra.items()})
    (inc,) = list_incidents(open_backend(str(tmp_path / "run")), "main")
    assert inc.step == 4 and any(t.endswith(target) for t in inc.tensors), inc.tensors
