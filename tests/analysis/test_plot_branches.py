"""Plots that tell runs apart (issue 29 item 2) and ``history`` over
several stores (item 5): every line labelled with its branch (and store),
fork points of values marked, integer step ticks, plain log ticks, lines
not drawn across steps never stored."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

pytest.importorskip("matplotlib")
runner = CliRunner()


def _run(path: Path, scale: float) -> None:
    for s in range(6):
        dstt.save(path, s, {"model": {"w": torch.full((8,), scale * (s + 1))}, "extra": {"loss": scale / (s + 1)}})
    for s in (4, 5):
        dstt.save(path, s, {"model": {"w": torch.full((8,), scale * 9.0)}, "extra": {"loss": scale * 2.0}},
                  branch="hot", **({"parent": ("main", 3)} if s == 4 else {}))


def _texts(svg: str) -> list[str]:
    return [re.sub(r"\s+", " ", t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def test_value_plot_over_branches_names_them_and_marks_the_fork(tmp_path: Path) -> None:
    a = tmp_path / "a"
    _run(a, 1.0)
    out = tmp_path / "loss.svg"
    res = runner.invoke(app, ["history", str(a), "extra/loss", "-b", "main", "-b", "hot", "--plot", str(out),
                              "--log-y"])
    assert res.exit_code == 0, res.output
    texts = _texts(out.read_text())
    assert "extra/loss@main" in texts and "extra/loss@hot" in texts  # was: 'extra/loss' twice
    assert "fork point" in texts and "hot forks from main:3" in texts
    ticks = [t for t in texts if re.fullmatch(r"[-\d.e+]+", t)]
    assert ticks and not [t for t in ticks if "." in t and t.replace(".", "").isdigit() and float(t) > 1
                          and not float(t).is_integer()]  # no 2.5 steps
    assert not [t for t in texts if "mathdefault" in t or "10^" in t or "×" in t]  # plain log ticks


def test_history_compares_stores_side_by_side(tmp_path: Path) -> None:
    a, b = tmp_path / "lr-0.1", tmp_path / "lr-1"
    _run(a, 1.0)
    _run(b, 3.0)
    res = runner.invoke(app, ["history", str(a), "model/w", "--store", str(b), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(s["store"], s["branch"], s["points"][-1]["value"]) for s in doc["series"]] == [
        ("lr-0.1", "main", pytest.approx(6.0 * 8 ** 0.5)), ("lr-1", "main", pytest.approx(18.0 * 8 ** 0.5))]
    out = tmp_path / "w.svg"
    res = runner.invoke(app, ["history", str(a), "model/w", "-s", f"{b}", "-b", "hot", "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert "lr-0.1" in res.stdout and "lr-1" in res.stdout  # the table's store column
    texts = _texts(out.read_text())
    assert "lr-0.1:model/w@hot" in texts and "lr-1:model/w@hot" in texts
    bad = runner.invoke(app, ["history", str(a), "model/w", "--store", str(tmp_path / "nope")])
    assert bad.exit_code == 1 and "nope" in bad.output


def test_history_says_when_update_stats_were_not_recorded(tmp_path: Path) -> None:
    """``--stat update_ratio`` on steps saved without the previous one at
    hand: a warning, not empty panels without a word."""
    a = tmp_path / "a"
    _run(a, 1.0)
    res = runner.invoke(app, ["history", str(a), "model/w", "--stat", "update_ratio"])
    assert res.exit_code == 0 and "no update_ratio was recorded for these steps" in res.output
    assert "no update" not in runner.invoke(app, ["history", str(a), "model/w"]).output
