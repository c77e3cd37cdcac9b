"""``dstt report``: one self-contained HTML page showing a whole run.

What it holds, all from the step index (no tensor data is read):

* the branch tree: each branch's fork point, step count, step range and
  bytes written;
* the tensors at the latest step with their stats;
* norm history plots, one per layer group (the same parameter across
  layers: ``model/layers.*.attn.wq.weight``), branches' own steps included;
* an update-size heatmap, tensors x steps: each tensor's update ratio
  ‖θₖ − θₖ₋₁‖ / ‖θₖ‖ where the capture recorded it, else the relative
  change of its norm from one captured step to the next;
* the largest changes between the first and the last step (norm, mean);
* which steps each branch captured and which it persisted (with
  ``Capture(memory_steps=K)`` some steps live in memory only);
* incidents recorded in the store (``cap.incident``, NaN/Inf, rewinds;
  marked on the norm plots too) and ``find``'s detections (NaN/Inf, 10x
  norm jumps, 10x update-ratio jumps).

The page is one file: figures are inline SVG drawn by matplotlib (the
``dstt[plot]`` extra), a Content-Security-Policy forbids every fetch and
every script, and every piece of text taken from the store (tensor and
branch names, the store's URL) is HTML-escaped: a store is untrusted input.

>>> import tempfile, torch, dstt
>>> path = tempfile.mkdtemp() + "/run"
>>> for s in range(3):
...     _ = dstt.save(path, s, {"model": {"w": torch.full((4,), float(s + 1))}})
>>> data = collect(dstt.open(path))
>>> [b["name"] for b in data.branches], data.steps, data.names
(['main'], [0, 1, 2], ['model/w'])
"""

from __future__ import annotations

import html
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dstt.format.layout import STATS_COLUMNS

#: Tensors listed in the latest-step table at most.
MAX_TABLE_ROWS = 2000
#: Norm-history figures at most, and lines per figure.
MAX_GROUPS = 24
MAX_LINES = 12
#: Rows (tensors) of the heatmap at most: the ones that changed most.
MAX_HEATMAP_ROWS = 80
#: Detections listed at most.
MAX_EVENTS = 200
TOP_CHANGES = 25

_NORM = STATS_COLUMNS.index("norm")
_MEAN = STATS_COLUMNS.index("mean")
_URATIO = STATS_COLUMNS.index("update_ratio")


def esc(value: Any) -> str:
    """Text from the store, made inert in HTML (quotes included)."""
    return html.escape(str(value), quote=True)


@dataclass
class ReportData:
    """What the page shows, as plain data (tests read it directly)."""

    url: str
    branch: str
    branches: list[dict[str, Any]]
    steps: list[int]  # the branch's trajectory (ancestors' steps up to each fork, then its own)
    step_branch: list[str]  # which branch each of ``steps`` was captured on
    names: list[str]  # tensors seen on the trajectory, in first-seen order
    norms: np.ndarray  # (len(names), len(steps)); NaN where a tensor is absent
    means: np.ndarray
    latest: list[dict[str, Any]]  # the latest step's tensors with stats
    events: list[dict[str, Any]]
    incidents: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    #: (len(names), len(steps)) update ratios recorded at capture time; NaN where none.
    updates: np.ndarray | None = None


def collect(run: Any, branch: str | None = None) -> ReportData:
    """Read what the report needs: branch summaries, every step's stats on
    ``branch``'s trajectory (default: the run's default branch), the latest
    step's tensors and find's detections."""
    from dstt.analysis.anomaly import find
    from dstt.analysis.listing import list_store

    t0 = time.perf_counter()
    branch = branch or run.default_branch
    branches = list_store(run)
    steps: list[int] = []
    where: list[str] = []
    for b, ss in run.lineage(branch):
        steps.extend(ss)
        where.extend([b] * len(ss))
    index: dict[str, int] = {}
    cols: list[tuple[np.ndarray, np.ndarray]] = []
    for s, b in zip(steps, where):
        names, stats = run.step_stats(s, branch=b)
        rows = np.fromiter((index.setdefault(n, len(index)) for n in names), dtype=np.int64, count=len(names))
        cols.append((rows, np.asarray(stats, dtype=np.float64)))
    norms = np.full((len(index), len(steps)), np.nan)
    means = np.full((len(index), len(steps)), np.nan)
    updates = np.full((len(index), len(steps)), np.nan)
    for j, (rows, stats) in enumerate(cols):
        if len(rows):
            norms[rows, j] = stats[:, _NORM]
            means[rows, j] = stats[:, _MEAN]
            updates[rows, j] = stats[:, _URATIO]
    latest: list[dict[str, Any]] = []
    if steps:
        latest = [t.to_dict() for t in run.tensors(steps[-1], branch=where[-1])][:MAX_TABLE_ROWS]
    events = find(run, None, branch, first=False)[:MAX_EVENTS] if steps else []
    incidents = [i for b in branches for i in b.get("incidents", [])][:MAX_EVENTS]
    return ReportData(run.url, branch, branches, steps, where, list(index), norms, means, latest, events,
                      incidents, elapsed_s=time.perf_counter() - t0, updates=updates)


