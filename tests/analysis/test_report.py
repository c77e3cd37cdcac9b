"""``dstt report``: the page's content checked against the store (branches,
tensors, groups, heatmap, changes, detections), store text escaped, no
fetch possible; and the page rendered by a real headless Chromium where one
is installed (``apt-get install chromium``)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

pytest.importorskip("matplotlib")
runner = CliRunner()
HOSTILE = "model/<img src=x onerror=alert(1)>&$x$"


def _store(path: Path) -> None:
    """main: 6 steps of 3 layers (+ a hostile name); at step 4 layer 1's
    weight becomes NaN; branch 'try-lr' forks at 2."""
    for s in range(6):
        state = {"model": {f"layers.{i}.weight": torch.full((4, 4), 1.0 + 0.1 * s * (i + 1)) for i in range(3)}}
        state["model"]["layers.0.bias"] = torch.full((4,), 2.0 ** s)
        state["model"][HOSTILE[len("model/"):]] = torch.ones(2)
        if s == 4:
            state["model"]["layers.1.weight"][0, 0] = float("nan")
        dstt.save(path, s, state)
    dstt.branch(f"{path}:2", "try-lr")
    for s in (3, 4):
        dstt.save(path, s, {"model": {"layers.0.weight": torch.zeros(4, 4)}}, branch="try-lr", parent=("main", 2))


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("report")
    _store(tmp / "run")
    out = tmp / "report.html"
    r = runner.invoke(app, ["report", str(tmp / "run"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out, out.read_text(encoding="utf-8")


def _section(text: str, title: str) -> str:
    start = text.index(title)
    nxt = text.find("<h2>", start + 4)
    return text[start: nxt if nxt >= 0 else len(text)]


def test_report_content(page: tuple[Path, str]) -> None:
    _, text = page
    branches = _section(text, "<h2>Branches")
    assert "<b>main</b>: 6 step(s), steps 0..5" in branches
    assert "<b>try-lr</b> forked from main:2: 2 step(s), steps 3..4" in branches
    table = _section(text, "Tensors at the latest step (5)")
    assert table.count("<tr>") == 1 + 5  # header + every tensor of step 5
    assert "<td>model/layers.2.weight</td><td>4x4</td><td>float32</td>" in table
    norm = float(torch.full((4, 4), 1.0 + 0.1 * 5 * 3).norm())
    assert f"<td>{norm:.4g}</td>" in table
    groups = _section(text, "Norm history by layer group")
    assert groups.count("<figure><svg") == 3  # layers.*.weight, layers.*.bias, the hostile one
    assert "<figcaption>model/layers.*.weight</figcaption>" in groups
    heat = _section(text, "Update size")
    assert "<svg" in heat and "data:image/png;base64," in heat  # the heatmap image, inline
    changes = _section(text, "Largest changes")
    first = re.search(r"<tbody><tr><td>([^<]*)</td>", changes)
    assert first is not None and first.group(1) == "model/layers.0.bias"  # norm x32 from step 0 to 5
    events = _section(text, "Incidents and detections")
    assert "<td>main</td><td>4</td><td>model/layers.1.weight</td><td>nonfinite</td>" in events


def test_report_is_self_contained_and_escapes_store_text(page: tuple[Path, str]) -> None:
    _, text = page
    assert "default-src 'none'" in text  # no fetch, no script, even if something slipped through
    assert not re.search(r"<script|<img", text, re.I)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text, re.I)
    assert html.escape(HOSTILE, quote=True) in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text


def test_report_cli_errors(tmp_path: Path) -> None:
    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.ones(2)})
    for args, why in ((["report", str(store), "-o", str(tmp_path / "r.txt")], "use a .html file name"),
                      (["report", f"{store}:0", "-o", str(tmp_path / "r.html")], "not a step"),
                      (["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")], "no store")):
        r = runner.invoke(app, args)
        assert r.exit_code in (1, 2) and why in r.output and "Traceback" not in r.output, r.output
    r = runner.invoke(app, ["report", str(store), "-o", str(tmp_path / "one.html"), "--json"])
    assert r.exit_code == 0 and '"steps": 1' in r.stdout  # one step: no heatmap, still a page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_report_renders_in_headless_chromium(page: tuple[Path, str], tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    out, _ = page
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                        "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", out.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert "dstt report" in dom and dom.count("<svg") >= 4 and "model/layers.1.weight" in dom
    console = [line for line in r.stderr.splitlines() if "CONSOLE" in line or "Refused to" in line]
    assert not console, console  # no script error, no blocked fetch
