"""``dstt unlock``: remove a branch's writer lock left by a writer that is
gone (:func:`dstt.format.lock.break_lock`); a lock whose holder is alive is
refused unless ``--force``. Torch-free."""

from __future__ import annotations

import typer

from dstt.cli.output import emit_json, handle_errors, stderr, stdout


def cmd_unlock(ref: str, force: bool, json_out: bool) -> None:
    """Break the writer lock of ``STORE@BRANCH`` and say whose it was."""
    from dstt.errors import InvalidReferenceError
    from dstt.format.backends import open_backend
    from dstt.format.lock import break_lock, lock_holder
    from dstt.format.refs import Ref
    from dstt.format.root import check_root, load_branch

    r = Ref.parse(ref)
    if r.branch is None or r.step is not None:
        raise InvalidReferenceError(f"expected STORE@BRANCH, got {ref!r}")
    backend = open_backend(r.store)
    check_root(backend)
    load_branch(backend, r.branch)
    live = lock_holder(backend, r.branch)
    info = break_lock(backend, r.branch, force=force)
    if json_out:
        emit_json({"branch": r.branch, "broken": info is not None, "was_held": live is not None,
                   "holder_gone": info.gone() if info is not None else None,
                   "holder": info.to_dict() if info else None})
    elif info is None:
        stdout.print(f"branch {r.branch!r} was not locked")
    else:
        if live is not None:
            state = "held by the live writer"
        elif info.gone():
            state = "stale: its holder is gone,"
        else:
            state = "last held by"
        stdout.print(f"broke the lock of branch {r.branch!r} ({state} {info.describe()})")
        if live is not None:
            stderr.print("that writer fails its next step or commit when it notices; "
                         "run dstt verify once it has stopped")


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def unlock(
        ref: str = typer.Argument(..., help="STORE@BRANCH whose writer lock to break."),
        force: bool = typer.Option(
            False, "--force",
            help="Break the lock even though its holder is alive (its flock is held, or its lease "
                 "has not expired). Risky: that writer, if it runs on, overwrites the chunks of the step "
                 "the next writer is writing until it notices (at its next step or commit, which then "
                 "fails); only for a holder you know will never run again."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        """Remove a branch's writer lock left by a writer that is gone.

        A crashed local writer's lock is released by the kernel anyway; a lock
        whose holder is alive is refused (exit 1) unless --force."""
        cmd_unlock(ref, force, json_out)
