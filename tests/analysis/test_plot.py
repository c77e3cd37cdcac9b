"""``dstt history --plot``: PNG, SVG and PDF drawn with matplotlib, checked
by decoding what was written (PNG pixels, SVG as XML, the PDF header) --
log scale, panels, branches with fork points, detections -- and a one-line
error when matplotlib is missing."""

from __future__ import annotations

import builtins
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

runner = CliRunner()


def _run_with_branch(path: Path) -> None:
    """main: steps 0..5 with a norm that grows 20x per step from step 3 (a
    jump find reports: more than its default 10x, whatever the rounding of
    the stats); alt forks at 2 and stays flat."""
    for s in range(6):
        scale = 1.0 if s < 3 else 20.0 ** (s - 2)
        dstt.save(path, s, {"model": {"w": torch.full((8,), scale), "b": torch.full((3,), 0.5 + s)}})
    dstt.branch(f"{path}:2", "alt")
    for s in (3, 4):
        dstt.save(path, s, {"model": {"w": torch.ones(8), "b": torch.full((3,), 0.1)}}, branch="alt", parent=("main", 2))


def _plot(args: list[str]) -> None:
    r = runner.invoke(app, ["history", *args])
    assert r.exit_code == 0, r.output


def test_png_svg_pdf_written_and_sane(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    store = tmp_path / "run"
    _run_with_branch(store)
    png, svg, pdf = tmp_path / "h.png", tmp_path / "h.svg", tmp_path / "h.pdf"
    _plot([str(store), "model/*", "--plot", str(png)])
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 300
        rgb = im.convert("RGB")
        colors = {c for _, c in rgb.getcolors(maxcolors=1 << 20)}
    assert len(colors) > 50  # anti-aliased lines and text, not a handful of flat colours
    _plot([str(store), "model/w", "--plot", str(svg), "-b", "main", "-b", "alt"])
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = svg.read_text()
    assert "model/w@main" in text and "model/w@alt" in text  # both branches overlaid, labelled
    assert "fork point" in text and "find: detection" in text  # alt's fork and the 20x jump marked
    _plot([str(store), "model/w", "--plot", str(pdf)])
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


def test_log_scale_and_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dstt.analysis.plot import PlotSpec, Series, figure, require_matplotlib

    store = tmp_path / "run"
    _run_with_branch(store)
    _plot([str(store), "model/*", "--plot", str(tmp_path / "p.svg"), "--log-y", "--panels"])
    text = (tmp_path / "p.svg").read_text()
    assert text.count("model/w") >= 1 and "model/b" in text
    spec = PlotSpec([Series("a", [0, 1, 2], [1.0, 10.0, 1000.0], tensor="a"),
                     Series("b", [0, 1, 2], [0.0, -1.0, math.nan], tensor="b")], log_y=True, panels=True)
    fig = figure(spec)
    try:
        axes = fig.get_axes()
        assert len(axes) == 2 and all(ax.get_yscale() == "log" for ax in axes)
        lo, hi = axes[0].get_ylim()
        assert lo <= 1.0 and hi >= 1000.0
    finally:
        require_matplotlib().close(fig)


def test_fork_and_detection_markers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from dstt.analysis.plot import events_and_forks

    store = tmp_path / "run"
    _run_with_branch(store)
    marks = events_and_forks(dstt.open(str(store)), ["model/w"], ["main", "alt"])
    forks = [(m.branch, m.step) for m in marks if m.kind == "fork"]
    found = {(m.branch, m.step, m.tensor) for m in marks if m.kind == "detection"}
    assert forks == [("alt", 2)]
    assert ("main", 3, "model/w") in found and not any(b == "alt" and s > 2 for b, s, _ in found)


def test_bad_suffix_and_missing_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.ones(2)})
    r = runner.invoke(app, ["history", str(store), "w", "--plot", str(tmp_path / "h.jpg")])
    assert r.exit_code == 2 and ".png, .svg or .pdf" in r.output
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kw):  # type: ignore[no-untyped-def]
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    r = runner.invoke(app, ["history", str(store), "w", "--plot", str(tmp_path / "h.png")])
    assert r.exit_code == 2, r.output
    assert "pip install 'dstt[plot]'" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "h.png").exists()


def test_history_without_plot_does_not_import_matplotlib(tmp_path: Path) -> None:
    import subprocess
    import sys

    store = tmp_path / "run"
    dstt.save(store, 0, {"w": torch.ones(2)})
    code = (f"import sys\nfrom dstt.cli.main import main\nsys.argv=['dstt','history',{str(store)!r},'w']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "assert 'matplotlib' not in sys.modules and 'torch' not in sys.modules, 'imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
