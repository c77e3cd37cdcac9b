"""Line plots of stats over steps, drawn with matplotlib (the ``dstt[plot]``
extra), for ``dstt history --plot`` and the HTML report.

matplotlib is imported only here, inside the functions that draw, with the
non-interactive Agg backend: the read-only CLI never pays for it unless a
plot is asked for. The output format follows the file's suffix (``.png``,
``.svg``, ``.pdf``).

What a plot shows: one line per (tensor, branch) series -- overlaid in one
panel, or one panel per tensor -- an optional log-scale y axis, each
branch's fork point (a dotted vertical line and a ring on the parent's
line), and events (``find`` detections, incidents) as red crosses.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "p.png")
>>> line_plot([("w", [0, 1, 2], [1.0, 0.5, 0.25])], path, title="norm")  # doctest: +SKIP
>>> open(path, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"  # doctest: +SKIP
True
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from dstt.errors import ConfigError

#: Output formats, by file suffix.
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
INSTALL_HINT = "pip install 'dstt[plot]' (or: pip install matplotlib)"


@dataclass
class Series:
    """One line: ``ys`` over ``xs`` (NaN/inf leave gaps)."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    tensor: str = ""
    branch: str = ""
    store: str = ""


@dataclass
class Marker:
    """A point of interest at ``step``: a fork (``kind="fork"``) or an
    event (``"detection"``, ``"incident"``); ``tensor``/``branch`` place it on
    a line where one matches, else it spans the panel."""

    step: float
    kind: str
    label: str = ""
    tensor: str = ""
    branch: str = ""
    store: str = ""


@dataclass
class PlotSpec:
    """What to draw."""

    series: list[Series]
    title: str = ""
    ylabel: str = ""
    xlabel: str = "step"
    log_y: bool = False
    panels: bool = False  # one panel per tensor instead of all overlaid
    markers: list[Marker] = field(default_factory=list)
    width_in: float = 9.0
    height_in: float = 4.5


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format a path's suffix asks for, or ConfigError (a usage error).

    >>> plot_format("a/b.SVG")
    'svg'
    >>> plot_format("x.jpg")
    Traceback (most recent call last):
    dstt.errors.ConfigError: cannot plot to 'x.jpg': use a .png, .svg or .pdf file name
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in FORMATS:
        raise ConfigError(f"cannot plot to {os.fspath(path)!r}: use a .png, .svg or .pdf file name")
    return FORMATS[suffix]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line ConfigError
    saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"plots need matplotlib, which is not installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


#: SVG text stays text (searchable; escaped by matplotlib's XML writer).
STYLE = {"svg.fonttype": "none", "axes.titlesize": 10}


def safe_text(text: Any) -> str:
    """Text from a store, shown literally: a '$' would start mathtext (which
    can fail to parse or draw a formula), so each is escaped; a leading '_'
    would hide a legend entry.

    >>> safe_text("_w$x$") == " _w" + chr(92) + "$x" + chr(92) + "$"
    True
    """
    s = str(text).replace("$", "\\$")
    return " " + s if s.startswith("_") else s


def style() -> Any:
    """A context in which figures are created and saved (see :data:`STYLE`)."""
    return require_matplotlib().rc_context(STYLE)


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _value_at(s: Series, step: float) -> float | None:
    for x, y in zip(s.xs, s.ys):
        if x == step and _finite(y):
            return float(y)
    return None


