"""``dstt export`` (a step to a file; ``dstt restore --out`` is an alias), ``dstt branch``, ``dstt prune``, ``dstt gc``."""

from __future__ import annotations

import os
from typing import Optional

import typer

from dstt.cli.output import emit_json, handle_errors, human_bytes, stderr, stdout


def from_ref(store: str, text: str | None) -> str:
    """The fork point as a full reference. ``--from`` may be a full
    reference, or relative to STORE: ``@BRANCH:STEP``, ``:STEP``, ``BRANCH:STEP``.

    >>> from_ref("runs/a", "main:100"), from_ref("runs/a", ":7"), from_ref("runs/a", None)
    ('runs/a@main:100', 'runs/a:7', 'runs/a@main:latest')
    """
    from dstt.format.refs import split_in_store

    if not text:
        return f"{store}@main:latest"
    rel = split_in_store(text)  # the same rule as the Python API's (dstt.format.refs)
    if rel is None:
        return text
    branch, step = rel
    return store + (f"@{branch}" if branch else "") + ("" if step is None else f":{step}")


def store_arg(text: str, command: str, hint: str) -> str:
    """``text`` as the STORE of a command that works on a whole store; a
    reference (``run@main``, ``run:5``) or nothing is refused before any work
    (an empty path would otherwise mean the current directory).

    >>> store_arg("runs/a", "gc", "")
    'runs/a'
    """
    from dstt.errors import InvalidReferenceError
    from dstt.format.refs import Ref

    if not text.strip():
        raise InvalidReferenceError(f"{command} needs a STORE path or URL, got an empty string")
    if os.path.exists(text):
        return text
    ref = Ref.parse(text)
    if ref.branch is not None or ref.step is not None:
        raise InvalidReferenceError(f"{command} takes a STORE, not a reference: got {text!r}{hint}")
    return text


def _same_store(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b) if "://" not in a + b else a.rstrip("/") == b.rstrip("/")


def register(app: typer.Typer) -> None:
    def export_step(ref: str, out: str, only: Optional[str], json_out: bool, quiet: bool,
                    overwrite: bool = False) -> None:
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

    ref_arg = typer.Argument(..., help="Step to export: STORE, STORE:STEP, STORE@BRANCH or STORE@BRANCH:STEP (latest step of main by default).")
    out_opt = typer.Option(..., "--out", "-o", help="File to write: .pt (torch.save) or .safetensors.")
    only_opt = typer.Option(None, "--only", help="Only this subtree, e.g. 'model'.")
    json_opt = typer.Option(False, "--json", help="Machine-readable report on stdout.")
    quiet_opt = typer.Option(False, "--quiet", "-q", help="No progress bar.")
    overwrite_opt = typer.Option(False, "--overwrite", help="Replace FILE if it exists (refused otherwise).")

    @app.command("export")
    @handle_errors
    def export_cmd(ref: str = ref_arg, out: str = out_opt, only: Optional[str] = only_opt,
                   json_out: bool = json_opt, quiet: bool = quiet_opt, overwrite: bool = overwrite_opt) -> None:
        """Write a step to a standalone file (.pt or .safetensors)."""
        export_step(ref, out, only, json_out, quiet, overwrite)

    @app.command("restore")
    @handle_errors
    def restore(ref: str = ref_arg, out: str = out_opt, only: Optional[str] = only_opt,
                json_out: bool = json_opt, quiet: bool = quiet_opt, overwrite: bool = overwrite_opt) -> None:
        """Same as 'dstt export' (kept as an alias). To restore into live training, use dstt.restore() in Python."""
        export_step(ref, out, only, json_out, quiet, overwrite)

    @app.command()
    @handle_errors
    def branch(
        store: str = typer.Argument(..., help="Store path or URL."),
        name: str = typer.Argument(..., help="Name of the new branch."),
        from_: Optional[str] = typer.Option(None, "--from", help="Fork point: REF, @BRANCH:STEP, BRANCH:STEP or :STEP (default: latest step of main)."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Create a branch forking at a step (no data is copied)."""
        from dstt.errors import InvalidReferenceError
        from dstt.format.refs import Ref
        from dstt.timetravel.restore import branch as make_branch

        store = store_arg(store, "branch", "; give the fork point with --from")
        ref = from_ref(store, from_)
        if not _same_store(Ref.parse(ref).store, store):
            raise InvalidReferenceError(f"--from {from_!r} names another store than {store!r}")
        parent = make_branch(ref, name)
        if json_out:
            emit_json({"branch": name, "parent": {"branch": parent[0], "step": parent[1]}})
        else:
            stdout.print(f"created branch {name!r} from step {parent[1]} of branch {parent[0]!r}")

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
            stdout.print(f"kept {len(steps)} step(s) of {b} that kept steps' predictive chunks are decoded from "
                         f"(steps {', '.join(map(str, steps[:20])) + (' ...' if len(steps) > 20 else '')})")
        if report.removed and not dry_run:
            stderr.print("run `dstt gc STORE` to free the data they no longer reference")

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
        from dstt.api import gc as run_gc

        path = store_arg(store, "gc", " (gc works on the whole store)")
        report = run_gc(path, dry_run=dry_run)  # (salvage first, then collect: the API's one path)
        if json_out:
            emit_json(report.to_dict())
            return
        for branch, steps in report.committed.items():
            verb = "would commit" if dry_run else "committed"
            stdout.print(f"{verb} {len(steps)} step(s) of branch {branch!r} sealed by a trainer that died: "
                         + ", ".join(map(str, steps)))
        verb = "would free" if dry_run else "freed"
        stdout.print(f"{verb} {human_bytes(report.bytes_freed)}: {report.chunks_removed} chunk(s), "
                     f"{report.arrays_removed} array(s), {len(report.partial_steps_removed)} uncommitted step dir(s); "
                     f"{report.chunks_kept} chunk(s) still referenced")
