"""Many small tensors (issue 16, "Scale in tensor count"): per-tensor costs
of an unchanged step, batched flushes and reads, errors inside a batch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import CaptureError
from dstt.format.backends.local import LocalBackend
from dstt.format.writeoptions import WriteOptions
from dstt.store.flusher import Flusher
from dstt.store.writer import Writer
from tests.conftest import bits_equal, small_state


def files_under(path: Path) -> int:
    return sum(len(fs) for _, _, fs in os.walk(path))


def test_many_small_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    state = small_state(600)
    path = tmp_path / "run"
    dstt.save(path, 0, state)
    changed = {k: dict(v) for k, v in state.items()}
    changed["layer7"]["p70"] = changed["layer7"]["p70"] + 1
    dstt.save(path, 1, changed)
    run = dstt.open(path)
    for step, want in ((0, state), (1, changed)):
        got = run.state_dict(step, threads=3)
        assert got.keys() == want.keys()
        for group, tensors in want.items():
            for name, t in tensors.items():
                assert bits_equal(got[group][name], t), (step, group, name)
    report = dstt.verify(path)
    assert report.problems == [] and report.steps == 2 and report.tensors == 1200


def test_unchanged_step_reads_no_chunk_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fully unchanged step written by a new writer (dstt.save opens one per
    call) used to read every chunk back to prove it equal (the first step
    recorded no sha256): one chunk file read per tensor."""
    n = 400
    path = tmp_path / "run"
    state = {f"block{i}": {"w": torch.full((4,), float(i))} for i in range(n)}
    dstt.save(path, 0, state)
    gets: list[str] = []
    real_get = LocalBackend.get

    def counting_get(self: LocalBackend, key: str, *, max_bytes: int | None = None) -> Any:
        gets.append(key)
        return real_get(self, key, max_bytes=max_bytes)

    monkeypatch.setattr(LocalBackend, "get", counting_get)
    before = files_under(path)
    info = dstt.save(path, 1, state)
    assert info.bytes_written == 0
    chunk_reads = [k for k in gets if k.startswith("tensors/") and not k.endswith("zarr.json")]
    assert chunk_reads == [], f"{len(chunk_reads)} chunks read back for an unchanged step: {chunk_reads[:3]}"
    # index.json, names.json, stats.json, commit.json and the branch head
    assert files_under(path) - before <= 6


def test_flush_error_inside_a_batch_is_raised_and_nothing_committed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks are flushed in batches: one failing chunk in the middle of
    a batch fails the step, naming it, and later chunks are still settled."""
    path = tmp_path / "run"
    state = {f"t{i:03d}": torch.full((8,), float(i)) for i in range(300)}
    # (the chunk-file write of one chunk: flush_chunk and the grouped path,
    # Writer.flush_chunks, both store through the flusher's chunk-file store; packing is off here)
    real_store = Flusher._store

    def failing_store(self: Flusher, plan: Any, task: Any, *args: Any) -> Any:
        if task.layout.name == "t150":
            raise OSError("disk on fire")
        return real_store(self, plan, task, *args)

    monkeypatch.setattr(Flusher, "_store", failing_store)
    with pytest.raises(CaptureError, match="step 3.*disk on fire"):
        dstt.save(path, 3, state)
    monkeypatch.setattr(Flusher, "_store", real_store)
    assert dstt.open(path).steps() == []
    dstt.save(path, 3, state)  # the failed step left nothing in the way
    assert bits_equal(dstt.open(path).read("t150", 3), state["t150"])


def test_layouts_reused_only_while_the_tensor_is_unchanged(tmp_path: Path) -> None:
    """One writer reuses a tensor's layout across steps (planning cost per
    tensor): a new shape or dtype under the same name gets a new layout."""
    path = tmp_path / "run"
    steps = [torch.arange(4.0), torch.arange(4.0) + 1, torch.arange(6.0), torch.arange(6, dtype=torch.int16),
             torch.arange(6, dtype=torch.int16).reshape(2, 3)]
    with Writer(path, WriteOptions(max_chunk_bytes=8)) as w:
        for step, t in enumerate(steps):
            w.write(step, {"w": t, "b": torch.ones(3)})
    run = dstt.open(path)
    for step, t in enumerate(steps):
        assert bits_equal(run.read("w", step), t), step
    assert len({run.entry("w", s).array for s in range(len(steps))}) == 4
    assert report_ok(path)


def report_ok(path: Path) -> bool:
    report = dstt.verify(path)
    return report.problems == []
