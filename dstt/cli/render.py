"""Human renderings of the inspection commands (rich, on stdout; notes on
stderr). Every function takes the same plain data the ``--json`` output has."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator

from rich.console import JustifyMethod
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from dstt.cli.output import fmt_float, human_bytes, printable, stderr, stdout
from dstt.format.layout import step_ranges

SPARK = "▁▂▃▄▅▆▇█"
#: Diffs reading at least this many bytes get a progress bar (smaller ones would only flash it).
PROGRESS_MIN_BYTES = 64 << 20


def sparkline(values: list[float], width: int = 40) -> str:
    """Unicode sparkline; values are bucket-averaged down to ``width``;
    non-finite points show as a space.

    >>> sparkline([0, 1, 2, 3])
    '▁▃▆█'
    """
    if not values:
        return ""
    if len(values) > width:
        out = []
        for k in range(width):
            chunk = [v for v in values[k * len(values) // width:(k + 1) * len(values) // width] if math.isfinite(v)]
            out.append(sum(chunk) / len(chunk) if chunk else math.nan)
        values = out
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    lo, hi = min(finite), max(finite)
    span = hi - lo
    return "".join(
        " " if not math.isfinite(v) else SPARK[int((v - lo) / span * (len(SPARK) - 1) + 0.5) if span else 3]
        for v in values
    )


def _time(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _cell_text(cell: Any) -> str | None:
    if isinstance(cell, str):
        return cell
    if isinstance(cell, Text):
        return cell.plain
    return None


def _plain_table(table: Table) -> bool:
    """Write ``table`` to a non-terminal stdout as aligned plain text (its
    title, a header, a rule and one line per row): what a pipe or a file
    wants, and ~10x faster than rich's layout of hundreds of rows (issue 11:
    ``dstt ls STORE:latest`` of 300 tensors). False (nothing written) for
    tables whose cells are not plain text."""
    cols = table.columns
    # Written to the file directly, past the console's escaping: every cell,
    # header and title goes through printable() (control characters and
    # newlines escaped) here.
    cells = [[_cell_text(c) for c in col.cells] for col in cols]
    if any(c is None for col in cells for c in col):
        return False
    cells = [[printable(c or "") for c in col] for col in cells]
    headers = [printable(_cell_text(col.header) or "") for col in cols]
    widths = [max([len(h), *(len(c or "") for c in col)]) for h, col in zip(headers, cells)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if col.justify == "right" else v.ljust(w)
                         for v, w, col in zip(values, widths, cols)).rstrip()

    out = []
    if table.title:
        out.append(printable(_cell_text(table.title) or ""))
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line([col[i] or "" for col in cells]) for i in range(table.row_count))
    stdout.file.write("\n".join(out) + "\n")
    stdout.file.flush()
    return True


def emit_table(table: Table) -> None:
    """Print a table on stdout; when stdout is not a terminal (a pipe, a
    file) the table keeps its natural width instead of wrapping at 80.

    (A table that does not expand renders at its natural width on a wide
    enough console: the same output as measuring it first, in one layout
    pass instead of two -- 0.4 s instead of 0.8 s for 300 rows.)"""
    if stdout.is_terminal:
        stdout.print(table)
        return
    if _plain_table(table):
        return
    emit(table)


#: The console width when stdout is not a terminal: wide enough that no
#: line is ever cut or wrapped (rich's default there is 80 columns).
PIPE_WIDTH = 100_000


def emit(renderable: Any) -> None:
    """Print ``renderable`` on stdout; when stdout is not a terminal (a
    pipe, a file) at :data:`PIPE_WIDTH`, so lines keep every character
    (rich would cut a tree's labels at 80 columns). Only for renderables
    that do not expand to the width (tables that don't, trees, text)."""
    if stdout.is_terminal:
        stdout.print(renderable)
        return
    old = stdout.width
    stdout.width = PIPE_WIDTH
    try:
        stdout.print(renderable)
    finally:
        stdout.width = old


def steps_text(steps: list[int], limit: int = 8) -> str:
    """Steps as ``a/b/c``; a long list keeps its first and last few.

    >>> steps_text([100, 108, 116, 124, 131])
    '100/108/116/124/131'
    >>> steps_text(list(range(0, 200, 10)), limit=4)
    '0/10/.../180/190 (20)'
    """
    if len(steps) <= limit:
        return "/".join(map(str, steps))
    half = max(1, limit // 2)
    return "/".join(map(str, steps[:half])) + "/.../" + "/".join(map(str, steps[-half:])) + f" ({len(steps)})"


def ranges_text(ranges: list[list[int]] | list[tuple[int, int]], limit: int = 6) -> str:
    """Inclusive ranges as ``100-131, 200``; a long list keeps its first and last few.

    >>> ranges_text([[100, 131], [200, 200]])
    '100-131, 200'
    """
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    if len(parts) > limit:
        parts = parts[: limit // 2] + ["..."] + parts[-(limit // 2):]
    return ", ".join(parts)


def captured_text(b: dict[str, Any]) -> str:
    """What a branch captured when some steps lived in memory only, e.g.
    ``steps 100-131 captured, 100/108/116/124/131 persisted``; "" when every
    captured step was persisted (nothing more to say than the step list)."""
    held = "; ".join(f"{a}-{z} by {n}/{w} rank{'s' if w > 1 else ''}" if a != z else f"{a} by {n}/{w}"
                     for a, z, n, w in b.get("held", [])[:4])
    held = f"; held in memory now: {held}" if held else ""
    if b.get("held_stale"):
        held += f" ({b['held_stale']} stale record(s) of stopped helpers not counted)"
    if b.get("protected") and held:
        held += f"; protected against a node's loss ({b['protected']['scheme']}): {ranges_text(b['protected']['steps'])}"
    if not b.get("memory_only"):
        return f"held in memory now: {held[len('; held in memory now: '):]}" if held else ""
    persisted = [s["step"] for s in b["steps"]]
    return (f"steps {ranges_text(b['captured'])} captured, {steps_text(persisted)} persisted "
            f"(memory-only: {ranges_text(b['memory_only'], limit=4)}){held}")


def incidents_table(title: str, incidents: list[dict[str, Any]]) -> None:
    """Recorded incidents (step, time, source, reason, ring steps persisted, tensors)."""
    table = Table(title=printable(title), title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("branch", "left"), ("step", "right"), ("time", "left"), ("source", "left"),
        ("reason", "left"), ("persisted", "left"), ("tensors", "left"))
    for col, just in columns:
        table.add_column(col, justify=just)
    for i in incidents:
        steps = i["steps"]
        tensors = i.get("tensors") or []
        shown = ", ".join(tensors[:3]) + (f", ... ({len(tensors)})" if len(tensors) > 3 else "")
        table.add_row(printable(i["branch"]), str(i["step"]), _time(i["time"]), printable(i["source"]),
                      printable(i["reason"]), f"{ranges_text(step_ranges(steps))} ({len(steps)} steps)" if steps else "-",
                      printable(shown) or "-")
    emit_table(table)


def store_listing(url: str, branches: list[dict[str, Any]], limit: int) -> None:
    tree = Tree(Text(printable(url), style="bold"))
    nodes: dict[str, Any] = {}
    pending = list(branches)
    while pending:  # parents first
        progressed = False
        for b in list(pending):
            parent = b["parent"]["branch"] if b["parent"] else None
            if parent is None or parent in nodes or parent not in {x["name"] for x in branches}:
                steps = b["steps"]
                written = sum(s["bytes_written"] or 0 for s in steps)
                ref = sum(s["bytes_referenced"] or 0 for s in steps)
                span = f"{steps[0]['step']}..{steps[-1]['step']}" if steps else "-"
                fork = f" from {b['parent']['branch']}:{b['parent']['step']}" if b["parent"] else ""
                n_inc = len(b.get("incidents") or [])
                label = Text.assemble((printable(b["name"]), "bold cyan"), f"{printable(fork)}  {len(steps)} steps ({span}), "
                                      f"{human_bytes(written)} written, {human_bytes(ref)} referenced",
                                      (f", {n_inc} incident(s)" if n_inc else "", "bold red"))
                nodes[b["name"]] = (nodes[parent] if parent in nodes else tree).add(label)
                pending.remove(b)
                progressed = True
        if not progressed:
            break
    emit(tree)  # (piped: never cut at 80 columns)
    for b in branches:  # a line of its own: a tree label is cut at the console's width
        extra = captured_text(b)
        if extra:
            stdout.print(Text(f"{printable(b['name'])}: {extra}"), soft_wrap=True)
    for b in branches:
        steps = b["steps"] if limit <= 0 else b["steps"][-limit:]
        table = Table(title=f"branch {printable(b['name'])}", title_justify="left")
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("step", "right"), ("time", "left"), ("tensors", "right"), ("written", "right"), ("referenced", "right"))
        for col, just in columns:
            table.add_column(col, justify=just)
        for s in steps:
            table.add_row(str(s["step"]), _time(s["time"]), str(s["n_tensors"]),
                          human_bytes(s["bytes_written"] or 0), human_bytes(s["bytes_referenced"] or 0))
        emit_table(table)
        if len(steps) < len(b["steps"]):
            stderr.print(f"{len(b['steps']) - len(steps)} earlier steps of {b['name']} not shown (--limit 0 shows all)")
        if b.get("incidents"):
            incidents_table(f"incidents on branch {b['name']}", b["incidents"])


def tensor_listing(ref: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=printable(ref), title_justify="left")
    # The update ratio (|θ_k - θ_k-1| / |θ_k|) only where the capture recorded one.
    updates = any(math.isfinite(r["stats"].get("update_ratio", math.nan)) for r in rows)
    cols = ("name", "shape", "dtype", "size", "norm", "mean", "std", "min", "max", "nonfinite",
            *(("update_ratio",) if updates else ()))
    for c in cols:
        table.add_column(c, justify="left" if c in ("name", "dtype", "shape") else "right")
    for r in rows:
        s = r["stats"]
        nonfinite = int(s.get("nonfinite", 0))
        table.add_row(printable(r["name"]), "x".join(map(str, r["shape"])) or "()", r["dtype"], human_bytes(r["nbytes"]),
                      *(fmt_float(s.get(k)) for k in ("norm", "mean", "std", "min", "max")),
                      Text(str(nonfinite), style="red" if nonfinite else ""),
                      *((fmt_float(s.get("update_ratio")),) if updates else ()))
    emit_table(table)
    stderr.print(f"{len(rows)} tensors, {human_bytes(sum(r['nbytes'] for r in rows))}")


def show(data: dict[str, Any], values: Any) -> None:
    stdout.print(Text.assemble((printable(data["name"]), "bold"), f" at {printable(data['store'])}@{data['branch']}:{data['step']}  "
                               f"{data['dtype']} {list(data['shape'])}  {human_bytes(data['nbytes'])}"
                               f"{'' if data['written'] else '  (unchanged from the previous step)'}"))
    st = Table(show_header=False, box=None)
    for k, v in data["stats"].items():
        st.add_row(k, fmt_float(v, 6) if k not in ("numel", "nonfinite") else str(int(v)))
    emit_table(st)
    h = data["histogram"]
    if h["counts"]:
        stdout.print("histogram (finite values):")
        peak = max(h["counts"]) or 1
        for k, n in enumerate(h["counts"]):
            bar = "█" * round(30 * n / peak)
            stdout.print(f"  [{fmt_float(h['edges'][k]):>10}, {fmt_float(h['edges'][k + 1]):>10})  {bar} {n}")
    if h["nonfinite"]:
        stdout.print(f"  {h['nonfinite']} NaN/Inf values", style="red")
    stdout.print(f"values [{data['slice']}]:")
    import numpy as np

    stdout.print(np.array2string(np.asarray(values), threshold=200), markup=False)


def diff_table(a: str, b: str, rows: list[dict[str, Any]], all_rows: list[dict[str, Any]]) -> None:
    """The ``rows`` shown (sorted, maybe cut to a top N); the summary counts ``all_rows``."""
    table = Table(title=f"{printable(a)}  →  {printable(b)}", title_justify="left")
    for c in ("name", "status", "rel_change", "l2_delta", "cosine", "max_abs_delta", "changed"):
        table.add_column(c, justify="left" if c in ("name", "status") else "right")
    colors = {"changed": "yellow", "unchanged": "dim", "added": "green", "removed": "red",
              "shape_changed": "magenta", "dtype_changed": "magenta"}
    for r in rows:
        frac = r["frac_changed"]
        table.add_row(printable(r["name"]), Text(r["status"], style=colors.get(r["status"], "white")),
                      fmt_float(r["rel_change"]), fmt_float(r["l2_delta"]), fmt_float(r["cosine"], 6),
                      fmt_float(r["max_abs_delta"]), "-" if frac is None else f"{100 * frac:.1f}%")
    emit_table(table)
    counts: dict[str, int] = {}
    for r in all_rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    stderr.print(f"{len(all_rows)} tensors: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) +
                 (f"; {len(rows)} shown" if len(rows) != len(all_rows) else ""))


def history(label: str, series: list[dict[str, Any]], points: bool) -> None:
    """``history``'s table: one row per series (a ``store`` column when the series come from several)."""
    stores = any(s.get("store") for s in series)
    table = Table(title=printable(label), title_justify="left")
    for c in (("store",) if stores else ()) + ("tensor", "branch", "points", "first", "last", "min", "max", "trend"):
        table.add_column(c, justify="left" if c in ("store", "tensor", "branch", "trend") else "right")
    for s in series:
        vals = [p["value"] for p in s["points"]]
        fin = [v for v in vals if math.isfinite(v)]
        table.add_row(*((printable(s.get("store", "")),) if stores else ()), printable(s["tensor"]), s["branch"],
                      str(len(vals)), fmt_float(vals[0] if vals else None),
                      fmt_float(vals[-1] if vals else None), fmt_float(min(fin) if fin else None),
                      fmt_float(max(fin) if fin else None), sparkline(vals))
    emit_table(table)
    if points:
        for s in series:
            pt = Table(title=f"{printable(s['tensor'])} ({s['branch']})", title_justify="left")
            for c in ("branch", "step", "value"):
                pt.add_column(c, justify="right" if c != "branch" else "left")
            for p in s["points"]:
                pt.add_row(p["branch"], str(p["step"]), fmt_float(p["value"], 6))
            emit_table(pt)


def events(where: str, evs: list[dict[str, Any]]) -> None:
    """``find``'s detections, one row per step (the tensors and values
    flagged there and why); ``where`` says what was searched ("on branch 'main'")."""
    from dstt.analysis.anomaly import group_by_step

    if not evs:
        stderr.print(f"nothing found {printable(where)}")
        return
    groups = group_by_step(evs)
    table = Table(title=f"first problem at step {groups[0]['step']} ({groups[0]['branch']})", title_justify="left")
    for c in ("step", "branch", "what", "why"):
        table.add_column(c, justify="right" if c == "step" else "left", overflow="fold")
    for g in groups:
        names = g["names"]
        what = ", ".join(printable(n) for n in names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
        table.add_row(str(g["step"]), g["branch"], what, "; ".join(_why(e) for e in _one_per_reason(g["events"])))
    emit_table(table)


def _one_per_reason(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first event of each reason (values and model tensors come first)."""
    seen: dict[str, dict[str, Any]] = {}
    for e in evs:
        seen.setdefault(e["reason"], e)
    return list(seen.values())


def _why(e: dict[str, Any]) -> str:
    """One event in words: ``spike: extra/loss 9.1 (recent high 2.3)``."""
    name, reason = printable(str(e["tensor"])), e["reason"]
    if reason == "nonfinite":
        detail = "NaN/Inf" + ("" if e.get("kind") == "value" else f" ({fmt_float(e['value'])} values)")
    elif reason in ("norm_jump", "value_jump"):
        gap = f" over {e['gap']} steps" if e.get("gap") and e["gap"] > 1 else ""
        detail = f"{fmt_float(e['previous'])} -> {fmt_float(e['value'])}{gap}"
    elif reason == "spike":
        detail = f"{fmt_float(e['value'])} (recent high {fmt_float(e['previous'])})"
    elif reason == "update_jump":
        detail = f"update ratio {fmt_float(e['value'])} (median {fmt_float(e['previous'])})"
    else:
        detail = f"{e['stat']} {fmt_float(e['value'])}"
    return f"{reason}: {name} {detail}"


@contextlib.contextmanager
def progress(label: str, *, enabled: bool = True, unit: str = "bytes") -> Iterator[Callable[..., None]]:
    """The one progress bar of every command: transient, on stderr, shown
    only when stderr is a terminal. Yields ``update(done, total=None,
    what=None)`` (absolute progress; ``total`` None while unknown; ``what``
    replaces the label). ``unit``: ``"bytes"`` (sizes, speed) or
    ``"items"`` (N/M)."""
    if not enabled or not stderr.is_terminal:
        yield lambda done, total=None, what=None: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    counts = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), *counts, TimeRemainingColumn(),
                  console=stderr, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int | None = None, what: str | None = None) -> None:
            bar.update(task, completed=done, total=total, description=escape(what or label))

        yield update
