"""``dstt branch``: create a branch forking at a step; no data is copied
(:func:`dstt.format.root.create_branch`, what :func:`dstt.branch` runs;
torch-free)."""

from __future__ import annotations

import os
from typing import Optional

import typer

from dstt.cli.output import emit_json, handle_errors, stdout
from dstt.cli.targets import store_arg


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


def same_store(a: str, b: str) -> bool:
    """Do two store strings name the same place (paths made absolute, URLs
    compared without a trailing slash)?

    >>> same_store("runs/a", "./runs/a/"), same_store("s3://b/run/", "s3://b/run")
    (True, True)
    """
    return os.path.abspath(a) == os.path.abspath(b) if "://" not in a + b else a.rstrip("/") == b.rstrip("/")


def create(store: str, name: str, from_: Optional[str], json_out: bool) -> None:
    """Create branch ``name`` in ``store`` at ``--from`` (default: latest step of main)."""
    from dstt.errors import InvalidReferenceError
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref
    from dstt.format.root import create_branch

    store = store_arg(store, "branch", "; give the fork point with --from")
    ref = from_ref(store, from_)
    if not same_store(Ref.parse(ref).store, store):
        raise InvalidReferenceError(f"--from {from_!r} names another store than {store!r}")
    with RunIndex(ref) as run:
        parent = run.resolve()
        create_branch(run.backend, name, parent)
    if json_out:
        emit_json({"branch": name, "parent": {"branch": parent[0], "step": parent[1]}})
    else:
        stdout.print(f"created branch {name!r} from step {parent[1]} of branch {parent[0]!r}")


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def branch(
        store: str = typer.Argument(..., help="Store path or URL."),
        name: str = typer.Argument(..., help="Name of the new branch."),
        from_: Optional[str] = typer.Option(None, "--from", help="Fork point: REF, @BRANCH:STEP, BRANCH:STEP or :STEP (default: latest step of main)."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Create a branch forking at a step (no data is copied)."""
        create(store, name, from_, json_out)
