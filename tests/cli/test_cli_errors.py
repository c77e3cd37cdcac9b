"""Bad input to the CLI: one clear line on stderr, exit code 2 (usage) or 1
(runtime), no traceback, stdout empty or valid JSON, and nothing stored
changed. Also: data printed literally (no rich markup in paths or names) and
a closed stdout (``dstt ls | head``) is not an error."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

runner = CliRunner()


def _state(k: float) -> dict:
    return {"model": {"w": torch.full((4, 3), k), "b": torch.arange(3.0) * k}, "lr": 0.1}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """main: steps 0, 1, 2; side: forked at main:1, with its own step 5."""
    path = tmp_path_factory.mktemp("cli") / "run"
    for step in range(3):
        dstt.save(path, step, _state(step + 1.0))
    dstt.save(path, 5, _state(9.0), branch="side", parent=("main", 1))
    return path


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = Path(root, f)
            h.update(str(p).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def cli(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.stdout + r.stderr
    return r.exit_code, r.stdout, r.stderr


def failed(code: int, *args: str) -> str:
    """Run a command that must fail with ``code``; its one-line message."""
    rc, out, err = cli(*args)
    assert rc == code, (rc, out, err)
    if "--json" in args and out.strip():
        json.loads(out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_messages_keep_brackets_and_never_crash_on_them(tmp_path: Path, store: Path) -> None:
    # rich markup used to eat '[@BRANCH]' and crash on '[/]' with a traceback
    assert "STORE[@BRANCH][:STEP]" in failed(2, "ls", ":5")
    assert "[@BRANCH]" in failed(2, "ls", str(store), "model/*")  # "patterns need a step: use STORE[@BRANCH]:STEP"
    missing = tmp_path / "x[/]"
    assert f"no store at {missing}" in failed(1, "ls", str(missing), "--json")
    assert "'model/a[/b]'" in failed(1, "show", str(store), "model/a[/b]")


def test_human_output_prints_names_and_paths_literally(tmp_path: Path) -> None:
    path = tmp_path / "r[bold]un"
    dstt.save(path, 0, {"extra": {"[red]b": torch.zeros(2)}})
    dstt.save(path, 1, {"extra": {"[red]b": torch.ones(2)}})
    for args in (["ls", str(path)], ["ls", f"{path}:1"], ["diff", f"{path}:0", ":1"],
                 ["show", str(path), "extra/[red]b"], ["history", str(path), "*"]):
        rc, out, err = cli(*args)
        assert rc == 0, (args, out, err)
        assert args[0] == "history" or str(path) in out, (args, out)
        if args[0] != "ls" or ":" in args[1]:
            assert "extra/[red]b" in out, (args, out)


def test_closed_stdout_is_not_an_error(store: Path) -> None:
    """``dstt ls --json STORE | head -1`` where head has exited: no message, no traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "dstt.cli.main", "ls", str(store), "--json"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 1
    assert p.stderr == "", p.stderr


def test_diff_reference_without_step_or_branch_means_main_latest(store: Path) -> None:
    """REF_B's omitted parts default to main and latest (docs/cli.md), not to REF_A's."""
    def b_of(a: str, b: str) -> str:
        rc, out, err = cli("diff", a, b, "--json")
        assert rc == 0, err
        return json.loads(out)["b"]

    assert b_of(f"{store}:0", str(store)).endswith("@main:2")      # was main:0 (REF_A's step)
    assert b_of(f"{store}:0", "@side").endswith("@side:5")         # was main:0
    assert b_of(f"{store}@side:5", f"{store}:2").endswith("@main:2")  # was "no step 2 on side"
    assert b_of(f"{store}:0", ":2").endswith("@main:2")
    assert b_of(f"{store}@side:5", ":1").endswith("@main:1")       # ':STEP' stays on REF_A's branch


@pytest.mark.parametrize("rel", [":abc", "@", ":", "@a@b", "@side:"])
def test_bad_relative_reference_names_what_was_given(store: Path, rel: str) -> None:
    msg = failed(2, "diff", f"{store}:0", rel, "--json")
    assert f"{rel!r}" in msg and "\\x00" not in msg and "@BRANCH" in msg


@pytest.mark.parametrize("cmd", [["gc", "-n"], ["prune", "--keep-last", "1", "-n"], ["branch", "new"]])
@pytest.mark.parametrize("suffix", ["@main", ":1", "@side:~0"])
def test_store_commands_refuse_a_reference(store: Path, cmd: list[str], suffix: str) -> None:
    before = tree_hash(store)
    msg = failed(2, cmd[0], f"{store}{suffix}", *cmd[1:], "--json")
    assert f"{cmd[0]} takes a STORE, not a reference" in msg
    assert tree_hash(store) == before


@pytest.mark.parametrize("cmd", [["gc"], ["prune", "--keep-last", "1"], ["branch", "new"]])
def test_store_commands_refuse_an_empty_path(store: Path, monkeypatch: pytest.MonkeyPatch,
                                             cmd: list[str]) -> None:
    """'' used to mean the current directory: `dstt gc "$UNSET"` collected the store in it."""
    monkeypatch.chdir(store)
    before = tree_hash(store)
    assert "got an empty string" in failed(2, cmd[0], "", *cmd[1:])
    assert tree_hash(store) == before


@pytest.mark.parametrize("spec", ["::0", "0:2:0,:"])
def test_zero_slice_step_is_a_usage_error(store: Path, spec: str) -> None:
    assert "slice steps must be positive" in failed(2, "show", str(store), "model/w", f"--slice={spec}", "--json")


def test_zero_slice_step_is_a_dstt_error_in_the_api(store: Path) -> None:
    with pytest.raises(dstt.InvalidReferenceError, match="slice steps must be positive"):
        dstt.open(store).read("model/w", 1, index=(slice(None, None, 0),))


def test_negative_limit_is_a_usage_error(store: Path) -> None:
    rc, out, err = cli("ls", str(store), "--limit", "-1")
    assert rc == 2 and out == "" and "--limit" in err


@pytest.mark.parametrize("args, code, words", [
    (["ls", "{s}@nope"], 1, "no branch 'nope'"),
    (["ls", "{s}:99"], 1, "no committed step 99"),
    (["ls", "{s}:~99"], 1, "~99 goes before the first step"),
    (["ls", "{s}:abc"], 2, "bad step 'abc'"),
    (["show", "{s}", "model/ww"], 1, "did you mean 'model/w'"),
    (["diff", "{s}:0", ":1", "--sort", "bogus"], 2, "cannot sort by 'bogus'"),
    (["history", "{s}", "nomatch*"], 1, "no tensor matches 'nomatch*'"),
    (["find", "{s}", "--stat", "bogus", "--gt", "1"], 2, "unknown stat 'bogus'"),
    (["unlock", "{s}"], 2, "expected STORE@BRANCH"),
    (["verify", "{s}@nope"], 1, "no branch 'nope'"),
    (["restore", "{s}:1", "--out", "{s}"], 2, "cannot export to"),
])
def test_bad_input_one_line_and_store_unchanged(store: Path, args: list[str], code: int, words: str) -> None:
    before = tree_hash(store)
    msg = failed(code, *[a.format(s=store) for a in args], "--json")
    assert words in msg
    assert tree_hash(store) == before
