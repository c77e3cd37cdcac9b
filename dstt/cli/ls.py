"""``dstt ls``: a store's branches and steps, or the tensors at a step.

Reads only the step index (torch-free); rendering lives in
:mod:`dstt.cli.render`.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from dstt.cli.output import JSON_OPT, emit_json, handle_errors
from dstt.cli.targets import open_index, target_text


def cmd_ls(target: str, patterns: list[str], sort: str, reverse: bool, limit: int, json_out: bool) -> None:
    """List the branches of STORE, or the tensors at STORE[@BRANCH]:STEP."""
    from dstt.analysis.listing import list_store, list_tensors
    from dstt.cli import render

    run, ref = open_index(target)
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
        render.tensor_listing(target_text(run.url, branch, step), rows)


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
