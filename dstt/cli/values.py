"""Non-tensor values in ``dstt show``, ``dstt diff`` and ``dstt history``:
learning rates and every other hyperparameter, scheduler state, ``extra``
values. The commands (:mod:`dstt.cli.show`, :mod:`dstt.cli.diff`,
:mod:`dstt.cli.history`) call these when a name is a value path
(``optim/param_groups/0/lr``) rather than a tensor. Torch-free.
"""

from __future__ import annotations

import json
import math
from typing import Any

from rich.table import Table
from rich.text import Text

from dstt.analysis.values import (
    flatten_values,
    get_value,
    has_value,
    numeric,
    step_tree,
    value_history,
)
from dstt.cli.output import emit_json, fmt_float, stderr


def _text(v: Any) -> str:
    if isinstance(v, float):
        return fmt_float(v, 6)
    if isinstance(v, (dict, list)):
        s = json.dumps(v, default=str)
        return s if len(s) <= 80 else s[:77] + "..."
    return str(v)


def _emit(table: Table) -> None:
    from dstt.cli.render import emit_table

    emit_table(table)


def show_value(target: str, path: str, json_out: bool) -> bool:
    """``dstt show REF PATH`` for a value path: print it (a table of leaves
    for a subtree) and return True; False when ``path`` is not a value (a
    tensor, or nothing: the tensor code path reports that)."""
    from dstt.format.index import RunIndex

    run = RunIndex(target)
    branch, step = run.resolve()
    rec = run.record(step, branch=branch)
    if path in rec.by_name:
        return False
    tree = rec.objects
    if not has_value(tree, path):
        parent = path.strip("/").rsplit("/", 1)[0]
        if "/" in path.strip("/") and not any(n.startswith(parent + "/") for n in rec.names):
            get_value(tree, path)  # inside the value tree: its error names what is there
        return False
    value = get_value(tree, path)
    if json_out:
        emit_json({"store": run.url, "branch": branch, "step": step, "name": path, "value": value})
        return True
    leaves = flatten_values(_subtree(tree, path), prefix=path.strip("/"))
    table = Table(title=f"{run.url}@{branch}:{step}  {path}", title_justify="left")
    table.add_column("value path")
    table.add_column("value", justify="right")
    for p, v in leaves.items():
        table.add_row(p, _text(v))
    _emit(table)
    return True


def _subtree(tree: Any, path: str) -> Any:
    """The raw node at ``path`` (known to exist)."""
    from dstt.analysis.values import _children

    node = tree
    for part in [p for p in path.strip("/").split("/") if p]:
        for name, child in _children(node) or []:
            if name == part:
                node = child
                break
    return node


def diff_values(pa: Any, pb: Any, patterns: list[str]) -> list[dict[str, Any]]:
    """Value rows between two resolved points ``(run, branch, step)``."""
    from dstt.analysis.values import value_diff

    return value_diff(step_tree(pa[0], pa[2], pa[1]), step_tree(pb[0], pb[2], pb[1]), patterns)


def render_value_diff(rows: list[dict[str, Any]]) -> None:
    if not rows:
        stderr.print("values: none changed")
        return
    table = Table(title="values (hyperparameters, scheduler, extra)", title_justify="left")
    for c in ("value path", "status", "a", "b"):
        table.add_column(c, justify="left" if c in ("value path", "status") else "right")
    colors = {"changed": "yellow", "added": "green", "removed": "red"}
    for r in rows:
        table.add_row(r["path"], Text(r["status"], style=colors.get(r["status"], "white")),
                      "-" if r["status"] == "added" else _text(r["a"]),
                      "-" if r["status"] == "removed" else _text(r["b"]))
    _emit(table)


def value_paths(run: Any, branch: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Split ``names`` into (value paths, the rest) by the latest step of
    ``branch``: a name is a value path when it names a value or subtree
    there, or is a glob matching only values."""
    from dstt.analysis.select import is_glob, match_names

    rec = run.record("latest", branch=branch)
    flat = None
    values, rest = [], []
    for n in names:
        if n in rec.by_name:
            rest.append(n)
        elif has_value(rec.objects, n):
            values.append(n)
        elif is_glob(n):
            flat = flat if flat is not None else list(flatten_values(rec.objects))
            (values if match_names(flat, [n]) and not match_names(rec.names, [n]) else rest).append(n)
        else:
            rest.append(n)
    return values, rest


def value_series(run: Any, paths: list[str], branches: list[str], ancestry: bool) -> list[dict[str, Any]]:
    """History series of value paths (leaves under a subtree path included)."""
    from dstt.analysis.history import to_series

    series = []
    for b in branches:
        pats = []
        for p in paths:
            if any(c in p for c in "*?["):
                pats.append(p)
                continue
            sub = get_value(step_tree(run, "latest", b), p)
            pats.append(p.rstrip("/") + "/*" if isinstance(sub, (dict, list)) else p)
        for s in to_series(value_history(run, pats, b, ancestry=ancestry)):
            series.append({"tensor": s["tensor"], "branch": b, "points": s["points"]})
    return series


def render_value_history(series: list[dict[str, Any]], points: bool) -> None:
    """Numeric series as the tensor history table; others as their changes."""
    from dstt.cli import render

    nums = [s for s in series if all(numeric(p["value"]) is not None for p in s["points"])]
    others = [s for s in series if s not in nums]
    if nums:
        render.history("value", [{**s, "points": [{**p, "value": float(p["value"])} for p in s["points"]]}
                                 for s in nums], points)
    if not others:
        return
    table = Table(title="values that are not numbers: each change", title_justify="left")
    for c in ("value path", "branch", "step", "value"):
        table.add_column(c, justify="right" if c == "step" else "left")
    for s in others:
        last: Any = object()
        for p in s["points"]:
            if points or p["value"] != last:
                table.add_row(s["tensor"], p["branch"], str(p["step"]), _text(p["value"]))
            last = p["value"]
    _emit(table)


def plot_points(series: list[dict[str, Any]]) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, values) of the numeric series, for the line plot."""
    out = []
    for s in series:
        vals = [numeric(p["value"]) for p in s["points"]]
        if vals and all(v is not None for v in vals):
            out.append((s["tensor"], [p["step"] for p in s["points"]], [float(v) if v is not None else math.nan
                                                                         for v in vals]))
    return out
