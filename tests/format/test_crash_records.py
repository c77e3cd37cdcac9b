"""A run's crash is one incident record, whoever records it (issue 25,
format/incidents.py ``record_once``, capture/crashnote.py): the capture
helper that saw its trainer die, or whoever salvages the ring later (the
next Capture, gc on this host, gc on another host of the same run) --
merged into one record under an id made from the run, never a second."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import dstt
from dstt.capture.crashnote import BY_GC, Crash, record
from dstt.format.backends import open_backend
from dstt.format.incidents import INCIDENTS_DIR, Incident, crash_ident, list_incidents, record_once


def _store(tmp_path: Path) -> object:
    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.zeros(2)})  # (an incident may name steps never stored)
    return open_backend(path)


def _names(backend: object) -> list[str]:
    return sorted(backend.list_dir(f"{INCIDENTS_DIR}/main"))  # type: ignore[attr-defined]


def test_a_second_salvage_of_the_same_crash_changes_nothing(tmp_path: Path) -> None:
    b = _store(tmp_path)
    crash = Crash("main", "4242-0123456789ab", None, set(), {5, 6, 7, 8}, 1.0e9, {4242})
    first = record(b, crash, lambda s: True, BY_GC)  # type: ignore[arg-type]
    assert (first.step, first.source, first.steps, first.time) == (8, "crash", (5, 6, 7, 8), 1.0e9)
    assert "pid 4242" in first.reason and "dstt gc" in first.reason
    names = _names(b)
    assert names == [f"{8:020d}-crash-4242-0123456789ab.json"]
    data = b.get(f"{INCIDENTS_DIR}/main/{names[0]}")  # type: ignore[attr-defined]
    again = record(b, crash, lambda s: True, BY_GC)  # type: ignore[arg-type]
    assert again == first and _names(b) == names
    assert b.get(f"{INCIDENTS_DIR}/main/{names[0]}") == data  # type: ignore[attr-defined]  (not rewritten)


def test_the_helpers_own_crash_record_is_not_doubled_by_the_salvage_of_its_leftovers(tmp_path: Path) -> None:
    """The helper stored its tier and recorded the crash (steps 5-8, at 8),
    but step 7 could not be written and stayed sealed; gc salvages the
    ring later: the one record stays."""
    b = _store(tmp_path)
    ident = crash_ident("4242-0123456789ab")
    helper = Incident("main", 8, "the trainer died; the memory tier's steps are stored", "crash", 2.0e9,
                      (5, 6, 7, 8))
    assert record_once(b, helper, ident) == (helper, True)  # type: ignore[arg-type]
    left = Crash("main", "4242-0123456789ab", None, set(), {7}, 1.0e9, {4242})
    now = record(b, left, lambda s: True, BY_GC)  # type: ignore[arg-type]
    assert now == helper
    assert [(i.step, i.reason) for i in list_incidents(b)] == [(8, helper.reason)]  # type: ignore[arg-type]


def test_two_hosts_salvaging_one_runs_ranks_make_one_record_naming_every_rank(tmp_path: Path) -> None:
    b = _store(tmp_path)
    run = "0123456789abcdef0123456789abcdef"
    record(b, Crash("main", run, 4, {0, 1}, {5, 6, 7, 8}, 1.0e9, {10, 11}), lambda s: True, BY_GC)  # type: ignore[arg-type]
    record(b, Crash("main", run, 4, {2, 3}, {5, 6, 7}, 1.5e9, {12, 13}), lambda s: True, BY_GC)  # type: ignore[arg-type]
    incs = list_incidents(b)  # type: ignore[arg-type]
    assert len(incs) == 1 and len(_names(b)) == 1
    inc = incs[0]
    assert (inc.step, inc.steps, inc.ranks, inc.world) == (8, (5, 6, 7, 8), (0, 1, 2, 3), 4)
    assert inc.reason.endswith("(ranks 0, 1, 2, 3 of 4)"), inc.reason


def test_racing_recorders_make_one_record(tmp_path: Path) -> None:
    b = _store(tmp_path)
    inc = Incident("main", 8, "crash", "crash", 1.0e9, (8,))
    go = threading.Barrier(8)
    wrote: list[bool] = []

    def one() -> None:
        go.wait(10)
        wrote.append(record_once(b, inc, crash_ident("run"))[1])  # type: ignore[arg-type]

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(wrote) == [False] * 7 + [True] and len(_names(b)) == 1


def test_a_damaged_record_of_the_crash_is_replaced_not_doubled(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    b = _store(tmp_path)
    key = f"{INCIDENTS_DIR}/main/{8:020d}-{crash_ident('run')}.json"
    b.put_atomic(key, b"{not json")  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        now = record(b, Crash("main", "run", None, set(), {7, 8}, 1.0e9, {1}), lambda s: s == 8, BY_GC)  # type: ignore[arg-type]
    assert "replacing incident record" in caplog.text
    assert now.steps == (8,) and "not steps 7" in now.reason
    assert [i.steps for i in list_incidents(b)] == [(8,)] and len(_names(b)) == 1  # type: ignore[arg-type]
