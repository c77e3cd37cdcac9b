"""``dstt ls / show / diff / history / find``: inspecting a captured run.

Thin commands over :mod:`dstt.analysis`; rendering lives in
:mod:`dstt.cli.render`. References are ``STORE[@BRANCH][:STEP]`` (see
docs/cli.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, stderr

JSON_OPT = typer.Option(False, "--json", help="Machine-readable output on stdout.")


def _open(text: str, tensors: bool = False) -> tuple[Any, Any]:
    """(reader, Ref) for a reference string: a torch-free
    :class:`~dstt.format.index.RunIndex`, or with ``tensors`` a
    :class:`~dstt.store.reader.TensorReader` (imports torch)."""
    from dstt.format.refs import Ref

    ref = Ref.parse(text)
    if tensors:
        from dstt.store.reader import TensorReader

        return TensorReader(text), ref
    from dstt.format.index import RunIndex

    return RunIndex(text), ref


def _ref_text(run: Any, branch: str, step: int) -> str:
    return f"{run.url}@{branch}:{step}"


def cmd_ls(target: str, patterns: list[str], sort: str, reverse: bool, limit: int, json_out: bool) -> None:
    from dstt.analysis.listing import list_store, list_tensors
    from dstt.cli import render

    run, ref = _open(target)
    if ref.step is None:
        if patterns:
            from dstt.errors import ConfigError

            raise ConfigError("tensor patterns need a step: use STORE[@BRANCH]:STEP (e.g. 'run:latest')")
        branches = list_store(run, ref.branch)
        if json_out:
            emit_json({"store": run.url, "branches": branches})
        else:
            render.store_listing(run.url, branches, limit)
        return
    branch, step = run.resolve()
    rows = list_tensors(run, step, branch, patterns, sort, reverse)
    if json_out:
        emit_json({"store": run.url, "step": step, "branch": branch, "tensors": rows})
    else:
        render.tensor_listing(_ref_text(run, branch, step), rows)


def cmd_show(target: str, tensor: str, slice_text: Optional[str], bins: int, json_out: bool) -> None:
    from dstt.analysis.history import histogram
    from dstt.analysis.select import parse_slice
    from dstt.cli import render
    from dstt.cli.values import show_value

    if show_value(target, tensor, json_out):  # a value path: optim/param_groups/0/lr, extra/loss, ...
        return
    run, _ = _open(target, tensors=True)
    branch, step = run.resolve()
    e = run.entry(tensor, step, branch=branch)
    index: Any = parse_slice(slice_text) if slice_text else _preview_index(e.shape)
    values = run.read(tensor, step, branch=branch, index=index)
    hist = histogram(run, tensor, step, branch, bins)
    data = {"store": run.url, "branch": branch, "step": step, "name": tensor, "shape": list(e.shape),
            "dtype": e.dtype.logical, "nbytes": e.nbytes, "written": e.written, "stats": dict(e.stats),
            "histogram": hist, "slice": slice_text or _index_text(index),
            "values": _to_list(values)}
    if json_out:
        emit_json(data)
    else:
        render.show(data, values)


def _preview_index(shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The first few values: leading rows and columns."""
    if not shape:
        return ()
    if len(shape) == 1:
        return (slice(0, 8),)
    return (slice(0, 4),) + (0,) * (len(shape) - 2) + (slice(0, 8),)


def _index_text(index: tuple[Any, ...]) -> str:
    def one(x: Any) -> str:
        if isinstance(x, slice):
            return f"{'' if x.start is None else x.start}:{'' if x.stop is None else x.stop}"
        return "..." if x is Ellipsis else str(x)

    return ",".join(one(x) for x in index)


def _to_list(t: Any) -> Any:
    import torch

    if t.is_complex():
        return [[float(z.real), float(z.imag)] for z in t.reshape(-1).tolist()] if t.dim() else [t.real.item(), t.imag.item()]
    if t.dtype not in (torch.float64, torch.float32, torch.bool) and t.is_floating_point():
        t = t.to(torch.float64)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        t = t.to(torch.int64) if t.dtype != torch.uint64 else t.to(torch.float64)
    return t.tolist()


