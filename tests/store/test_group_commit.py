"""Group commit (issue 16): several steps committed with one round of syncs,
each with its own index and commit marker, none acknowledged before it is
durable -- in the Writer (format/groupcommit.py) and through the capture
helper, whose trainer hands steps over without waiting for the previous
answer (capture/committers.py)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.capture.helper import HelperHandle
from dstt.errors import CaptureError
from dstt.format import layout as L
from dstt.format.backends import LocalBackend
from dstt.format.verify import verify
from dstt.store.writer import Writer
from tests.conftest import bits_equal


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.full((8,), float(step)),
            "frozen": torch.arange(50.0), "i": torch.tensor(step)}


def _prepared(w: Writer, steps: range) -> list[tuple[Any, list[Any]]]:
    items = []
    for step in steps:
        plan = w.plan(step, state(step))
        w.ensure_arrays(plan)
        items.append((plan, [w.flush_chunk(plan, t) for t in plan.tasks]))
    return items


def _assert_steps_exact(path: Path, steps: list[int]) -> None:
    run = dstt.open(path)
    assert run.steps() == steps
    for step in steps:
        got = run.state_dict(step, verify=True)
        assert set(got) == set(state(step))
        assert all(bits_equal(got[k], v) for k, v in state(step).items()), step
    report = verify(path)
    assert report.ok, [str(p) for p in report.problems]


def _count(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(LocalBackend, name)

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(LocalBackend, name, counted)
    return calls


def test_group_of_steps_committed_with_one_round_of_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run"
    w = Writer(path)
    items = _prepared(w, range(5))
    syncs, renames = _count(monkeypatch, "sync"), _count(monkeypatch, "rename")
    infos = w.commit_group(items)
    assert [getattr(i, "step", i) for i in infos] == [0, 1, 2, 3, 4]
    assert syncs[0] == 2 and renames[0] == 5  # one commit by one: 2 syncs per step
    assert w.last_commit == (4, items[-1][0].seq)
    w.close()
    for step in range(5):  # each step has its own index and marker, and no temporary is left
        files = sorted(os.listdir(path / L.step_dir("main", step)))
        assert L.COMMIT_FILE in files and L.INDEX_FILE in files and not any(".tmp-" in f for f in files), files
    _assert_steps_exact(path, list(range(5)))
    assert dstt.open(path).latest() == 4


@pytest.mark.parametrize("group_sync", [True, False])
def test_grouping_asks_the_backends_capability_not_its_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             group_sync: bool) -> None:
    """A backend of another class that says it can (``group_sync``) commits
    a group with one round of syncs; one that says it cannot, one by one
    (the group commit tested ``type(backend) is LocalBackend`` before)."""

    class Mine(LocalBackend):
        pass

    Mine.group_sync = group_sync and LocalBackend.group_sync
    if group_sync and not LocalBackend.group_sync:
        pytest.skip("no syncfs(2) here: no backend can group")
    path = tmp_path / "run"
    w = Writer(Mine(path, create=True))
    items = _prepared(w, range(4))
    syncs = _count(monkeypatch, "sync")
    assert [getattr(i, "step", i) for i in w.commit_group(items)] == [0, 1, 2, 3]
    assert syncs[0] == (2 if group_sync else 4)  # one step alone: its one sync (a single writer)
    w.close()
    _assert_steps_exact(path, [0, 1, 2, 3])


def test_a_group_writes_the_branch_head_once_naming_its_last_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from dstt.format.heads import head_key, head_record

    path = tmp_path / "run"
    w = Writer(path)
    items = _prepared(w, range(3))
    keys: list[str] = []
    real_put = LocalBackend.put
    monkeypatch.setattr(LocalBackend, "put", lambda self, key, data: (keys.append(key), real_put(self, key, data))[1])
    w.commit_group(items)
    assert keys.count(head_key("main")) == 1  # each step rewrote it: only the last is ever durable
    assert keys.index(head_key("main")) < min(i for i, k in enumerate(keys) if ".tmp-" in k)  # before the sync
    head = head_record(LocalBackend(str(path)), "main")
    assert head is not None and head.step == 2 and head.seq == items[-1][0].seq
    w.close()
    _assert_steps_exact(path, [0, 1, 2])


def test_a_failed_step_does_not_take_its_group_down(tmp_path: Path) -> None:
    path = tmp_path / "run"
    w = Writer(path)
    items = _prepared(w, range(4))
    items[2] = (items[2][0], items[2][1][:-1])  # a chunk result missing: step 2 cannot be committed
    out = w.commit_group(items)
    assert isinstance(out[2], CaptureError) and "chunks were written" in str(out[2])
    assert [o.step for i, o in enumerate(out) if i != 2] == [0, 1, 3]
    w.close()
    _assert_steps_exact(path, [0, 1, 3])


def test_nothing_is_acknowledged_when_publishing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The markers' renames fail: every step of the group is reported
    failed, none is visible, no temporary is left, and the writer goes on."""
    path = tmp_path / "run"
    w = Writer(path)
    items = _prepared(w, range(3))

    def refuse(self: Any, src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalBackend, "rename", refuse)
    out = w.commit_group(items)
    assert all(isinstance(o, OSError) for o in out)
    monkeypatch.undo()
    assert dstt.open(path).steps() == []
    assert not any(".tmp-" in f for _, _, fs in os.walk(path) for f in fs)
    assert w.last_commit is None
    w.write(3, state(3))
    w.close()
    _assert_steps_exact(path, [3])


