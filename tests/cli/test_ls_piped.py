"""``dstt ls`` into a pipe (issue 29): no line is cut at rich's 80 columns
when stdout is not a terminal -- a long branch name, its fork point and its
byte counts all reach the reader (a real subprocess writing into a pipe)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import dstt

LONG = "an-experiment-with-lr-3e-4-warmup-2000-steps-and-a-much-longer-name-than-80-columns"


def test_ls_into_a_pipe_cuts_no_line(store: Path) -> None:
    for s in range(3):
        dstt.save(store, s, {"model": {"w": torch.full((4,), float(s))}})
    dstt.save(store, 3, {"model": {"w": torch.zeros(4)}}, branch=LONG, parent=("main", 1))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    for columns in (None, "40"):
        if columns:
            env["COLUMNS"] = columns
        p = subprocess.run([sys.executable, "-m", "dstt.cli.main", "ls", str(store)], capture_output=True, text=True,
                           env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        line = next(ln for ln in p.stdout.splitlines() if LONG in ln and "steps" in ln)  # the tree's line, whole
        assert line.rstrip().endswith("0 B referenced") and f"{LONG} from main:1  1 steps (3..3)" in line, line
        assert str(store) in p.stdout.splitlines()[0]