def cmd_diff(ref_a: str, ref_b: str, patterns: list[str], top: Optional[int], sort: str,
             changed_only: bool, threads: int, progress: bool, json_out: bool) -> None:
    from dstt.analysis.diff import bytes_to_read, diff_points, sort_rows
    from dstt.analysis.select import resolve_point
    from dstt.cli import render

    run, _ = _open(ref_a, tensors=True)
    pa = resolve_point(run, run.default_step)
    pb = resolve_point(run, ref_b)
    if pa == pb:
        stderr.print("note: both references name the same step")
    total = bytes_to_read(pa, pb, patterns)
    with render.progress("diff", enabled=progress and total >= render.PROGRESS_MIN_BYTES) as update:
        done = [0]

        def advance(nbytes: int) -> None:  # diff_points reports increments
            done[0] += nbytes
            update(done[0], total)

        rows = diff_points(pa, pb, patterns, progress=advance, threads=threads)
    from dstt.analysis.values import section_sorted
    from dstt.cli.values import diff_values, render_value_diff

    value_rows = diff_values(pa, pb, patterns)
    if patterns and not rows and not value_rows:
        from dstt.errors import TensorNotFoundError

        raise TensorNotFoundError(f"no tensor matches {' '.join(patterns)!r} on either side (nor any value)")
    all_rows = rows
    if changed_only:
        rows = [r for r in rows if r["status"] != "unchanged"]
    # Model tensors first, then the rest, optimizer state last (Adam's step
    # counters change by 100% every step and would crowd out every weight).
    rows = sort_rows(rows, sort)
    if sort != "name":
        rows = section_sorted(rows)
    rows = rows[:top] if top is not None else rows
    a, b = _ref_text(pa[0], pa[1], pa[2]), _ref_text(pb[0], pb[1], pb[2])
    if json_out:
        emit_json({"a": a, "b": b, "tensors": rows, "values": value_rows})
    else:
        if rows or not value_rows:
            render.diff_table(a, b, rows, all_rows)
        render_value_diff(value_rows)


def cmd_history(target: str, tensors: list[str], stat: str, branches: list[str], delta: bool,
                plot: Optional[Path], points: bool, ancestry: bool, json_out: bool,
                log_y: bool = False, panels: bool = False, marks: bool = True) -> None:
    from dstt.analysis.history import history, stat_column, to_series
    from dstt.cli import render
    from dstt.errors import InvalidReferenceError
    from dstt.format.outpath import check_output_file

    stat_column(stat)
    if plot is not None:  # a bad path, format or a missing matplotlib: one line, before any work
        from dstt.analysis.plot import plot_format, require_matplotlib

        check_output_file(plot, "plot")
        plot_format(plot)
        require_matplotlib()
    run, ref = _open(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"history takes STORE[@BRANCH], not a step: got {target!r}")
    from dstt.cli import values as V

    value_names, tensors = V.value_paths(run, (branches or [run.default_branch])[0], tensors)
    if value_names:  # learning rates, scheduler state, extra values: their values over the steps
        vseries = V.value_series(run, value_names, branches or [run.default_branch], ancestry)
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
    series = []
    for b in branches or [run.default_branch]:
        for s in to_series(history(run, tensors, stat, b, delta=delta, ancestry=ancestry)):
            series.append({"tensor": s["tensor"], "branch": b, "points": s["points"]})
    label = f"{'relative change of ' if delta else ''}{stat}"
    if plot is not None:
        from dstt.analysis.plot import history_plot

        history_plot(run, series, plot, label=label, log_y=log_y, panels=panels, marks=marks)
        stderr.print(f"wrote {plot}")
    if json_out:
        emit_json({"stat": stat, "delta": delta, "series": series})
    else:
        render.history(label, series, points)


def _incidents(run: Any, branch: Optional[str]) -> list[dict[str, Any]]:
    """Recorded incidents (of ``branch``, or every branch) as plain data."""
    from dstt.format.incidents import list_incidents

    return [i.to_dict() for i in list_incidents(run.backend, branch)]


