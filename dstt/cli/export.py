"""``dstt export``: write a step to a standalone file (``.pt`` or
``.safetensors``; :mod:`dstt.timetravel.export`). ``dstt restore`` is its
alias (:mod:`dstt.cli.restore`): the same command under a second name."""

from __future__ import annotations

import os
from typing import Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout


def export_step(ref: str, out: str, only: Optional[str], json_out: bool, quiet: bool,
                overwrite: bool = False) -> None:
    """Export the step ``ref`` names to the file ``out``, with a progress bar."""
    from dstt.cli.render import progress
    from dstt.timetravel.export import export

    if not overwrite and os.path.lexists(out) and not os.path.isdir(out):
        from dstt.errors import ConfigError

        raise ConfigError(f"{out!r} exists; pass --overwrite to replace it")

    with progress("exporting", enabled=not quiet and not json_out) as update:
        info = export(ref, out, only=only, progress=update)
    if json_out:
        emit_json(info.to_dict())
        return
    for note in info.notes:
        stderr.print(f"note: {note}")
    stdout.print(f"wrote {info.path} ({info.format}): {info.n_tensors} tensors, "
                 f"{human_bytes(info.nbytes)} from step {info.step} of branch {info.branch!r}")


@handle_errors
def export_command(
    ref: str = typer.Argument(..., help="Step to export: STORE, STORE:STEP, STORE@BRANCH or STORE@BRANCH:STEP (latest step of main by default)."),
    out: str = typer.Option(..., "--out", "-o", help="File to write: .pt (torch.save) or .safetensors."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this subtree, e.g. 'model'."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace FILE if it exists (refused otherwise)."),
) -> None:
    """Write a step to a standalone file (.pt or .safetensors)."""
    export_step(ref, out, only, json_out, quiet, overwrite)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
