"""``dstt demo``, the README's main job: it trains, captures every step, lists
the store and diffs two steps; it never clobbers an existing path unasked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import bits_equal
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.format.verify import verify

runner = CliRunner()


def test_demo_captures_lists_and_diffs(tmp_path: Path) -> None:
    store = tmp_path / "demo"
    r = runner.invoke(app, ["demo", str(store), "--steps", "6", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    run = dstt.open(store)
    assert run.steps() == list(range(6))
    assert verify(store).ok
    assert [b["name"] for b in out["branches"]] == ["main"]
    assert [s["step"] for s in out["branches"][0]["steps"]] == list(range(6))
    rows = {t["name"]: t for t in out["diff"]["tensors"]}
    assert out["diff"]["a"].endswith("@main:0") and out["diff"]["b"].endswith("@main:5")
    # the diff is of real data: the weights changed by exactly what the store holds
    w0, w5 = run.read("model/0.weight", 0), run.read("model/0.weight", 5)
    if "model/0.weight" in rows:
        assert abs(rows["model/0.weight"]["l2_delta"] - float((w5 - w0).norm())) < 1e-5
    assert rows and all(t["status"] == "changed" for t in rows.values())
    # what was captured at the last step is what training left (extra holds the loss)
    assert run.state_dict(5)["extra"]["step"] == 5
    assert out["final_loss"] == run.state_dict(5)["extra"]["loss"]


def test_demo_refuses_existing_paths_unless_overwrite(tmp_path: Path) -> None:
    store = tmp_path / "demo"
    assert runner.invoke(app, ["demo", str(store), "--steps", "3"]).exit_code == 0
    before = dstt.open(store).read("model/0.weight", 2)
    again = runner.invoke(app, ["demo", str(store), "--steps", "3"])
    assert again.exit_code == 1 and "already exists" in again.output and "--overwrite" in again.output
    assert bits_equal(dstt.open(store).read("model/0.weight", 2), before)  # untouched

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    refused = runner.invoke(app, ["demo", str(other), "--overwrite"])
    assert refused.exit_code == 1 and "not a dstt store" in refused.output
    assert (other / "keep.txt").read_text() == "mine"

    replaced = runner.invoke(app, ["demo", str(store), "--steps", "4", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert dstt.open(store).steps() == [0, 1, 2, 3]


def test_demo_in_a_subprocess_prints_ls_and_diff(tmp_path: Path) -> None:
    env = {**os.environ, "DSTT_DEBUG": "0", "COLUMNS": "200"}
    p = subprocess.run([sys.executable, "-m", "dstt.cli.main", "demo", "--steps", "4"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "main" in p.stdout and "4 steps" in p.stdout  # the store listing
    assert "dstt-demo@main:0" in p.stdout and "dstt-demo@main:3" in p.stdout  # the diff's title
    assert "changed" in p.stdout and "rel_change" in p.stdout and "Traceback" not in p.stderr
    assert "dstt show dstt-demo:2 " in p.stderr  # the hints name steps that exist
    assert torch.is_tensor(dstt.open(tmp_path / "dstt-demo").read("model/0.weight", 3))
