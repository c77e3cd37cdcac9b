"""Inspection: the analysis API (diff, history, find) checked against values
computed independently with torch, and the ls/show/diff/history/find
commands through typer's runner and a real subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.analysis.anomaly import find
from dstt.analysis.diff import sort_rows
from dstt.analysis.select import parse_slice
from dstt.cli.main import app
from dstt.cli.render import sparkline
from dstt.errors import ConfigError, CorruptStoreError, InvalidReferenceError, TensorNotFoundError
from dstt.format.backends import LocalBackend
from dstt.format.chunks import chunk_key_of
from dstt.format.writeoptions import WriteOptions

runner = CliRunner()


def _states() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    a = {
        "big": torch.randn(64, 40, generator=g),          # partly changed, many chunks
        "same": torch.randn(50, generator=g),              # unchanged
        "gone": torch.ones(3),                             # removed in B
        "reshaped": torch.zeros(4, 4),                     # shape changes
        "half": torch.randn(30, generator=g).bfloat16(),   # bfloat16, fully changed
        "nan": torch.tensor([float("nan"), 1.0, 2.0, 0.0]),  # NaN kept, +0 -> -0
        "ints": torch.arange(10),
        "cast": torch.linspace(0, 1, 6),                   # dtype changes
    }
    b = {k: v.clone() for k, v in a.items() if k != "gone"}
    b["big"][10:20] += 0.01 * torch.randn(10, 40, generator=g)
    b["reshaped"] = torch.zeros(2, 8)
    b["half"] = (b["half"].float() * 1.5).bfloat16()
    b["nan"][1] = 5.0
    b["nan"][3] = -0.0
    b["ints"][0] = 100
    b["cast"] = b["cast"].double()
    b["added"] = torch.ones(2)
    return a, b


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, dict, dict]:
    """A store with steps 0 (A) and 1 (B), small chunks so partly changed
    tensors have chunks the writer referenced instead of rewrote."""
    a, b = _states()
    path = tmp_path / "run"
    with dstt.Writer(path, WriteOptions(max_chunk_bytes=640)) as w:
        w.write(0, a)
        w.write(1, b)
    return path, a, b


def _expected(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Metrics computed directly from the original tensors."""
    fa, fb = a.double().reshape(-1), b.double().reshape(-1)
    same = torch.tensor([x == y for x, y in zip(a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1).tolist(),
                                               b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1).tolist())])
    d = torch.where(same, 0.0, fb - fa)
    return {
        "l2_delta": float(d.norm()),
        "rel_change": float(d.norm() / fa.norm()),
        "cosine": float(torch.dot(fa, fb) / (fa.norm() * fb.norm())),
        "max_abs_delta": float(d.abs().max()),
        "frac_changed": float((~same).double().mean()),
    }


def test_diff_metrics_match_torch(pair: tuple[Path, dict, dict]) -> None:
    path, a, b = pair
    rows = {r["name"]: r for r in dstt.open(path).diff(0, 1)}
    assert {k: r["status"] for k, r in rows.items()} == {
        "big": "changed", "same": "unchanged", "gone": "removed", "reshaped": "shape_changed",
        "half": "changed", "nan": "changed", "ints": "changed", "cast": "dtype_changed", "added": "added",
    }
    for name in ("big", "half", "ints"):
        exp = _expected(a[name], b[name])
        for k, v in exp.items():
            assert rows[name][k] == pytest.approx(v, rel=1e-6, abs=1e-12), (name, k)
    assert rows["big"]["frac_changed"] == pytest.approx(400 / 2560)
    same = rows["same"]
    assert (same["l2_delta"], same["max_abs_delta"], same["frac_changed"], same["cosine"]) == (0.0, 0.0, 0.0, 1.0)
    assert rows["reshaped"]["l2_delta"] is None and rows["reshaped"]["shape_b"] == [2, 8]


