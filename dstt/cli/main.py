"""The ``dstt`` command: one typer app, one module per command.

Each command lives in the module named after it (``dstt ls`` in
:mod:`dstt.cli.ls`, ``dstt gc`` in :mod:`dstt.cli.gc`, ...), which exposes
``register(app)``; this module only wires them up, lazily: :data:`COMMANDS`
says which module defines each command, and a command's module is imported
only when that command runs (or ``--help`` lists it). Commands are thin:
they parse, call the library and hand data to :mod:`dstt.cli.output` (and
the renderings of :mod:`dstt.cli.render` and :mod:`dstt.cli.values`); what
several commands share is there or in :mod:`dstt.cli.targets`. Read-only
commands never import torch.

>>> COMMANDS["ls"], COMMANDS["gc"]
('ls', 'gc')
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, ClassVar

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:  # the click typer runs on (vendored by typer 0.29)
    from typer._click import Command, Context

#: Command -> the module (under dstt.cli) defining it, in help order. A new
#: command gets a module of its own, named after it (``import-dcp`` would be
#: ``import_dcp``), and a row here.
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "verify": "verify",
    "unlock": "unlock",
    "ls": "ls",
    "show": "show",
    "diff": "diff",
    "history": "history",
    "find": "find",
    "export": "export",
    "import-dcp": "import_dcp",
    "restore": "restore",
    "branch": "branch",
    "prune": "prune",
    "gc": "gc",
    "report": "report",
}

#: Command modules, each with ``register(app)``, in help order.
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))


class LazyGroup(TyperGroup):
    """A typer group that imports a command's module on first use."""

    #: Module name -> the click group of the commands it registered (built once).
    _loaded: ClassVar[dict[str, TyperGroup]] = {}

    def _module_commands(self, module: str) -> TyperGroup:
        group = self._loaded.get(module)
        if group is None:
            sub = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
            sub.callback()(lambda: None)  # a group even when the module has one command
            importlib.import_module(f"dstt.cli.{module}").register(sub)
            group = typer.main.get_group(sub)
            self._loaded[module] = group
        return group

    def list_commands(self, ctx: Context) -> list[str]:
        return [*COMMANDS, *(n for n in self.commands if n not in COMMANDS)]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return self.commands.get(cmd_name)
        return self._module_commands(module).get_command(ctx, cmd_name)


app = typer.Typer(
    name="dstt",
    cls=LazyGroup,
    help="Capture a PyTorch training run and travel through it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

importlib.import_module("dstt.cli.helptext").apply()  # no "<bool>" on flags; help printed as written


def _version(value: bool) -> None:
    if value:
        from dstt._version import __version__

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


def main() -> None:
    """The ``dstt`` console script."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
