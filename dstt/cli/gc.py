"""``dstt gc``: commit what dead trainers sealed, then remove the chunks,
arrays and uncommitted step directories no committed step references --
through :func:`dstt.capture.collect.gc`, the one gc path :func:`dstt.gc`
runs too, so the command is never less safe than the API. Torch-free
unless a dead trainer left something to commit."""

from __future__ import annotations

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, printable, stdout
from dstt.cli.targets import store_arg


def cmd_gc(store: str, dry_run: bool, json_out: bool) -> None:
    """Collect ``store`` (salvage first, then collect) and say what was freed."""
    from dstt.capture.collect import gc as run_gc

    path = store_arg(store, "gc", " (gc works on the whole store)")
    report = run_gc(path, dry_run=dry_run)  # (salvage first, then collect: the API's one path)
    if json_out:
        emit_json(report.to_dict())
        return
    for branch, steps in report.committed.items():
        verb = "would commit" if dry_run else "committed"
        stdout.print(f"{verb} {len(steps)} step(s) of branch {branch!r} sealed by a trainer that died: "
                     + ", ".join(map(str, steps)))
    for inc in report.incidents:
        verb = "would record" if dry_run else "recorded"
        stdout.print(printable(f"{verb} a crash incident at step {inc['step']} of branch {inc['branch']!r}: "
                               f"{inc['reason']}"))
    verb = "would free" if dry_run else "freed"
    stdout.print(f"{verb} {human_bytes(report.bytes_freed)}: {report.chunks_removed} chunk(s), "
                 f"{report.arrays_removed} array(s), {len(report.partial_steps_removed)} uncommitted step dir(s), "
                 f"{report.tier_records_removed} memory-tier record(s); "
                 f"{report.chunks_kept} chunk(s) still referenced")


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def gc(
        store: str = typer.Argument(..., help="Store path or URL."),
        dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show what would be removed."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Remove chunks and arrays no committed step references, and uncommitted leftovers.

        First commits the steps that dead trainers sealed in staging rings on
        this host, or that every rank recorded (a distributed capture whose
        helpers died), so their data is not taken for leftovers.
        Refuses to run while any branch has a live writer."""
        cmd_gc(store, dry_run, json_out)