def test_diff_bitwise_semantics(pair: tuple[Path, dict, dict]) -> None:
    """A NaN that stays the same NaN is unchanged and adds nothing; +0 -> -0 is a change of 0."""
    path, _, _ = pair
    r = {x["name"]: x for x in dstt.open(path).diff(0, 1)}["nan"]
    assert r["frac_changed"] == 0.5  # elements 1 (1 -> 5) and 3 (+0 -> -0)
    assert r["l2_delta"] == 4.0 and r["max_abs_delta"] == 4.0
    assert math.isnan(r["rel_change"])  # ‖A‖ itself is NaN
    cast = {x["name"]: x for x in dstt.open(path).diff(0, 1)}["cast"]
    assert cast["dtype_a"] == "float32" and cast["dtype_b"] == "float64"
    exp = (torch.linspace(0, 1, 6).double() - torch.linspace(0, 1, 6).double().float().double()).norm()
    assert cast["l2_delta"] == pytest.approx(float(exp), abs=1e-12)


class ReadLog(LocalBackend):
    """A local store that logs the key of every read: a real backend,
    handed to ``dstt.open`` like any other."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.keys: list[str] = []

    def get(self, key: str, *, max_bytes: int | None = None) -> bytearray | None:  # type: ignore[override]
        self.keys.append(key)
        return super().get(key, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, length: int) -> bytes | None:
        self.keys.append(key)
        return super().get_range(key, start, length)

    def readinto(self, key: str, out: memoryview | list[memoryview]) -> int | None:
        self.keys.append(key)
        return super().readinto(key, out)

    def chunk_reads(self, run: dstt.Run, name: str, *points: tuple[str, int]) -> list[tuple[int, int]]:
        """(point, chunk index) of each chunk read of tensor ``name`` at the
        ``(branch, step)`` points, in read order (a read per occurrence)."""
        keys = {chunk_key_of(run.entry(name, s, branch=b), i): (k, i)
                for k, (b, s) in enumerate(points) for i in range(run.entry(name, s, branch=b).nchunks)}
        return [keys[k] for k in self.keys if k in keys]


def test_diff_skips_referenced_chunks(pair: tuple[Path, dict, dict]) -> None:
    path, _, _ = pair
    log = ReadLog(path)
    run = dstt.open(log)
    rows = {r["name"]: r for r in run.diff(0, 1, ["big", "same"])}
    assert not log.chunk_reads(run, "same", ("main", 0), ("main", 1))
    big = run.entry("big", 1)
    changed_chunks = {i for i in range(big.nchunks) if big.slots[i] != run.entry("big", 0).slots[i]}
    assert 0 < len(changed_chunks) < big.nchunks
    read = log.chunk_reads(run, "big", ("main", 0), ("main", 1))
    assert sorted(read) == sorted((k, i) for k in (0, 1) for i in changed_chunks)  # each side once per changed chunk
    assert rows["big"]["status"] == "changed"


def test_diff_across_stores_with_different_chunking(tmp_path: Path) -> None:
    a, b = _states()
    with dstt.Writer(tmp_path / "x", WriteOptions(max_chunk_bytes=256)) as w:
        w.write(0, {"big": a["big"]})
    with dstt.Writer(tmp_path / "y", WriteOptions(max_chunk_bytes=4096)) as w:
        w.write(7, {"big": b["big"]})
    rows = dstt.open(tmp_path / "x").diff(0, f"{tmp_path / 'y'}:7")
    exp = _expected(a["big"], b["big"])
    for k, v in exp.items():
        assert rows[0][k] == pytest.approx(v, rel=1e-6), k


def test_diff_points_and_sorting(pair: tuple[Path, dict, dict]) -> None:
    path, _, _ = pair
    run = dstt.open(path)
    assert run.diff(("main", 0), ":1") == run.diff(0, f"{path}:1") == run.diff("~1", "latest")
    every = run.diff(0, 1)
    ranked = sorted((r for r in every if r["rel_change"] is not None and not math.isnan(r["rel_change"])),
                    key=lambda r: -r["rel_change"])
    assert [r["name"] for r in sort_rows(every, "rel_change", top=2)] == [r["name"] for r in ranked[:2]]
    assert sort_rows(every, "rel_change")[-1]["rel_change"] is None  # no metric: last
    assert [r["name"] for r in sort_rows(run.diff(0, 1), "name")][:2] == ["added", "big"]
    with pytest.raises(ConfigError):
        sort_rows(every, "bogus")


def _series_store(path: Path) -> list[torch.Tensor]:
    ws = [torch.full((8,), float(s + 1)) for s in range(6)]
    ws[4] = ws[4] * 50  # a norm jump at step 4
    for s, w in enumerate(ws):
        dstt.save(path, s, {"model": {"w": w, "b": torch.zeros(2)}})
    bad = ws[2].clone()
    bad[0] = float("nan")
    dstt.save(path, 3, {"model": {"w": bad, "b": torch.zeros(2)}}, branch="alt", parent=("main", 2))
    return ws


def test_history_and_delta(store: Path) -> None:
    ws = _series_store(store)
    run = dstt.open(store)
    rows = run.history("model/w")
    assert [(r["step"], r["branch"]) for r in rows] == [(s, "main") for s in range(6)]
    for r, w in zip(rows, ws):
        assert r["value"] == pytest.approx(float(w.norm()))
    d = run.history(["model/*"], stat="max", delta=True)
    wd = [r["value"] for r in d if r["tensor"] == "model/w"]
    assert math.isnan(wd[0]) and wd[1] == pytest.approx(1.0)  # 1 -> 2
    alt = run.history("model/w", stat="nonfinite", branch="alt")
    assert [(r["branch"], r["step"], r["value"]) for r in alt] == [("main", 0, 0), ("main", 1, 0), ("main", 2, 0), ("alt", 3, 1)]
    assert len(run.history("model/w", branch="alt", ancestry=False)) == 1
    with pytest.raises(TensorNotFoundError, match="did you mean 'model/w'"):
        run.history("model/ww")


def test_find_first_bad_step(store: Path) -> None:
    _series_store(store)
    run = dstt.open(store)
    ev = find(run)
    assert [(e["step"], e["tensor"], e["reason"]) for e in ev] == [(4, "model/w", "norm_jump")]
    ev = find(run, branch="alt")
    assert [(e["branch"], e["step"], e["reason"]) for e in ev] == [("alt", 3, "nonfinite")]
    ev = find(run, ["model/w"], nonfinite=False, jump=None, stat="max", gt=3.5)
    assert ev[0]["step"] == 3 and ev[0]["value"] == 4.0
    assert len(find(run, first=False, jump=None, stat="max", gt=3.5, nonfinite=False)) == 3
    assert run.find(branch="alt") == find(run, branch="alt")  # the Run method is the same query


def test_parse_slice_and_sparkline() -> None:
    assert parse_slice("0:4,:") == (slice(0, 4), slice(None))
    assert parse_slice("1,::2,...") == (1, slice(None, None, 2), Ellipsis)
    with pytest.raises(InvalidReferenceError):
        parse_slice("a:b")
    assert sparkline([1, 2, float("nan"), 4]) == "▁▃ █"
    assert len(sparkline(list(range(1000)), width=40)) == 40


# ----------------------------------------------------------------------------- CLI


def _json(args: list[str]) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cli_ls(store: Path) -> None:
    _series_store(store)
    doc = _json(["ls", str(store)])
    by = {b["name"]: b for b in doc["branches"]}
    assert by["alt"]["parent"] == {"branch": "main", "step": 2} and by["main"]["parent"] is None
    assert [s["step"] for s in by["main"]["steps"]] == list(range(6))
    assert set(by["main"]["steps"][0]) >= {"step", "time", "n_tensors", "bytes_written", "bytes_referenced"}
    assert by["main"]["steps"][1]["bytes_referenced"] > 0  # model/b unchanged
    doc = _json(["ls", f"{store}:2", "model/w*", "--sort", "norm"])
    assert (doc["step"], doc["branch"]) == (2, "main")
    t = doc["tensors"]
    assert [x["name"] for x in t] == ["model/w"] and t[0]["shape"] == [8] and t[0]["dtype"] == "float32"
    assert t[0]["nbytes"] == 32 and t[0]["stats"]["max"] == 3.0
    human = runner.invoke(app, ["ls", str(store)])
    assert human.exit_code == 0 and "alt" in human.stdout and "from main:2" in human.stdout


def test_cli_show(pair: tuple[Path, dict, dict]) -> None:
    path, a, _ = pair
    doc = _json(["show", f"{path}:0", "big", "--slice", "0:2,3:5", "--bins", "5"])
    assert torch.allclose(torch.tensor(doc["values"]), a["big"][0:2, 3:5])
    assert sum(doc["histogram"]["counts"]) == a["big"].numel() and len(doc["histogram"]["edges"]) == 6
    assert doc["stats"]["max"] == pytest.approx(float(a["big"].max()))
    human = runner.invoke(app, ["show", f"{path}:0", "half"])
    assert human.exit_code == 0 and "histogram" in human.stdout and "bfloat16" in human.stdout


def test_cli_diff(pair: tuple[Path, dict, dict]) -> None:
    path, a, b = pair
    doc = _json(["diff", f"{path}:0", f"{path}:1", "--sort", "l2_delta", "--top", "3"])
    assert doc["a"].endswith("@main:0") and doc["b"].endswith("@main:1")
    assert len(doc["tensors"]) == 3
    ls = [t["l2_delta"] for t in doc["tensors"]]
    assert ls == sorted(ls, reverse=True)
    doc = _json(["diff", f"{path}:0", ":1", "b*", "--changed"])
    assert [t["name"] for t in doc["tensors"]] == ["big"]
    assert doc["tensors"][0]["l2_delta"] == pytest.approx(_expected(a["big"], b["big"])["l2_delta"], rel=1e-6)
    assert set(doc["tensors"][0]) >= {"name", "status", "l2_delta", "rel_change", "cosine", "max_abs_delta", "frac_changed"}
    human = runner.invoke(app, ["diff", f"{path}:0", ":1"])
    assert human.exit_code == 0 and "shape_changed" in human.stdout


def test_cli_history_plot_path_checked_before_work(store: Path, tmp_path: Path) -> None:
    _series_store(store)
    for bad, why in ((tmp_path / "no-dir" / "h.png", "is not a writable directory"),
                     (tmp_path, "it is a directory")):
        r = runner.invoke(app, ["history", str(store), "model/w", "--plot", str(bad)])
        assert r.exit_code == 2, r.output
        assert why in r.output and "Traceback" not in r.output
    assert not (tmp_path / "no-dir").exists()


def test_cli_history_and_plot(store: Path, tmp_path: Path) -> None:
    ws = _series_store(store)
    doc = _json(["history", str(store), "model/w", "--stat", "norm"])  # plots: tests/analysis/test_plot.py
    assert doc["stat"] == "norm"
    (s,) = doc["series"]
    assert s["tensor"] == "model/w"
    assert [p["value"] for p in s["points"]] == pytest.approx([float(w.norm()) for w in ws])
    doc = _json(["history", f"{store}@alt", "model/*", "--stat", "nonfinite", "-b", "alt", "-b", "main"])
    assert {(x["tensor"], x["branch"]) for x in doc["series"]} == {
        ("model/w", "alt"), ("model/b", "alt"), ("model/w", "main"), ("model/b", "main")}
    human = runner.invoke(app, ["history", str(store), "model/w", "--delta", "--points"])
    assert human.exit_code == 0 and "relative change of norm" in human.stdout


def test_cli_find(store: Path) -> None:
    _series_store(store)
    doc = _json(["find", str(store)])  # every branch unless told otherwise (issue 15)
    assert doc["branches"] == {"main": 4, "alt": 3} and doc["first_step"] == 3
    doc = _json(["find", f"{store}@main"])
    assert doc["first_step"] == 4 and doc["events"][0]["reason"] == "norm_jump"
    doc = _json(["find", f"{store}@alt", "--nonfinite"])
    assert doc["first_step"] == 3
    doc = _json(["find", str(store), "model/b", "--stat", "max", "--gt", "1"])
    assert doc["first_step"] is None and doc["events"] == []


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["ls", "{s}:abc"], 2, "bad step 'abc'"),
        (["ls", "{s}@no-such:1"], 1, "no branch 'no-such'"),
        (["ls", "{s}:99"], 1, "no committed step 99"),
        (["ls", "{s}/missing"], 1, "no store at"),
        (["show", "{s}:1", "model/ww"], 1, "did you mean 'model/w'"),
        (["show", "{s}:1", "model/w", "--slice", "x"], 2, "bad slice"),
        (["show", "{s}:1", "model/w", "--slice", "0,0"], 2, "index has 2 dimensions"),
        (["diff", "{s}:0", ":42"], 1, "no committed step 42"),
        (["diff", "{s}:0", ":1", "nothing*"], 1, "no tensor matches"),
        (["diff", "{s}:0", ":1", "--sort", "bogus"], 2, "cannot sort by 'bogus'"),
        (["history", "{s}", "model/w", "--stat", "median"], 2, "unknown stat 'median'"),
        (["history", "{s}:3", "model/w"], 2, "not a step"),
        (["find", "{s}", "--gt", "1", "--jump", "0.5"], 2, "jump must be a factor"),
    ],
)
def test_cli_bad_input(store: Path, args: list[str], code: int, message: str) -> None:
    _series_store(store)
    r = runner.invoke(app, [a.replace("{s}", str(store)) for a in args])
    assert r.exit_code == code, r.output
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert r.stdout == ""


def test_cli_subprocess(store: Path) -> None:
    _series_store(store)
    env = {**os.environ, "DSTT_DEBUG": "0"}
    ok = subprocess.run([sys.executable, "-m", "dstt.cli.main", "history", str(store), "model/w", "--json"],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["series"][0]["points"][-1]["step"] == 5
    bad = subprocess.run([sys.executable, "-m", "dstt.cli.main", "show", f"{store}:1", "model/x"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().startswith("error: no tensor 'model/x'") and "Traceback" not in bad.stderr


def test_find_follows_tensors_that_come_and_go(store: Path) -> None:
    """A norm jump is judged against the tensor's latest captured norm, also
    when it was absent in between; a new tensor has nothing to jump from."""
    one = torch.ones(4) * 0.5  # norm 1
    dstt.save(store, 0, {"a": one, "b": one})
    dstt.save(store, 1, {"a": one, "c": one * 50})          # b gone, c new (norm 50: no jump)
    dstt.save(store, 2, {"a": one, "b": one * 20, "c": one * 50})  # b back, 20x its last norm
    dstt.save(store, 3, {"a": one * 2, "b": one * 20, "c": one * 50})
    events = find(dstt.open(store), first=False, jump=10.0)
    assert [(e["step"], e["tensor"], e["previous"]) for e in events] == [(2, "b", 1.0)]
    assert events[0]["value"] == pytest.approx(20.0)
    assert find(dstt.open(store), ["a"], jump=1.5) == [
        {"branch": "main", "step": 3, "tensor": "a", "kind": "tensor", "reason": "norm_jump", "stat": "norm",
         "value": 2.0, "previous": 1.0, "gap": 1}]


# ----------------------------------------------------------------------------- edge cases (audit)


def test_diff_float32_extreme_magnitudes_match_float64(store: Path) -> None:
    """float32 data is differenced in float32 on the fast path, but sums of
    squares that would underflow (tiny values) or overflow (huge values)
    there must not turn the metrics into 0 or inf."""
    a = {"tiny": torch.full((100,), 1e-25), "huge": torch.full((100,), 1e20),
         "mixed": torch.cat([torch.full((50,), 1e-30), torch.full((50,), 3e19)])}
    b = {"tiny": torch.full((100,), 2e-25), "huge": torch.full((100,), 2e20),
         "mixed": torch.cat([torch.full((50,), 3e-30), torch.full((50,), -3e19)])}
    dstt.save(store, 0, a)
    dstt.save(store, 1, b)
    rows = {r["name"]: r for r in dstt.open(store).diff(0, 1)}
    for name in a:
        exp = _expected(a[name], b[name])
        for k, v in exp.items():
            assert rows[name][k] == pytest.approx(v, rel=1e-6), (name, k)


def test_diff_cosine_is_nan_when_a_norm_is_not_finite(store: Path) -> None:
    """A·B/(‖A‖‖B‖) with an infinite norm is undefined: NaN (JSON null), not
    clamped to 1; an unchanged tensor is still cosine 1."""
    inf = float("inf")
    dstt.save(store, 0, {"a_inf": torch.tensor([1.0, inf, 2.0]), "b_inf": torch.tensor([1.0, 2.0, 3.0]),
                         "same_inf": torch.tensor([inf, 1.0])})
    dstt.save(store, 1, {"a_inf": torch.tensor([1.0, inf, 5.0]), "b_inf": torch.tensor([1.0, inf, 3.0]),
                         "same_inf": torch.tensor([inf, 1.0])})
    rows = {r["name"]: r for r in dstt.open(store).diff(0, 1)}
    assert math.isnan(rows["a_inf"]["cosine"]) and math.isnan(rows["b_inf"]["cosine"])
    assert rows["a_inf"]["max_abs_delta"] == 3.0  # the unchanged Inf adds nothing
    assert rows["b_inf"]["l2_delta"] == inf and rows["b_inf"]["rel_change"] == inf
    assert rows["same_inf"]["status"] == "unchanged" and rows["same_inf"]["cosine"] == 1.0
    doc = _json(["diff", f"{store}:0", ":1"])  # strict JSON: non-finite metrics are null
    assert {t["name"]: t["cosine"] for t in doc["tensors"]} == {"a_inf": None, "b_inf": None, "same_inf": 1.0}


def test_diff_dtypes_and_zero_dim(store: Path) -> None:
    """bf16, fp8, ints, bool and 0-d tensors against metrics computed in the test."""
    g = torch.Generator().manual_seed(3)
    a = {"bf": torch.randn(40, generator=g).bfloat16(), "f8": torch.randn(40, generator=g).to(torch.float8_e4m3fn),
         "i32": torch.arange(20, dtype=torch.int32), "u8": torch.arange(20, dtype=torch.uint8),
         "flag": torch.tensor([True, False, True, False]), "s": torch.tensor(3.0), "si": torch.tensor(7)}
    b = {"bf": (a["bf"].float() + 0.5).bfloat16(), "f8": (a["f8"].float() * 2).to(torch.float8_e4m3fn),
         "i32": a["i32"].clone(), "u8": a["u8"].clone(), "flag": torch.tensor([True, True, False, False]),
         "s": torch.tensor(4.0), "si": torch.tensor(9)}
    b["i32"][3] = -50
    b["u8"][0] = 255
    dstt.save(store, 0, a)
    dstt.save(store, 1, b)
    rows = {r["name"]: r for r in dstt.open(store).diff(0, 1)}
    for name in a:
        assert rows[name]["status"] == "changed", name
        exp = _expected(a[name].to(torch.uint8) if a[name].dtype == torch.bool else a[name],
                        b[name].to(torch.uint8) if b[name].dtype == torch.bool else b[name])
        for k, v in exp.items():
            assert rows[name][k] == pytest.approx(v, rel=1e-6), (name, k)
    assert rows["s"]["shape_a"] == [] and rows["s"]["l2_delta"] == 1.0


def test_diff_zero_norm_edge_cases(store: Path) -> None:
    """rel_change: 0 when A and B are both 0, inf when only A is 0; cosine NaN when a norm is 0."""
    dstt.save(store, 0, {"zeros": torch.zeros(3), "from0": torch.zeros(3), "to0": torch.ones(3)})
    dstt.save(store, 1, {"zeros": torch.zeros(3), "from0": torch.tensor([0.0, 3.0, 4.0]), "to0": torch.zeros(3)})
    rows = {r["name"]: r for r in dstt.open(store).diff(0, 1)}
    z, f, t = rows["zeros"], rows["from0"], rows["to0"]
    assert (z["status"], z["rel_change"], z["l2_delta"]) == ("unchanged", 0.0, 0.0) and math.isnan(z["cosine"])
    assert (f["l2_delta"], f["rel_change"]) == (5.0, math.inf) and math.isnan(f["cosine"])
    assert t["rel_change"] == 1.0 and math.isnan(t["cosine"])


def test_cli_diff_progress_counts_to_its_total(pair: tuple[Path, dict, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress bar's total is the bytes the diff compares: with a glob
    filter it ends at 100%, not short of it."""
    import contextlib

    from dstt.cli import render

    calls: list[tuple[int, int]] = []
    shown: list[bool] = []

    @contextlib.contextmanager
    def fake(label: str, *, enabled: bool = True, unit: str = "bytes"):  # type: ignore[no-untyped-def]
        shown.append(enabled)
        yield lambda done, total=None, what=None: calls.append((done, total))

    monkeypatch.setattr(render, "progress", fake)
    monkeypatch.setattr(render, "PROGRESS_MIN_BYTES", 1)
    path, a, _ = pair
    for globs in ([], ["big"]):
        calls.clear()
        r = runner.invoke(app, ["diff", f"{path}:0", ":1", *globs, "--json"])
        assert r.exit_code == 0, r.output
        done, total = calls[-1]
        assert done == total, globs
    assert total == a["big"].numel() * 4 and shown == [True, True]


