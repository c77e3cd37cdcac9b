"""``dstt verify`` (integrity check) and ``dstt unlock`` (break a writer lock)."""

from __future__ import annotations

from typing import Any

import typer

from dstt.cli.output import emit_json, handle_errors, stderr, stdout


def _progress_bar(enabled: bool) -> tuple[Any, Any]:
    """A rich progress bar on stderr and its update callback (None when off)."""
    if not enabled or not stderr.is_terminal:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("verifying {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=stderr, transient=True)
    task = bar.add_task("", total=None)

    def update(done: int, total: int, what: str) -> None:
        bar.update(task, completed=done, total=total, description=what)

    return bar, update


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def verify(
        ref: str = typer.Argument(..., help="STORE[@BRANCH][:STEP]; without a branch, every branch."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    ) -> None:
        """Check every committed step: manifests, chunk CRC-32C, sha256 per chunk and per tensor.

        Exits 1 when anything is corrupt or missing, naming the step and tensor.
        """
        from dstt.store.verify import verify as run_verify

        bar, update = _progress_bar(not quiet)
        if bar is not None:
            with bar:
                report = run_verify(ref, progress=update)
        else:
            report = run_verify(ref)
        if json_out:
            emit_json(report.to_dict())
        else:
            for p in report.problems:
                stdout.print(f"CORRUPT {p}")
            if report.partial:
                stderr.print(f"{len(report.partial)} uncommitted step(s) left by an interrupted writer "
                             f"(invisible to readers; dstt gc removes them): {', '.join(report.partial[:5])}")
            verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
            stdout.print(f"{verdict}: {report.steps} steps, {report.tensors} tensors, "
                         f"{report.chunks} chunks ({report.bytes} bytes) checked in {report.store}")
        if not report.ok:
            raise typer.Exit(1)

    @app.command()
    @handle_errors
    def unlock(
        ref: str = typer.Argument(..., help="STORE@BRANCH whose writer lock to break."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Break a branch's writer lock. Only when its writer is known to be gone:
        a crashed local writer's lock is released by the kernel anyway."""
        from dstt.errors import InvalidReferenceError
        from dstt.refs import Ref
        from dstt.store.backend import open_backend
        from dstt.store.lock import break_lock, lock_holder
        from dstt.store.root import check_root, load_branch

        r = Ref.parse(ref)
        if r.branch is None or r.step is not None:
            raise InvalidReferenceError(f"expected STORE@BRANCH, got {ref!r}")
        backend = open_backend(r.store)
        check_root(backend)
        load_branch(backend, r.branch)
        live = lock_holder(backend, r.branch)
        info = break_lock(backend, r.branch)
        if json_out:
            emit_json({"branch": r.branch, "broken": info is not None, "was_held": live is not None,
                       "holder": info.to_dict() if info else None})
        elif info is None:
            stdout.print(f"branch {r.branch!r} was not locked")
        else:
            state = "held by" if live is not None else "last held by"
            stdout.print(f"broke the lock of branch {r.branch!r} ({state} {info.describe()})")
