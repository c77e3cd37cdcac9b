"""``dstt report STORE -o report.html``: a whole run on one self-contained
HTML page (see :mod:`dstt.analysis.report`). Reads only the step index;
needs matplotlib for the figures (``pip install 'dstt[plot]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dstt.cli.output import emit_json, handle_errors, stderr


def cmd_report(target: str, out: Path, branch: Optional[str], json_out: bool) -> None:
    from dstt.analysis.plot import require_matplotlib
    from dstt.errors import ConfigError, InvalidReferenceError
    from dstt.format.outpath import check_output_file

    check_output_file(out, "write the report")
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"cannot write the report to {str(out)!r}: use a .html file name")
    require_matplotlib()  # before any work: a missing extra is a one-line error
    from dstt.analysis.report import write_report
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref

    ref = Ref.parse(target)
    if ref.step is not None:
        raise InvalidReferenceError(f"report takes STORE[@BRANCH], not a step: got {target!r}")
    run = RunIndex(target)
    data = write_report(run, str(out), branch or ref.branch)
    if json_out:
        emit_json({"store": run.url, "branch": data.branch, "out": str(out), "steps": len(data.steps),
                   "tensors": len(data.names), "branches": len(data.branches), "incidents": len(data.incidents),
                   "held": {b["name"]: {"held": b["held"], "held_stale": b["held_stale"]} for b in data.branches}})
    else:
        stderr.print(f"wrote {out} ({len(data.steps)} steps, {len(data.names)} tensors, "
                     f"{len(data.branches)} branch(es)"
                     + (f", {len(data.incidents)} incident(s)" if data.incidents else "") + ")")


def register(app: typer.Typer) -> None:
    @app.command("report")
    @handle_errors
    def report(
        target: str = typer.Argument(..., metavar="STORE", help="STORE[@BRANCH] (default branch: main)."),
        out: Path = typer.Option(..., "--out", "-o", help="The HTML file to write."),
        branch: Optional[str] = typer.Option(None, "--branch", "-b", help="The branch whose trajectory is plotted."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable summary on stdout."),
    ) -> None:
        """Write one self-contained HTML page about a run (needs dstt[plot]).

        Branches, captured and persisted steps, the latest tensors, norm histories, an update heatmap, largest changes, incidents and detections."""
        cmd_report(target, out, branch, json_out)