def _render_incidents(incidents: list[dict[str, Any]]) -> None:
    from dstt.cli import render

    if incidents:
        render.incidents_table(f"{len(incidents)} recorded incident(s)", incidents)
    else:
        stderr.print("no incidents recorded")


def cmd_find(target: str, tensors: list[str], branch: Optional[str], nonfinite: Optional[bool],
             jump: Optional[float], stat: Optional[str], gt: Optional[float], lt: Optional[float],
             all_steps: bool, json_out: bool, diverge: list[str] | None = None,
             update_jump: Optional[float] = None) -> None:
    from dstt.analysis.anomaly import find
    from dstt.cli import render
    from dstt.cli.output import stdout
    from dstt.errors import InvalidReferenceError

    run, ref = _open(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"find takes STORE[@BRANCH], not a step: got {target!r}")
    if diverge:
        from dstt.analysis.branches import first_divergence

        if len(diverge) > 2:
            from dstt.errors import ConfigError

            raise ConfigError("--diverge takes one branch (compared with --branch or main) or two")
        a, b2 = (diverge[0], diverge[1]) if len(diverge) == 2 else (branch or ref.branch or "main", diverge[0])
        d = first_divergence(run, a, b2)
        if json_out:
            emit_json(d)
        else:
            fork = f"share steps up to {d['fork'][0]}:{d['fork'][1]}" if d["fork"] else "share no step"
            where = (f"first differ at step {d['step']} ({len(d['tensors'])} tensors: "
                     f"{', '.join(d['tensors'][:5])}{', ...' if len(d['tensors']) > 5 else ''})"
                     if d["step"] is not None else "never differ on the steps both captured")
            stdout.print(f"{a} and {b2} {fork}; they {where}")
        return
    if nonfinite is None and jump is None and stat is None and gt is None and lt is None and update_jump is None:
        nonfinite, jump, update_jump = True, 10.0, 10.0
    checks = {"nonfinite": bool(nonfinite), "jump": jump, "stat": stat, "gt": gt, "lt": lt,
              "update_jump": update_jump}
    if branch is None and ref.branch is None:  # every branch, unless told otherwise
        from dstt.analysis.branches import find_branches

        per = find_branches(run, tensors, first=not all_steps, **checks)
        events = sorted((e for evs in per.values() for e in evs), key=lambda e: (e["step"], e["branch"]))
        firsts = {b: (evs[0]["step"] if evs else None) for b, evs in per.items()}
        incidents = _incidents(run, None)
        if json_out:
            emit_json({"branch": None, "branches": firsts, "first_step": events[0]["step"] if events else None,
                       "events": events, "incidents": incidents})
        else:
            render.events(f"on any of {len(per)} branch(es)", events)
            _render_incidents(incidents)
        return
    b = branch or run.default_branch
    events = find(run, tensors, b, first=not all_steps, **checks)
    first = events[0]["step"] if events else None
    incidents = _incidents(run, b)
    if json_out:
        emit_json({"branch": b, "first_step": first, "events": events, "incidents": incidents})
    else:
        render.events(f"on branch {b!r}", events)
        _render_incidents(incidents)


