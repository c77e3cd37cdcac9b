"""The memory tier in a real capture helper process (issue 25): a trainer
in miniature copies each step into a slot of a real /dev/shm-style ring
pool, seals it and hands it over (``tier <step>``); the helper process
(capture/helper.py + helperops.py) keeps the last K, persists by policy,
answers ``ok``/``free``, dumps the tier on incidents, and stores every
held step when its trainer dies. Everything read back bit for bit."""

from __future__ import annotations

import json
import os
import select
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.capture import helper as H
from dstt.capture.ring import Ring, seal_record
from dstt.format.backends import open_backend
from dstt.format.incidents import list_incidents
from dstt.format.index import RunIndex
from dstt.store.writer import Writer

SLOT = 1 << 16


def state_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 16, generator=g), "n": torch.arange(5, dtype=torch.int64) * step}


class MiniTrainer:
    """Plan, copy into a free slot, seal, hand over: the trainer's whole part."""

    def __init__(self, tmp_path: Path, k: int, policy: Any, watch: bool = True) -> None:
        self.path = tmp_path / "run"
        self.writer = Writer(str(self.path))
        self.ring = Ring({"store": str(self.path), "branch": "main", "branch_id": 0, "branch_created": 0.0},
                         base=tmp_path / "shm")
        self.nslots = k + 4
        self.pool = self.ring.new_pool(self.nslots * SLOT)
        self.free = list(range(self.nslots))
        self.slot_of: dict[int, int] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.answers: dict[int, str] = {}
        self.lines: list[str] = []
        lock = self.writer.branch_lock
        self.h = H.start({"branch": "main"}, str(self.path), self.ring.dir, lock.fileno(), 0,
                         tier={"k": k, "policy": policy, "watch": watch, "run": "t1"}, timeout_s=60)

    def _read(self, timeout: float) -> None:
        line = self.h._readline(timeout)
        if line is None:
            raise EOFError("the helper closed its answers")
        if line == "ready":
            self.h.ready = True
        elif line:
            self.lines.append(line)
            kind, step, *_ = line.split(" ", 2)
            if kind == "free":
                self.free.append(self.slot_of.pop(int(step)))
            elif kind in ("ok", "err"):
                self.answers[int(step)] = line

    def until(self, cond: Any, what: str, limit: float = 60.0) -> None:
        end = time.monotonic() + limit
        while not cond():
            assert time.monotonic() < end, f"timed out waiting for {what}; answers so far: {self.lines[-5:]}"
            self._read(0.05)

    def snapshot(self, step: int, state: dict[str, torch.Tensor] | None = None) -> None:
        st = state or state_at(step)
        self.states[step] = {k: v.clone() for k, v in st.items()}
        plan = self.writer.plan(step, self.states[step])
        self.until(lambda: bool(self.free), f"a free slot for step {step}")
        slot = self.free.pop()
        self.slot_of[step] = slot
        off = slot * SLOT
        staged = []
        for t in plan.tasks:
            n = t.source.numel() * t.source.element_size()
            view = self.pool[off:off + n]
            view.copy_(t.source.contiguous().view(-1).view(torch.uint8))
            staged.append((t, view))
            off += -(-n // 64) * 64
        assert off <= (slot + 1) * SLOT
        self.ring.seal(seal_record(plan, self.ring.pool_name, self.pool, staged, crc=False))
        os.write(self.h._cmd, f"tier {step}\n".encode())
        while select.select([self.h._ack], [], [], 0)[0]:
            self._read(0.001)

    def incident(self, reason: str) -> dict[str, Any]:
        os.write(self.h._cmd, f"incident - {reason.encode().hex()}\n".encode())
        self.until(lambda: any(x.startswith("incident ") for x in self.lines), "the incident's answer")
        line = next(x for x in self.lines if x.startswith("incident "))
        doc: dict[str, Any] = json.loads(line.split(" ", 2)[2])
        return doc

    def close(self) -> None:
        os.write(self.h._cmd, b"close\n")
        self.until(lambda: len(self.free) == self.nslots, "every slot back")
        self.h.close(timeout_s=60)
        self.ring.close()
        self.writer.close()

    def die(self) -> int:
        """The trainer's end of the pipe closes without ``close`` (as when it is SIGKILLed)."""
        os.close(self.h._cmd)
        code = self.h.proc.wait(60)
        os.close(self.h._ack)
        self.h.closed = True
        self.ring.close()
        self.writer.close()
        return code


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_stored(t: MiniTrainer, steps: list[int]) -> None:
    run = dstt.open(t.path)
    assert run.steps() == steps
    for s in steps:
        for name, v in t.states[s].items():
            assert bits(run.read(name, s)) == bits(v), (s, name)


@pytest.mark.slow  # (the same path end to end, quick: tests/capture/test_tier_in_helper.py)
@pytest.mark.parametrize("policy", ["all", 3])
def test_helper_tier_persists_by_policy_and_frees_every_slot(tmp_path: Path, policy: Any) -> None:
    t = MiniTrainer(tmp_path, 3, policy)
    for s in range(10):
        t.snapshot(s)
    t.close()
    want = list(range(10)) if policy == "all" else [0, 3, 6, 9]
    assert sorted(t.answers) == want and all(a.startswith("ok ") for a in t.answers.values())
    check_stored(t, want)
    spans, persisted = RunIndex(str(t.path)).captured()
    assert spans == [(0, 9)] and persisted == want
    assert not list(t.ring.dir.glob("seal-*")) if t.ring.dir.exists() else True


@pytest.mark.slow
def test_helper_tier_incident_and_newest(tmp_path: Path) -> None:
    t = MiniTrainer(tmp_path, 4, "newest")
    for s in range(8):
        t.snapshot(s)
    t.until(lambda: len([x for x in t.lines if x.startswith("free ")]) >= 3, "the oldest steps to leave")
    doc = t.incident("loss spike at 7")
    assert doc["reason"] == "loss spike at 7" and doc["source"] == "trainer" and doc["step"] == 7
    held = doc["steps"]
    assert held[-1] == 7 and len(held) >= 4
    t.close()
    stored = RunIndex(str(t.path)).steps()
    assert set(held) <= set(stored)
    check_stored(t, stored)
    incs = list_incidents(open_backend(str(t.path)), "main")
    assert [(i.step, list(i.steps)) for i in incs] == [(7, held)]


@pytest.mark.slow
def test_helper_tier_nonfinite_incident(tmp_path: Path) -> None:
    t = MiniTrainer(tmp_path, 3, 4)
    for s in range(7):
        st = state_at(s)
        if s == 5:
            st["w"][1, 2] = float("inf")
        t.snapshot(s, st)
    t.close()
    incs = list_incidents(open_backend(str(t.path)), "main")
    assert [(i.step, i.source, i.tensors, i.steps) for i in incs] == [(5, "non-finite", ("w",), (2, 3, 4, 5, 6))]
    check_stored(t, RunIndex(str(t.path)).steps())
    assert {2, 3, 4, 5, 6} <= set(RunIndex(str(t.path)).steps())  # the K before it, itself, and what came after


def test_trainer_death_stores_every_held_step(tmp_path: Path) -> None:
    t = MiniTrainer(tmp_path, 4, "newest", watch=False)
    for s in range(9):
        t.snapshot(s)
    t.until(lambda: any(x.startswith("ok ") for x in t.lines), "a first commit")
    assert t.die() == 0
    incs = list_incidents(open_backend(str(t.path)), "main")
    assert [i.source for i in incs] == ["crash"]
    stored = RunIndex(str(t.path)).steps()
    assert set(incs[0].steps) <= set(stored) and 8 in stored  # the newest held step included
    assert set(range(9 - 4, 9)) <= set(stored)  # the K last steps at least
    check_stored(t, stored)
