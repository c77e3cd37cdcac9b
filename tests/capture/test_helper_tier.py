"""The memory tier's decisions as the capture helper makes them (issue 25,
capture/helpertier.py), on a real store: every step planned in order by a
real Writer (as the trainer plans them), persisted by the tier through
the Writer's flush and commit, read back bit for bit; the agreement
between ranks through real store records (capture/tierpeers.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.capture.helpercpu import PersistPace
from dstt.capture.helpertier import HelperTier
from dstt.capture.tierpeers import StorePeers
from dstt.format import tier as T
from dstt.format.backends import open_backend
from dstt.format.incidents import Incident, list_incidents, record_incident
from dstt.format.index import RunIndex
from dstt.format.layout import STATS_COLUMNS
from dstt.store.writer import Writer


def state_at(step: int, rank: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.arange(8, dtype=torch.float64) + step}


class StoreOps:
    """The tier's I/O on a real store: what the helper does with a sealed
    step, with the step's state held in memory instead of a ring slot."""

    def __init__(self, path: Path, rank: int = 0) -> None:
        self.writer = Writer(str(path))
        self.rank = rank
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.plans: dict[int, Any] = {}
        self.answers: dict[int, Any] = {}
        self.released: list[int] = []
        self.checked: list[int] = []
        self.memory: list[int] = []
        self.lost_steps: list[tuple[int, str]] = []

    def capture(self, tier: HelperTier, step: int, state: dict[str, torch.Tensor] | None = None) -> None:
        st = {k: v.clone() for k, v in (state or state_at(step, self.rank)).items()}
        self.states[step] = st
        self.plans[step] = self.writer.plan(step, st)
        tier.add(step)

    def check(self, step: int) -> tuple[str, ...]:
        self.checked.append(step)
        return tuple(k for k, v in self.states[step].items() if not bool(torch.isfinite(v).all()))

    def persist(self, step: int, prev: int | None, memory_only: list[tuple[int, int]] | None) -> Any:
        w, plan = self.writer, self.plans[step]
        w.relink(plan)
        w.settle_before(plan)
        w.ensure_arrays(plan)
        prevs = None
        if prev is not None:
            pp = {(t.layout.array, t.index): t.source for t in self.plans[prev].tasks}
            prevs = [pp.get((t.layout.array, t.index)) for t in plan.tasks]
        results, err = w.flush_chunks(plan, plan.tasks, None, prevs)
        return w.commit(plan, results, err, memory_only=memory_only)

    def answer(self, step: int, outcome: Any) -> None:
        self.answers[step] = outcome

    def passed(self, step: int) -> None:
        self.memory.append(step)

    def release(self, step: int) -> None:
        assert step not in self.released
        self.released.append(step)

    def record(self, incident: Incident, ident: str | None) -> None:
        record_incident(self.writer.backend, incident, ident)

    def lost(self, step: int, why: str) -> None:
        self.lost_steps.append((step, why))


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_stored(path: Path, ops: StoreOps, steps: list[int]) -> None:
    run = dstt.open(path)
    assert run.steps() == sorted(steps)
    for s in steps:
        for name, t in ops.states[s].items():
            assert bits(run.read(name, s)) == bits(t), (s, name)


