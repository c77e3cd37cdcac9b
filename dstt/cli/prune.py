"""``dstt prune``: remove the steps outside a retention policy
(:func:`dstt.format.gc.prune`); their data is freed by a following
``dstt gc``."""

from __future__ import annotations

from typing import Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout
from dstt.cli.targets import store_arg


def cmd_prune(store: str, keep_last: Optional[int], keep_every: Optional[int], branch: Optional[str],
              dry_run: bool, json_out: bool) -> None:
    """Prune ``store`` (or one ``branch`` of it) and say what was removed and kept."""
    from dstt.format.gc import prune as run_prune

    store = store_arg(store, "prune", "; choose a branch with --branch")
    report = run_prune(store, keep_last=keep_last, keep_every=keep_every, branch=branch, dry_run=dry_run)
    if json_out:
        emit_json(report.to_dict())
        return
    verb = "would remove" if dry_run else "removed"
    if dry_run and report.step_bytes is not None:
        for (b, s), n in report.step_bytes.items():
            stdout.print(f"  {b}:{s}  {human_bytes(n)}")
    freed = f", freeing {human_bytes(report.bytes_freed)} with a following gc" if report.bytes_freed else ""
    stdout.print(f"{verb} {len(report.removed)} step(s){freed}; kept "
                 + ", ".join(f"{b}: {len(s)}" for b, s in report.kept.items()))
    for b, steps in report.chained.items():
        shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
        stdout.print(f"kept {len(steps)} step(s) of {b} that kept steps' predictive chunks are decoded from "
                     f"(steps {shown})")
    if report.removed and not dry_run:
        stderr.print("run `dstt gc STORE` to free the data they no longer reference")


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def prune(
        store: str = typer.Argument(..., help="Store path or URL."),
        keep_last: Optional[int] = typer.Option(None, "--keep-last", help="Keep the last N steps of each branch."),
        keep_every: Optional[int] = typer.Option(None, "--keep-every", help="Keep every step divisible by K."),
        branch: Optional[str] = typer.Option(None, "--branch", "-b", help="Only prune this branch."),
        dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show what would be removed."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Remove steps outside the policy (data is freed by a following `dstt gc`).

        Always kept: each branch's latest step and every fork point."""
        cmd_prune(store, keep_last, keep_every, branch, dry_run, json_out)
