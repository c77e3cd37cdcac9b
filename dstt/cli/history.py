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
                log_y: bool = False, panels: bool = False, marks: bool = True, stores: list[str] | None = None,
                rewrite_plot: bool = False, metric: Optional[str] = None,
                scan: Optional[dict[str, Any]] = None) -> None:
    """The history of TENSOR... (names, globs or value paths) on each branch,
    of STORE and of every ``--store`` beside it (each series then names its store);
    with ``metric``, of a metric of the data (read where the stats hold it)."""
    from dstt.analysis.history import stat_column

    if metric is not None:
        from dstt.analysis.metrics import check_metric

        stat = check_metric(metric)
    else:
        stat_column(stat)
    if plot is not None and not rewrite_plot:  # a bad path, format or a missing matplotlib: one line, before any work
        _check_plot(plot)
    targets = [target, *(stores or [])]
    runs: dict[str, RunIndex] = {}
    vseries: list[dict[str, Any]] = []
    tseries: list[dict[str, Any]] = []
    for t in targets:
        run, got_v, got_t = _one_store(t, tensors, stat, branches, delta, ancestry, metric, scan, json_out)
        label = store_label(run.url, [r.url for r in runs.values()] + [run.url]) if len(targets) > 1 else ""
        runs[label] = run
        vseries += [{**s, "store": label} if label else s for s in got_v]
        tseries += [{**s, "store": label} if label else s for s in got_t]
    if stat in ("update_norm", "update_ratio") and tseries and not any(
            p["value"] == p["value"] for s in tseries for p in s["points"]):
        stderr.print(f"warning: no {stat} was recorded for these steps: a Capture records them for every "
                     "step after its first (dstt.save, one step at a time, does not); the lines are empty")
    title = ", ".join(r.url for r in runs.values())
    label_ = f"{'relative change of ' if delta else ''}{stat}"
    if plot is not None:
        from dstt.analysis.plot import history_plot

        if tseries:
            history_plot(runs, tseries, plot, label=label_, log_y=log_y, panels=panels, marks=marks, title=title)
        else:
            from dstt.cli import values as V

            history_plot(runs, V.numeric_series(vseries), plot, label="value", log_y=log_y, panels=panels,
                         marks=marks, title=title)
        stderr.print(f"wrote {plot}")
    if json_out:
        if tseries or not vseries:
            emit_json({"stat": stat, "delta": delta, "series": tseries,
                       **({"values": vseries} if vseries else {})})
        else:
            emit_json({"stat": "value", "delta": False, "series": vseries})
        return
    if vseries:
        from dstt.cli import values as V

        V.render_value_history(vseries, points)
    if tseries or not vseries:
        from dstt.cli import render

        render.history(label_, tseries, points)


def store_label(url: str, urls: list[str]) -> str:
    """A short name for a store among several: its last path part, longer
    where two would read the same.

    >>> store_label("/r/a/run", ["/r/a/run", "/r/b/run"]), store_label("/x/lr-0.1", ["/x/lr-0.1", "/x/lr-1"])
    ('a/run', 'lr-0.1')
    """
    parts = str(url).rstrip("/").split("/")
    for k in range(1, len(parts) + 1):
        name = "/".join(parts[-k:])
        if sum(1 for u in urls if "/".join(str(u).rstrip("/").split("/")[-k:]) == name) <= urls.count(url):
            return name
    return str(url)


def _one_store(target: str, tensors: list[str], stat: str, branches: list[str], delta: bool,
               ancestry: bool, metric: Optional[str] = None, scan: Optional[dict[str, Any]] = None,
               json_out: bool = False) -> tuple[RunIndex, list[dict[str, Any]], list[dict[str, Any]]]:
    """(run, value series, tensor series) of one STORE[@BRANCH]; with
    ``metric``, the tensors' series are computed from their data (a progress
    bar while it reads)."""
    from dstt.cli import values as V
    from dstt.errors import InvalidReferenceError

    run, ref = open_index(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"history takes STORE[@BRANCH], not a step: got {target!r}")
    if metric is not None:  # reads tensor data: the torch reader
        from dstt.cli.targets import open_tensors

        run = open_tensors(target)
    bs = branches or [ref.branch or run.default_branch]
    value_names, names = V.value_paths(run, bs[0], tensors)
    vseries = V.value_series(run, value_names, bs, ancestry) if value_names else []
    if not names:
        return run, vseries, []
    if metric is None:
        return run, vseries, tensor_series(run, names, stat, bs, delta, ancestry, scan)
    from dstt.cli import render

    with render.progress(f"computing {metric}", enabled=not json_out) as update:
        done = [0]

        def advance(nbytes: int) -> None:
            done[0] += nbytes
            update(done[0])

        return run, vseries, tensor_series(run, names, stat, bs, delta, ancestry, {**(scan or {}), "progress": advance})


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
        stores: Optional[List[str]] = typer.Option(None, "--store", "-s", metavar="STORE[@BRANCH]", help="Another store to compare (repeatable): its series beside STORE's, each labelled with its store."),
        delta: bool = typer.Option(False, "--delta", help="Relative change between consecutive captured steps."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Also write a line plot here: .png, .svg or .pdf (needs matplotlib: pip install 'dstt[plot]')."),
        log_y: bool = typer.Option(False, "--log-y", help="Plot with a logarithmic y axis."),
        panels: bool = typer.Option(False, "--panels", help="Plot one panel per tensor instead of overlaying them."),
        marks: bool = typer.Option(True, "--marks/--no-marks", help="Mark fork points and find's detections on the plot."),
        points: bool = typer.Option(False, "--points", help="Print every point, not just the summary."),
        follow: bool = typer.Option(False, "--follow", "-F", help="Show it again (and rewrite --plot) each time a step commits; Ctrl-C to stop."),
        interval: float = typer.Option(2.0, "--interval", help="With --follow: seconds between looks at the store."),
        ancestry: bool = typer.Option(True, "--ancestry/--no-ancestry", help="Include parent branches' steps up to the fork."),
        metric: Optional[str] = typer.Option(
            None, "--metric",
            help="A metric of the data instead of a stat: rms, absmax (from the stats where they hold it), "
                 "sparsity, l1, spectral_norm, stable_rank (read from the tensors, on --workers/--executor)."),
        workers: Optional[int] = WORKERS_OPT,
        executor: Optional[str] = EXECUTOR_OPT,
        json_out: bool = JSON_OPT,
    ) -> None:
        """A stat of tensors (or values: extra/loss, learning rates) across steps, from the step index (no tensor reads); --store compares runs side by side."""
        shown: list[bool] = []

        def show() -> None:  # following: the plot written the first time is rewritten, not refused
            cmd_history(target, tensors, stat, branches or [], delta, plot, points, ancestry, json_out,
                        log_y=log_y, panels=panels, marks=marks, stores=stores or [], rewrite_plot=bool(shown),
                        metric=metric, scan=scan_args(workers, executor))
            shown.append(True)

        if follow:
            from dstt.cli.follow import follow as follow_

            follow_(show, target, interval=interval, json_out=json_out)
            return
        show()
