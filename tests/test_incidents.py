"""Issue 14, the store and inspection side of the flight recorder: incident
records, memory-only steps in commit documents, update statistics
(``update_norm``/``update_ratio``) and how ls/find/history/report show them.

Steps are written with ``dstt.save``; the fields the capture side records
(``memory_only``) are added to real commit documents by a helper that
re-signs nothing it does not have to (the commit marker is the root of trust).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import ConfigError, CorruptStoreError, DsttError
from dstt.store import layout as L
from dstt.store.backends import open_backend
from dstt.store.incidents import (
    MAX_REASON_CHARS,
    Incident,
    incident_document,
    list_incidents,
    parse_incident,
    record_incident,
)
from dstt.store.index import RunIndex, captured_spans
from dstt.store.manifest import commit_document, decode_stats, encode_json, parse_commit, sha256_hex
from dstt.store.stats import Partial, chunk_partial, finalize, merge

# ----------------------------------------------------------------------------- helpers


def _commit_path(store: Path, branch: str, step: int) -> Path:
    return store / L.step_dir(branch, step) / L.COMMIT_FILE


def edit_commit(store: Path, step: int, branch: str = "main", **fields: object) -> None:
    """Set (or, with None, drop) fields of a committed step's commit document."""
    p = _commit_path(store, branch, step)
    doc = json.loads(p.read_bytes())
    for k, v in fields.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    p.write_bytes(encode_json(doc))


def make_legacy(store: Path, step: int, branch: str = "main") -> np.ndarray:
    """Rewrite a step as a dstt from before the update columns wrote it:
    a 7-column stats.npy and a commit document without ``stats_columns``.
    Returns the 7-column table."""
    where = store / L.step_dir(branch, step)
    full = np.load(where / L.STATS_FILE)
    old = np.ascontiguousarray(full[:, :7])
    buf = io.BytesIO()
    np.save(buf, old, allow_pickle=False)
    data = buf.getvalue()
    (where / L.STATS_FILE).write_bytes(data)
    doc = json.loads((where / L.COMMIT_FILE).read_bytes())
    doc.pop("stats_columns")
    doc["files"][L.STATS_FILE] = {"sha256": sha256_hex(data), "size": len(data)}
    (where / L.COMMIT_FILE).write_bytes(encode_json(doc))
    return old


def _series(store: Path, steps: list[int]) -> list[torch.Tensor]:
    ws = []
    for s in steps:
        w = torch.linspace(-1, 1, 64) * (1 + s / 10)
        dstt.save(store, s, {"model": {"w": w, "b": torch.ones(4)}})
        ws.append(w)
    return ws


# ----------------------------------------------------------------------------- incident records


def test_record_and_list_round_trip(store: Path) -> None:
    _series(store, [1])
    b = open_backend(store)
    inc = [
        Incident("main", 131, "loss spike: 9.1 after 2.3", "trainer", 1000.5, (124, 125, 131)),
        Incident("main", 40, "non-finite values in 2 tensors", "non-finite", 2000.0, (33, 40),
                 ("model/w", "optim/w/exp_avg")),
        Incident("side", 7, "rewound to 5", "rewind", 3000.0, ()),
        Incident("main", 40, "second at the same step", "trainer", 2500.0, (40,)),
    ]
    keys = [record_incident(b, i) for i in inc]
    assert len(set(keys)) == 4 and all(k.startswith(L.INCIDENTS_DIR + "/") for k in keys)
    assert list_incidents(b) == sorted(inc, key=lambda i: (i.branch, i.step, i.time))
    assert list_incidents(b, "side") == [inc[2]]
    assert list_incidents(b, "nothing-here") == []
    # the same incident twice: two records (never one overwriting the other)
    record_incident(b, inc[2])
    assert list_incidents(b, "side") == [inc[2], inc[2]]


def test_incident_document_bounds(store: Path) -> None:
    long = "x" * 5000 + "\x1b[31m"
    doc = json.loads(incident_document(Incident("main", 3, long, "trainer", float("nan"), (3, 1, 1))))
    assert len(doc["reason"]) == MAX_REASON_CHARS and doc["reason"].endswith("...")
    assert doc["steps"] == [1, 3] and doc["time"] == 0.0  # sorted, deduplicated; NaN time is not JSON
    for bad in (Incident("main", 3, "r", "cosmic-ray", 1.0, ()), Incident("../x", 3, "r", "trainer", 1.0, ()),
                Incident("main", -1, "r", "trainer", 1.0, ())):
        with pytest.raises(DsttError):
            incident_document(bad)
    with pytest.raises(ConfigError):
        incident_document(Incident("main", 3, 42, "trainer", 1.0, ()))  # type: ignore[arg-type]


