"""``RunIndex.value_tree`` (issue 29, bench_cli at 1,000 steps x 300
tensors): reads of values (``history extra/loss``, ``find``, ``show
VALUE``) parse a step's value tree without building its tensor entries --
the same tree as the full record, inherited steps included, and the same
checks: a damaged index.json is refused, never read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app
from dstt.errors import ChecksumMismatchError
from dstt.format import layout as L
from dstt.format.index import RunIndex

runner = CliRunner()


def test_value_tree_is_the_records_tree_and_keeps_its_checks(store: Path) -> None:
    for s in range(3):
        dstt.save(store, s, {"model": {f"w{i}": torch.full((2,), float(s)) for i in range(5)},
                             "extra": {"loss": 1.0 / (s + 1), "tags": ["a", s]}})
    dstt.save(store, 3, {"extra": {"loss": 9.0}}, branch="b", parent=("main", 1))
    fresh = RunIndex(str(store))
    for b, s in (("main", 0), ("main", 2), ("b", 1), ("b", 3)):
        assert RunIndex(str(store)).value_tree(s, branch=b) == fresh.record(s, branch=b).objects
    assert RunIndex(str(store)).value_tree("latest", branch="b") == {"extra": {"loss": 9.0}}
    index = store / L.step_dir("main", 2) / L.INDEX_FILE
    data = index.read_bytes()
    assert b'"loss":0.333' in data
    index.write_bytes(data.replace(b'"loss":0.333', b'"loss":0.999'))
    with pytest.raises(ChecksumMismatchError):
        RunIndex(str(store)).value_tree(2)
    r = runner.invoke(app, ["history", str(store), "extra/loss"])
    assert r.exit_code == 1 and "checksum" in r.output
