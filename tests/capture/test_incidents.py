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
from dstt.format import layout as L
from dstt.format.backends import open_backend
from dstt.format.incidents import (
    MAX_REASON_CHARS,
    Incident,
    incident_document,
    list_incidents,
    parse_incident,
    record_incident,
)
from dstt.format.index import RunIndex, captured_spans
from dstt.format.manifest import commit_document, decode_stats, encode_json, parse_commit, sha256_hex
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
    {"time": True}, {"time": 1e300}, {"time": -5}, {"time": float("nan")}, {"steps": [3, 2]}, {"steps": [1, 1]}, {"steps": "1-3"}, {"steps": [-4]},
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
    with caplog.at_level(logging.WARNING, logger="dstt.format.incidents"):
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
    from dstt.format.verify import verify

    assert verify(str(store)).ok
    # without the commit's column list, a 7-column table is still taken for what it is
    data = (store / L.step_dir("main", 1) / L.STATS_FILE).read_bytes()
    assert np.isnan(decode_stats(data, 2, "w")[:, 8]).all()
    # a column list the table does not match is damage, not a guess
    edit_commit(store, 1, stats_columns=list(L.STATS_COLUMNS))
    with pytest.raises(DsttError):
        dstt.open(store).step_stats(1)


# ----------------------------------------------------------------------------- what people see: ls, find, history, report

from typer.testing import CliRunner

from dstt.cli.main import app

runner = CliRunner()
HOSTILE_REASON = "loss 9.1\x1b[2J<b>spike</b>\nnext line"


