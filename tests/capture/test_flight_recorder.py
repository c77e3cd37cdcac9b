"""The flight recorder (issue 14): the memory tier, persistence policies,
incidents, rewind, update statistics -- real captures, real stores."""

from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import dstt
from dstt.capture.tiersize import EXTRA_SLOTS
from dstt.errors import CaptureError, ConfigError, RestoreMismatchError, StepNotFoundError
from dstt.format.backends import open_backend
from dstt.format.incidents import list_incidents
from dstt.format.layout import STATS_COLUMNS
from tests.conftest import start_script

#: Packs of small tensors (issue 16) on, as users get them.
DSTT_PACKING = True
SCRIPTS = Path(__file__).parents[1] / "scripts"


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _steps(cap: dstt.Capture, m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
           ref: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
    """Train and capture ``steps``, keeping each step's weights in ``ref``."""
    for s in steps:
        _train(m, opt)
        cap.snapshot(s, model=m, optimizer=opt)
        if ref is not None:
            ref[s] = _weights(m)


def _weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


class Gate:
    """Blocks a Capture's writer (its flush_chunk) until opened: the disk is
    "slow" for as long as a test wants, deterministically."""

    def __init__(self, cap: dstt.Capture) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()
        inner = cap.writer.flush_chunk

        def flush(*a, **k):  # type: ignore[no-untyped-def]
            self.entered.set()
            if not self.open_.wait(60):
                raise RuntimeError("gate never opened")
            return inner(*a, **k)

        cap.writer.flush_chunk = flush  # type: ignore[method-assign]

    def release(self) -> None:
        self.open_.set()


_OPEN: list[tuple[dstt.Capture, Gate]] = []


def _close_on_failure(cap: dstt.Capture, gate: Gate) -> None:
    _OPEN.append((cap, gate))


@pytest.fixture(autouse=True)
def _release_gates():
    yield
    while _OPEN:  # a failed test must not leave a writer blocked (or a Capture open)
        cap, gate = _OPEN.pop()
        gate.release()
        try:
            cap.close()
        except Exception:  # noqa: BLE001 - the test already failed or passed
            pass


def _stored(path: str, branch: str = "main") -> list[int]:
    return dstt.open(path).steps(branch)


def _check_bit_exact(path: str, ref: dict[int, dict[str, torch.Tensor]], branch: str = "main") -> None:
    run = dstt.open(path)
    for s in run.steps(branch):
        if s not in ref:
            continue
        got = run.state_dict(s, branch=branch)["model"]
        for k, v in ref[s].items():
            assert torch.equal(got[k], v), (branch, s, k)


def test_persist_all_keeps_every_step_bit_exact(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=3, persist="all") as cap:
        _steps(cap, m, opt, range(10), ref)
    assert _stored(path) == list(range(10))
    _check_bit_exact(path, ref)
    assert dstt.verify(path).ok


def test_newest_never_waits_for_the_writer_and_records_memory_only_steps(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    cap = dstt.Capture(path, helper=False, memory_steps=4, persist="newest")
    gate = Gate(cap)
    _close_on_failure(cap, gate)
    # The writer is blocked for the whole loop: with persist="newest" the
    # trainer must still capture every step (staging only, never the disk).
    for s in range(12):
        _train(m, opt)
        assert cap.snapshot(s, model=m, optimizer=opt)
        ref[s] = _weights(m)
    cap.wait_staged()
    assert gate.entered.wait(10)
    assert cap.parts.slots is not None and cap.parts.slots.nslots == 4 + EXTRA_SLOTS
    gate.release()
    cap.close()
    stored = _stored(path)
    # the step the writer took first (whichever was newest when it got free),
    # the newest at close, and little in between: the writer was blocked
    assert stored[-1] == 11 and len(stored) <= 3
    _check_bit_exact(path, ref)
    spans, persisted = dstt.open(path).captured("main")
    assert persisted == stored
    assert spans == [(0, 11)]  # every captured step is accounted for
    ls = dstt.open(path)  # the CLI shows memory-only steps
    assert ls.captured("main")[1] == stored


def test_persist_every_n_and_the_last_step_at_close(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=2, persist=3) as cap:
        _steps(cap, m, opt, range(10, 20), ref)
    assert _stored(path) == [10, 13, 16, 19]
    _check_bit_exact(path, ref)
    commit = dstt.open(path).commit_info(13, branch="main")
    assert commit.get("memory_only") == [[11, 12]]


def test_incident_persists_exactly_the_ring(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    cap = dstt.Capture(path, helper=False, memory_steps=4, persist="newest")
    gate = Gate(cap)
    _close_on_failure(cap, gate)
    _steps(cap, m, opt, range(1), ref)
    # the writer takes a step and blocks on the "slow disk" (waited for: on a
    # busy machine its low-priority thread may not run before step 6)
    assert gate.entered.wait(60)
    _steps(cap, m, opt, range(1, 10), ref)
    cap.wait_staged()
    inc = cap.incident("loss spike 9.7 > 3x median")
    assert inc.steps == (6, 7, 8, 9) and inc.step == 9 and inc.source == "trainer"
    gate.release()
    cap.close()
    # the step being written when the gate closed (the newest staged then),
    # and the ring; the others were evicted from memory
    first, *rest = _stored(path)
    assert first < 6 and rest == [6, 7, 8, 9]
    _check_bit_exact(path, ref)
    (got,) = list_incidents(open_backend(path), "main")
    assert got.reason == "loss spike 9.7 > 3x median" and got.steps == (6, 7, 8, 9)
    assert dstt.verify(path).ok


def test_backfilled_steps_keep_the_branch_head(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=8, persist=4) as cap:
        _steps(cap, m, opt, range(8), ref)
        cap.wait()  # 0 and 4 stored, the rest in memory
        assert _stored(path) == [0, 4]
        cap.incident("bad batch")  # 1, 2, 3, 5, 6, 7: 1..3 are older than the head (4): backfilled
        cap.wait()
        assert _stored(path) == list(range(8))
        assert dstt.open(path).latest("main") == 7
        _train(m, opt)
        cap.snapshot(8, model=m, optimizer=opt)
        ref[8] = _weights(m)
    assert _stored(path) == list(range(9))
    _check_bit_exact(path, ref)
    assert dstt.verify(path).ok


def test_nonfinite_values_raise_an_incident(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    with dstt.Capture(path, helper=False, memory_steps=3, persist=5) as cap:
        for s in range(8):
            _train(m, opt)
            if s == 6:
                with torch.no_grad():
                    m[0].weight[0, 0] = float("nan")
            cap.snapshot(s, model=m, optimizer=opt)
        cap.wait_staged()
        deadline = 200
        while not list_incidents(open_backend(path), "main") and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
    (inc,) = list_incidents(open_backend(path), "main")  # once, not once per non-finite step
    assert inc.source == "non-finite" and inc.step == 6
    assert any("0.weight" in t for t in inc.tensors)
    stored = _stored(path)
    # step 6 and the K=3 steps before it, however far behind the watcher was
    # (it runs beside the trainer: step 7 may be in the ring already)
    assert {3, 4, 5, 6} <= set(stored) and set(inc.steps) <= {3, 4, 5, 6, 7}
    run = dstt.open(path)
    names, rows = run.step_stats(6, branch="main")
    col = list(STATS_COLUMNS).index("nonfinite")
    assert rows[names.index(next(n for n in names if n.endswith("0.weight") and "model" in n)), col] == 1


def test_update_statistics_from_the_previous_step_in_memory(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=2, persist="all") as cap:
        _steps(cap, m, opt, range(4), ref)
    run = dstt.open(path)
    cols = list(STATS_COLUMNS)
    names, rows = run.step_stats(3, branch="main")
    i = names.index(next(n for n in names if n.startswith("model/") and n.endswith("2.weight")))
    want = float(torch.linalg.vector_norm((ref[3]["2.weight"] - ref[2]["2.weight"]).double()))
    assert math.isclose(rows[i, cols.index("update_norm")], want, rel_tol=1e-6)
    norm = float(torch.linalg.vector_norm(ref[3]["2.weight"].double()))
    assert math.isclose(rows[i, cols.index("update_ratio")], want / norm, rel_tol=1e-6)
    names0, rows0 = run.step_stats(0, branch="main")
    assert math.isnan(rows0[names0.index(names[i]), cols.index("update_norm")])  # no previous step


def test_rewind_from_the_ring_is_bit_exact_and_forks_a_branch(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref, opt_ref = {}, {}
    with dstt.Capture(path, helper=False, memory_steps=4, persist="newest") as cap:
        for s in range(10):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt, extra={"batch": s * 32})
            ref[s] = _weights(m)
            opt_ref[s] = {k: {n: v.clone() for n, v in st.items()} for k, st in opt.state_dict()["state"].items()}
        extra = cap.rewind(7, model=m, optimizer=opt, branch="skip-bad-batch")
        assert extra == {"batch": 224}
        for k, v in ref[7].items():
            assert torch.equal(m.state_dict()[k], v)
        for k, st in opt.state_dict()["state"].items():
            for n, v in st.items():
                assert torch.equal(v, opt_ref[7][k][n]), (k, n)
        new_ref = {}
        _steps(cap, m, opt, range(8, 11), new_ref)
    run = dstt.open(path)
    assert run.branch_info("skip-bad-batch").parent == dstt.StepRef("main", 7)
    assert {6, 7, 8, 9}.issubset(run.steps("main"))  # the ring: the spike, stored by the rewind
    assert 10 in run.steps("skip-bad-batch")
    _check_bit_exact(path, ref)
    _check_bit_exact(path, new_ref, branch="skip-bad-batch")
    sources = {i.source for i in list_incidents(open_backend(path))}
    assert sources == {"rewind"}
    assert dstt.verify(path).ok


def test_rewind_from_the_store_and_bad_rewinds_change_nothing(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=2, persist="all") as cap:
        _steps(cap, m, opt, range(6), ref)
        before = _weights(m)
        with pytest.raises(StepNotFoundError):
            cap.rewind(77, model=m, optimizer=opt)
        other = torch.nn.Linear(3, 3)
        with pytest.raises(RestoreMismatchError):
            cap.rewind(1, model=other)
        for k, v in before.items():
            assert torch.equal(m.state_dict()[k], v)
        cap.rewind(1, model=m, optimizer=opt)  # long evicted from memory: read from the store
        for k, v in ref[1].items():
            assert torch.equal(m.state_dict()[k], v)
        _train(m, opt)
        cap.snapshot(2, model=m, optimizer=opt)
    run = dstt.open(path)
    assert run.branch_info("main-rewind-1").parent == dstt.StepRef("main", 1)
    assert run.steps("main-rewind-1") == [2]


def test_rewind_without_memory_tier_uses_the_store(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path) as cap:
        for s in range(4):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt, extra={"s": s})
            ref[s] = _weights(m)
        assert cap.rewind(2, model=m, optimizer=opt, branch="b2") == {"s": 2}
        _train(m, opt)
        cap.snapshot(3, model=m, optimizer=opt)
    assert _stored(path, "b2") == [3]
    assert dstt.open(path).branch_info("b2").parent == dstt.StepRef("main", 2)


def test_memory_bound_is_stated_and_enforced(tmp_path):
    m, opt = _model()
    cap = dstt.Capture(str(tmp_path / "run"), memory_steps=4, host_buffer_bytes=64 << 10, max_chunk_bytes=4096)
    _train(m, opt)
    with pytest.raises(CaptureError, match="memory_steps=4 needs 8 slots"):
        cap.snapshot(0, model=m, optimizer=opt)
    cap.close()
    with pytest.raises(ConfigError, match="needs memory_steps"):
        dstt.Capture(str(tmp_path / "r2"), persist="newest")
    with dstt.Capture(str(tmp_path / "r3"), memory_steps=2, helper=True) as cap3:  # (issue 25: no longer refused)
        assert cap3.tier_where == "helper"
    with pytest.raises(ConfigError, match="persist"):
        dstt.Capture(str(tmp_path / "r4"), memory_steps=2, persist="some")


def test_ring_holds_at_most_k_steps(tmp_path):
    m, opt = _model()
    with dstt.Capture(str(tmp_path / "run"), helper=False, memory_steps=3, persist="newest") as cap:
        for s in range(15):
            _steps(cap, m, opt, range(s, s + 1))
            cap.wait_staged()
            assert len(cap.parts.tier_held) <= 3
            assert cap.parts.slots is not None and cap.parts.slots.free_slots >= 0
        in_use = cap.parts.slots.nslots - cap.parts.slots.free_slots
        assert in_use <= 3 + EXTRA_SLOTS


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm for the staging ring")
def test_sigkill_after_an_incident_loses_no_sealed_ring_step(tmp_path):
    path, ref_path = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    proc = start_script(SCRIPTS / "flight_kill.py", path, ref_path)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["incident"], proc.stderr.read()[-2000:] if proc.stderr else line
        ring_steps = [int(x) for x in line[1:]]
        assert ring_steps == [6, 7, 8, 9]
        os.kill(proc.pid, signal.SIGKILL)  # the trainer dies with nothing written (its disk stalled)
    finally:
        proc.kill()
        proc.communicate()
    ref = torch.load(ref_path)
    m, opt = _model()
    with dstt.Capture(path, helper=False, memory_steps=4) as cap:  # the next Capture commits what the ring sealed
        assert set(ring_steps).issubset(cap.recovered)
        _train(m, opt)
        cap.snapshot(10, model=m, optimizer=opt)  # the branch is writable again
    stored = _stored(path)
    assert set(ring_steps).issubset(stored) and 10 in stored
    _check_bit_exact(path, ref)
    assert dstt.verify(path).ok


def test_steps_stored_by_an_incident_get_update_statistics(tmp_path):
    path = str(tmp_path / "run")
    m, opt = _model()
    with dstt.Capture(path, helper=False, memory_steps=4, persist=4) as cap:
        _steps(cap, m, opt, range(8))
        cap.wait_staged()
        cap.incident("check")  # 5, 6, 7 were passed over; 4 was stored
        for s in range(8, 10):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)  # 9 passed over, stored at close
    run = dstt.open(path)
    cols = list(STATS_COLUMNS)
    for step in (5, 6, 7, 9):
        names, rows = run.step_stats(step, branch="main")
        i = names.index(next(n for n in names if n.startswith("model/") and n.endswith("0.weight")))
        assert not math.isnan(rows[i, cols.index("update_norm")]), step


def test_rewind_right_after_snapshot_waits_for_the_lazy_copies(tmp_path, monkeypatch):
    """The rewind changes the live tensors in place: a step whose lazy copy
    has not run yet must be copied first (its stored values are the state at
    snapshot(), not the rewound one)."""
    path = str(tmp_path / "run")
    m, opt = _model()
    ref = {}
    with dstt.Capture(path, helper=False, memory_steps=4, persist="all") as cap:
        cap.parts.stager.before_lazy = lambda job: threading.Event().wait(0.3)  # a slow stager thread
        _steps(cap, m, opt, range(4), ref)
        cap.rewind(1, model=m, optimizer=opt)  # step 3's copy is still queued behind a slow stager
    _check_bit_exact(path, ref)
    assert _stored(path) == [0, 1, 2, 3]