def register(app: typer.Typer) -> None:
    @app.command("ls")
    @handle_errors
    def ls(
        target: str = typer.Argument(..., metavar="STORE|REF", help="A store (lists branches and steps) or STORE[@BRANCH]:STEP (lists tensors)."),
        patterns: Optional[List[str]] = typer.Argument(None, metavar="[TENSOR_GLOB]...", help="Only tensors matching these globs."),
        sort: str = typer.Option("name", help="Sort tensors by name, nbytes, numel, dtype, written, nonfinite, norm, mean, std, min, max, update_norm, update_ratio."),
        reverse: bool = typer.Option(False, "--reverse", "-r", help="Reverse the sort."),
        limit: int = typer.Option(20, min=0, help="Steps shown per branch in the table (0: all); --json lists all."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """List a store's branches and steps, or the tensors at a step."""
        cmd_ls(target, patterns or [], sort, reverse, limit, json_out)

    @app.command("show")
    @handle_errors
    def show(
        target: str = typer.Argument(..., metavar="REF", help="STORE[@BRANCH][:STEP] (default step: latest)."),
        tensor: str = typer.Argument(..., help="Tensor name, e.g. model/layers.0.weight."),
        slice_text: Optional[str] = typer.Option(None, "--slice", help="Values to print, NumPy style: '0:4,:'."),
        bins: int = typer.Option(20, min=1, max=200, help="Histogram bins."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Stats, a value histogram and some values of one tensor."""
        cmd_show(target, tensor, slice_text, bins, json_out)

    @app.command("diff")
    @handle_errors
    def diff(
        ref_a: str = typer.Argument(..., metavar="REF_A", help="STORE[@BRANCH][:STEP]."),
        ref_b: str = typer.Argument(..., metavar="REF_B", help="STORE[@BRANCH][:STEP], or ':STEP' / '@BRANCH[:STEP]' in REF_A's store."),
        patterns: Optional[List[str]] = typer.Argument(None, metavar="[TENSOR_GLOB]...", help="Only tensors matching these globs."),
        top: Optional[int] = typer.Option(None, "--top", min=0, help="Show only the N most changed."),
        sort: str = typer.Option("rel_change", help="rel_change, l2_delta, max_abs_delta, frac_changed, cosine, name or status."),
        changed_only: bool = typer.Option(False, "--changed", help="Hide unchanged tensors."),
        threads: int = typer.Option(2, min=1, help="Reader threads."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr for long diffs."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Per-tensor difference between two steps, branches or stores."""
        cmd_diff(ref_a, ref_b, patterns or [], top, sort, changed_only, threads, progress, json_out)

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
        json_out: bool = JSON_OPT,
    ) -> None:
        """A stat of tensors across steps, from the step index (no tensor reads)."""
        cmd_history(target, tensors, stat, branches or [], delta, plot, points, ancestry, json_out,
                    log_y=log_y, panels=panels, marks=marks)

    @app.command("find")
    @handle_errors
    def find(
        target: str = typer.Argument(..., metavar="STORE", help="STORE[@BRANCH]."),
        tensors: Optional[List[str]] = typer.Argument(None, metavar="[TENSOR_GLOB]...", help="Only these tensors."),
        branch: Optional[str] = typer.Option(None, "--branch", "-b", help="Only this branch (default: the reference's, else every branch)."),
        nonfinite: Optional[bool] = typer.Option(None, "--nonfinite/--no-nonfinite", help="Look for NaN/Inf values."),
        jump: Optional[float] = typer.Option(None, "--jump", help="Look for a norm change of more than this factor between captured steps."),
        update_jump: Optional[float] = typer.Option(None, "--update-jump", help="Look for an update ratio (|θ_k - θ_k-1| / |θ_k|) above this factor times the median of the tensor's previous 8."),
        stat: Optional[str] = typer.Option(None, "--stat", help="Stat for --gt/--lt (default norm)."),
        gt: Optional[float] = typer.Option(None, "--gt", help="Look for the stat above this value."),
        lt: Optional[float] = typer.Option(None, "--lt", help="Look for the stat below this value."),
        all_steps: bool = typer.Option(False, "--all", help="Every matching step, not only the first."),
        diverge: Optional[List[str]] = typer.Option(None, "--diverge", metavar="BRANCH", help="Instead: the first step where BRANCH differs from --branch (or main); give it twice to compare two branches."),
        json_out: bool = JSON_OPT,
    ) -> None:
        """Find the first step where something went wrong, or where two branches first differ.

        Default: NaN/Inf, a 10x norm jump or a 10x jump of the update ratio, on every branch unless STORE@BRANCH or --branch names one. Incidents the capture recorded are listed beside the detections.

        --diverge A --diverge B: where two branches first differ."""
        cmd_find(target, tensors or [], branch, nonfinite, jump, stat, gt, lt, all_steps, json_out, diverge or [],
                 update_jump=update_jump)
