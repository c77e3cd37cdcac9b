"""``dstt export``: write a step to a standalone file or directory (``.pt``,
``.safetensors``, ``.npz``, or a torch.distributed.checkpoint directory);
``dstt restore`` is its alias (:mod:`dstt.cli.restore`): the same command
under a second name.

:data:`EXPORTERS` is the choice table of ``--format``: one row per format,
naming the function that writes it. ``safetensors`` and ``npz`` are
written torch-free (:mod:`dstt.format.flatexport`); arguments (the output
path, the format) are checked before anything heavy is imported.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout

#: --format -> "module:function" writing it, called as
#: ``function(ref, out, only=..., progress=...)`` and returning an ExportInfo.
EXPORTERS: dict[str, str] = {
    "pt": "dstt.timetravel.export:export",
    "safetensors": "dstt.cli.export:export_flat_file",
    "npz": "dstt.cli.export:export_flat_file",
    "dcp": "dstt.timetravel.dcp:export_dcp",
}
#: File suffix -> format, when --format is not given.
SUFFIXES = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors", ".npz": "npz"}
#: Formats written as a directory (the others: one file).
DIRECTORY_FORMATS = {"dcp"}


def pick_format(out: str, fmt: Optional[str]) -> str:
    """The format to write: ``--format``, else from the file suffix.

    >>> pick_format("w.safetensors", None), pick_format("ckpt", "dcp")
    ('safetensors', 'dcp')
    """
    from dstt.errors import ConfigError

    if fmt is not None:
        if fmt not in EXPORTERS:
            raise ConfigError(f"unknown --format {fmt!r}; choose one of {', '.join(EXPORTERS)}")
        return fmt
    got = SUFFIXES.get(Path(out).suffix.lower())
    if got is None:
        raise ConfigError(f"cannot export to {out!r}: cannot tell the format; name it .pt, .safetensors or "
                          f".npz, or pass --format ({', '.join(EXPORTERS)})")
    return got


def check_out(out: str, fmt: str, overwrite: bool) -> None:
    """Refuse an output that exists (unless ``overwrite`` for a file) or
    whose directory is missing -- before any store is opened."""
    from dstt.errors import ConfigError
    from dstt.format.outpath import check_output_file

    if fmt in DIRECTORY_FORMATS:
        if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
            raise ConfigError(f"{out!r} exists; a {fmt} checkpoint is written to a new or empty directory")
        parent = Path(out).absolute().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(f"cannot export to {out!r}: {parent} is not a writable directory")
        return
    if not overwrite and os.path.lexists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out!r} exists; pass --overwrite to replace it")
    check_output_file(out, "export")


def export_flat_file(ref: str, out: str, only: Optional[str] = None, progress: Any = None) -> Any:
    """safetensors / npz, torch-free (:func:`dstt.format.flatexport.export_flat`)."""
    from dstt.format.flatexport import export_flat
    from dstt.format.index import RunIndex

    fmt = SUFFIXES.get(Path(out).suffix.lower(), "safetensors")
    with RunIndex(ref) as run:
        return export_flat(run, out, fmt, only, progress=progress)


def export_step(ref: str, out: str, only: Optional[str], json_out: bool, quiet: bool,
                overwrite: bool = False, fmt: Optional[str] = None) -> None:
    """Export the step ``ref`` names to ``out``, with a progress bar."""
    from dstt.cli.render import progress

    fmt = pick_format(out, fmt)
    check_out(out, fmt, overwrite)
    if fmt in ("safetensors", "npz") and Path(out).suffix.lower() != f".{fmt}":
        from dstt.errors import ConfigError

        raise ConfigError(f"--format {fmt} writes a .{fmt} file: name it so (got {out!r})")
    module, func = EXPORTERS[fmt].split(":")
    writer = getattr(importlib.import_module(module), func)
    with progress("exporting", enabled=not quiet and not json_out) as update:
        info = writer(ref, out, only=only, progress=update)
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
    out_arg: Optional[str] = typer.Argument(None, metavar="[OUT]", help="File or directory to write (or --out)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="File to write: .pt (torch.save), .safetensors or .npz; a directory for --format dcp."),
    fmt: Optional[str] = typer.Option(None, "--format", "-f", help=f"One of {', '.join(EXPORTERS)} (default: from OUT's suffix)."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this subtree, e.g. 'model'."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace FILE if it exists (refused otherwise)."),
) -> None:
    """Write a step to a standalone file (.pt, .safetensors, .npz) or a DCP checkpoint directory."""
    from dstt.errors import ConfigError

    if (out is None) == (out_arg is None):
        raise ConfigError("give the output once: dstt export REF OUT, or --out OUT")
    export_step(ref, out or out_arg or "", only, json_out, quiet, overwrite, fmt)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