def test_index_only_commands_read_no_tensor_data(store: Path) -> None:
    """history, find and `ls REF` come from the step index: they work on a
    store whose tensor data (every chunk file) is gone."""
    _series_store(store)
    run = dstt.open(store)
    chunks = {chunk_key_of(e, i) for b in run.branches() for s in run.steps(b)
              for e in run.record(s, branch=b).entries for i in range(e.nchunks)}
    for key in chunks:
        (store / key).unlink()
    with pytest.raises(CorruptStoreError, match="missing"):  # the data is really gone
        dstt.open(store).read("model/w", 0)
    run = dstt.open(store)
    assert len(run.history("model/*", stat="mean", branch="alt")) == 8
    assert find(run, branch="alt")[0]["reason"] == "nonfinite"
    for args in (["history", str(store), "model/w", "--delta"], ["ls", f"{store}:3"], ["ls", str(store)],
                 ["find", str(store)]):
        r = runner.invoke(app, [*args, "--json"])
        assert r.exit_code == 0, (args, r.output)


def test_cli_ls_sort_and_reverse(pair: tuple[Path, dict, dict]) -> None:
    path, a, _ = pair
    doc = _json(["ls", f"{path}:0", "--sort", "nbytes", "--reverse"])
    sizes = [t["nbytes"] for t in doc["tensors"]]
    assert sizes == sorted(sizes, reverse=True) and doc["tensors"][0]["name"] == "big"
    doc = _json(["ls", f"{path}:0", "*a*", "--sort", "max"])
    names = [t["name"] for t in doc["tensors"]]
    assert set(names) == {"same", "half", "nan", "reshaped", "cast"}
    maxes = [float(a[n].float().nan_to_num(nan=-1).max()) if n != "nan" else 2.0 for n in names]
    assert maxes == sorted(maxes)


