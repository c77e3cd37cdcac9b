"""The ``dstt`` command: one typer app, one module per command group.

Each command module exposes ``register(app)``; this module only wires them
up. Commands are thin: they parse, call the library and hand data to
:mod:`dstt.cli.output`.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="dstt",
    help="Capture a PyTorch training run and travel through it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

#: Command modules, each with ``register(app)``, in help order.
COMMAND_MODULES = ["demo", "verify", "inspect", "timetravel"]


def _version(value: bool) -> None:
    if value:
        from dstt import __version__

        typer.echo(f"dstt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks (also DSTT_DEBUG=1)."),
) -> None:
    if debug:
        import os

        os.environ["DSTT_DEBUG"] = "1"


for _name in COMMAND_MODULES:
    importlib.import_module(f"dstt.cli.{_name}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
