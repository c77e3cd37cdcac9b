"""Skip records (meta/skips/<branch>/<step>.json) are validated on read like
every other document: format, branch, step (matching the file name), reason
and time; a bad one is a one-line CorruptStoreError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dstt
from dstt.format import layout as L
from dstt.format.backends import open_backend
from dstt.format.skips import skipped_steps, write_skip


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    dstt.save(path, 0, {"w": torch.zeros(1)})
    return path


def test_written_records_read_back(store: Path) -> None:
    write_skip(open_backend(store), "main", 7, "staging pool full")
    got = skipped_steps(store)
    assert list(got) == [7] and got[7]["reason"] == "staging pool full" and got[7]["branch"] == "main"
    assert dstt.open(store).steps() == [0]  # not a step


@pytest.mark.parametrize("doc, message", [
    ({"format": "dstt-skip", "branch": "main", "step": 7, "reason": 5, "time": 1.0}, "reason must be a string"),
    ({"format": "other", "branch": "main", "step": 7, "reason": "r", "time": 1.0}, "not a skip record"),
    ({"format": "dstt-skip", "branch": "side", "step": 7, "reason": "r", "time": 1.0}, "of branch 'side'"),
    ({"format": "dstt-skip", "branch": "main", "step": 8, "reason": "r", "time": 1.0}, "another step's name"),
    ({"format": "dstt-skip", "branch": "main", "step": 7, "reason": "r", "time": "now"}, "time must be a number"),
])
def test_bad_records_are_refused(store: Path, doc: dict, message: str) -> None:
    key = store / L.skip_key("main", 7)
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text(json.dumps(doc))
    with pytest.raises(dstt.CorruptStoreError, match=message):
        skipped_steps(store)
