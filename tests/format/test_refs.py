"""References: ``STORE[@BRANCH][:STEP]`` parsing and step resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import BranchNotFoundError, InvalidReferenceError, StepNotFoundError
from dstt.format.refs import Ref, resolve_step


@pytest.mark.parametrize(
    "text, expected",
    [
        ("runs/exp1", Ref("runs/exp1", None, None)),
        ("runs/exp1:100", Ref("runs/exp1", None, 100)),
        ("runs/exp1:latest", Ref("runs/exp1", None, "latest")),
        ("runs/exp1@lr-sweep:~2", Ref("runs/exp1", "lr-sweep", "~2")),
        ("runs/exp1@v1.2_b", Ref("runs/exp1", "v1.2_b", None)),
        ("s3://bucket/run:100", Ref("s3://bucket/run", None, 100)),
        ("s3://bucket/run", Ref("s3://bucket/run", None, None)),
        ("s3://bucket/run@main:~0", Ref("s3://bucket/run", "main", "~0")),
        ("memory://x@b:latest", Ref("memory://x", "b", "latest")),
        ("/abs/path/run:0", Ref("/abs/path/run", None, 0)),
    ],
)
def test_parse(text: str, expected: Ref) -> None:
    ref = Ref.parse(text)
    assert ref == expected
    assert Ref.parse(str(ref)) == ref


@pytest.mark.parametrize("text", ["", "   ", "run:abc", "run:-1", "run:~x", "run@bad!name", ":5", "@main:5"])
def test_parse_rejects_malformed(text: str) -> None:
    with pytest.raises(InvalidReferenceError):
        Ref.parse(text)


def test_existing_path_with_at_sign_is_a_store(tmp_path: Path) -> None:
    path = tmp_path / "run@v2"
    dstt.save(path, 3, {"w": torch.ones(2)})
    ref = Ref.parse(f"{path}:3")
    assert ref == Ref(str(path), None, 3)
    assert dstt.open(f"{path}:3").resolve() == ("main", 3)


def test_resolve_step_specs(store: Path) -> None:
    for s in (0, 5, 10):
        dstt.save(store, s, {"w": torch.full((2,), float(s))})
    run = dstt.open(store)
    assert resolve_step(run, "main", None) == ("main", 10)
    assert resolve_step(run, "main", "latest") == ("main", 10)
    assert resolve_step(run, "main", "~0") == ("main", 10)
    assert resolve_step(run, "main", "~2") == ("main", 0)
    assert resolve_step(run, "main", 5) == ("main", 5)
    with pytest.raises(StepNotFoundError, match="~3 goes before the first step"):
        resolve_step(run, "main", "~3")
    with pytest.raises(StepNotFoundError, match="no committed step 7"):
        resolve_step(run, "main", 7)
    with pytest.raises(InvalidReferenceError):
        resolve_step(run, "main", 2.5)
    for bad in ("~x", "~-1", "~"):
        with pytest.raises(InvalidReferenceError, match="'~N' takes a non-negative number"):
            run.resolve(bad)


def test_open_reference_sets_defaults(store: Path) -> None:
    dstt.save(store, 0, {"w": torch.zeros(2)})
    dstt.save(store, 1, {"w": torch.ones(2)})
    dstt.save(store, 2, {"w": torch.full((2,), 7.0)}, branch="alt", parent=("main", 0))
    run = dstt.open(f"{store}@alt:latest")
    assert run.resolve() == ("alt", 2)
    assert torch.equal(run.read("w"), torch.full((2,), 7.0))
    assert dstt.open(f"{store}:~1").resolve() == ("main", 0)
    with pytest.raises(BranchNotFoundError, match="no branch 'nope'"):
        dstt.open(f"{store}@nope:1")


def test_a_branch_reference_follows_its_trajectory(store: Path) -> None:
    """Like a git branch, a dstt branch's history includes its parent's steps
    up to the fork: references resolve through it, to the step's real owner."""
    from typer.testing import CliRunner

    from dstt.cli.main import app

    for s in (0, 5, 10):
        dstt.save(store, s, {"w": torch.full((2,), float(s))})
    dstt.branch(f"{store}:5", "side")
    run = dstt.open(store)
    assert run.lineage("side") == [("main", [0, 5]), ("side", [])]
    assert run.resolve("latest", branch="side") == ("main", 5)  # no own steps yet: its fork point
    assert run.resolve(0, branch="side") == ("main", 0)
    assert run.latest("side") == 5
    with pytest.raises(StepNotFoundError, match=r"step 10 on branch 'side' \(its trajectory has main: 0..5"):
        run.resolve(10, branch="side")  # main's step 10 came after the fork: not side's history
    assert torch.equal(run.read("w", 5, branch="side"), torch.full((2,), 5.0))
    assert run.record(5, branch="side").branch == "main"

    dstt.save(store, 6, {"w": torch.full((2,), 60.0)}, branch="side", parent=("main", 5))
    dstt.save(store, 7, {"w": torch.full((2,), 70.0)}, branch="side", parent=("main", 5))
    run = dstt.open(store)
    assert [run.resolve(spec, branch="side") for spec in ("latest", "~1", "~2", "~3", 6)] == [
        ("side", 7), ("side", 6), ("main", 5), ("main", 0), ("side", 6)]
    with pytest.raises(StepNotFoundError, match="~4 goes before the first step: branch 'side' has 4 steps"):
        run.resolve("~4", branch="side")
    assert dstt.open(f"{store}@side:~2").resolve() == ("main", 5)

    r = CliRunner().invoke(app, ["diff", f"{store}@side:5", f"{store}:5", "--json"])
    assert r.exit_code == 0, r.output
    assert [t["status"] for t in json.loads(r.stdout)["tensors"]] == ["unchanged"]
    r = CliRunner().invoke(app, ["show", f"{store}@side:0", "w", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["branch"] == "main"
