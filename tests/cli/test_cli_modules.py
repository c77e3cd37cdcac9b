"""The CLI's structure holds by itself: every command lives in the module
named after it (``dstt ls`` in ``dstt/cli/ls.py``), which registers that
command and no other, and running a command imports its own module and no
other command's (the lazy loading of ``cli/main.py``)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer

import dstt
from dstt.cli.main import COMMAND_MODULES, COMMANDS

ROOT = Path(dstt.__file__).resolve().parent.parent


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_lives_in_the_module_named_after_it(command: str) -> None:
    module = COMMANDS[command]
    assert module == command.replace("-", "_"), f"dstt {command} is defined in dstt/cli/{module}.py"
    app = typer.Typer()
    app.callback()(lambda: None)
    importlib.import_module(f"dstt.cli.{module}").register(app)
    registered = sorted(typer.main.get_group(app).commands)
    assert registered == [command], f"dstt/cli/{module}.py registers {registered}"


def test_every_command_module_is_in_the_table() -> None:
    """A module of dstt/cli that registers commands is a row of COMMANDS."""
    registering = sorted(p.stem for p in (ROOT / "dstt" / "cli").glob("*.py")
                         if "\ndef register(" in p.read_text())
    assert registering == sorted(COMMAND_MODULES)


_PROBE = """
import json, sys
from dstt.cli.main import main
sys.argv = ["dstt", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "cli": sorted(m for m in sys.modules if m.startswith("dstt.cli."))}),
      file=sys.stderr)
"""


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("modules") / "run"
    for s in range(2):
        dstt.save(path, s, {"model": {"w": torch.full((4,), float(s))}})
    return path


@pytest.mark.parametrize("args", [
    ["ls", "{s}", "--json"], ["history", "{s}", "model/w", "--json"], ["find", "{s}", "--json"],
    ["verify", "{s}", "--json"], ["branch", "{s}", "b2", "--json"],
])
def test_a_command_imports_its_own_module_only(small_store: Path, args: list[str]) -> None:
    argv = [a.format(s=small_store) for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True,
                       env=env, timeout=120)
    report = json.loads(p.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), (argv, p.stdout, p.stderr)
    assert json.loads(p.stdout)  # the command ran and printed its document
    loaded = {m.removeprefix("dstt.cli.") for m in report["cli"]}
    assert loaded & set(COMMAND_MODULES) == {COMMANDS[argv[0]]}, f"dstt {argv[0]} imported {sorted(loaded)}"
