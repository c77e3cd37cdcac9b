"""``dstt export``: write a step to a standalone file (``.pt`` or
``.safetensors``; :mod:`dstt.timetravel.export`), or chosen steps to a plain
Zarr v3 group (:mod:`dstt.timetravel.zarr_export`) or an Icechunk
repository (:mod:`dstt.timetravel.icechunk_export`). ``dstt restore`` is
its alias (:mod:`dstt.cli.restore`): the same command under a second name."""

from __future__ import annotations

import os
from typing import Any, List, Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout
from dstt.cli.scanopts import EXECUTOR_OPT, WORKERS_OPT, scan_args


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
    refs: List[str] = typer.Argument(..., metavar="REF...", help="Step to export: STORE, STORE:STEP, STORE@BRANCH or STORE@BRANCH:STEP (latest step of main by default). --format zarr|icechunk: one or more steps of one store, or STORE[@BRANCH] for every step of its branch (--steps to choose)."),
    out: str = typer.Option(..., "--out", "-o", help="File to write: .pt (torch.save) or .safetensors; a directory for --format zarr or icechunk."),
    only: Optional[str] = typer.Option(None, "--only", help="Only this subtree, e.g. 'model'."),
    fmt: Optional[str] = typer.Option(None, "--format", help="pt, safetensors, zarr (a plain Zarr v3 group, step as the leading axis) or icechunk (a repository, one commit per step); default: by OUT's suffix (.pt, .pth, .safetensors, .zarr, .icechunk)."),
    steps: Optional[str] = typer.Option(None, "--steps", help="zarr/icechunk: which steps of the branch: A:B[:K] (B excluded, every K-th) or A,B,C."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace FILE if it exists (refused otherwise)."),
    workers: Optional[int] = WORKERS_OPT,
    executor: Optional[str] = EXECUTOR_OPT,
) -> None:
    """Write a step to a standalone file (.pt or .safetensors), or steps to a Zarr group or an Icechunk repository."""
    kind = export_format(out, fmt)
    if kind in ("pt", "safetensors"):
        from dstt.errors import ConfigError

        if len(refs) != 1 or steps is not None:
            raise ConfigError(f"--format {kind} writes one step: give one REF and no --steps "
                              "(--format zarr or icechunk take several)")
        export_step(refs[0], out, only, json_out, quiet, overwrite)
        return
    export_steps(kind, refs, out, only, steps, json_out, quiet, overwrite, scan_args(workers, executor))


#: --format values and the suffixes that choose them.
FORMATS = {"pt": (".pt", ".pth"), "safetensors": (".safetensors",), "zarr": (".zarr",), "icechunk": (".icechunk",)}


def export_format(out: str, fmt: Optional[str]) -> str:
    """The export format: ``--format``, else by OUT's suffix."""
    from dstt.errors import ConfigError

    if fmt is not None:
        if fmt not in FORMATS:
            raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
        return fmt
    suffix = os.path.splitext(out.rstrip("/"))[1].lower()
    for kind, suffixes in FORMATS.items():
        if suffix in suffixes:
            return kind
    raise ConfigError(f"cannot export to {out!r}: the name must end in .pt, .pth, .safetensors, .zarr or "
                      ".icechunk (or pass --format)")


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
    with progress("exporting", enabled=not quiet and not json_out) as update:
        if kind == "zarr":
            from dstt.timetravel.zarr_export import export_zarr

            info: Any = export_zarr(store, out, names=names, overwrite=overwrite, progress=update, **where, **scan)
        else:
            from dstt.timetravel.icechunk_export import export_icechunk

            info = export_icechunk(store, out, names=names, progress=update, **where, **scan)
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