def _cli_json(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def add_update_stats(store: Path, step: int, cur: dict[str, torch.Tensor], prev: dict[str, torch.Tensor]) -> None:
    """Fill a saved step's update columns as the capture does, from the real
    tensors (torch, float64), and re-record the file in its commit."""
    where = store / L.step_dir("main", step)
    names = json.loads((where / L.NAMES_FILE).read_bytes())
    table = np.load(where / L.STATS_FILE).copy()
    for i, n in enumerate(names):
        u = float(torch.linalg.vector_norm(cur[n].double() - prev[n].double()))
        table[i, 7], table[i, 8] = u, u / float(torch.linalg.vector_norm(cur[n].double()))
    buf = io.BytesIO()
    np.save(buf, table, allow_pickle=False)
    (where / L.STATS_FILE).write_bytes(buf.getvalue())
    doc = json.loads((where / L.COMMIT_FILE).read_bytes())
    doc["files"][L.STATS_FILE] = {"sha256": sha256_hex(buf.getvalue()), "size": len(buf.getvalue())}
    (where / L.COMMIT_FILE).write_bytes(encode_json(doc))


def flight_store(store: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 100..131 captured, 100/108/116/124/131 persisted (the rest
    memory-only, as Capture(helper=False, memory_steps=K, persist=8) records them); small
    steady updates, and a 50x larger update of model/w at 124; an incident at
    124 (the trainer's) and one at 131 (non-finite)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, generator=g)
    states: dict[int, dict[str, torch.Tensor]] = {}
    persisted = [100, 108, 116, 124, 131]
    for s in persisted:
        if states:
            w = w + torch.randn(256, generator=g) * (0.5 if s == 124 else 0.01)
        states[s] = {"model/w": w.clone(), "model/b": torch.full((8,), 1.0 + s / 1000)}
        dstt.save(store, s, {"model": {"w": states[s]["model/w"], "b": states[s]["model/b"]}})
    for prev, s in zip(persisted, persisted[1:]):
        edit_commit(store, s, memory_only=[[prev + 1, s - 1]])
        add_update_stats(store, s, states[s], states[prev])
    b = open_backend(store)
    record_incident(b, Incident("main", 124, HOSTILE_REASON, "trainer", 1.7e9, tuple(range(117, 125))))
    record_incident(b, Incident("main", 131, "non-finite values in 1 tensor(s)", "non-finite", 1.7e9 + 60,
                                tuple(range(125, 132)), ("model/w",)))
    return states


def test_cli_ls_says_captured_persisted_and_incidents(store: Path) -> None:
    flight_store(store)
    (branch,) = _cli_json("ls", str(store))["branches"]
    assert branch["captured"] == [[100, 131]] and [s["step"] for s in branch["steps"]] == [100, 108, 116, 124, 131]
    assert branch["memory_only"] == [[101, 107], [109, 115], [117, 123], [125, 130]]
    assert branch["steps"][1]["memory_only"] == [[101, 107]]
    assert [(i["step"], i["source"]) for i in branch["incidents"]] == [(124, "trainer"), (131, "non-finite")]
    assert branch["incidents"][0]["reason"] == HOSTILE_REASON and branch["incidents"][0]["steps"][0] == 117
    human = runner.invoke(app, ["ls", str(store)])
    assert human.exit_code == 0, human.output
    assert "steps 100-131 captured, 100/108/116/124/131 persisted" in human.stdout
    assert "2 incident(s)" in human.stdout and "non-finite" in human.stdout and "117-124 (8 steps)" in human.stdout
    assert "\x1b" not in human.stdout and "\\x1b[2J<b>spike</b>" in human.stdout  # store text printed as text
    # a store without memory-only steps says nothing more than before
    plain = store.parent / "plain"
    _series(plain, [0, 1])
    (b2,) = _cli_json("ls", str(plain))["branches"]
    assert b2["captured"] == [[0, 1]] and b2["memory_only"] == [] and b2["incidents"] == []
    assert "persisted" not in runner.invoke(app, ["ls", str(plain)]).stdout


def test_cli_find_lists_incidents_and_detects_update_jumps(store: Path) -> None:
    states = flight_store(store)
    doc = _cli_json("find", f"{store}@main")
    assert doc["first_step"] == 124
    (ev,) = [e for e in doc["events"] if e["reason"] == "update_jump"]
    want = float(torch.linalg.vector_norm(states[124]["model/w"] - states[116]["model/w"]))
    assert ev["tensor"] == "model/w" and ev["value"] == pytest.approx(want / float(states[124]["model/w"].norm()))
    assert ev["previous"] > 0 and ev["value"] > 10 * ev["previous"]
    assert [(i["step"], i["source"]) for i in doc["incidents"]] == [(124, "trainer"), (131, "non-finite")]
    assert _cli_json("find", str(store))["incidents"] == doc["incidents"]  # every branch
    # only the checks asked for: no update jump without --update-jump
    assert _cli_json("find", f"{store}@main", "--nonfinite")["events"] == []
    assert _cli_json("find", f"{store}@main", "--update-jump", "5")["first_step"] == 124
    assert _cli_json("find", f"{store}@main", "--update-jump", "1000")["events"] == []
    human = runner.invoke(app, ["find", f"{store}@main"])
    assert human.exit_code == 0 and "update_jump" in human.stdout and "recorded incident" in human.stdout
    bad = runner.invoke(app, ["find", str(store), "--update-jump", "0.5"])
    assert bad.exit_code == 2 and "update jump must be a factor" in bad.stderr
    # steps without update stats (dstt.save, old stores) are not judged
    plain = store.parent / "plain"
    _series(plain, [0, 1, 2])
    assert _cli_json("find", str(plain), "--update-jump", "1.01")["events"] == []


def test_history_of_update_stats_reads_no_tensor_data(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    states = flight_store(store)
    steps = sorted(states)
    want = [math.nan] + [float(torch.linalg.vector_norm(states[s]["model/w"].double() - states[p]["model/w"].double()))
                         for p, s in zip(steps, steps[1:])]

    def no_reads(*a: object, **k: object) -> None:
        raise AssertionError("history read tensor data")

    monkeypatch.setattr(RunIndex, "_chunk", no_reads)
    got = [p["value"] for p in dstt.open(store).history("model/w", stat="update_norm")]
    assert math.isnan(got[0]) and got[1:] == pytest.approx(want[1:])
    doc = _cli_json("history", str(store), "model/w", "--stat", "update_ratio")
    vals = [p["value"] for p in doc["series"][0]["points"]]
    assert vals[1:] == pytest.approx([u / float(states[s]["model/w"].norm()) for u, s in zip(want[1:], steps[1:])])
    run = dstt.open(store)
    assert [(i.step, i.source) for i in run.incidents()] == [(124, "trainer"), (131, "non-finite")]
    assert run.incidents("main")[1].tensors == ("model/w",) and run.captured()[0] == [(100, 131)]
    rows = _cli_json("ls", f"{store}:124", "--sort", "update_ratio")["tensors"]
    assert [r["name"] for r in rows] == ["model/b", "model/w"]


def test_report_shows_incidents_and_memory_only_steps(store: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import html

    flight_store(store)
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", str(store), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "2 incident(s)" in r.stderr
    page = out.read_text()
    assert "No incident records" not in page
    assert html.escape(HOSTILE_REASON) in page and "<b>spike</b>" not in page
    assert "117-124" in page and "non-finite" in page
    assert "Captured and persisted steps" in page and "100-131" in page and "101-107, 109-115, 117-123, 125-130" in page
    assert "5: 100/108/116/124/131" in page and "update_jump" in page
    assert "update ratio |θ<sub>k</sub>" in page  # the heatmap shows the recorded update ratios


def test_history_plot_marks_incidents(store: Path) -> None:
    from dstt.analysis.plot import events_and_forks

    flight_store(store)
    marks = events_and_forks(dstt.open(store), ["model/w"], ["main"])
    assert [(m.step, m.kind) for m in marks if m.kind == "incident"] == [(124, "incident"), (131, "incident")]
    assert any(m.kind == "detection" and m.label == "update_jump" for m in marks)


def test_update_jump_baseline_is_the_nan_median() -> None:
    """find's baseline (the median of a tensor's previous finite ratios) equals numpy's nanmedian."""
    import warnings

    from dstt.analysis.anomaly import _nanmedian_rows

    rng = np.random.default_rng(0)
    for _ in range(50):
        a = rng.random((40, 8))
        a[rng.random((40, 8)) < 0.4] = np.nan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.nanmedian(a, axis=1)
        assert np.allclose(_nanmedian_rows(a), want, equal_nan=True)


def test_fuzzed_records_and_ranges_only_raise_corrupt_store_error() -> None:
    """Whatever a hostile store holds, parsing an incident record or a
    commit's memory_only ranges either succeeds or is a CorruptStoreError."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
    values = st.recursive(leaves, lambda c: st.one_of(st.lists(c, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), c, max_size=4)),
                          max_leaves=10)
    good = json.loads(incident_document(Incident("main", 3, "r", "trainer", 1.0, (2, 3))))
    fast = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

    @fast
    @given(st.sampled_from(sorted(good)), values, st.binary(max_size=40))
    def check(field: str, value: object, raw: bytes) -> None:
        for data in (json.dumps({**good, field: value}).encode(), raw):
            try:
                parse_incident(data, "w", "main")
            except CorruptStoreError:
                pass
        doc = {**json.loads(commit_document(
            version=1, branch="main", step=50, seq=1, time=1.0, world_size=1, n_tensors=0, bytes_total=0,
            bytes_written=0, bytes_referenced=0, has_pickle=False,
            files={f: {"sha256": "0" * 64, "size": 1} for f in (L.INDEX_FILE, L.NAMES_FILE, L.STATS_FILE)})),
            "memory_only": value}
        try:
            parse_commit(json.dumps(doc).encode(), "w")
        except CorruptStoreError:
            pass

    check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.complex64])
def test_blocked_stats_equal_whole_tensor_stats(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values widened block by block (and update sums formed block by block)
    give the stats of the whole tensor, NaN/Inf and LayerNorm-like values
    (|mean| >> std, the two-pass path) included."""
    from dstt.store import stats

    monkeypatch.setattr(stats, "UPDATE_BLOCK", 1000)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(10_007, generator=g, dtype=torch.float64)
    for values, bad in ((base * 3, False), (1.0 + base * 1e-3, False), (base, True)):
        x = values.to(dtype) if not dtype.is_complex else torch.complex(values, -values).to(dtype)
        prev = (x.to(torch.complex128 if dtype.is_complex else torch.float64) * 0.9).to(dtype)
        if bad and not (dtype.is_floating_point or dtype.is_complex):
            continue  # integers hold no NaN/Inf
        if bad:
            x[5], x[4000] = float("nan"), float("inf")
        row = dict(zip(L.STATS_COLUMNS, finalize(chunk_partial(x, prev))))
        ref = x.abs().double() if dtype.is_complex else x.double()
        assert row["numel"] == x.numel() and row["nonfinite"] == int((~torch.isfinite(ref)).sum())
        d = (x.to(torch.complex128) - prev.to(torch.complex128)).abs() if dtype.is_complex else x.double() - prev.double()
        if bad:
            assert math.isnan(row["std"]) and math.isnan(row["min"]) and not math.isfinite(row["update_norm"])
            continue
        for k, want in (("norm", ref.norm()), ("mean", ref.mean()), ("std", ref.std()), ("min", ref.min()),
                        ("max", ref.max()), ("update_norm", d.norm())):
            assert row[k] == pytest.approx(float(want), rel=1e-5, abs=1e-9), k


def test_cli_on_a_real_flight_recorder_capture(store: Path) -> None:
    """A real Capture(memory_steps=K, persist=N) with an incident: ls, find
    and history show what it recorded, through the CLI."""
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 4)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with dstt.Capture(str(store), memory_steps=4, persist=4) as cap:
        for s in range(12):
            m(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(s, model=m, optimizer=opt)
            if s == 9:
                cap.incident("loss spike \x1b[1mat 9")
    run = dstt.open(store)
    spans, persisted = run.captured()
    (inc,) = run.incidents()
    assert spans == [(0, 11)] and persisted == run.steps() and len(persisted) < 12
    assert inc.source == "trainer" and set(inc.steps) <= set(persisted) and inc.reason == "loss spike \x1b[1mat 9"
    (branch,) = _cli_json("ls", str(store))["branches"]
    memory = {s for a, b in branch["memory_only"] for s in range(a, b + 1)}
    assert branch["captured"] == [[0, 11]] and memory == set(range(12)) - set(persisted)
    assert [i["step"] for i in branch["incidents"]] == [inc.step]
    human = runner.invoke(app, ["ls", str(store)])
    from dstt.cli.render import steps_text  # (how many steps the incident stored depends on timing)

    assert human.exit_code == 0 and f"steps 0-11 captured, {steps_text(persisted)} persisted" in human.stdout
    assert "\x1b" not in human.stdout
    assert _cli_json("find", str(store))["incidents"] == branch["incidents"]
    doc = _cli_json("history", str(store), "model/weight", "--stat", "update_ratio")
    ratios = {p["step"]: p["value"] for p in doc["series"][0]["points"]}
    assert ratios[0] is None  # NaN (no previous step), null in JSON
    with_ratio = next(s for s, v in ratios.items() if v is not None and math.isfinite(v))
    listing = runner.invoke(app, ["ls", f"{store}:{with_ratio}"])
    assert listing.exit_code == 0 and "update_ratio" in listing.stdout  # shown where recorded
    assert any(v is not None and math.isfinite(v) and v > 0 for v in ratios.values())


def test_cli_reads_old_seven_column_steps(store: Path) -> None:
    """Steps written before the update columns: ls, history and find read
    them as before (the update columns null in JSON), verify finds no problem."""
    ws = _series(store, [0, 1, 2])
    for s in (0, 1, 2):
        make_legacy(store, s)
    (t,) = _cli_json("ls", f"{store}:1", "model/w")["tensors"]
    assert t["stats"]["norm"] == pytest.approx(float(ws[1].norm())) and t["stats"]["update_ratio"] is None
    doc = _cli_json("history", str(store), "model/w", "--stat", "update_norm")
    assert [p["value"] for p in doc["series"][0]["points"]] == [None, None, None]
    assert _cli_json("find", str(store))["events"] == [] and _cli_json("verify", str(store))["ok"]