def figure(spec: PlotSpec) -> Any:
    """A matplotlib Figure drawing ``spec`` (closed by :func:`save`)."""
    plt = require_matplotlib()
    groups: list[tuple[str, list[Series]]] = []
    if spec.panels:
        for s in spec.series:
            key = s.tensor or s.label
            for name, members in groups:
                if name == key:
                    members.append(s)
                    break
            else:
                groups.append((key, [s]))
    else:
        groups = [("", list(spec.series))]
    n = max(1, len(groups))
    fig, axes = plt.subplots(n, 1, figsize=(spec.width_in, max(spec.height_in, 2.6 * n) if n > 1 else spec.height_in),
                             sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    branch_colors: dict[tuple[str, str], str] = {}
    for ax, (name, members) in zip(axes[:, 0], groups or [("", [])]):
        for k, s in enumerate(members):
            color = colors[k % len(colors)] if not spec.panels else branch_colors.setdefault(
                (s.store, s.branch), colors[len(branch_colors) % len(colors)])
            ys = [float(y) if _finite(y) and not (spec.log_y and y <= 0) else math.nan for y in s.ys]
            xs, ys, broken = break_gaps(list(s.xs), ys)
            ax.plot(xs, ys, label=safe_text(s.label), color=color, linewidth=1.6,
                    marker="." if len(ys) < 60 or broken else None, markersize=4 if broken and len(ys) >= 60 else 6)
        _draw_markers(ax, spec, members)
        _axes_ticks(ax, spec.log_y)
        ax.grid(True, alpha=0.3)
        ax.set_ylabel(safe_text(spec.ylabel))
        if name:
            ax.set_title(safe_text(name), fontsize=10, loc="left")
        if members:
            ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel(spec.xlabel)
    if spec.title:
        fig.suptitle(safe_text(spec.title), fontsize=11)
    fig.tight_layout()
    return fig


def break_gaps(xs: list[float], ys: list[float]) -> tuple[list[float], list[float], bool]:
    """The points with a NaN between two that are more than twice the
    series' usual spacing apart (its smallest step gap): a line is not drawn
    across steps that were never stored (the flight recorder's memory-only
    stretches). Also says whether any gap was broken.

    >>> break_gaps([0, 1, 2, 20, 21], [1.0, 2.0, 3.0, 4.0, 5.0])
    ([0, 1, 2, 11.0, 20, 21], [1.0, 2.0, 3.0, nan, 4.0, 5.0], True)
    """
    gaps = [b - a for a, b in zip(xs, xs[1:]) if b > a]
    if not gaps:
        return xs, ys, False
    usual = min(gaps)
    out_x: list[float] = []
    out_y: list[float] = []
    broken = False
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i and x - xs[i - 1] > 2 * usual:
            out_x.append((x + xs[i - 1]) / 2)
            out_y.append(math.nan)
            broken = True
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y, broken


def _axes_ticks(ax: Any, log_y: bool) -> None:
    """Steps are integers (no 2.5 ticks); a log axis reads 0.01, 1, 100 (not
    2x10^0)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, numticks=8))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_markers(ax: Any, spec: PlotSpec, members: list[Series]) -> None:
    labelled: set[str] = set()
    for m in spec.markers:
        on = [s for s in members if (not m.tensor or s.tensor == m.tensor) and (not m.branch or s.branch == m.branch)
              and (not m.store or s.store == m.store)]
        if m.tensor and not on:
            continue  # the event is on a tensor of another panel
        legend = {"fork": "fork point", "detection": "find: detection", "incident": "incident"}.get(m.kind, m.kind)
        label = None if legend in labelled else legend
        labelled.add(legend)
        if m.kind == "fork":
            ax.axvline(m.step, color="0.45", linestyle=":", linewidth=1.2, label=label)
            if m.label:
                ax.annotate(safe_text(m.label), (m.step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, va="top", ha="right", color="0.35")
            for s in on:
                y = _value_at(s, m.step)
                if y is not None:
                    ax.plot([m.step], [y], marker="o", markersize=8, markerfacecolor="none",
                            markeredgecolor="0.2", linestyle="none")
            continue
        color = "#d62728" if m.kind == "detection" else "#9467bd"
        ys = [y for y in (_value_at(s, m.step) for s in on) if y is not None]
        if ys:
            ax.plot([m.step] * len(ys), ys, marker="x", markersize=9, markeredgewidth=2, color=color,
                    linestyle="none", label=label)
        else:
            ax.axvline(m.step, color=color, linestyle="--", linewidth=1.0, label=label)


def render(spec: PlotSpec, fmt: str) -> bytes:
    """The plot as ``fmt`` (png, svg or pdf) bytes."""
    with style():
        fig = figure(spec)
        buf = io.BytesIO()
        try:
            fig.savefig(buf, format=fmt, dpi=110 if fmt == "png" else None,
                        metadata={"Date": None} if fmt in ("svg", "pdf") else None)
        finally:
            require_matplotlib().close(fig)
    return buf.getvalue()


def save(spec: PlotSpec, path: str | os.PathLike[str]) -> None:
    """Write the plot to ``path`` in the format its suffix names."""
    fmt = plot_format(path)
    data = render(spec, fmt)
    with open(path, "wb") as f:
        f.write(data)


def line_plot(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], path: str, *,
              title: str = "", xlabel: str = "step", ylabel: str = "", log_y: bool = False) -> None:
    """Write a line plot of ``(label, xs, ys)`` series to ``path`` (.png,
    .svg or .pdf)."""
    save(PlotSpec([Series(label, xs, ys, tensor=label) for label, xs, ys in series], title=title,
                  xlabel=xlabel, ylabel=ylabel, log_y=log_y), path)


#: Most event markers drawn per plot (a run blown up flags every tensor).
MAX_EVENT_MARKERS = 200


def events_and_forks(run: Any, tensors: Sequence[str], branches: Sequence[str], store: str = "") -> list[Marker]:
    """Markers for ``branches``: each one's fork point, every ``find``
    detection (NaN/Inf, a norm or value jump, a spike) on ``tensors`` (tensor
    names or value paths) and every recorded incident -- from the step index
    and incident records only. ``store`` labels them (several stores)."""
    from dstt.analysis.anomaly import find

    markers: list[Marker] = []
    for b in branches:
        parent = run.branch_info(b).parent
        if parent is not None:
            where = f"{store}: " if store else ""
            markers.append(Marker(parent[1], "fork", f"{where}{b} forks from {parent[0]}:{parent[1]}", branch=b,
                                  store=store))
    seen: set[tuple[int, str]] = set()
    for b in branches:
        for e in find(run, list(tensors) or None, b, first=False):
            key = (int(e["step"]), str(e["tensor"]))
            if key in seen or len(seen) >= MAX_EVENT_MARKERS:
                continue
            seen.add(key)
            markers.append(Marker(e["step"], "detection", str(e.get("reason", "")), tensor=str(e["tensor"]), branch=b,
                                  store=store))
    from dstt.format.incidents import list_incidents

    for b in branches:  # incidents the capture recorded: across the panel (they name a step, not a tensor)
        for i in list_incidents(run.backend, b)[:MAX_EVENT_MARKERS]:
            markers.append(Marker(i.step, "incident", f"{i.source}: {i.reason}", branch=b, store=store))
    return markers


def series_label(s: dict[str, Any], *, stores: bool, branches: bool, panels: bool) -> str:
    """A line's legend: the tensor (or value), then ``@branch`` where there
    are several (store, branch) pairs, prefixed ``store:`` where several
    stores; in a panel of one tensor, only the store and branch.

    >>> series_label({"tensor": "extra/loss", "branch": "hot", "store": "a"}, stores=True, branches=True, panels=False)
    'a:extra/loss@hot'
    """
    where = (f"{s.get('store', '')}:" if stores else "")
    if panels:
        return f"{where}{s['branch']}"
    return f"{where}{s['tensor']}" + (f"@{s['branch']}" if branches else "")


def history_plot(runs: Any, series: list[dict[str, Any]], path: str | os.PathLike[str], *, label: str,
                 log_y: bool = False, panels: bool = False, marks: bool = True, title: str = "") -> None:
    """Write ``dstt history``'s series (``{"tensor", "branch", "points"}``,
    and ``"store"`` when several stores) to ``path``: every line labelled
    with its branch (and store) where there are several, fork points
    marked, ``find`` detections marked (``marks``), one panel per tensor
    with ``panels``. ``runs``: the run, or ``{store label: run}``."""
    by_store = runs if isinstance(runs, dict) else {"": runs}
    pairs = list(dict.fromkeys((s.get("store", ""), s["branch"]) for s in series))
    stores = len(by_store) > 1
    multi = len(pairs) > 1
    lines = [Series(series_label(s, stores=stores, branches=multi, panels=panels),
                    [p["step"] for p in s["points"]], [p["value"] for p in s["points"]],
                    tensor=s["tensor"], branch=s["branch"], store=s.get("store", "")) for s in series]
    markers: list[Marker] = []
    if marks:
        for name, run in by_store.items():
            mine = [s for s in series if s.get("store", "") == name]
            tensors = list(dict.fromkeys(s["tensor"] for s in mine))
            branches = list(dict.fromkeys(s["branch"] for s in mine))
            got = events_and_forks(run, tensors, branches, store=name) if mine else []
            if not multi:  # a single branch: its fork point is still worth a line, not a ring per tensor
                got = [m for m in got if m.kind != "fork" or m.branch in branches]
            markers += got
    shown = title or ", ".join(str(r.url) for r in by_store.values())
    save(PlotSpec(lines, title=f"{label} - {shown}", ylabel=label, log_y=log_y, panels=panels,
                  markers=markers), path)


__all__ = ["FORMATS", "Marker", "PlotSpec", "Series", "break_gaps", "events_and_forks", "figure", "history_plot",
           "line_plot", "series_label",
           "plot_format", "render", "require_matplotlib", "safe_text", "save", "style"]