def test_capture_helper_pipelines_and_groups_steps_bit_exact(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop faster than a commit: the trainer hands steps to the helper
    without waiting for each answer (a send before the previous receive),
    the answers come back in order, and every step is stored bit-exact."""
    events: list[tuple[str, int]] = []
    real_send, real_receive = HelperHandle.send, HelperHandle.receive

    def send(self: HelperHandle, step: int) -> None:
        events.append(("send", step))
        real_send(self, step)

    def receive(self: HelperHandle, step: int) -> dict[str, Any]:
        out = real_receive(self, step)
        events.append(("ack", step))
        return out

    monkeypatch.setattr(HelperHandle, "send", send)
    monkeypatch.setattr(HelperHandle, "receive", receive)
    path = tmp_path / "run"
    with dstt.Capture(path) as cap:
        assert cap.parts.helper is not None
        for step in range(40):
            cap.snapshot(step, extra=state(step), rng=False)
        cap.wait()
        assert cap.n_committed == 40 and [c.step for c in cap.committed] == list(range(40))
    acks = [s for kind, s in events if kind == "ack"]
    assert acks == list(range(40))
    ahead = max(sum(1 for kind, s in events[:i] if kind == "send") - sum(1 for kind, s in events[:i] if kind == "ack")
                for i in range(len(events) + 1))
    assert ahead >= 2, events  # at least once, two steps were handed over before the first was answered
    run = dstt.open(path)
    assert run.steps() == list(range(40))
    for step in (0, 17, 39):
        got = run.state_dict(step, verify=True)["extra"]
        assert all(bits_equal(got[k], v) for k, v in state(step).items())
    assert verify(path).ok


WORKER = textwrap.dedent("""
    import os, sys, torch, dstt
    sys.path.insert(0, {root!r})
    from tests.store.test_group_commit import state
    store, acked = sys.argv[1], sys.argv[2]
    cap = dstt.Capture(store)
    with open(acked + ".helper", "w") as f:
        f.write(str(cap.parts.helper.pid))
    start = 0 if cap.writer.last_step is None else cap.writer.last_step + 1
    with open(acked, "a") as out:
        for step in range(start, start + 10000):
            cap.snapshot(step, extra=state(step), rng=False)
            last = cap.last_commit
            if last is not None:
                out.write(f"{{last.step}}\\n")
                out.flush()
""")


@pytest.mark.parametrize("trials", [2, pytest.param(12, marks=pytest.mark.slow)])
def test_sigkill_of_trainer_and_helper_loses_no_acknowledged_step(tmp_path: Path, trials: int) -> None:
    """Trainer and capture helper SIGKILLed at random moments of a loop whose
    steps are committed in groups: every step the trainer was told is
    committed is in the store, bit-exact, after the next Capture recovers
    what was sealed; the steps have no gap and verify is clean."""
    root = str(Path(__file__).resolve().parents[2])
    path, acked = tmp_path / "run", tmp_path / "acked"
    rng = random.Random(16)
    for _ in range(trials):
        for f in (acked, Path(str(acked) + ".helper")):
            f.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", WORKER.format(root=root), str(path), str(acked)],
                                cwd=root)
        deadline = time.monotonic() + 60
        while not (acked.exists() and acked.stat().st_size > 0) and proc.poll() is None:
            assert time.monotonic() < deadline, "the worker never committed a step"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        helper = int(Path(str(acked) + ".helper").read_text())
        for pid in (helper, proc.pid):  # the helper first: no one finishes its group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
        told = [int(x) for x in acked.read_text().split()]
        # Waits for the branch, recovers the sealed steps (in this process, before
        # a helper would start: none is, it would only be closed again).
        with dstt.Capture(path, helper=False):
            pass
        run = dstt.open(path)
        steps = run.steps()
        assert steps == list(range(len(steps))), steps
        assert max(told) in steps, (max(told), steps[-3:])
        for step in {max(told), steps[-1]}:
            got = run.state_dict(step, verify=True)["extra"]
            assert all(bits_equal(got[k], v) for k, v in state(step).items()), step
    report = verify(path)
    assert report.ok, [str(p) for p in report.problems]
