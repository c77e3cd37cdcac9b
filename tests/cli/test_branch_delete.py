"""``dstt branch -d`` (issue 29 item 5): deletes a branch, refuses one that
others fork from unless forced, refuses beside a live writer, and ``dstt
gc`` then frees its data; what other branches hold is untouched."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.format.backends import open_backend
from dstt.format.lock import acquire

runner = CliRunner()


def _files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def test_branch_delete_refuses_forks_then_gc_frees_the_data(store: Path) -> None:
    for s in range(3):
        dstt.save(store, s, {"model": {"w": torch.full((64,), float(s))}})
    before = _files(store)
    main_state = dstt.open(store).state_dict(2)
    dstt.save(store, 2, {"model": {"w": torch.randn(64)}}, branch="try", parent=("main", 1))
    dstt.save(store, 3, {"model": {"w": torch.randn(64)}}, branch="try")
    dstt.save(store, 4, {"model": {"w": torch.randn(64)}}, branch="try2", parent=("try", 3))
    res = runner.invoke(app, ["branch", str(store), "try", "-d"])
    assert res.exit_code == 2 and "forked from it ('try2')" in res.output and "--force" in res.output
    assert dstt.open(store).branches() == ["main", "try", "try2"]  # refused: nothing changed
    res = runner.invoke(app, ["branch", str(store), "try", "-d", "--force", "--dry-run", "--json"])
    assert json.loads(res.stdout) == {"deleted": ["try2", "try"], "dry_run": True}
    with acquire(open_backend(str(store)), "try2"):  # a live writer on a branch: refused, nothing changed
        res = runner.invoke(app, ["branch", str(store), "try", "-d", "--force"])
        assert res.exit_code == 1 and "try2" in res.output
    assert dstt.open(store).branches() == ["main", "try", "try2"]
    res = runner.invoke(app, ["branch", str(store), "try", "-d", "--force"])
    assert res.exit_code == 0 and "deleted branches 'try2', 'try'" in res.stdout, res.output
    assert dstt.open(store).branches() == ["main"]
    assert runner.invoke(app, ["gc", str(store)]).exit_code == 0
    left = {f for f in _files(store) - before if not f.startswith(("meta/locks/", "meta/branch_ids/", "meta/retired_ids/"))}
    assert left == set()  # the deleted branches' chunks, steps and records are gone
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2] and torch.equal(run.state_dict(2)["model"]["w"], main_state["model"]["w"])
    assert dstt.verify(str(store)).ok
    res = runner.invoke(app, ["branch", str(store), "try", "-d"])
    assert res.exit_code == 1 and "no branch 'try'" in res.output
    dstt.save(store, 2, {"model": {"w": torch.ones(64)}}, branch="try", parent=("main", 1))  # the name is free again
    assert dstt.open(store).steps("try") == [2]