@pytest.mark.parametrize("doc", [
    [], {"format": "dstt-skip"}, {"format": "dstt-incident", "format_version": 2},
    {"branch": "../x"}, {"branch": "other"}, {"step": -1}, {"step": True}, {"step": 10**21},
    {"reason": 5}, {"reason": "r" * (MAX_REASON_CHARS + 1)}, {"source": "me"}, {"time": "now"},
    {"time": True}, {"steps": [3, 2]}, {"steps": [1, 1]}, {"steps": "1-3"}, {"steps": [-4]},
    {"tensors": [1]}, {"tensors": "w"},
])
def test_parse_incident_refuses_hostile_fields(doc: object) -> None:
    good = json.loads(incident_document(Incident("main", 3, "r", "trainer", 1.0, (2, 3))))
    raw = {**good, **doc} if isinstance(doc, dict) else doc
    with pytest.raises(CorruptStoreError):
        parse_incident(json.dumps(raw).encode(), "w", "main")
    assert parse_incident(json.dumps(good).encode(), "w", "main").steps == (2, 3)


def test_damaged_records_are_skipped_with_a_warning(store: Path, caplog: pytest.LogCaptureFixture) -> None:
    _series(store, [1])
    b = open_backend(store)
    good = Incident("main", 5, "ok", "trainer", 1.0, (5,))
    record_incident(b, good)
    d = store / L.incidents_prefix("main")
    (d / "00000000000000000001-garbage.json").write_bytes(b"{not json")
    (d / "00000000000000000002-other.json").write_bytes(b'{"format": "dstt-skip"}')
    (d / "00000000000000000003-huge.json").write_bytes(b" " * (2 << 20))  # past the size bound
    os.mkfifo(d / "00000000000000000004-fifo.json")  # a read would block: never opened for reading
    (d / "00000000000000000005-dir.json").mkdir()
    (d / "not-a-record.txt").write_text("ignored")
    (store / L.INCIDENTS_DIR / "bad..name").mkdir()
    with caplog.at_level(logging.WARNING, logger="dstt.store.incidents"):
        assert list_incidents(b) == [good]
    text = caplog.text
    assert "garbage" in text and "other" in text and "huge" in text and "fifo" in text
    assert "bad..name" in text


# ----------------------------------------------------------------------------- memory_only


def test_memory_only_round_trip_and_absence(store: Path) -> None:
    files = {f: {"sha256": "0" * 64, "size": 1} for f in (L.INDEX_FILE, L.NAMES_FILE, L.STATS_FILE)}
    common = dict(version=1, branch="main", seq=3, time=1.0, world_size=1, n_tensors=0, bytes_total=0,
                  bytes_written=0, bytes_referenced=0, has_pickle=False, files=files)
    doc = parse_commit(commit_document(step=131, memory_only=[(101, 107), (109, 130)], **common), "w")
    assert doc["memory_only"] == [[101, 107], [109, 130]]
    for none in (None, []):
        assert "memory_only" not in parse_commit(commit_document(step=131, memory_only=none, **common), "w")
    with pytest.raises(CorruptStoreError):
        commit_document(step=100, memory_only=[(101, 107)], **common)  # a later step: not "since"


@pytest.mark.parametrize("value", [
    "1-3", [[1]], [[1, 2, 3]], [[3, 1]], [[-1, 2]], [[1, 200]], [[1, 2], [2, 3]], [[5, 6], [1, 2]],
    [[True, 2]], [[1.0, 2]], [["1", "2"]], {"a": 1}, [[1, 2]] * 100_001,
])
def test_memory_only_hostile_values_refused(store: Path, value: object) -> None:
    _series(store, [1, 100])
    edit_commit(store, 100, memory_only=value)
    with pytest.raises(CorruptStoreError, match="memory_only"):
        RunIndex(store).captured()
    r = dstt.open(store)
    with pytest.raises(CorruptStoreError):
        r.record(100)


def test_captured_spans_from_commits(store: Path) -> None:
    _series(store, [100, 108, 116, 124, 131, 200])
    for s, prev in ((108, 100), (116, 108), (124, 116), (131, 124)):
        edit_commit(store, s, memory_only=[[prev + 1, s - 1]])
    assert RunIndex(store).captured() == ([(100, 131), (200, 200)], [100, 108, 116, 124, 131, 200])
    # a backfill after an incident persisted 104 too: persisted, not memory-only (markers win)
    spans, persisted, memory = captured_spans([(100, []), (108, [(101, 107)]), (104, [])])
    assert persisted == [100, 104, 108] and memory == [(101, 103), (105, 107)] and spans == [(100, 108)]


