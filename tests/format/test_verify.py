"""Integrity: dstt verify (API and CLI) detects every kind of damage and
names the step and tensor; normal reads fail loudly on a checksum mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import dstt
from dstt.errors import ChecksumMismatchError, CorruptStoreError, DsttError
from dstt.format import layout as L
from dstt.format.verify import verify

ROOT = Path(__file__).resolve().parents[2]


def make_store(path: Path) -> None:
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        dstt.save(path, s, {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(8, generator=g)},
                            "frozen": torch.arange(50.0), "step": s})


def chunk_file(path: Path, step: int, tensor: str) -> Path:
    e = dstt.open(path).entry(tensor, step)
    return path / L.chunk_key(e.array, e.slots[0], e.coords(0))


def step_file(path: Path, step: int, name: str) -> Path:
    return path / L.step_dir("main", step) / name


def flip(p: Path, offset: int = 17) -> None:
    b = bytearray(p.read_bytes())
    b[offset % len(b)] ^= 0x01
    p.write_bytes(bytes(b))


def truncate(p: Path, keep: int | None = None) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2 if keep is None else keep])


Damage = Callable[[Path], None]

CASES: list[tuple[str, Damage, int, str | None, str]] = [
    ("flipped-chunk-byte", lambda p: flip(chunk_file(p, 1, "model/w")), 1, "model/w", "checksum"),
    ("flipped-crc-trailer", lambda p: flip(chunk_file(p, 1, "model/b"), -1), 1, "model/b", "checksum"),
    ("truncated-chunk", lambda p: truncate(chunk_file(p, 2, "model/w")), 2, "model/w", "checksum"),
    ("empty-chunk", lambda p: truncate(chunk_file(p, 2, "model/b"), 0), 2, "model/b", "checksum"),
    ("missing-chunk", lambda p: chunk_file(p, 1, "model/w").unlink(), 1, "model/w", "chunk"),
    ("flipped-index", lambda p: flip(step_file(p, 1, "index.json"), 40), 1, None, "index"),
    ("truncated-index", lambda p: truncate(step_file(p, 2, "index.json")), 2, None, "index"),
    ("missing-names", lambda p: step_file(p, 1, "names.json").unlink(), 1, None, "names"),
    ("flipped-stats", lambda p: flip(step_file(p, 0, "stats.npy"), 100), 0, None, "stats"),
    ("truncated-commit", lambda p: truncate(step_file(p, 1, "commit.json")), 1, None, "commit"),
    ("corrupted-commit", lambda p: step_file(p, 2, "commit.json").write_bytes(b'{"format_version": 1, "step": "x"}'), 2, None, "commit"),
]


@pytest.mark.parametrize("name,damage,step,tensor,kind", CASES, ids=[c[0] for c in CASES])
def test_verify_detects_damage(tmp_path: Path, name: str, damage: Damage, step: int, tensor: str | None, kind: str) -> None:
    path = tmp_path / "run"
    make_store(path)
    assert verify(path).ok
    damage(path)
    report = verify(path)
    assert not report.ok
    hits = [p for p in report.problems if p.step == step and p.tensor == tensor and p.kind == kind]
    assert hits, [str(p) for p in report.problems]
    # Only the damaged step is reported (other steps, incl. shared chunks, are fine).
    assert {p.step for p in report.problems} == {step}


def test_shared_chunk_damage_is_reported_for_every_step_using_it(tmp_path: Path) -> None:
    path = tmp_path / "run"
    make_store(path)
    flip(chunk_file(path, 0, "frozen"))  # written at step 0, referenced by 1 and 2
    report = verify(path)
    assert {(p.step, p.tensor) for p in report.problems} == {(0, "frozen"), (1, "frozen"), (2, "frozen")}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_array_metadata_is_reported(tmp_path: Path, damage: str) -> None:
    """dstt never reads an array's zarr.json, so damage to it went unnoticed
    by verify, while plain zarr-python (docs/format.md) could no longer read
    the tensor's chunks."""
    path = tmp_path / "run"
    make_store(path)
    doc = path / dstt.open(path).entry("model/b", 0).array / "zarr.json"
    {"flip": lambda: flip(doc, 40), "truncate": lambda: truncate(doc), "delete": doc.unlink}[damage]()
    report = verify(path)
    assert {(p.step, p.tensor, p.kind) for p in report.problems} == {(s, "model/b", "array") for s in range(3)}
    assert "zarr.json" in report.problems[0].message


def test_normal_reads_fail_loudly(tmp_path: Path) -> None:
    path = tmp_path / "run"
    make_store(path)
    flip(chunk_file(path, 1, "model/w"))
    run = dstt.open(path)
    with pytest.raises(ChecksumMismatchError, match="model/w"):
        run.read("model/w", 1)
    with pytest.raises(ChecksumMismatchError):
        run.state_dict(1)
    assert torch.equal(run.read("model/w", 2), dstt.open(path).read("model/w", 2))  # others still read
    truncate(step_file(path, 2, "index.json"))
    with pytest.raises(ChecksumMismatchError, match="index.json"):
        dstt.open(path).tensors(2)
    chunk_file(path, 0, "model/b").unlink()
    with pytest.raises(CorruptStoreError, match="missing"):
        dstt.open(path).read("model/b", 0)


def test_scoped_verify(tmp_path: Path) -> None:
    path = tmp_path / "run"
    make_store(path)
    flip(chunk_file(path, 1, "model/w"))
    assert verify(f"{path}:2").ok and verify(f"{path}:2").steps == 1
    assert not verify(f"{path}@main:1").ok
    assert verify(f"{path}@main").steps == 3
    with pytest.raises(DsttError):
        verify(f"{path}:7")


def dstt_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dstt.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_verify(tmp_path: Path) -> None:
    path = tmp_path / "run"
    make_store(path)
    ok = dstt_cli("verify", str(path), "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["steps"] == 3
    flip(chunk_file(path, 1, "model/w"))
    truncate(step_file(path, 2, "index.json"))
    bad = dstt_cli("verify", str(path))
    assert bad.returncode == 1
    assert "main:1 model/w" in bad.stdout and "CRC-32C" in bad.stdout
    assert "main:2" in bad.stdout and "index.json" in bad.stdout
    assert "Traceback" not in bad.stderr
    missing = dstt_cli("verify", str(tmp_path / "nope"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