def test_diff_across_branches_skips_what_the_branch_references(store: Path) -> None:
    ws = _series_store(store)
    log = ReadLog(store)
    run = dstt.open(log)
    rows = {r["name"]: r for r in run.diff(("main", 2), "@alt:3")}
    assert rows["model/b"]["status"] == "unchanged" and not log.chunk_reads(run, "model/b", ("main", 2), ("alt", 3))
    assert log.chunk_reads(run, "model/w", ("main", 2), ("alt", 3))  # (what is read is seen)
    w = rows["model/w"]
    assert w["status"] == "changed" and w["frac_changed"] == 1 / 8 and math.isnan(w["l2_delta"])
    assert math.isnan(w["max_abs_delta"]) and math.isnan(w["rel_change"])  # a changed NaN propagates
    doc = _json(["diff", f"{store}@alt", f"{store}:5", "model/w"])
    assert doc["a"].endswith("@alt:3") and doc["b"].endswith("@main:5")
    (t,) = doc["tensors"]
    assert t["l2_delta"] is None and t["frac_changed"] == 1.0  # NaN -> null in strict JSON
    assert t["max_abs_delta"] is None and len(ws) == 6


def test_history_delta_from_zero_keeps_the_sign(store: Path) -> None:
    """(v − prev)/|prev| from prev = 0 is +inf or −inf by the sign of v, 0 if v is 0."""
    for s, m in enumerate([0.0, -1.0, 0.0, 2.0, 0.0, 0.0]):
        dstt.save(store, s, {"w": torch.full((2,), m)})
    d = [r["value"] for r in dstt.open(store).history("w", stat="mean", delta=True)]
    assert math.isnan(d[0]) and d[1:] == [-math.inf, 1.0, math.inf, -1.0, 0.0]


def test_find_does_not_flag_optimizer_step_counters(tmp_path) -> None:
    """Adam's ``step`` grows by the gap between captured steps: 1 -> 11 is not a norm jump."""
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(m.parameters())
    path = str(tmp_path / "run")
    for s in range(21):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if s in (0, 10, 20):
            dstt.save(path, s, dstt.state_of(model=m, optimizer=opt))
    assert not [e for e in dstt.open(path).find(first=False) if e["tensor"].endswith("/step")]
