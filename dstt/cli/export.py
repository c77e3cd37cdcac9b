"""``dstt export``: write a step to a standalone file or directory (``.pt``,
``.safetensors``, ``.npz``, or a torch.distributed.checkpoint directory), or
chosen steps to a plain Zarr v3 group (:mod:`dstt.timetravel.zarr_export`)
or an Icechunk repository (:mod:`dstt.timetravel.icechunk_export`);
``dstt restore`` is its alias (:mod:`dstt.cli.restore`): the same command
under a second name.

:data:`EXPORTERS` is the choice table of ``--format``: one row per format,
naming the function that writes it. ``safetensors`` and ``npz`` are
written torch-free (:mod:`dstt.format.flatexport`); arguments (the output
path, the format, the REFs and ``--steps``) are checked before anything
heavy is imported.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, List, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout
from dstt.cli.scanopts import EXECUTOR_OPT, WORKERS_OPT, scan_args

#: --format -> "module:function" writing it, called as
#: ``function(ref, out, only=..., progress=...)`` and returning an ExportInfo.
EXPORTERS: dict[str, str] = {
    "pt": "dstt.timetravel.export:export",
    "safetensors": "dstt.cli.export:export_flat_file",
    "npz": "dstt.cli.export:export_flat_file",
    "dcp": "dstt.timetravel.dcp:export_dcp",
    "zarr": "dstt.timetravel.zarr_export:export_zarr",
    "icechunk": "dstt.timetravel.icechunk_export:export_icechunk",
}
#: File suffix -> format, when --format is not given.
SUFFIXES = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors", ".npz": "npz", ".zarr": "zarr",
            ".icechunk": "icechunk"}
#: Formats written as a directory (the others: one file).
DIRECTORY_FORMATS = {"dcp"}
#: Formats holding several steps: REF... and --steps, called as
#: ``function(store, out, names=..., progress=..., points=... | steps=..., branch=..., executor/workers)``
#: (:func:`export_steps`); each checks its own output directory.
STEP_FORMATS = {"zarr", "icechunk"}


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
        raise ConfigError(f"cannot export to {out!r}: cannot tell the format; name it .pt, .safetensors, "
                          f".npz, .zarr or .icechunk, or pass --format ({', '.join(EXPORTERS)})")
    return got


def check_out(out: str, fmt: str, overwrite: bool) -> None:
    """Refuse an output that exists (unless ``overwrite`` for a file) or
    whose directory is missing -- before any store is opened."""
    from dstt.errors import ConfigError
    from dstt.format.outpath import check_output_file

    if fmt in DIRECTORY_FORMATS:
        if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
            raise ConfigError(f"{out!r} exists; a {fmt} checkpoint is written to a new or empty directory")
        # Missing parents are made (as dcp.save does), once the step is
        # known to exist: the nearest existing one must be a writable directory.
        parent = Path(out).absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
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
    if fmt in DIRECTORY_FORMATS and not Path(out).absolute().parent.is_dir():
        from dstt.format.index import RunIndex

        with RunIndex(ref) as run:
            run.resolve()  # (a bad REF makes no directory)
        os.makedirs(Path(out).absolute().parent, exist_ok=True)
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
    args: List[str] = typer.Argument(..., metavar="REF... [OUT]", help="Step to export: STORE, STORE:STEP, STORE@BRANCH or STORE@BRANCH:STEP (latest step of main by default), then the file or directory to write (or --out). --format zarr|icechunk: one or more steps of one store, or STORE[@BRANCH] for every step of its branch (--steps to choose)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="File to write: .pt (torch.save), .safetensors or .npz; a directory for --format dcp, zarr or icechunk."),
    fmt: Optional[str] = typer.Option(None, "--format", "-f", help=f"One of {', '.join(EXPORTERS)} (default: from OUT's suffix: .pt, .pth, .safetensors, .npz, .zarr, .icechunk). zarr: a plain Zarr v3 group, step as the leading axis; icechunk: a repository, one commit per step."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this subtree, e.g. 'model'."),
    steps: Optional[str] = typer.Option(None, "--steps", help="zarr/icechunk: which steps of the branch: A:B[:K] (B excluded, every K-th) or A,B,C."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace FILE if it exists (refused otherwise)."),
    workers: Optional[int] = WORKERS_OPT,
    executor: Optional[str] = EXECUTOR_OPT,
) -> None:
    """Write a step to a standalone file (.pt, .safetensors, .npz) or a DCP checkpoint directory, or steps to a Zarr group or an Icechunk repository."""
    from dstt.errors import ConfigError

    refs = list(args)
    if out is None:
        if len(refs) < 2:
            raise ConfigError("give the output once: dstt export REF OUT, or --out OUT")
        out = refs.pop()
    kind = pick_format(out, fmt)
    if kind not in STEP_FORMATS:
        if len(refs) != 1:
            raise ConfigError(f"--format {kind} writes one step: give one REF and its OUT "
                              "(--format zarr or icechunk take several REFs)")
        if steps is not None:
            raise ConfigError(f"--format {kind} writes one step: --steps is for --format zarr or icechunk")
        export_step(refs[0], out, only, json_out, quiet, overwrite, kind)
        return
    export_steps(kind, refs, out, only, steps, json_out, quiet, overwrite, scan_args(workers, executor))


def parse_steps(text: Optional[str]) -> Any:
    """``--steps``: None, ``A:B[:K]`` (a slice) or ``A,B,C`` (a list).

    >>> parse_steps("0:100:10"), parse_steps("5,7")
    (slice(0, 100, 10), [5, 7])
    """
    from dstt.errors import ConfigError

    if text is None:
        return None
    try:
        if ":" in text:
            parts = [int(p) if p.strip() else None for p in text.split(":")]
            if len(parts) > 3:
                raise ValueError
            return slice(*parts)
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A:B[:K] or A,B,C (step numbers)") from None


def export_steps(kind: str, refs: list[str], out: str, only: Optional[str], steps: Optional[str], json_out: bool,
                 quiet: bool, overwrite: bool, scan: dict[str, Any]) -> None:
    """``--format zarr|icechunk``: the steps REF... name (one store), or every
    step (``--steps``) of one REF's branch."""
    from dstt.cli.render import progress
    from dstt.errors import ConfigError
    from dstt.format.refs import Ref

    parsed = [Ref.parse(r) for r in refs]
    store = parsed[0].store

    def place(s: str) -> str:
        return s if "://" in s else os.path.abspath(s)

    for r in parsed[1:]:
        if place(r.store) != place(store):
            raise ConfigError(f"every REF must name the same store: {store!r} and {r.store!r}")
    with_step = [r for r in parsed if r.step is not None]
    if with_step and (len(with_step) != len(parsed) or steps is not None):
        raise ConfigError("give either REFs with steps (STORE:STEP ...) or one STORE[@BRANCH] with --steps")
    if not with_step and len(parsed) != 1:
        raise ConfigError("several REFs must each name a step (STORE:STEP); for a range use --steps")
    where: dict[str, Any] = {"points": [(r.branch, r.step) for r in parsed]} if with_step else {
        "steps": parse_steps(steps), "branch": parsed[0].branch}
    names = None if not only else [only.strip("/"), only.strip("/") + "/*"]
    if kind == "zarr":
        where["overwrite"] = overwrite
    module, func = EXPORTERS[kind].split(":")
    writer = getattr(importlib.import_module(module), func)
    with progress("exporting", enabled=not quiet and not json_out) as update:
        info = writer(store, out, names=names, progress=update, **where, **scan)
    if json_out:
        emit_json(info.to_dict())
        return
    for note in getattr(info, "notes", []):
        stderr.print(f"note: {note}")
    if kind == "zarr":
        stdout.print(f"wrote {info.path} (zarr): {info.n_tensors} tensors x {len(info.steps)} steps, "
                     f"{human_bytes(info.nbytes)}")
    else:
        stdout.print(f"committed {len(info.tags)} step(s) to {info.path} (icechunk): {', '.join(info.tags) or '-'}"
                     f"{f'; already there: {len(info.skipped)}' if info.skipped else ''}")


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