_LAYER_RE = re.compile(r"(?<=[./_])\d+(?=[./_]|$)")


def layer_group(name: str) -> str:
    """The same parameter across layers: each run of digits between
    separators becomes ``*`` (``model/layers.3.w`` -> ``model/layers.*.w``).

    >>> layer_group("model/layers.12.attn.wq.weight")
    'model/layers.*.attn.wq.weight'
    """
    return _LAYER_RE.sub("*", name)


#: Points per line at most: more than a figure has pixels across.
MAX_POINTS = 500


def envelope(xs: np.ndarray, ys: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ~``max_points`` points of a line that keep its shape: the
    minimum and the maximum of each of ``max_points // 2`` buckets (a spike
    survives; plain striding could drop it). NaN-only buckets are dropped.

    >>> px, py = envelope(np.arange(10000.0), np.r_[np.zeros(5000), [7.0], np.zeros(4999)], 100)
    >>> len(px) <= 100, float(py.max())
    (True, 7.0)
    """
    n = len(xs)
    if n <= max_points:
        return xs, ys
    buckets = max(1, max_points // 2)
    size = -(-n // buckets)
    pad = buckets * size - n
    y = np.concatenate([ys, np.full(pad, np.nan)]).reshape(buckets, size)
    valid = ~np.isnan(y)
    lo = np.argmin(np.where(valid, y, np.inf), axis=1)
    hi = np.argmax(np.where(valid, y, -np.inf), axis=1)
    keep = valid.any(axis=1)
    base = np.arange(buckets) * size
    idx = np.unique(np.concatenate([(base + lo)[keep], (base + hi)[keep]]))
    return xs[idx], ys[idx]


def update_sizes(norms: np.ndarray) -> np.ndarray:
    """|n_t - n_{t-1}| / |n_{t-1}| along steps (NaN where undefined)."""
    out = np.full(norms.shape, np.nan)
    if norms.shape[1] > 1:
        prev, cur = norms[:, :-1], norms[:, 1:]
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, 1:] = np.abs(cur - prev) / np.abs(prev)
    return out


def largest_changes(data: ReportData, top: int = TOP_CHANGES) -> list[dict[str, Any]]:
    """Tensors whose norm changed most (relatively) between their first and
    last captured steps on the trajectory."""
    from dstt.analysis.scope import SKIPPED_ROOTS, is_counter

    rows = []
    for i, name in enumerate(data.names):
        if name.split("/", 1)[0] in SKIPPED_ROOTS or is_counter(name):
            continue  # RNG states, step counters, data offsets: change by design
        finite = np.flatnonzero(~np.isnan(data.norms[i]))
        if len(finite) < 2:
            continue
        a, b = finite[0], finite[-1]
        n0, n1 = data.norms[i, a], data.norms[i, b]
        rel = abs(n1 - n0) / abs(n0) if n0 != 0 else (math.inf if n1 != n0 else 0.0)
        rows.append({"name": name, "first_step": data.steps[a], "last_step": data.steps[b], "norm_first": n0,
                     "norm_last": n1, "rel_change": rel, "mean_first": data.means[i, a],
                     "mean_last": data.means[i, b]})
    rows.sort(key=lambda r: (-(r["rel_change"] if not math.isnan(r["rel_change"]) else -1.0), r["name"]))
    return rows[:top]


# --------------------------------------------------------------------------- figures


def _svg(fig: Any) -> str:
    import io

    from dstt.analysis.plot import require_matplotlib

    buf = io.StringIO()
    try:
        fig.savefig(buf, format="svg", metadata={"Date": None})
    finally:
        require_matplotlib().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline in HTML


def group_figures(data: ReportData) -> list[tuple[str, str]]:
    """(group, inline SVG) of norm histories, one figure per layer group."""
    from dstt.analysis.plot import require_matplotlib, safe_text

    plt = require_matplotlib()
    from dstt.analysis.scope import SKIPPED_ROOTS, is_counter

    groups: dict[str, list[int]] = {}
    for i, n in enumerate(data.names):
        if n.split("/", 1)[0] not in SKIPPED_ROOTS and not is_counter(n):  # (no norm plot of RNG states, counters)
            groups.setdefault(layer_group(n), []).append(i)
    order = sorted(groups, key=lambda g: (not g.startswith("model/"), g))[:MAX_GROUPS]
    xs = np.asarray(data.steps, dtype=np.float64)
    forks = sorted({s for s, b0, b1 in zip(data.steps[1:], data.step_branch, data.step_branch[1:]) if b0 != b1})
    on_path = set(data.step_branch) | {data.branch}
    incident_steps = sorted({i["step"] for i in data.incidents if i["branch"] in on_path})[:MAX_EVENTS]
    out = []
    for g in order:
        members = groups[g]
        if len(members) > MAX_LINES:  # evenly spread over depth
            members = [members[round(k * (len(members) - 1) / (MAX_LINES - 1))] for k in range(MAX_LINES)]
        fig, ax = plt.subplots(figsize=(6.4, 2.8))
        fig.subplots_adjust(left=0.12, right=0.98, bottom=0.17, top=0.96)  # fixed: tight_layout draws twice
        for i in members:
            px, py = envelope(xs, data.norms[i])
            ids = ",".join(_LAYER_RE.findall(data.names[i]))
            ax.plot(px, py, linewidth=1.2, label=safe_text(ids or data.names[i]))
        for f in forks:
            ax.axvline(f, color="0.5", linestyle=":", linewidth=1)
        for k, s in enumerate(incident_steps):
            ax.axvline(s, color="#9467bd", linestyle="--", linewidth=1, label="incident" if k == 0 else None)
        if np.nanmin(np.where(data.norms[members] > 0, data.norms[members], np.nan), initial=np.inf) < np.inf:
            finite = data.norms[members][np.isfinite(data.norms[members])]
            if finite.size and finite.min() > 0 and finite.max() / finite.min() > 100:
                ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("norm")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper right", ncol=4, title="*" if "*" in g else None,
                  title_fontsize=6)  # not "best": it searches every point
        out.append((g, _svg(fig)))
    return out


def heatmap_figure(data: ReportData) -> str | None:
    """Inline SVG of the update-size heatmap (tensors x steps), or None."""
    if len(data.steps) < 2 or not data.names:
        return None
    from matplotlib.colors import LogNorm

    from dstt.analysis.plot import require_matplotlib, safe_text

    plt = require_matplotlib()
    recorded = data.updates is not None and bool(np.isfinite(data.updates).any())
    sizes = data.updates if recorded and data.updates is not None else update_sizes(data.norms)
    score = np.nan_to_num(np.nanmax(np.where(np.isfinite(sizes), sizes, np.nan), axis=1, initial=0.0), nan=0.0)
    rows = np.argsort(-score, kind="stable")[:MAX_HEATMAP_ROWS]
    rows = np.sort(rows)  # keep the store's order among the ones shown
    shown = sizes[rows]
    finite = shown[np.isfinite(shown) & (shown > 0)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1e-6, 1.0)
    lo = max(lo, hi * 1e-8)
    height_in = 1.2 + 0.14 * len(rows)
    fig, ax = plt.subplots(figsize=(8.0, height_in))
    fig.subplots_adjust(left=0.3, right=0.98, bottom=0.75 / height_in, top=1 - 0.2 / height_in)
    img = np.where(np.isfinite(shown) & (shown > 0), shown, np.nan)
    im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="viridis",
                   norm=LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10),
                   extent=(-0.5, len(data.steps) - 0.5, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([safe_text(data.names[i]) for i in rows], fontsize=5)
    ticks = np.linspace(0, len(data.steps) - 1, min(10, len(data.steps))).round().astype(int)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(data.steps[t]) for t in ticks], fontsize=7)
    ax.set_xlabel("step")
    from matplotlib.ticker import NullFormatter

    bar = fig.colorbar(im, ax=ax, label="update ratio |Δθ| / |θ|" if recorded else "|Δ norm| / norm")
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    return _svg(fig)


# --------------------------------------------------------------------------- HTML


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _as_ranges(steps: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _ranges(ranges: list[list[int]], limit: int = 12) -> str:
    """``[[100, 131], [200, 200]]`` -> ``100-131, 200`` (a long list cut in the middle)."""
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
    if len(parts) > limit:
        parts = parts[: limit // 2] + ["..."] + parts[-(limit // 2):]
    return ", ".join(parts)


def _steps(b: dict[str, Any], limit: int = 12) -> str:
    steps = [str(s["step"]) for s in b["steps"]]
    if len(steps) > limit:
        steps = steps[: limit // 2] + ["..."] + steps[-(limit // 2):]
    return f"{len(b['steps'])}: " + "/".join(steps) if steps else "none"


def _table(headers: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _branch_tree(data: ReportData) -> str:
    children: dict[str | None, list[dict[str, Any]]] = {}
    names = {b["name"] for b in data.branches}
    for b in data.branches:
        parent = b["parent"]["branch"] if b["parent"] and b["parent"]["branch"] in names else None
        children.setdefault(parent, []).append(b)

    def node(b: dict[str, Any], depth: int) -> str:
        steps = [s["step"] for s in b["steps"]]
        written = sum(s["bytes_written"] or 0 for s in b["steps"])
        fork = f" forked from {esc(b['parent']['branch'])}:{esc(b['parent']['step'])}" if b["parent"] else ""
        rng = f"steps {esc(steps[0])}..{esc(steps[-1])}" if steps else "no steps of its own"
        kids = "".join(node(c, depth + 1) for c in children.get(b["name"], []) if depth < 64)
        mark = ' class="current"' if b["name"] == data.branch else ""
        return (f"<li{mark}><b>{esc(b['name'])}</b>{fork}: {len(steps)} step(s), {rng}, "
                f"{esc(_bytes(written))} written{('<ul>' + kids + '</ul>') if kids else ''}</li>")

    return "<ul class=\"tree\">" + "".join(node(b, 0) for b in children.get(None, [])) + "</ul>"


CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666}table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#f4f4f4;position:sticky;top:0}.scroll{max-height:480px;overflow:auto;border:1px solid #eee}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}
figure{margin:0;border:1px solid #eee;padding:6px}figcaption{font-size:12px;color:#444;word-break:break-all}
svg{max-width:100%;height:auto}.tree li.current>b{color:#1f77b4}.none{color:#888}
"""


