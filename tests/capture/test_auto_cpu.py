"""compression="auto" backs off on CPU contention, not only on queue depth
(issue 27): the capture helper measures the idle time of its CPUs per
window and stores steps fast while the host has no core to spare
(dstt/capture/helpercpu.py), recorded per step in commit.json."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

import dstt
from dstt import knobs
from dstt.capture.helpercpu import WINDOW_S, CpuWatch, idle_seconds
from dstt.errors import ConfigError
from dstt.format.verify import verify
from tests.conftest import bits_equal


class Host:
    """A fake host: a clock, /proc/stat's idle ticks of two CPUs, the helper's CPU seconds."""

    def __init__(self) -> None:
        self.t = 100.0
        self.ticks = [0, 0]  # idle ticks (100 per second) of cpu0, cpu1
        self.own = 0.0

    def stat(self) -> str:
        lines = ["cpu  1 2 3 4 5 6 7 8"]
        lines += [f"cpu{i} 10 0 10 {idle} 0 0 0 0" for i, idle in enumerate(self.ticks)]
        return "\n".join(lines + ["intr 1 2 3"]) + "\n"

    def run(self, seconds: float, idle_cores: float, helper_cores: float) -> None:
        self.t += seconds
        self.ticks[0] += round(100 * seconds * min(idle_cores, 1.0))
        self.ticks[1] += round(100 * seconds * max(idle_cores - 1.0, 0.0))
        self.own += seconds * helper_cores

    def watch(self, spare: float) -> CpuWatch:
        return CpuWatch(spare, clock=lambda: self.t, own=lambda: self.own, stat=self.stat, cpus={0, 1})


def test_the_watch_falls_back_on_contention_and_resumes_without_flapping() -> None:
    """A fake clock and counters: with 1.2 idle cores coding goes on; with
    0.1 (the trainer took every core) the next steps are fast; when the
    trainer leaves 0.8 idle while steps are stored fast, coding would take
    the 0.45 cores it took before and leave 0.35 < 0.5: still fast; with
    1.5 idle, coding again. Decisions wait for a whole window."""
    host = Host()
    w = host.watch(0.5)
    assert w.budget() == math.inf
    host.run(0.2, idle_cores=0.0, helper_cores=0.45)
    assert w.budget() == math.inf  # (less than a window: no decision yet)
    host.run(WINDOW_S, idle_cores=1.2, helper_cores=0.45)
    assert w.budget() == math.inf
    host.run(1.0, idle_cores=0.1, helper_cores=0.45)
    assert w.budget() == -math.inf  # contended: store fast
    host.run(1.0, idle_cores=0.8, helper_cores=0.05)
    assert w.budget() == -math.inf  # 0.8 - 0.45 < 0.5: coding would contend again
    host.run(1.0, idle_cores=1.5, helper_cores=0.05)
    assert w.budget() == math.inf


@pytest.mark.parametrize("case", ["off", "no-proc-stat", "unreadable"])
def test_the_watch_codes_when_it_cannot_or_must_not_measure(case: str) -> None:
    host = Host()
    spare = 0.0 if case == "off" else 0.5
    w = CpuWatch(spare, clock=lambda: host.t, own=lambda: host.own, cpus={0, 1},
                 stat=host.stat if case == "off" else (lambda: None) if case == "no-proc-stat" else (lambda: "junk"))
    host.run(2.0, idle_cores=0.0, helper_cores=1.0)
    assert w.budget() == math.inf
    assert idle_seconds("cpu0 1 2 3 x 5\ncpu9 1 2 3 4 5\n", {0}, 0.01) is None  # malformed: not read


def test_a_bad_spare_cores_setting_is_refused_when_capture_starts(tmp_path: Path) -> None:
    with knobs.override(DSTT_AUTO_SPARE_CORES="lots"), pytest.raises(ConfigError, match="DSTT_AUTO_SPARE_CORES"):
        dstt.Capture(tmp_path / "run")


def test_a_host_without_spare_cores_gets_fast_steps_recorded_per_step(tmp_path: Path) -> None:
    """A real capture helper with the default compression ("auto") on a
    host that never has the idle cores asked for (DSTT_AUTO_SPARE_CORES
    beyond any machine): once a window has passed its steps are stored fast,
    each recorded as ``coding: fast``, all bit-exact and verified. (With
    the rule off, as in the rest of the suite, such steps are coded:
    tests/format/test_predchain.py, and the fake host above.)"""
    path = tmp_path / "run"
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = []
    with knobs.override(DSTT_AUTO_SPARE_CORES="1000000"):
        cap = dstt.Capture(path, helper=True)
    try:
        for step in range(4):
            model(torch.randn(4, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            cap.wait()
            if step == 1:
                time.sleep(WINDOW_S + 0.1)  # (a whole window before step 2 is planned)
    finally:
        cap.close()
    run = dstt.open(path)
    codings = [run.commit_info(s).get("coding") for s in run.steps()]
    assert len(codings) == 4 and codings[2:] == ["fast", "fast"], codings
    for s, state in enumerate(states):
        for k, v in state.items():
            assert bits_equal(run.read(f"model/{k}", s), v)
    assert verify(path).ok