# ----------------------------------------------------------------------------- update stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_update_stats_match_torch_across_chunks(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    prev = (torch.randn(1000, generator=g) * 3).to(dtype)
    cur = (prev.double() + torch.randn(1000, generator=g, dtype=torch.float64) * 0.01).to(dtype)
    parts = [chunk_partial(cur[i:i + 300], prev[i:i + 300]) for i in range(0, 1000, 300)]
    row = dict(zip(L.STATS_COLUMNS, finalize(merge(parts))))
    want = float(torch.linalg.vector_norm(cur.double() - prev.double()))
    assert row["update_norm"] == pytest.approx(want, rel=1e-5)
    assert row["update_ratio"] == pytest.approx(want / float(torch.linalg.vector_norm(cur.double())), rel=1e-5)
    assert row["norm"] == pytest.approx(float(torch.linalg.vector_norm(cur.double())), rel=1e-5)
    # to_list/from_list carry the update sum (what crosses threads and processes)
    assert finalize(merge([Partial.from_list(p.to_list()) for p in parts])) == finalize(merge(parts))


def test_update_stats_edge_cases() -> None:
    z = torch.zeros(5)
    row = dict(zip(L.STATS_COLUMNS, finalize(chunk_partial(z, z))))
    assert (row["update_norm"], row["update_ratio"]) == (0.0, 0.0)
    row = dict(zip(L.STATS_COLUMNS, finalize(chunk_partial(z, torch.ones(5)))))
    assert row["update_norm"] == pytest.approx(math.sqrt(5)) and row["update_ratio"] == math.inf
    row = dict(zip(L.STATS_COLUMNS, finalize(chunk_partial(torch.ones(5)))))
    assert math.isnan(row["update_norm"]) and math.isnan(row["update_ratio"])
    # one chunk without its previous value makes the whole tensor's update unknown
    row = dict(zip(L.STATS_COLUMNS, finalize(merge([chunk_partial(z[:2], z[:2]), chunk_partial(z[2:])]))))
    assert math.isnan(row["update_norm"])
    assert Partial.from_list([3, 0.0, 0.0, 0.0, 0.0, 0.0, 0]).usq != Partial.from_list([3, 0, 0, 0, 0, 0, 0]).usq
    c = torch.tensor([1 + 1j, 2 - 1j])
    want = float(torch.linalg.vector_norm(c - c.conj()))
    assert finalize(chunk_partial(c, c.conj()))[7] == pytest.approx(want)


def test_saved_steps_have_nine_columns_and_nan_updates(store: Path) -> None:
    _series(store, [0])
    run = dstt.open(store)
    assert parse_commit(_commit_path(store, "main", 0).read_bytes(), "w")["stats_columns"] == list(L.STATS_COLUMNS)
    st = run.tensors(0)[0].stats
    assert list(st) == list(L.STATS_COLUMNS) and math.isnan(st["update_norm"]) and math.isnan(st["update_ratio"])


def test_old_seven_column_stores_still_read(store: Path) -> None:
    ws = _series(store, [0, 1, 2])
    old = make_legacy(store, 1)
    run = dstt.open(store)
    names, table = run.step_stats(1)
    assert table.shape == (2, len(L.STATS_COLUMNS)) and np.isnan(table[:, 7:]).all()
    assert np.array_equal(table[:, :7], old)
    w = {t.name: t for t in run.tensors(1)}["model/w"]
    assert w.stats["norm"] == pytest.approx(float(ws[1].norm())) and math.isnan(w.stats["update_ratio"])
    assert [p["value"] for p in run.history("model/w")] == pytest.approx([float(x.norm()) for x in ws])
    from dstt.store.verify import verify

    assert verify(str(store)).ok
    # without the commit's column list, a 7-column table is still taken for what it is
    data = (store / L.step_dir("main", 1) / L.STATS_FILE).read_bytes()
    assert np.isnan(decode_stats(data, 2, "w")[:, 8]).all()
    # a column list the table does not match is damage, not a guess
    edit_commit(store, 1, stats_columns=list(L.STATS_COLUMNS))
    with pytest.raises(DsttError):
        dstt.open(store).step_stats(1)
