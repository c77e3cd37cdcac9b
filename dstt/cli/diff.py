"""``dstt diff``: per-tensor difference between two steps, branches or
stores, and the values (hyperparameters, scheduler, extra) that changed.

Reads tensor data as numpy arrays (torch-free), with a progress bar on stderr for long
diffs; rendering lives in :mod:`dstt.cli.render` and :mod:`dstt.cli.values`.
"""

from __future__ import annotations

from typing import Any, List, Optional

import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors, stderr
from dstt.cli.scanopts import EXECUTOR_OPT, WORKERS_OPT, scan_args
from dstt.cli.targets import open_index, target_text


def cmd_diff(ref_a: str, ref_b: str, patterns: list[str], top: Optional[int], sort: str,
             changed_only: bool, threads: int, progress: bool, json_out: bool,
             scan: Optional[dict[str, Any]] = None) -> None:
    """Compare REF_A with REF_B (``REF_B`` may be relative to REF_A's store)."""
    from dstt.analysis.diff import sort_rows
    from dstt.analysis.select import resolve_point
    from dstt.cli.values import diff_values, render_value_diff

    run, _ = open_index(ref_a)
    pa = resolve_point(run, run.default_step)
    pb = resolve_point(run, ref_b)
    if pa == pb:
        stderr.print("note: both references name the same step")
    rows = _tensor_rows(pa, pb, patterns, threads, progress, scan or {})
    value_rows = diff_values(pa, pb, patterns)
    if patterns and not rows and not value_rows:
        from dstt.errors import TensorNotFoundError

        raise TensorNotFoundError(f"no tensor matches {' '.join(patterns)!r} on either side (nor any value)")
    all_rows = rows
    if changed_only:
        rows = [r for r in rows if r["status"] != "unchanged"]
    rows = _shown(sort_rows(rows, sort), sort, top)
    a, b = target_text(pa[0].url, pa[1], pa[2]), target_text(pb[0].url, pb[1], pb[2])
    if json_out:
        emit_json({"a": a, "b": b, "tensors": rows, "values": value_rows})
    else:
        if rows or not value_rows:
            from dstt.cli import render

            render.diff_table(a, b, rows, all_rows)
        render_value_diff(value_rows)


def _tensor_rows(pa: Any, pb: Any, patterns: list[str], threads: int, progress: bool,
                 scan: dict[str, Any]) -> list[dict[str, Any]]:
    """The diff rows of every tensor, with the progress bar when the diff
    reads enough bytes to show one."""
    from dstt.analysis.diff import bytes_to_read, diff_points
    from dstt.cli import render

    total = bytes_to_read(pa, pb, patterns)
    with render.progress("diff", enabled=progress and total >= render.PROGRESS_MIN_BYTES) as update:
        done = [0]

        def advance(nbytes: int) -> None:  # diff_points reports increments
            done[0] += nbytes
            update(done[0], total)

        return diff_points(pa, pb, patterns, progress=advance, threads=threads, **scan)


def _shown(rows: list[dict[str, Any]], sort: str, top: Optional[int]) -> list[dict[str, Any]]:
    """Sorted rows in sections -- model tensors first, then the rest,
    optimizer state last (Adam's step counters change by 100% every step
    and would crowd out every weight) -- cut to ``top``."""
    from dstt.analysis.values import section_sorted

    if sort != "name":
        rows = section_sorted(rows)
    return rows[:top] if top is not None else rows


def register(app: typer.Typer) -> None:
    @app.command("diff")
    @handle_errors
    def diff(
        ref_a: str = typer.Argument(..., metavar="REF_A", help="STORE[@BRANCH][:STEP]."),
        ref_b: str = typer.Argument(..., metavar="REF_B", help="STORE[@BRANCH][:STEP], or ':STEP' / '@BRANCH[:STEP]' in REF_A's store."),
        patterns: Optional[List[str]] = typer.Argument(None, metavar="[TENSOR_GLOB]...", help="Only tensors matching these globs."),
        top: Optional[int] = typer.Option(None, "--top", min=0, help="Show only the N most changed."),
        sort: str = typer.Option("rel_change", help="rel_change, l2_delta, max_abs_delta, frac_changed, cosine, name or status."),
        changed_only: bool = typer.Option(False, "--changed", help="Hide unchanged tensors."),
        threads: int = typer.Option(2, min=1, help="Reader threads (when the diff runs in this process)."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr for long diffs."),
        workers: Optional[int] = WORKERS_OPT,
        executor: Optional[str] = EXECUTOR_OPT,
        json_out: bool = JSON_OPT,
    ) -> None:
        """Per-tensor difference between two steps, branches or stores."""
        cmd_diff(ref_a, ref_b, patterns or [], top, sort, changed_only, threads, progress, json_out,
                 scan_args(workers, executor))
