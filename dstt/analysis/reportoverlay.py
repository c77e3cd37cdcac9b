"""The report's overlays (issue 29 item 2): every branch's series on one
plot, fork points marked, and several stores side by side
(``dstt report A B``).

What is overlaid, from the step index and value trees only (no tensor
data): the floats the default scope looks at (``extra/loss``, learning
rates, scheduler floats: :func:`dstt.analysis.scope.default_value`) and
the model's global norm (‖model‖ = √Σ‖θᵢ‖² over ``model/*``). One figure
per series, one line per (store, branch) -- each branch's whole trajectory,
its ancestors' steps up to the fork included, so a fork reads as one line
leaving another -- labelled ``store:branch`` (the store only where there
are several); each fork is a dotted vertical line and a ring on the
parent's line (:func:`dstt.analysis.plot.figure`).

:func:`legend_labels` reads the texts back from the SVG a figure became
(figures are drawn with ``svg.fonttype: none``: every legend entry is a
``<text>`` element): a test checks every series' label is in the page
without a browser.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"model": {"w": torch.full((4,), float(s + 1))}, "extra": {"loss": 1.0 / (s + 1)}})
>>> got = overlay_series({"": dstt.open(path)})
>>> sorted(got), [p["value"] for p in got["extra/loss"][0]["points"]]
(['extra/loss', 'model (global norm)'], [1.0, 0.5, 0.3333333333333333])
"""

from __future__ import annotations

import math
import re
from typing import Any

#: Series overlaid at most (values first, by name), and lines per figure.
MAX_OVERLAYS = 8
MAX_OVERLAY_LINES = 16
#: The global model norm's series name.
MODEL_NORM = "model (global norm)"


def _model_norm(names: list[str], stats: Any) -> float:
    from dstt.format.layout import STATS_COLUMNS

    col = STATS_COLUMNS.index("norm")
    total, seen = 0.0, False
    for i, n in enumerate(names):
        if n.startswith("model/"):
            v = float(stats[i][col])
            total += v * v
            seen = True
    return math.sqrt(total) if seen else math.nan


def branch_points(run: Any, branch: str) -> dict[str, list[dict[str, Any]]]:
    """Per series name, the points ``{"step", "value"}`` of ``branch``'s
    trajectory (ancestors up to the fork, then its own steps)."""
    from dstt.analysis.scope import default_value
    from dstt.analysis.values import flatten_values, step_tree

    out: dict[str, list[dict[str, Any]]] = {}
    for b, steps in run.lineage(branch):
        for s in steps:
            names, stats = run.step_stats(s, branch=b)
            norm = _model_norm(names, stats)
            if norm == norm:
                out.setdefault(MODEL_NORM, []).append({"step": s, "value": norm})
            for path, v in flatten_values(step_tree(run, s, b)).items():
                if default_value(path, v):
                    out.setdefault(path, []).append({"step": s, "value": float(v)})
    return out


def overlay_series(runs: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``{series name: [{"tensor", "branch", "store", "points"}]}``: each
    overlaid series of every branch of every store (``runs``: store label ->
    run; label ``""`` for one store). Values first, then the model norm."""
    got: dict[str, list[dict[str, Any]]] = {}
    for label, run in runs.items():
        for b in run.branches():
            for name, points in branch_points(run, b).items():
                got.setdefault(name, []).append({"tensor": name, "branch": b, "store": label, "points": points})
    order = sorted(got, key=lambda n: (n == MODEL_NORM, n))[:MAX_OVERLAYS]
    return {n: got[n][:MAX_OVERLAY_LINES] for n in order}


def line_label(s: dict[str, Any], stores: bool) -> str:
    """``store:branch`` where there are several stores, else ``branch``.

    >>> line_label({"store": "a/run", "branch": "hot"}, True), line_label({"store": "", "branch": "main"}, False)
    ('a/run:hot', 'main')
    """
    return f"{s['store']}:{s['branch']}" if stores else str(s["branch"])


def overlay_figures(runs: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
    """(series name, inline SVG, the legend labels drawn) of every overlay."""
    from dstt.analysis.plot import Marker, PlotSpec, Series, figure, require_matplotlib, safe_text, style

    stores = len(runs) > 1
    out = []
    for name, series in overlay_series(runs).items():
        lines = [Series(safe_text(line_label(s, stores)), [p["step"] for p in s["points"]],
                        [p["value"] for p in s["points"]], tensor=name, branch=s["branch"], store=s["store"])
                 for s in series]
        markers = []
        for label, run in runs.items():
            for s in series:
                if s["store"] != label:
                    continue
                parent = run.branch_info(s["branch"]).parent
                if parent is not None:
                    markers.append(Marker(parent[1], "fork", f"{s['branch']} forks at {parent[1]}", branch=s["branch"],
                                          store=label))
        spec = PlotSpec(lines, ylabel=safe_text(name), markers=markers, width_in=6.4, height_in=3.2,
                        log_y=name == MODEL_NORM and _wide(lines))
        with style():
            fig = figure(spec)
            import io

            buf = io.StringIO()
            try:
                fig.savefig(buf, format="svg", metadata={"Date": None})
            finally:
                require_matplotlib().close(fig)
        svg = buf.getvalue()
        out.append((name, svg[svg.index("<svg"):], [ln.label for ln in lines]))
    return out


def _wide(lines: list[Any]) -> bool:
    vals = [v for ln in lines for v in ln.ys if v == v and v > 0 and v != math.inf]
    return bool(vals) and max(vals) / min(vals) > 100


_TEXT_RE = re.compile(r"<text\b[^>]*>(.*?)</text>", re.S)
_TAG_RE = re.compile(r"<[^>]+>")


def legend_labels(svg: str) -> list[str]:
    """The texts of an SVG's ``<text>`` elements (legend entries, titles,
    tick labels), whitespace collapsed, entities unescaped.

    >>> legend_labels('<svg><text x="1">a/run:main</text><text><tspan>x &amp; y</tspan></text></svg>')
    ['a/run:main', 'x & y']
    """
    import html

    return [html.unescape(" ".join(_TAG_RE.sub("", t).split())) for t in _TEXT_RE.findall(svg)]


def overlay_html(runs: dict[str, Any]) -> str:
    """The report's overlay section: one figure per series."""
    from html import escape

    def esc(v: object) -> str:
        return escape(str(v), quote=True)

    figs = overlay_figures(runs)
    if not figs:
        return "<p class=\"none\">nothing to overlay (no float values, no model tensors)</p>"
    return "<div class=\"grid\">" + "".join(
        f"<figure>{svg}<figcaption>{esc(name)}: "
        + ", ".join(f"<span class=\"line\">{esc(lbl)}</span>" for lbl in labels)
        + "</figcaption></figure>" for name, svg, labels in figs) + "</div>"


__all__ = ["MODEL_NORM", "branch_points", "legend_labels", "line_label", "overlay_figures", "overlay_html",
           "overlay_series"]
