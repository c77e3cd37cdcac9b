"""``dstt history``: a stat of tensors across steps -- or the values of
hyperparameters, scheduler state and ``extra`` values -- from the step
index (no tensor reads, torch-free), as a table, JSON or a plot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors, stderr
from dstt.cli.scanopts import EXECUTOR_OPT, WORKERS_OPT, scan_args
from dstt.cli.targets import open_index

if TYPE_CHECKING:
    from dstt.format.index import RunIndex


def cmd_history(target: str, tensors: list[str], stat: str, branches: list[str], delta: bool,
                plot: Optional[Path], points: bool, ancestry: bool, json_out: bool,
                log_y: bool = False, panels: bool = False, marks: bool = True,
                metric: Optional[str] = None, scan: Optional[dict[str, Any]] = None) -> None:
    """The history of TENSOR... (names, globs or value paths) on each branch;
    with ``metric``, of a metric of the data (read where the stats hold it)."""
    from dstt.analysis.history import stat_column
    from dstt.cli import values as V
    from dstt.errors import InvalidReferenceError

    if metric is not None:
        from dstt.analysis.metrics import check_metric

        stat = check_metric(metric)
    else:
        stat_column(stat)
    if plot is not None:  # a bad path, format or a missing matplotlib: one line, before any work
        _check_plot(plot)
    run, ref = open_index(target)
    if metric is not None:  # reads tensor data: the torch reader
        from dstt.cli.targets import open_tensors

        run = open_tensors(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"history takes STORE[@BRANCH], not a step: got {target!r}")
    branches = branches or [run.default_branch]
    value_names, tensors = V.value_paths(run, branches[0], tensors)
    if value_names:  # learning rates, scheduler state, extra values: their values over the steps
        vseries = V.value_series(run, value_names, branches, ancestry)
        if plot is not None and not tensors:
            from dstt.analysis.plot import line_plot

            line_plot(V.plot_points(vseries), str(plot), title=f"value - {run.url}", log_y=log_y)
            stderr.print(f"wrote {plot}")
        if not tensors:
            if json_out:
                emit_json({"stat": "value", "delta": False, "series": vseries})
            else:
                V.render_value_history(vseries, points)
            return
        if not json_out:
            V.render_value_history(vseries, points)
    if metric is None:
        series = tensor_series(run, tensors, stat, branches, delta, ancestry, scan)
    else:  # reads tensor data: a progress bar while it does
        from dstt.cli import render

        with render.progress(f"computing {metric}", enabled=not json_out) as update:
            done = [0]

            def advance(nbytes: int) -> None:
                done[0] += nbytes
                update(done[0])

            series = tensor_series(run, tensors, stat, branches, delta, ancestry, {**(scan or {}), "progress": advance})
    label = f"{'relative change of ' if delta else ''}{stat}"
    if plot is not None:
        from dstt.analysis.plot import history_plot

        history_plot(run, series, plot, label=label, log_y=log_y, panels=panels, marks=marks)
        stderr.print(f"wrote {plot}")
    if json_out:
        emit_json({"stat": stat, "delta": delta, "series": series})
    else:
        from dstt.cli import render

        render.history(label, series, points)


def _check_plot(plot: Path) -> None:
    """Refuse a plot file we could not write, before any work."""
    from dstt.analysis.plot import plot_format, require_matplotlib
    from dstt.format.outpath import check_output_file

    check_output_file(plot, "plot")
    plot_format(plot)
    require_matplotlib()


def tensor_series(run: RunIndex, tensors: list[str], stat: str, branches: list[str], delta: bool,
                  ancestry: bool, scan: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """``[{"tensor", "branch", "points"}]``: one series per tensor and branch
    (``scan``: where a metric of the data is computed)."""
    from dstt.analysis.history import history, to_series

    series = []
    for b in branches:
        for s in to_series(history(run, tensors, stat, b, delta=delta, ancestry=ancestry, **(scan or {}))):
            series.append({"tensor": s["tensor"], "branch": b, "points": s["points"]})
    return series


def register(app: typer.Typer) -> None:
    @app.command("history")
    @handle_errors
    def history(
        target: str = typer.Argument(..., metavar="STORE", help="STORE[@BRANCH]."),
        tensors: List[str] = typer.Argument(..., metavar="TENSOR...", help="Tensor names or globs."),
        stat: str = typer.Option("norm", help="norm, mean, std, min, max, nonfinite, numel, update_norm (|θ_k - θ_k-1|) or update_ratio (update_norm / norm)."),
        branches: Optional[List[str]] = typer.Option(None, "--branch", "-b", help="Branch (repeatable; default: the reference's or main)."),
        delta: bool = typer.Option(False, "--delta", help="Relative change between consecutive captured steps."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Also write a line plot here: .png, .svg or .pdf (needs matplotlib: pip install 'dstt[plot]')."),
        log_y: bool = typer.Option(False, "--log-y", help="Plot with a logarithmic y axis."),
        panels: bool = typer.Option(False, "--panels", help="Plot one panel per tensor instead of overlaying them."),
        marks: bool = typer.Option(True, "--marks/--no-marks", help="Mark fork points and find's detections on the plot."),
        points: bool = typer.Option(False, "--points", help="Print every point, not just the summary."),
        ancestry: bool = typer.Option(True, "--ancestry/--no-ancestry", help="Include parent branches' steps up to the fork."),
        metric: Optional[str] = typer.Option(
            None, "--metric",
            help="A metric of the data instead of a stat: rms, absmax (from the stats where they hold it), "
                 "sparsity, l1, spectral_norm, stable_rank (read from the tensors, on --workers/--executor)."),
        workers: Optional[int] = WORKERS_OPT,
        executor: Optional[str] = EXECUTOR_OPT,
        json_out: bool = JSON_OPT,
    ) -> None:
        """A stat of tensors across steps, from the step index (no tensor reads); --metric reads the data."""
        cmd_history(target, tensors, stat, branches or [], delta, plot, points, ancestry, json_out,
                    log_y=log_y, panels=panels, marks=marks, metric=metric, scan=scan_args(workers, executor))
