"""``dstt branch``: create a branch forking at a step; no data is copied
(:func:`dstt.format.root.create_branch`, what :func:`dstt.branch` runs;
torch-free); ``-d`` deletes one (:mod:`dstt.format.branchops`), ``-m``
renames one (:mod:`dstt.format.branchrename`)."""

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


def delete(store: str, name: str, force: bool, dry_run: bool, json_out: bool) -> None:
    """Delete branch ``name`` (and, with ``force``, the branches forked from it)."""
    from dstt.format.backends import open_backend
    from dstt.format.branchops import delete_branch
    from dstt.format.root import check_root

    backend = open_backend(store_arg(store, "branch", ""), create=False)
    check_root(backend)
    gone = delete_branch(backend, name, force=force, dry_run=dry_run)
    if json_out:
        emit_json({"deleted": gone, "dry_run": dry_run})
        return
    verb = "would delete" if dry_run else "deleted"
    stdout.print(f"{verb} branch{'es' if len(gone) > 1 else ''} {', '.join(repr(b) for b in gone)}"
                 + ("" if dry_run else "; run 'dstt gc' to free their data"))


def rename(store: str, old: str, new: str, dry_run: bool, json_out: bool) -> None:
    """Rename branch ``old`` to ``new`` (:mod:`dstt.format.branchrename`)."""
    from dstt.format.backends import open_backend
    from dstt.format.branchrename import rename_branch
    from dstt.format.root import check_root

    backend = open_backend(store_arg(store, "branch", ""), create=False)
    check_root(backend)
    done = rename_branch(backend, old, new, dry_run=dry_run)
    if json_out:
        emit_json({"renamed": done, "dry_run": dry_run})
        return
    kids = done["children"]
    stdout.print(f"{'would rename' if dry_run else 'renamed'} branch {old!r} to {new!r} "
                 f"({done['steps']} step{'s' if done['steps'] != 1 else ''}"
                 + (f"; {len(kids)} branch{'es' if len(kids) != 1 else ''} forked from it re-pointed" if kids else "")
                 + (", finishing an interrupted rename" if done["resumed"] else "") + ")")


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def branch(
        store: str = typer.Argument(..., help="Store path or URL."),
        name: str = typer.Argument(..., help="Name of the new branch (of the branch to delete with -d, to rename with -m)."),
        new_name: Optional[str] = typer.Argument(None, metavar="[NEW]", help="With -m: the branch's new name."),
        from_: Optional[str] = typer.Option(None, "--from", help="Fork point: REF, @BRANCH:STEP, BRANCH:STEP or :STEP (default: latest step of main)."),
        delete_: bool = typer.Option(False, "--delete", "-d", help="Delete the branch (refused if others fork from it, unless --force); 'dstt gc' then frees its data."),
        rename_: bool = typer.Option(False, "--rename", "-m", help="Rename branch NAME to NEW (refused if NEW exists or a capture writes to the store; running it again finishes an interrupted rename)."),
        force: bool = typer.Option(False, "--force", "-f", help="With -d: also delete the branches forked from it."),
        dry_run: bool = typer.Option(False, "--dry-run", help="With -d or -m: only say what would be done."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    ) -> None:
        """Create a branch forking at a step (no data is copied), delete one (-d) or rename one (-m)."""
        from dstt.errors import ConfigError

        if delete_ and rename_:
            raise ConfigError("-d deletes a branch, -m renames one: give one of them")
        if rename_:
            if new_name is None or from_ is not None or force:
                raise ConfigError("-m takes STORE OLD NEW (and no --from or --force)")
            rename(store, name, new_name, dry_run, json_out)
            return
        if new_name is not None:
            raise ConfigError(f"unexpected argument {new_name!r} (a third name goes with -m, to rename a branch)")
        if delete_:
            if from_ is not None:
                raise ConfigError("--from creates a branch; -d deletes one: give one of them")
            delete(store, name, force, dry_run, json_out)
            return
        if force or dry_run:
            raise ConfigError("--force goes with -d/--delete, --dry-run with -d or -m")
        create(store, name, from_, json_out)
