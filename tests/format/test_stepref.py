"""One way to name a step: StepRef everywhere a step comes back, reference
strings or StepRefs everywhere a parent goes in, branch as a keyword, and
one rule for references inside a store (CLI and Python alike)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.branch import from_ref
from dstt.cli.main import app
from dstt.format.refs import split_in_store


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    for s in range(4):
        dstt.save(path, s, {"w": torch.full((2,), float(s))})
    return path


def test_steps_come_back_as_stepref(store: Path) -> None:
    run = dstt.open(store)
    got = run.resolve("~1")
    assert isinstance(got, dstt.StepRef) and got == dstt.StepRef("main", 2) and got.step == 2
    parent = dstt.branch(f"{store}:1", "side")
    assert parent == dstt.StepRef("main", 1) and run.branch_info("side").parent == parent


@pytest.mark.parametrize("parent, expected", [
    ("main:1", ("main", 1)), ("@main:latest", ("main", 3)), ("~2", ("main", 1)), (":0", ("main", 0)),
    ("main", ("main", 3)), (dstt.StepRef("main", 2), ("main", 2)), (("main", 2), ("main", 2)),
])
def test_parent_takes_references_and_steprefs(store: Path, parent: object, expected: tuple) -> None:
    dstt.save(store, 10, {"w": torch.zeros(2)}, branch="b", parent=parent)
    assert dstt.open(store).branch_info("b").parent == expected


def test_capture_parent_reference(store: Path) -> None:
    with dstt.Capture(store, branch="cap", parent="@main:~1") as cap:
        cap.snapshot(7, extra={"x": 1})
    run = dstt.open(store)
    assert run.branch_info("cap").parent == ("main", 2) and run.steps("cap") == [7]
    with pytest.raises(dstt.InvalidReferenceError, match="not a step of this store"):  # (as save: store/args.py)
        dstt.Capture(store, branch="bad", parent="other/store:3")


def test_bad_parent_is_a_clear_error_and_creates_nothing(store: Path) -> None:
    with pytest.raises(dstt.StepNotFoundError, match="no committed step 9"):
        dstt.save(store, 10, {"w": torch.zeros(2)}, branch="b", parent="main:9")
    with pytest.raises(dstt.InvalidReferenceError):
        dstt.save(store, 10, {"w": torch.zeros(2)}, branch="c", parent="/elsewhere/run:1")
    assert dstt.open(store).branches() == ["main"]


def test_branch_is_keyword_only(store: Path) -> None:
    run = dstt.open(store)
    with pytest.raises(TypeError):
        run.read("w", 1, "main")  # type: ignore[misc]
    with pytest.raises(TypeError):
        run.record(1, "main")  # type: ignore[misc]
    assert torch.equal(run.read("w", 1, branch="main"), torch.full((2,), 1.0))


def test_cli_and_api_read_store_references_alike(store: Path) -> None:
    for text in ("main:2", "@main:~1", ":2", "~1", "latest", "2"):
        branch, step = split_in_store(text)  # type: ignore[misc]
        api = dstt.open(store).resolve("latest" if step is None else step, branch=branch)
        cli = dstt.open(from_ref(str(store), text)).resolve()
        assert api == cli, text


def test_export_command_and_restore_alias(store: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    for cmd in ("export", "restore"):
        out = tmp_path / f"{cmd}.pt"
        r = runner.invoke(app, [cmd, f"{store}:2", "--out", str(out), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["step"] == 2
        assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((2,), 2.0))
