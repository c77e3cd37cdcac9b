"""gc removes the memory tier's records of a run that is over -- some helper
of which died, so the last clean close never removed them -- and never a
record a live run needs (capture/runsover.py, format/tierruns.py; issue 25).
Liveness is judged on real processes: SIGKILLed and reaped, or running."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dstt
from dstt.capture.ringowner import process_identity
from dstt.format import tier as T
from dstt.format.backends import open_backend
from dstt.format.tierruns import OpenMark, write_open


@pytest.fixture
def procs() -> Iterator[tuple[dict[str, object], dict[str, object]]]:
    """(identity of a process SIGKILLed and reaped, identity of a live one)."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = process_identity(dead.pid)
        dead.kill()
        dead.wait(30)
        yield gone, process_identity(live.pid)
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(30)


def _run(backend: object, run: str, helpers: list[dict[str, object]], trainers: list[dict[str, object]],
         closed: list[int]) -> None:
    """A run of len(helpers) ranks: each rank's open mark, the closed marks
    of ``closed``, rank 0's persist decisions and a held record per rank."""
    world = len(helpers)
    for r in range(world):
        write_open(backend, OpenMark("main", run, r, world, "h", helpers[r], trainers[r]))
        T.write_held(backend, T.HeldRecord("main", run, r, world, 1, "h", 1.0e9, ((3, 4),)))
    T.write_decisions(backend, T.Decisions("main", run, 4, frozenset({4})))
    for r in closed:
        T.close_run(backend, "main", run, r, world)


def test_gc_removes_a_dead_runs_marks_and_keeps_a_live_ones(tmp_path: Path, procs: tuple[dict[str, object],
                                                                                   dict[str, object]]) -> None:
    dead, live = procs
    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.zeros(2)})  # (a store; step 4 of the decisions is not committed: kept by rule)
    backend = open_backend(store)
    prefix = T.run_prefix("main", "over").rstrip("/")
    # rank 1's helper still runs (its trainer dead): the run may still need its records
    _run(backend, "alive", [process_identity(), live], [process_identity(), dead], closed=[0])
    # rank 1 marked on another boot: nothing proven here
    _run(backend, "elsewhere", [process_identity(), {**dead, "boot": "another"}],
         [process_identity(), {**dead, "boot": "another"}], closed=[0])
    # rank 1 never marked its start (not started yet, or an older dstt): nothing proven
    _run(backend, "unmarked", [process_identity(), dead], [process_identity(), dead], closed=[0])
    backend.delete(f"{T.run_prefix('main', 'unmarked')}open-1.json")
    # rank 0 closed cleanly; rank 1's helper and trainer were SIGKILLed: over
    # (written last: the held records, one per rank, are this run's now)
    _run(backend, "over", [process_identity(), dead], [process_identity(), dead], closed=[0])
    assert "closed-0.json" in backend.list_dir(prefix)
    report = dstt.gc(store, dry_run=True)
    assert report.tier_records_removed == 4 + 2  # over's 2 open marks, closed-0, decisions, 2 held records
    assert "closed-0.json" in backend.list_dir(prefix)  # (a dry run removes nothing)
    report = dstt.gc(store)
    assert report.tier_records_removed == 6
    assert backend.list_dir(prefix) == [] and T.read_held(backend, "main") == []
    for run in ("alive", "elsewhere", "unmarked"):
        names = set(backend.list_dir(T.run_prefix("main", run).rstrip("/")))
        assert {"open-0.json", "closed-0.json", "decisions.json"} <= names, (run, names)
    assert dstt.gc(store).tier_records_removed == 0  # nothing more to prove
