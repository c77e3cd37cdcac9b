"""``dstt branch -m`` (issue 29 item 5): renames a branch with its steps,
records and children's parent pointers; refuses an existing new name and a
live writer; ``--dry-run`` changes nothing; a rename SIGKILLed at any write
leaves a store that opens and verifies, keeps writers off both names, and
running the same rename again finishes it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.errors import ConfigError
from dstt.format.lock import acquire
from dstt.format.verify import verify

runner = CliRunner()


def _build(store: Path) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """main 0..3, 'try' forked at main:1 with steps 2..3: what each step holds."""
    want: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for s in range(4):
        sd = {"w": torch.randn(32), "b": torch.full((3,), float(s))}
        dstt.save(store, s, {"model": sd, "extra": {"loss": 1.0 / (s + 1)}})
        want[("main", s)] = sd
    for s in (2, 3):
        sd = {"w": torch.randn(32), "b": torch.full((3,), -float(s))}
        dstt.save(store, s, {"model": sd}, branch="try", parent=("main", 1))
        want[("try", s)] = sd
    return want


def _check(store: Path, want: dict[tuple[str, int], dict[str, torch.Tensor]], main: str) -> None:
    run = dstt.open(store)
    assert sorted(run.branches()) == sorted([main, "try"])
    assert run.branch_info(main).name == main and json.loads((store / f"meta/branches/{main}.json").read_text())["name"] == main
    assert run.steps(branch=main) == [0, 1, 2, 3]
    assert tuple(run.branch_info("try").parent) == (main, 1)
    for (b, s), sd in want.items():
        got = dstt.open(f"{store}@{main if b == 'main' else b}:{s}").state_dict()["model"]
        for k, v in sd.items():
            assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), (b, s, k)
    # 'try' still inherits step 1 from the renamed branch
    assert torch.equal(dstt.open(f"{store}@try:1").state_dict()["model"]["w"], want[("main", 1)]["w"])
    assert verify(str(store)).ok


def test_rename_moves_steps_and_children_refuses_clashes(store: Path) -> None:
    want = _build(store)
    r = runner.invoke(app, ["branch", "-m", str(store), "main", "try"])
    assert r.exit_code == 1 and "already exists" in r.output
    r = runner.invoke(app, ["branch", "-m", str(store), "nope", "x"])
    assert r.exit_code == 1 and "no branch 'nope'" in r.output
    before = sorted(p.name for p in store.rglob("*"))
    r = runner.invoke(app, ["branch", "-m", "--dry-run", str(store), "main", "trunk"])
    assert r.exit_code == 0 and "would rename branch 'main' to 'trunk' (4 steps; 1 branch" in r.output
    assert sorted(p.name for p in store.rglob("*")) == before
    held = acquire(str(store), "try")  # a live writer on another branch: refused
    try:
        r = runner.invoke(app, ["branch", "-m", str(store), "main", "trunk"])
        assert r.exit_code == 1 and "being written by" in r.output
    finally:
        held.release()
    r = runner.invoke(app, ["branch", "-m", "--json", str(store), "main", "trunk"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["renamed"]["children"] == ["try"]
    _check(store, want, "trunk")
    assert not (store / "meta" / "steps" / "main").exists()
    assert not list((store / "meta").glob("renames/*.json"))
    # the new name takes writes; the old one is a fresh name again
    dstt.save(store, 4, {"model": {"w": torch.zeros(32)}}, branch="trunk")
    assert dstt.open(store).steps(branch="trunk") == [0, 1, 2, 3, 4]


#: A subprocess that renames main -> trunk and SIGKILLs itself at its K-th write to the store.
_KILLER = r"""
import os, signal, sys
from dstt.format.backends import open_backend
from dstt.format.branchrename import rename_branch
backend = open_backend(sys.argv[1], create=False)
k, n = int(sys.argv[2]), [0]
def hook(name):
    real = getattr(backend, name)
    def wrapped(*a, **kw):
        n[0] += 1
        if n[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)
    setattr(backend, name, wrapped)
for name in ("put", "put_atomic", "put_if_absent", "delete", "delete_prefix"):
    hook(name)
rename_branch(backend, "main", "trunk")
print(n[0])
"""


def _rename_killed_at(store: Path, k: int) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", _KILLER, str(store), str(k)], capture_output=True, text=True,
                       env=env, timeout=120)
    if k == 0:
        assert p.returncode == 0, p.stderr
        return int(p.stdout)
    assert p.returncode == -signal.SIGKILL, p.stderr
    return k


@pytest.mark.parametrize("where", ["quick", pytest.param("every", marks=pytest.mark.slow)])
def test_rename_sigkilled_at_any_write_leaves_a_store_that_verifies(tmp_path: Path, where: str) -> None:
    base = tmp_path / "base"
    want = _build(base)
    total = _rename_killed_at(shutil.copytree(base, tmp_path / "count"), 0)  # writes of a whole rename
    assert total > 20
    # quick: mid-copy, right after the new document, mid-removal; every: each write of the rename
    points = {total // 3, total - 14, total - 6} if where == "quick" else set(range(1, total + 1))
    for k in sorted(points):
        store = Path(shutil.copytree(base, tmp_path / f"k{k}"))
        _rename_killed_at(store, k)
        run = dstt.open(store)
        names = set(run.branches())
        assert names in ({"main", "try"}, {"main", "trunk", "try"}, {"trunk", "try"}), (k, names)
        assert verify(str(store)).ok, k
        if "trunk" in names:  # the new name answers with every step as soon as it exists
            assert run.steps(branch="trunk") == [0, 1, 2, 3], k
        if "main" in names:  # the old one loses its newest steps first
            assert run.steps(branch="main") == list(range(len(run.steps(branch="main")))), k
        if (store / "meta" / "renames" / "trunk.json").exists():  # (written first, removed last)
            with pytest.raises(ConfigError, match="dstt branch -m"):  # writers kept off the new name
                dstt.save(store, 9, {"model": {"w": torch.zeros(32)}}, branch="trunk")
        if (store / "meta" / "renames" / "main.json").exists():
            with pytest.raises(ConfigError, match="dstt branch -m"):  # and off the old one
                dstt.save(store, 9, {"model": {"w": torch.zeros(32)}}, branch="main")
        r = runner.invoke(app, ["branch", "-m", str(store), "main", "trunk"])
        assert r.exit_code == 0, (k, r.output)
        _check(store, want, "trunk")
