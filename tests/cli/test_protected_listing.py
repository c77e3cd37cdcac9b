"""``dstt ls`` says which steps held in memory are protected against the
loss of a node (issue 26: every rank's protection record,
dstt.format.redundancy): a step counts only once every rank protected it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import dstt
from dstt.format import redundancy as RD
from dstt.format import tier as T
from dstt.format.backends import open_backend
from tests.cli.test_cli_errors import cli


def test_ls_shows_the_steps_protected_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "run"
    dstt.save(str(path), 0, {"w": torch.zeros(3)})
    b = open_backend(str(path))
    now = time.time()
    for r in (0, 1):
        T.write_held(b, T.HeldRecord("main", "r9", r, 2, 11 + r, f"node-{r}", now, ((5, 8),)))
    RD.write_protected(b, RD.Protected("main", "r9", 0, 2, 0, "pair", ((5, 8),)))
    rc, out, err = cli("ls", str(path))
    assert rc == 0 and "protected" not in out, err  # rank 1 has not protected anything yet
    RD.write_protected(b, RD.Protected("main", "r9", 1, 2, 1, "pair", ((5, 7),)))
    rc, out, err = cli("ls", str(path), "--json")
    doc = json.loads(out)
    branch = doc["branches"][0] if "branches" in doc else doc[0]
    assert branch["protected"] == {"scheme": "pair", "steps": [[5, 7]]}
    rc, out, err = cli("ls", str(path))
    assert "protected against a node's loss (pair): 5-7" in " ".join(out.split()), out
