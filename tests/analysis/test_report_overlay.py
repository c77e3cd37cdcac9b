"""The report's branch overlay and two-store comparison (issue 29 item 2):
every branch of every store drawn on one figure per series, each line's
legend label in the page (read from the SVG: no browser needed), fork
points marked, the values plotted equal to the stored ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.analysis.reportoverlay import MODEL_NORM, legend_labels, overlay_series

pytest.importorskip("matplotlib")
runner = CliRunner()


def _run(path: Path, scale: float) -> None:
    for s in range(6):
        dstt.save(path, s, {"model": {"w": torch.full((4,), scale * (s + 1))},
                            "extra": {"loss": scale / (s + 1), "iter_num": s}})
    for s in (4, 5):
        dstt.save(path, s, {"model": {"w": torch.full((4,), 9.0 * scale)}, "extra": {"loss": 2.0 * scale, "iter_num": s}},
                  branch="hot", **({"parent": ("main", 3)} if s == 4 else {}))


def _figures(page: str) -> dict[str, tuple[str, list[str]]]:
    """figure caption's series name -> (its SVG, the texts drawn in it)."""
    start = page.index("<h2>Every branch")
    section = page[start: page.index("<h2>", start + 4)]
    out = {}
    for svg, caption in re.findall(r"<figure>(<svg.*?</svg>)\s*<figcaption>(.*?)</figcaption></figure>", section, re.S):
        out[caption.split(":", 1)[0]] = (svg, legend_labels(svg))
    return out


def test_report_overlays_branches_and_compares_two_stores(tmp_path: Path) -> None:
    from dstt.cli.main import app

    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, 1.0)
    _run(b, 3.0)
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(a), str(b), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["compared"] == [str(b)]
    page = out.read_text(encoding="utf-8")
    figs = _figures(page)
    assert set(figs) == {"extra/loss", MODEL_NORM}  # no counter (iter_num) overlaid
    for name, (_svg, texts) in figs.items():
        for line in ("a:main", "a:hot", "b:main", "b:hot"):  # every series labelled with its store and branch
            assert line in texts, (name, line, texts)
        assert "fork point" in texts and "hot forks at 3" in texts, name
    # the lines carry the stored values: hot's loss leaves main's at the fork
    got = overlay_series({"a": dstt.open(str(a)), "b": dstt.open(str(b))})["extra/loss"]
    hot_b = next(s for s in got if s["store"] == "b" and s["branch"] == "hot")
    assert [(p["step"], p["value"]) for p in hot_b["points"]] == [(0, 3.0), (1, 1.5), (2, 1.0), (3, 0.75), (4, 6.0),
                                                                  (5, 6.0)]
    # one store: lines named by branch alone
    res = runner.invoke(app, ["report", str(a), "-o", str(tmp_path / "one.html")])
    assert res.exit_code == 0, res.output
    texts = _figures((tmp_path / "one.html").read_text(encoding="utf-8"))["extra/loss"][1]
    assert "main" in texts and "hot" in texts and not [t for t in texts if t.startswith("a:")]
    bad = runner.invoke(app, ["report", str(a), str(tmp_path / "nope"), "-o", str(tmp_path / "x.html")])
    assert bad.exit_code == 1 and "nope" in bad.output and not (tmp_path / "x.html").exists()
