"""The memory tier's store records under torch.distributed (issue 25):
held-in-memory records per rank, rank 0's persist decisions, incident
requests every rank acts on, and one incident record per incident.
Real files in a real local store; everything read back is untrusted."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from dstt.errors import ConfigError, CorruptStoreError
from dstt.format import tier as T
from dstt.format.backends import open_backend
from dstt.format.incidents import Incident, list_incidents, record_incident


@pytest.fixture()
def b(tmp_path: Path):  # type: ignore[no-untyped-def]
    return open_backend(tmp_path / "run", create=True)


def held(rank: int, steps: tuple[tuple[int, int], ...], *, world: int = 3, run: str = "r1",
         t: float = 1.0e9) -> T.HeldRecord:
    return T.HeldRecord("main", run, rank, world, 1000 + rank, "node-a", t, steps)


def test_held_records_count_the_ranks_holding_each_step(b) -> None:  # type: ignore[no-untyped-def]
    T.write_held(b, held(0, ((10, 17),)))
    T.write_held(b, held(1, ((11, 18),)))
    T.write_held(b, held(2, ((12, 15), (17, 18))))
    recs = T.read_held(b, "main")
    assert [r.rank for r in recs] == [0, 1, 2]
    assert recs[2].steps == ((12, 15), (17, 18))
    assert T.held_ranges(recs, now=1.0e9) == [
        (10, 10, 1, 3), (11, 11, 2, 3), (12, 15, 3, 3), (16, 16, 2, 3), (17, 17, 3, 3), (18, 18, 2, 3)]
    assert T.held_by(recs, 16, now=1.0e9) == (2, 3)
    assert T.held_by(recs, 9, now=1.0e9) == (0, 3)
    # a rank whose tier is closed holds nothing any more
    T.remove_held(b, "main", 1)
    recs = T.read_held(b, "main")
    assert [T.held_by(recs, s, now=1.0e9) for s in (11, 12, 16, 18)] == [(1, 3), (2, 3), (1, 3), (1, 3)]


def test_stale_and_older_run_records_are_not_counted(b) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    T.write_held(b, held(0, ((5, 9),), t=now))
    T.write_held(b, held(1, ((5, 9),), t=now - 3600))  # a helper that died without removing it
    T.write_held(b, held(2, ((5, 9),), run="r0", t=now - 1))  # an older capture of the branch
    recs = T.read_held(b, "main")
    assert T.held_by(recs, 7, now=now) == (1, 3)
    assert sorted(r.rank for r in T.stale_records(recs, now)) == [1, 2]


def test_a_hostile_held_record_is_skipped_never_trusted(b, caplog) -> None:  # type: ignore[no-untyped-def]
    T.write_held(b, held(0, ((0, 2**40),)))  # one range over a huge span: a sweep, not a loop per step
    t0 = time.perf_counter()
    assert T.held_ranges(T.read_held(b, "main"), now=1.0e9) == [(0, 2**40, 1, 3)]
    assert time.perf_counter() - t0 < 5
    bad = {
        "rank-00001.json": b"{not json",
        "rank-00002.json": json.dumps({"format": T.HELD_FORMAT, "format_version": 1, "branch": "main",
                                       "run": "r1", "rank": 2, "world": 3, "pid": 1, "host": "h", "time": 1e9,
                                       "steps": [[5, 3]]}).encode(),  # reversed range
        "rank-00003.json": json.dumps({"format": T.HELD_FORMAT, "format_version": 1, "branch": "main",
                                       "run": "r1", "rank": 4, "world": 5, "pid": 1, "host": "h", "time": 1e9,
                                       "steps": []}).encode(),  # names another rank than its key
    }
    for name, data in bad.items():
        b.put_atomic(T.held_prefix("main") + name, data)
    with caplog.at_level(logging.WARNING, logger="dstt.store.tier"):
        recs = T.read_held(b, "main")
    assert [r.rank for r in recs] == [0]
    assert len([r for r in caplog.records if "skipping held-in-memory record" in r.getMessage()]) == 3


def test_decisions_round_trip_and_say_what_is_undecided(b) -> None:  # type: ignore[no-untyped-def]
    assert T.read_decisions(b, "main", "r1") is None
    T.write_decisions(b, T.Decisions("main", "r1", 20, frozenset({3, 11, 20})))
    d = T.read_decisions(b, "main", "r1")
    assert d is not None and d.upto == 20 and d.persist == frozenset({3, 11, 20})
    assert [d.decided(s) for s in (3, 4, 20, 21)] == [True, False, True, None]
    # the window: steps older than the decisions kept are never called memory-only
    many = frozenset(range(0, 3 * T.DECISION_WINDOW, 2))
    T.write_decisions(b, T.Decisions("main", "r1", 3 * T.DECISION_WINDOW, many))
    d = T.read_decisions(b, "main", "r1")
    assert d is not None and len(d.persist) == T.DECISION_WINDOW
    assert d.decided(1) is None and d.decided(3 * T.DECISION_WINDOW - 3) is False


def test_damaged_decisions_are_an_error_not_a_guess(b) -> None:  # type: ignore[no-untyped-def]
    key = T.decisions_key("main", "r1")
    b.put_atomic(key, json.dumps({"format": T.DECISIONS_FORMAT, "format_version": 1, "branch": "main",
                                  "run": "r1", "upto": 5, "persist": [7]}).encode())  # decided beyond upto
    with pytest.raises(CorruptStoreError, match="persist must be"):
        T.read_decisions(b, "main", "r1")
    b.put_atomic(key, b"x" * (T.MAX_RECORD_BYTES + 1))
    with pytest.raises(CorruptStoreError):
        T.read_decisions(b, "main", "r1")


def request(rank: int, ident: str, step: int = 30, source: str = "non-finite") -> T.IncidentRequest:
    return T.IncidentRequest("main", "r1", ident, step, "NaN in w", source, rank, 3, 1.0e9, (27, 28, 29, 30),
                             ("model/w",))


def test_the_same_nonfinite_step_seen_on_two_ranks_is_one_request(b) -> None:  # type: ignore[no-untyped-def]
    ident = T.new_id("non-finite", 30)
    assert ident == "nonfinite-30"
    assert T.publish_request(b, request(1, ident)) is True
    assert T.publish_request(b, request(2, ident)) is False  # rank 2 saw the same step: no second request
    other = T.new_id("trainer", 31)
    assert other != T.new_id("trainer", 31)  # cap.incident() twice: two requests
    assert T.publish_request(b, request(0, other, 31, "trainer")) is True
    reqs = T.list_requests(b, "main", "r1")
    assert [(r.ident, r.rank, r.step) for r in reqs] == [("nonfinite-30", 1, 30), (other, 0, 31)]
    assert reqs[0].steps == (27, 28, 29, 30) and reqs[0].tensors == ("model/w",)
    T.remove_run(b, "main", "r1")
    assert T.list_requests(b, "main", "r1") == []


def test_bad_requests_and_ids_are_refused_or_skipped(b, caplog) -> None:  # type: ignore[no-untyped-def]
    for ident in ("../x", "", "a/b", "x" * 65):
        with pytest.raises(ConfigError):
            T.request_key("main", "r1", ident)
    with pytest.raises(ConfigError):
        T.run_prefix("main", "../r")
    b.put_atomic(T.run_prefix("main", "r1") + "incident-x.json", b'{"format": "dstt-tier-incident"}')
    b.put_atomic(T.run_prefix("main", "r1") + "incident-y.json", json.dumps(
        {"format": T.REQUEST_FORMAT, "format_version": 1, "branch": "main", "run": "r1", "id": "z", "step": 3,
         "reason": "r", "source": "trainer", "rank": 0, "world": 1, "time": 1.0, "steps": [],
         "tensors": []}).encode())  # names another id than its key
    with caplog.at_level(logging.WARNING, logger="dstt.store.tier"):
        assert T.list_requests(b, "main", "r1") == []
    assert len([r for r in caplog.records if "skipping incident request" in r.getMessage()]) == 2


def test_one_incident_record_per_distributed_incident(b) -> None:  # type: ignore[no-untyped-def]
    inc = Incident("main", 30, "NaN in w", "non-finite", 1.0e9, (27, 28, 29, 30), ("model/w",), rank=1, world=3)
    k1 = record_incident(b, inc, ident="nonfinite-30")
    k2 = record_incident(b, inc, ident="nonfinite-30")  # a retry (or another helper): the same record
    assert k1 == k2
    record_incident(b, Incident("main", 12, "spike", "trainer", 1.0e9, (12,)))  # a single-process one
    got = list_incidents(b, "main")
    assert [(i.step, i.rank, i.world) for i in got] == [(12, None, None), (30, 1, 3)]
    assert got[1] == inc
    with pytest.raises(ConfigError):
        record_incident(b, Incident("main", 1, "r", "trainer", 1.0, (), rank=3, world=3))
    with pytest.raises(ConfigError):
        record_incident(b, inc, ident="../evil")


def test_an_incident_record_with_a_bad_rank_is_skipped(b, caplog) -> None:  # type: ignore[no-untyped-def]
    key = record_incident(b, Incident("main", 5, "r", "crash", 1.0e9, (5,), rank=0, world=2))
    doc = json.loads(b.get(key))
    doc["rank"] = 2  # not below world
    b.put_atomic(key, json.dumps(doc).encode())
    with caplog.at_level(logging.WARNING, logger="dstt.store.incidents"):
        assert list_incidents(b, "main") == []
    assert any("rank and world" in r.getMessage() for r in caplog.records)


def test_gc_removes_the_decisions_and_requests_no_helper_can_need(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    import torch

    import dstt
    from tests.cli.test_cli_errors import cli

    path = tmp_path / "run"
    for s in range(5):
        dstt.save(str(path), s, {"w": torch.full((2,), float(s))})
    b = open_backend(str(path))

    def req(run: str, ident: str, step: int, steps: tuple[int, ...]) -> T.IncidentRequest:
        return T.IncidentRequest("main", run, ident, step, "nan", "trainer", 1, 2, 1.0e9, steps)

    T.write_decisions(b, T.Decisions("main", "rA", 3, frozenset({1, 3})))  # decided up to a committed step
    T.write_decisions(b, T.Decisions("main", "rB", 7, frozenset({5})))     # beyond the newest commit: needed
    assert T.publish_request(b, req("rA", "done", 3, (2, 3)))              # every step committed
    assert T.publish_request(b, req("rA", "open", 6, (5, 6)))              # steps not committed yet
    assert T.publish_request(b, req("rB", "part", 4, (4, 5)))              # one step not committed
    bad = T.decisions_key("main", "rC")
    b.put_atomic(bad, b"{not json")                                        # damaged: never judged
    T.write_held(b, T.HeldRecord("main", "rB", 1, 2, 7, "h", 1.0e9, ((5, 7),)))
    keys = {T.decisions_key("main", "rA"), T.request_key("main", "rA", "done")}
    kept = {T.decisions_key("main", "rB"), T.request_key("main", "rA", "open"),
            T.request_key("main", "rB", "part"), bad, T.held_key("main", 1)}

    rc, out, err = cli("gc", str(path), "--dry-run", "--json")
    assert rc == 0, err
    assert json.loads(out)["tier_records_removed"] == 2
    assert all(b.exists(k) for k in keys | kept)                           # a dry run removes nothing
    rc, out, err = cli("gc", str(path), "--dry-run")
    assert rc == 0 and "2 memory-tier record(s)" in " ".join(out.split()), err

    with caplog.at_level(logging.WARNING, logger="dstt.store.tier"):
        assert dstt.gc(str(path)).tier_records_removed == 2
    assert not any(b.exists(k) for k in keys) and all(b.exists(k) for k in kept)
    assert "leaving memory-tier record" in caplog.text
    assert dstt.gc(str(path)).tier_records_removed == 0

    for s in (5, 6):  # the open requests' steps committed: nothing left for a helper to store
        dstt.save(str(path), s, {"w": torch.full((2,), float(s))})
    assert dstt.gc(str(path)).tier_records_removed == 2
    assert not b.exists(T.request_key("main", "rA", "open")) and not b.exists(T.request_key("main", "rB", "part"))
    assert b.exists(T.decisions_key("main", "rB")) and b.exists(bad)       # upto 7 > 6: still needed
