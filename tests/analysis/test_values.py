"""Values are first-class in the CLI: learning rate, hyperparameters,
scheduler state and extra values in show / diff / history; diff lists model
tensors before optimizer counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

runner = CliRunner()


@pytest.fixture
def blown_up(tmp_path: Path) -> Path:
    """A run whose learning rate jumps from 3e-4 to 10 at step 3 (Adam, StepLR, a stored loss)."""
    path = tmp_path / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    for step in range(5):
        if step == 3:
            for g in opt.param_groups:
                g["lr"] = 10.0
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        dstt.save(path, step, dstt.state_of(model=model, optimizer=opt, scheduler=sched, rng=True,
                                            extra={"loss": loss.item(), "note": "warm" if step < 3 else "hot"}))
    return path


def cli(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_show_a_value_path(blown_up: Path) -> None:
    assert cli("show", f"{blown_up}:3", "optim/param_groups/0/lr")["value"] == 10.0
    assert cli("show", f"{blown_up}:2", "optim/param_groups/0/lr")["value"] == 3e-4
    group = cli("show", f"{blown_up}:2", "optim/param_groups/0")["value"]
    assert group["betas"] == [0.9, 0.999] and group["params"] == ["weight", "bias"]
    assert cli("show", f"{blown_up}:4", "scheduler/last_epoch")["value"] == 5
    human = runner.invoke(app, ["show", f"{blown_up}:3", "optim/param_groups/0"])
    assert human.exit_code == 0 and "optim/param_groups/0/lr" in human.stdout and "10" in human.stdout
    bad = runner.invoke(app, ["show", f"{blown_up}:3", "optim/param_groups/0/lx"])
    assert bad.exit_code == 1 and "has no 'lx'" in bad.output and "lr" in bad.output and "Traceback" not in bad.output
    # A tensor is still a tensor.
    assert cli("show", f"{blown_up}:3", "model/weight")["shape"] == [2, 4]


def test_diff_reports_changed_values_and_weights_first(blown_up: Path) -> None:
    out = cli("diff", f"{blown_up}:2", ":3")
    values = {r["path"]: r for r in out["values"]}
    assert values["optim/param_groups/0/lr"]["a"] == 3e-4 and values["optim/param_groups/0/lr"]["b"] == 10.0
    assert values["extra/note"] == {"path": "extra/note", "status": "changed", "a": "warm", "b": "hot"}
    assert "scheduler/last_epoch" in values
    assert not any(p.startswith("rng/") for p in values)  # RNG states are noise, left out
    assert "extra/loss" in values and out["values"][0]["path"] == "optim/param_groups/0/lr"  # hyperparameters first
    names = [r["name"] for r in out["tensors"]]
    # Adam's step counters change by 100% every step; the weights still come first.
    assert names[:2] == ["model/weight", "model/bias"] or names[:2] == ["model/bias", "model/weight"]
    assert names.index("model/weight") < names.index("optim/weight/step")
    top = cli("diff", f"{blown_up}:2", ":3", "--top", "2")
    assert {r["name"] for r in top["tensors"]} == {"model/weight", "model/bias"}
    human = runner.invoke(app, ["diff", f"{blown_up}:2", ":3"])
    assert "optim/param_groups/0/lr" in human.stdout and "values" in human.stdout
    only_values = cli("diff", f"{blown_up}:2", ":3", "optim/param_groups/*")
    assert only_values["tensors"] == [] and {r["path"] for r in only_values["values"]} == {
        "optim/param_groups/0/lr"}


def test_history_of_a_value(blown_up: Path, tmp_path: Path) -> None:
    out = cli("history", str(blown_up), "optim/param_groups/0/lr")
    (series,) = out["series"]
    assert [(p["step"], p["value"]) for p in series["points"]] == [(0, 3e-4), (1, 3e-4), (2, 3e-4), (3, 10.0),
                                                                   (4, 10.0)]
    both = cli("history", str(blown_up), "extra/*")
    assert {s["tensor"] for s in both["series"]} == {"extra/loss", "extra/note"}
    human = runner.invoke(app, ["history", str(blown_up), "optim/param_groups/0/lr", "extra/note"])
    assert human.exit_code == 0 and "hot" in human.stdout and "optim/param_groups/0/lr" in human.stdout
    plot = tmp_path / "lr.png"
    r = runner.invoke(app, ["history", str(blown_up), "optim/param_groups/0/lr", "--plot", str(plot)])
    assert r.exit_code == 0 and plot.stat().st_size > 0
    # Tensors and values together: both are reported.
    r = runner.invoke(app, ["history", str(blown_up), "model/weight", "extra/loss"])
    assert r.exit_code == 0 and "model/weight" in r.stdout and "extra/loss" in r.stdout


def test_value_api_without_torch_tensors(blown_up: Path) -> None:
    from dstt.analysis.values import flatten_values, step_tree, value_diff
    from dstt.format.index import RunIndex

    run = RunIndex(str(blown_up))
    flat = flatten_values(step_tree(run, 4))
    assert flat["extra/note"] == "hot" and "model/weight" not in flat
    assert len([p for p in flat if p.startswith("rng/python")]) == 3  # 625-word state kept as one value
    assert value_diff(step_tree(run, 4), step_tree(run, 4)) == []


# ------------------------------------------------------------------ the rest of issue 15 item 7


def test_find_searches_every_branch_and_reports_divergence(tmp_path: Path) -> None:
    path = tmp_path / "run"
    for s in range(4):
        dstt.save(path, s, {"model": {"w": torch.full((4,), float(s + 1))}})
    dstt.save(path, 2, {"model": {"w": torch.full((4,), float("nan"))}}, branch="hot", parent=("main", 1))
    dstt.save(path, 3, {"model": {"w": torch.full((4,), 4.0)}}, branch="hot")
    doc = cli("find", str(path))
    assert doc["branches"] == {"hot": 2, "main": None} and doc["events"][0]["branch"] == "hot"
    assert cli("find", f"{path}@main")["first_step"] is None  # told otherwise: one branch
    d = cli("find", str(path), "--diverge", "main", "--diverge", "hot")
    assert (d["fork"], d["step"], d["tensors"]) == (["main", 1], 2, ["model/w"])
    human = runner.invoke(app, ["find", str(path), "--diverge", "hot"])
    assert human.exit_code == 0 and "first differ at step 2" in human.stdout


def test_prune_dry_run_lists_steps_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "run"
    for s in range(5):
        dstt.save(path, s, {"w": torch.full((4096,), float(s)), "frozen": torch.ones(4096)})
    doc = cli("prune", str(path), "--keep-last", "2", "--dry-run")
    assert [r["step"] for r in doc["removed"]] == [0, 1, 2] and all(r["bytes"] > 16384 for r in doc["removed"])
    gc_before = cli("gc", str(path), "--dry-run")["bytes_freed"]
    assert gc_before == 0 and dstt.open(path).steps() == [0, 1, 2, 3, 4]  # nothing was touched
    # 'frozen' is shared with kept steps: not counted; each step's own 'w' chunk is.
    chunk_bytes = doc["bytes_freed"] - sum(
        sum(f.stat().st_size for f in (path / "meta/steps/main" / f"{s:020d}").iterdir()) for s in range(3))
    cli("prune", str(path), "--keep-last", "2")
    assert cli("gc", str(path))["bytes_freed"] == chunk_bytes  # the estimate is what gc then frees


def test_export_refuses_to_overwrite(tmp_path: Path) -> None:
    path, out = tmp_path / "run", tmp_path / "w.pt"
    dstt.save(path, 0, {"w": torch.ones(2)})
    out.write_bytes(b"keep me")
    r = runner.invoke(app, ["export", f"{path}:0", "--out", str(out)])
    assert r.exit_code == 2 and "--overwrite" in r.stderr and out.read_bytes() == b"keep me"
    r = runner.invoke(app, ["export", f"{path}:0", "--out", str(out), "--overwrite", "-q"])
    assert r.exit_code == 0 and torch.load(out, weights_only=True)["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("command", ["ls", "show", "diff", "history", "find", "export", "prune", "gc", "branch"])
def test_help_has_no_bool_on_flags_and_prints_reference_syntax(command: str) -> None:
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "<bool>" not in r.stdout
    if command in ("history", "find"):
        assert "STORE[@BRANCH]" in r.stdout  # not eaten as rich markup


def test_demo_diff_lists_weights_before_optimizer_counters(tmp_path: Path) -> None:
    r = runner.invoke(app, ["demo", str(tmp_path / "demo"), "--json"])
    assert r.exit_code == 0, r.output
    names = [row["name"] for row in json.loads(r.stdout)["diff"]["tensors"]]
    assert names[0].startswith("model/") and any(n.endswith("/step") for n in names)
    assert max(i for i, n in enumerate(names) if n.startswith("model/")) < min(
        i for i, n in enumerate(names) if n.startswith("optim/"))
