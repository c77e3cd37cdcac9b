"""``dstt ls`` shows which steps a live capture's memory tier holds, by how
many ranks (issue 25: per-rank records written by the capture helpers,
dstt.format.tier), and leaves out records of helpers that stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import dstt
from dstt.format import tier as T
from dstt.format.backends import open_backend
from tests.cli.test_cli_errors import cli


def _two_ranks_holding(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    for s in (0, 4):
        dstt.save(str(path), s, {"w": torch.full((3,), float(s))})
    b = open_backend(str(path))
    now = time.time()
    T.write_held(b, T.HeldRecord("main", "r9", 0, 2, 11, "node-a", now, ((5, 8),)))
    T.write_held(b, T.HeldRecord("main", "r9", 1, 2, 12, "node-b", now, ((6, 8),)))
    return path


def test_ls_shows_steps_held_in_memory_by_how_many_ranks(tmp_path: Path) -> None:
    path = _two_ranks_holding(tmp_path)
    T.write_held(open_backend(str(path)), T.HeldRecord("main", "r8", 2, 3, 13, "node-c", time.time() - 3600,
                                                        ((1, 2),)))  # a dead helper's
    rc, out, err = cli("ls", str(path), "--json")
    assert rc == 0, err
    branch = json.loads(out)["branches"][0] if "branches" in json.loads(out) else json.loads(out)[0]
    assert branch["held"] == [[5, 5, 1, 2], [6, 8, 2, 2]] and branch["held_stale"] == 1
    rc, out, err = cli("ls", str(path))
    assert rc == 0, err
    text = " ".join(out.split())
    assert "held in memory now: 5 by 1/2; 6-8 by 2/2 ranks" in text
    assert "1 stale record(s)" in text


def test_find_shows_steps_held_in_memory_like_ls(tmp_path: Path) -> None:
    path = _two_ranks_holding(tmp_path)
    for target in (str(path), f"{path}@main"):  # every branch, and one
        rc, out, err = cli("find", target, "--json")
        assert rc == 0, err
        assert json.loads(out)["held"]["main"]["held"] == [[5, 5, 1, 2], [6, 8, 2, 2]]
        rc, out, err = cli("find", target)
        assert rc == 0, err
        assert "branch 'main': held in memory now: 5 by 1/2; 6-8 by 2/2 ranks" in " ".join(out.split())


def test_report_shows_steps_held_in_memory_like_ls(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("matplotlib")
    path = _two_ranks_holding(tmp_path)
    page = tmp_path / "r.html"
    rc, out, err = cli("report", str(path), "-o", str(page), "--json")
    assert rc == 0, err
    assert json.loads(out)["held"]["main"] == {"held": [[5, 5, 1, 2], [6, 8, 2, 2]], "held_stale": 0}
    html = page.read_text()
    assert "held in memory now" in html and "5 by 1/2; 6-8 by 2/2 ranks" in html
