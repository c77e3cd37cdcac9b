"""``dstt report STORE [OTHER...] -o report.html``: a whole run (and its
branches, and other runs beside it) on one self-contained HTML page (see :mod:`dstt.analysis.report`). Reads only the step index;
needs matplotlib for the figures (``pip install 'dstt[plot]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, stderr


def cmd_report(target: str, out: Path, branch: Optional[str], json_out: bool, against: list[str] | None = None) -> None:
    from dstt.analysis.plot import require_matplotlib
    from dstt.errors import ConfigError, InvalidReferenceError
    from dstt.format.outpath import check_output_file

    check_output_file(out, "write the report")
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"cannot write the report to {str(out)!r}: use a .html file name")
    require_matplotlib()  # before any work: a missing extra is a one-line error
    from dstt.analysis.report import write_report
    from dstt.cli.history import store_label
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref

    for t in [target, *(against or [])]:
        if Ref.parse(t).step is not None:
            raise InvalidReferenceError(f"report takes STORE[@BRANCH], not a step: got {t!r}")
    ref = Ref.parse(target)
    run = RunIndex(target)
    runs = [run, *(RunIndex(t) for t in against or [])]
    urls = [str(r.url) for r in runs]
    others = {store_label(u, urls): r for u, r in zip(urls, runs)} if len(runs) > 1 else None
    data = write_report(run, str(out), branch or ref.branch, others)
    if json_out:
        emit_json({"store": run.url, "branch": data.branch, "out": str(out), "steps": len(data.steps),
                   "tensors": len(data.names), "branches": len(data.branches), "incidents": len(data.incidents),
                   "compared": urls[1:]})
    else:
        stderr.print(f"wrote {out} ({len(data.steps)} steps, {len(data.names)} tensors, "
                     f"{len(data.branches)} branch(es)"
                     + (f", {len(data.incidents)} incident(s)" if data.incidents else "") + ")")


def register(app: typer.Typer) -> None:
    @app.command("report")
    @handle_errors
    def report(
        target: str = typer.Argument(..., metavar="STORE", help="STORE[@BRANCH] (default branch: main)."),
        against: Optional[List[str]] = typer.Argument(None, metavar="[OTHER]...", help="Other stores to compare: their branches overlaid beside STORE's."),
        out: Path = typer.Option(..., "--out", "-o", help="The HTML file to write."),
        branch: Optional[str] = typer.Option(None, "--branch", "-b", help="The branch whose trajectory is plotted."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable summary on stdout."),
    ) -> None:
        """Write one self-contained HTML page about a run (needs dstt[plot]).

        Branches (every branch's loss, learning rate and model norm overlaid, forks marked; OTHER stores beside them), captured and persisted steps, the latest tensors, norm histories, an update heatmap, largest changes, incidents and detections."""
        cmd_report(target, out, branch, json_out, against or [])