def test_all_persists_every_step_and_keeps_k(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(3, "all", ops, branch="main")
    for s in range(8):
        ops.capture(tier, s)
        while tier.pump():
            pass
        assert tier.steps_held() == list(range(max(0, s - 2), s + 1))  # the K newest, never fewer
    assert ops.released == [0, 1, 2, 3, 4] and ops.checked == list(range(8))
    tier.close()
    ops.writer.close()
    assert tier.persisted == list(range(8)) and ops.released == list(range(8))
    check_stored(tmp_path / "r", ops, list(range(8)))


def test_every_nth_and_memory_only_ranges(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(2, 3, ops, branch="main")
    for s in range(10, 20):
        ops.capture(tier, s)
        tier.pump()
    tier.close()
    ops.writer.close()
    assert tier.persisted == [10, 13, 16, 19]  # the 1st, 4th, 7th captured; close() stores the last
    spans, persisted = RunIndex(str(tmp_path / "r")).captured()
    assert spans == [(10, 19)] and persisted == [10, 13, 16, 19]
    check_stored(tmp_path / "r", ops, [10, 13, 16, 19])


def test_newest_passes_over_what_queued_while_the_writer_was_busy(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(4, "newest", ops, branch="main")
    for s in range(5):  # handed over while the helper wrote nothing (its writer busy)
        ops.capture(tier, s)
    tier.pump()
    assert tier.persisted == [4] and tier.passed_over == [0, 1, 2, 3] and ops.memory == [0, 1, 2, 3]
    assert 0 in ops.released and 4 not in ops.released  # only what left the K newest
    ops.capture(tier, 5)
    tier.pump()
    assert tier.persisted == [4, 5]
    tier.close()
    ops.writer.close()
    spans, persisted = RunIndex(str(tmp_path / "r")).captured()
    assert spans == [(0, 5)] and persisted == [4, 5]
    check_stored(tmp_path / "r", ops, [4, 5])


def test_update_statistics_against_the_previous_held_step(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(2, "all", ops, branch="main")
    for s in range(3):
        ops.capture(tier, s)
        tier.pump()
    tier.close()
    ops.writer.close()
    idx = RunIndex(str(tmp_path / "r"))
    names, table = idx.step_stats(2)
    row = table[names.index("w")]
    col = dict(zip(STATS_COLUMNS, row))
    want = float(torch.linalg.vector_norm((ops.states[2]["w"] - ops.states[1]["w"]).double()))
    assert math.isclose(col["update_norm"], want, rel_tol=1e-5)
    names0, table0 = idx.step_stats(0)
    assert np.isnan(dict(zip(STATS_COLUMNS, table0[names0.index("w")]))["update_norm"])  # no previous step


def test_an_incident_stores_the_tier_with_backfills(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(4, "newest", ops, branch="main")
    for s in range(6):
        ops.capture(tier, s)
    tier.pump()  # 5 stored, 2..4 passed over (still held), 0..1 evicted
    inc = tier.incident("loss spike")
    assert inc is not None and inc.steps == (2, 3, 4, 5) and inc.source == "trainer" and inc.world is None
    tier.close()
    ops.writer.close()
    check_stored(tmp_path / "r", ops, [2, 3, 4, 5])
    assert tier.persisted == [5, 2, 3, 4]  # older ones after the newer: backfills
    assert [(i.step, i.steps) for i in list_incidents(open_backend(str(tmp_path / "r")), "main")] == \
        [(5, (2, 3, 4, 5))]


def test_nonfinite_once_per_divergence_with_the_k_steps_before(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(3, 4, ops, branch="main")
    nan = state_at(0)
    nan["w"][3, 3] = float("nan")
    for s in range(12):
        ops.capture(tier, s, nan if s in (6, 7, 10) else None)
        tier.pump()
    tier.close()
    ops.writer.close()
    incs = list_incidents(open_backend(str(tmp_path / "r")), "main")
    assert [(i.step, i.source, i.tensors) for i in incs] == [(6, "non-finite", ("w",)), (10, "non-finite", ("w",))]
    assert incs[0].steps == (3, 4, 5, 6)  # the K steps that led up to it, and itself
    assert set(incs[1].steps) >= {8, 9, 10}
    assert ops.checked == list(range(12))  # every step checked, in order, none skipped
    stored = RunIndex(str(tmp_path / "r")).steps()
    assert {0, 3, 4, 5, 6, 8, 9, 10, 11} <= set(stored)
    check_stored(tmp_path / "r", ops, stored)


def test_a_held_step_stays_past_k_until_unheld(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(2, "newest", ops, branch="main")
    ops.capture(tier, 0)
    tier.pump()
    assert tier.hold(0) and not tier.hold(99)
    for s in range(1, 5):
        ops.capture(tier, s)
        tier.pump()
    assert tier.steps_held()[0] == 0 and 0 not in ops.released
    tier.unhold(0)
    tier.pump()
    assert 0 in ops.released and len(tier.steps_held()) == 2
    tier.close()
    ops.writer.close()


def test_trainer_death_stores_every_held_step_as_a_crash_incident(tmp_path: Path) -> None:
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(3, "newest", ops, branch="main")
    for s in range(7):
        ops.capture(tier, s)
    tier.pump()
    tier.trainer_died()
    ops.writer.close()
    incs = list_incidents(open_backend(str(tmp_path / "r")), "main")
    assert [(i.source, i.steps) for i in incs] == [("crash", (4, 5, 6))]
    check_stored(tmp_path / "r", ops, [4, 5, 6])
    assert sorted(ops.released) == list(range(7))


def test_a_step_not_stored_at_the_trainers_death_stays_sealed(tmp_path: Path) -> None:
    """The trainer died and step 5 could not be stored (its write failed):
    its slot is not released -- its seal stays for the next Capture or
    `dstt gc` (serve_tier then leaves the ring) -- where before every held
    step was released, stored or not, and the ring removed."""
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(3, "newest", ops, branch="main")
    for s in range(7):
        ops.capture(tier, s)
    tier.pump()
    persist = ops.persist

    def failing(step: int, prev: int | None, memory_only: list[tuple[int, int]] | None) -> Any:
        if step == 5:
            raise OSError(28, "No space left on device (injected)")
        return persist(step, prev, memory_only)

    ops.persist = failing  # type: ignore[method-assign]
    tier.trainer_died()
    ops.writer.close()
    assert tier.unstored() == [5] and 5 not in ops.released
    assert sorted(ops.released) == [0, 1, 2, 3, 4, 6]
    assert isinstance(ops.answers[5], OSError)


# ----------------------------------------------------------------------------- ranks


def ranks(tmp_path: Path, world: int, k: int, policy: Any) -> tuple[list[StoreOps], list[HelperTier]]:
    shared = open_backend(str(tmp_path / "shared"), create=True)  # the store the ranks agree through
    opss = [StoreOps(tmp_path / f"rank{r}", rank=r) for r in range(world)]
    tiers = [HelperTier(k, policy, opss[r], branch="main", peers=StorePeers(shared, "main", "run1", r, world))
             for r in range(world)]
    return opss, tiers


def _pump_all(tiers: list[HelperTier], order: list[int]) -> None:
    for _ in range(3):
        for r in order:
            p = tiers[r].peers  # (look at the store every time: no throttle in this test)
            p._next_requests = p._next_decisions = 0.0  # type: ignore[union-attr]
            while tiers[r].pump():
                pass


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_persist_the_steps_rank0_chose_and_no_other(tmp_path: Path, world: int) -> None:
    opss, tiers = ranks(tmp_path, world, 3, "newest")
    for s in range(9):
        for r in range(world):
            opss[r].capture(tiers[r], s)
        if s % 3 == 2:  # rank 0's writer free only now and then; the others look later
            _pump_all(tiers, [0, *range(1, world)])
    for r in range(1, world):
        assert tiers[r].persisted == tiers[0].persisted, r  # every rank or none
        assert tiers[r].passed_over == tiers[0].passed_over, r
    assert tiers[0].persisted == [2, 5, 8]
    # a rank never lets go of a step rank 0 has not decided about
    for r in range(world):
        opss[r].capture(tiers[r], 9)
        opss[r].capture(tiers[r], 10)
    for r in range(1, world):
        while tiers[r].pump():
            pass
        assert [s.step for s in tiers[r].held if s.decision is None] == [9, 10]
    for t in tiers:
        t.close()
    for o in opss:
        o.writer.close()


def test_an_incident_on_one_rank_dumps_every_ranks_tier_once(tmp_path: Path) -> None:
    opss, tiers = ranks(tmp_path, 3, 4, "newest")
    for s in range(6):
        for r in range(3):
            opss[r].capture(tiers[r], s)
    _pump_all(tiers, [0, 1, 2])
    assert tiers[2].incident("loss spike on rank 2") is None  # recorded by rank 0, not here
    _pump_all(tiers, [0, 1, 2])
    for r in range(3):
        assert sorted(tiers[r].persisted) == [2, 3, 4, 5], r
    shared = open_backend(str(tmp_path / "shared"))
    assert list_incidents(shared, "main") == []  # (records go to each rank's own store in this test)
    incs = list_incidents(open_backend(str(tmp_path / "rank0")), "main")
    assert [(i.step, i.rank, i.world, i.steps) for i in incs] == [(5, 2, 3, (2, 3, 4, 5))]
    for r in (1, 2):
        assert list_incidents(open_backend(str(tmp_path / f"rank{r}")), "main") == []
    # the held records: every rank holds its tier
    held = T.read_held(shared, "main")
    assert [h.rank for h in held] == [0, 1, 2]
    for t in tiers:
        t.close()
    assert T.read_held(shared, "main") == []
    for o in opss:
        o.writer.close()


@pytest.mark.parametrize("ahead", [0, 1])
def test_the_whole_jobs_death_is_one_crash_incident(tmp_path: Path, ahead: int) -> None:
    """Every rank's trainer dies (a whole-job SIGKILL): every helper stores
    what its tier holds, and the crash is recorded once -- also where one
    rank had sealed one step more than the other (``ahead``)."""
    opss, tiers = ranks(tmp_path, 2, 3, 100)
    for s in range(6):
        for r in range(2):
            opss[r].capture(tiers[r], s)
    for s in range(6, 6 + ahead):
        opss[1].capture(tiers[1], s)
    _pump_all(tiers, [0, 1])
    tiers[1].trainer_died()
    tiers[0].trainer_died()
    _pump_all(tiers, [0, 1])
    incs = list_incidents(open_backend(str(tmp_path / "rank0")), "main")
    assert [i.source for i in incs] == ["crash"], incs
    assert {3, 4, 5} <= set(tiers[0].persisted)  # (each rank's tier: its last K steps)
    assert {3 + ahead, 4 + ahead, 5 + ahead} <= set(tiers[1].persisted)
    for o in opss:
        o.writer.close()


def test_a_clean_close_of_every_rank_removes_the_runs_records(tmp_path: Path) -> None:
    """The run's decisions and incident requests stay while any rank's
    helper may read them, and go with the last clean close."""
    opss, tiers = ranks(tmp_path, 2, 2, "newest")
    for s in range(5):
        for r in range(2):
            opss[r].capture(tiers[r], s)
        _pump_all(tiers, [0, 1])
    tiers[1].incident("loss spike on rank 1")
    _pump_all(tiers, [0, 1])
    shared = open_backend(str(tmp_path / "shared"))
    prefix = T.run_prefix("main", "run1").rstrip("/")
    assert {"decisions.json"} < set(shared.list_dir(prefix))  # (and rank 1's request)
    tiers[0].close()
    assert "decisions.json" in shared.list_dir(prefix)  # rank 1's helper still reads them
    tiers[1].close()
    assert shared.list_dir(prefix) == [] and T.read_held(shared, "main") == []
    for o in opss:
        o.writer.close()


def test_a_rank_that_lost_an_incidents_step_says_so_at_once(tmp_path: Path) -> None:
    """Rank 0 still holds steps 1..4 (persist every 100th: memory only),
    rank 1 holds 3..4 only (a smaller tier, as one rank falling behind
    would): rank 0's incident asks for 1..4; rank 1 answers for 1 and 2 at
    once (TierOps.lost: its failure record, so rank 0 fails them now
    instead of waiting DSTT_RANK_WAIT_S for records that never come); step
    0, which rank 1 wrote, is not named. (Before: a log line only.)"""
    shared = open_backend(str(tmp_path / "shared"), create=True)
    opss = [StoreOps(tmp_path / f"rank{r}", rank=r) for r in range(2)]
    tiers = [HelperTier(k, 100, opss[r], branch="main", peers=StorePeers(shared, "main", "run1", r, 2))
             for r, k in ((0, 6), (1, 2))]
    for s in range(5):
        for r in range(2):
            opss[r].capture(tiers[r], s)
    _pump_all(tiers, [0, 1])
    assert tiers[1].steps_held() == [3, 4] and tiers[0].steps_held() == [0, 1, 2, 3, 4]
    tiers[0].incident("loss spike", 4)
    _pump_all(tiers, [1, 0])
    assert [s for s, _ in opss[1].lost_steps] == [1, 2]
    assert "rank 1's memory tier no longer held" in opss[1].lost_steps[0][1]
    assert opss[0].lost_steps == []
    for t in tiers:
        t.close()
    for o in opss:
        o.writer.close()


def test_the_same_nan_on_two_ranks_is_one_incident(tmp_path: Path) -> None:
    opss, tiers = ranks(tmp_path, 2, 3, "all")
    for s in range(5):
        for r in range(2):
            st = state_at(s, r)
            if s == 3:
                st["w"][0, 0] = float("inf")
            opss[r].capture(tiers[r], s, st)
        _pump_all(tiers, [1, 0])
    incs = list_incidents(open_backend(str(tmp_path / "rank0")), "main")
    assert [(i.step, i.source, i.rank) for i in incs] == [(3, "non-finite", 1)]
    assert len(T.list_requests(open_backend(str(tmp_path / "shared")), "main", "run1")) == 1
    for t in tiers:
        t.close()
    for o in opss:
        o.writer.close()


def test_an_incident_before_any_write_still_records_what_was_passed_over(tmp_path: Path) -> None:
    """A helper still starting when the incident came (every step queued,
    nothing written yet): the older undecided steps are passed over before
    the dump is written, so its first commit records them as memory-only
    (seen in the helper process: they were decided only after the last
    commit and recorded nowhere)."""
    ops = StoreOps(tmp_path / "r")
    tier = HelperTier(3, "newest", ops, branch="main")
    for s in range(10):
        ops.capture(tier, s)
    inc = tier.incident("spike")  # before any pump
    assert inc is not None and inc.steps == (6, 7, 8, 9)
    tier.close()
    ops.writer.close()
    spans, persisted = RunIndex(str(tmp_path / "r")).captured()
    assert spans == [(0, 9)] and persisted == [6, 7, 8, 9]


class _Host:
    """A CpuWatch stand-in: whether the host had idle cores to spare."""

    def __init__(self, spare: bool) -> None:
        self.coding = spare

    def budget(self) -> float:
        return math.inf if self.coding else -math.inf


def test_newest_rests_while_the_host_has_no_spare_core(tmp_path: Path) -> None:
    """persist="newest" on a host without spare cores: after a write of 1 s
    the helper rests 3 s before it picks the next newest step, and passes
    over the older ones meanwhile, so memory never holds more than K; with
    cores to spare it persists as soon as its writer is free."""
    now = [0.0]
    ops = StoreOps(tmp_path / "r")
    persist = ops.persist

    def slow_persist(*a: Any) -> Any:
        now[0] += 1.0  # a write takes 1 s of this clock
        return persist(*a)

    ops.persist = slow_persist  # type: ignore[method-assign]
    host = _Host(spare=False)
    tier = HelperTier(2, "newest", ops, branch="main", clock=lambda: now[0],
                      pace=PersistPace(host, rest=3.0, clock=lambda: now[0]))  # type: ignore[arg-type]
    ops.capture(tier, 0)
    tier.pump()
    assert tier.persisted == [0]  # (nothing written yet: no rest owed)
    for s in (1, 2, 3):
        ops.capture(tier, s)
    now[0] = 2.5
    while tier.pump():
        pass
    assert tier.persisted == [0] and tier.passed_over == [1, 2]  # resting until 1 + 3 x 1 s
    assert len(tier.held) <= 2 and [s.step for s in tier.held if s.decision is None] == [3]
    now[0] = 4.0
    tier.pump()
    assert tier.persisted == [0, 3]
    host.coding = True  # cores to spare again: no rest
    ops.capture(tier, 4)
    tier.pump()
    assert tier.persisted == [0, 3, 4]
    tier.close()
    ops.writer.close()
    check_stored(tmp_path / "r", ops, [0, 3, 4])
