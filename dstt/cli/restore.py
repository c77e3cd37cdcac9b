"""``dstt restore --out FILE``: an alias of ``dstt export``
(:mod:`dstt.cli.export`), kept for the name people look for. It is the same
command -- arguments, options, behaviour -- with its own help line; an
option added to ``export`` is an option of ``restore`` too. Restoring into
live training objects is :func:`dstt.restore`, in Python."""

from __future__ import annotations

import typer

HELP = "Same as 'dstt export' (kept as an alias). To restore into live training, use dstt.restore() in Python."


def register(app: typer.Typer) -> None:
    from dstt.cli.export import export_command

    app.command("restore", help=HELP)(export_command)
