"""The report (issue 29 item 2): no norm plot or "largest change" of RNG
states, step counters or data offsets; detections one row per step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import dstt
from dstt.analysis.report import collect, largest_changes, write_report

pytest.importorskip("matplotlib")


def test_report_skips_counters_and_groups_detections(tmp_path: Path) -> None:
    store = tmp_path / "run"
    for s in range(4):
        bad = float("nan") if s == 3 else 1.0
        dstt.save(store, s, {"model": {"w": torch.full((8,), 1.0 + s / 10), "v": torch.full((8,), bad)},
                             "optim": {"w": {"step": torch.tensor(float(s + 1) * 1000)}},
                             "rng": {"torch": torch.arange(16, dtype=torch.uint8) * s},
                             "extra": {"next_ix": torch.tensor(4096 * s), "loss": bad}})
    run = dstt.open(store)
    names = [r["name"] for r in largest_changes(collect(run))]
    assert names and all(n.startswith("model/") for n in names)  # was: led by optim/w/step and rng/torch
    html = write_report(run, str(tmp_path / "r.html")) and (tmp_path / "r.html").read_text()
    table = html[html.index("<h2>Detections"):] if "<h2>Detections" in html else html
    rows = re.findall(r"<tr><td>main</td><td>3</td>", table)
    assert len(rows) == 1  # one row for step 3 (was: one per tensor)
    assert "extra/loss" in table and "model/v" in table
    assert "rng/torch" not in html.split("<h2>Largest changes")[1].split("<h2>")[0]