def render_html(data: ReportData, overlay: str = "", compared: list[str] | None = None) -> str:
    """The report page for ``data`` (figures need matplotlib); ``overlay``:
    the branch (and store) overlay section's HTML (:mod:`dstt.analysis.reportoverlay`),
    ``compared``: the URLs of the other stores in it."""
    t0 = time.perf_counter()
    total_steps = sum(len(b["steps"]) for b in data.branches)
    latest = data.steps[-1] if data.steps else None
    latest_rows = [[t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"], _bytes(t["nbytes"]),
                    *(t["stats"].get(c, math.nan) for c in ("norm", "mean", "std", "min", "max", "nonfinite"))]
                   for t in data.latest]
    changes = [[r["name"], r["first_step"], r["last_step"], r["norm_first"], r["norm_last"], r["rel_change"],
                r["mean_first"], r["mean_last"]] for r in largest_changes(data)]
    from dstt.analysis.anomaly import group_by_step

    events = [[g["branch"], g["step"], ", ".join(g["names"][:6]) + (f" (+{len(g['names']) - 6} more)"
                                                                   if len(g["names"]) > 6 else ""),
               ", ".join(f"{r} x{n}" if n > 1 else r for r, n in g["reasons"].items()),
               g["events"][0].get("value", math.nan), g["events"][0].get("previous", math.nan)]
              for g in group_by_step(data.events)]  # one row per step (was: one per tensor)
    from dstt.analysis.plot import style

    with style():
        figs = "".join(f"<figure>{svg}<figcaption>{esc(g)}</figcaption></figure>" for g, svg in group_figures(data))
        heat = heatmap_figure(data)
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        # No fetch of any kind, no script: the page is data only.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; img-src data:\">",
        f"<title>dstt report: {esc(data.url)}</title><style>{CSS}</style></head><body>",
        f"<h1>dstt report</h1><p class=\"meta\">{esc(data.url)} &middot; branch <b>{esc(data.branch)}</b> &middot; "
        f"{len(data.branches)} branch(es), {total_steps} committed step(s) &middot; generated "
        f"{esc(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
        "<h2>Branches</h2>", _branch_tree(data),
        *(["<h2>Every branch" + (" of every store" if compared else "") + ", overlaid (forks dotted)</h2>"
            + ("<p class=\"meta\">compared with " + ", ".join(esc(u) for u in compared) + "</p>" if compared else ""),
            overlay] if overlay else []),
        f"<h2>Tensors at the latest step ({esc(latest)})</h2>",
        ("<div class=\"scroll\">" + _table(["tensor", "shape", "dtype", "bytes", "norm", "mean", "std", "min", "max",
                                             "nonfinite"], latest_rows, "tensors") + "</div>")
        if latest_rows else "<p class=\"none\">no steps</p>",
        "<h2>Norm history by layer group</h2>",
        f"<div class=\"grid\">{figs}</div>" if figs else "<p class=\"none\">no steps</p>",
        ("<h2>Update size (update ratio |θ<sub>k</sub> − θ<sub>k−1</sub>| / |θ<sub>k</sub>|, recorded at capture)</h2>"
         if data.updates is not None and np.isfinite(data.updates).any() else
         "<h2>Update size (relative change of norm between captured steps)</h2>"),
        heat if heat else "<p class=\"none\">fewer than two steps</p>",
        "<h2>Largest changes between the first and last steps</h2>",
        _table(["tensor", "first step", "last step", "norm (first)", "norm (last)", "relative change",
                "mean (first)", "mean (last)"], changes, "changes") if changes else "<p class=\"none\">none</p>",
        "<h2>Captured and persisted steps</h2>",
        _table(["branch", "captured", "persisted", "memory-only (never persisted)"],
               [[b["name"], _ranges(b.get("captured", [])), _steps(b), _ranges(b.get("memory_only", [])) or "none"]
                for b in data.branches], "captured"),
        "<h2>Incidents and detections</h2>",
        "<p class=\"none\">No incident records in this store.</p>" if not data.incidents else
        _table(["branch", "step", "time", "source", "reason", "ring steps persisted", "tensors"],
               [[i["branch"], i["step"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i["time"])), i["source"],
                 i["reason"], _ranges(_as_ranges(i["steps"])) or "-", ", ".join(i["tensors"][:5])
                 + (f", ... ({len(i['tensors'])})" if len(i["tensors"]) > 5 else "")] for i in data.incidents],
               "incidents"),
        (_table(["branch", "step", "tensors and values", "why", "value (first)", "previous (first)"], events,
                "events")
         if events else "<p class=\"none\">find: no NaN/Inf, no 10x jump and no spike.</p>"),
        f"<p class=\"meta\">read in {data.elapsed_s:.2f} s, drawn in {time.perf_counter() - t0:.2f} s</p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_report(run: Any, path: str, branch: str | None = None, others: dict[str, Any] | None = None) -> ReportData:
    """Collect, render and write the report for ``run`` to ``path``;
    ``others`` (label -> run, ``run``'s own label included): stores whose
    branches are overlaid beside ``run``'s."""
    from dstt.analysis.plot import require_matplotlib
    from dstt.analysis.reportoverlay import overlay_html

    require_matplotlib()
    data = collect(run, branch)
    runs = others or {"": run}
    page = render_html(data, overlay_html(runs), [str(r.url) for r in runs.values() if r is not run])
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return data


__all__ = ["ReportData", "collect", "largest_changes", "layer_group", "render_html", "update_sizes", "write_report"]
