"""Packs (issue 16): small chunks of many tensors stored together in pack
objects (dstt/format/packs.py, docs/format.md "Packs"): real round trips,
dedup across steps, gc/prune/verify, damage, format version, compression
modes, the capture paths (in-thread, helper process, 2 ranks over gloo)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal
from conftest import small_state as _small_state

import dstt
from dstt.api import gc
from dstt.errors import CaptureError, ChecksumMismatchError, CorruptStoreError, FormatVersionError
from dstt.format import layout as L
from dstt.format import packs as P
from dstt.format.gc import prune
from dstt.format.manifest import decode_json
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer

#: This module runs with packing on (tests/conftest.py turns it off elsewhere).
DSTT_PACKING = True


def small_state(n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` small tensors of mixed dtypes (0-d and empty included), and one
    tensor above the packing threshold (conftest.small_state)."""
    return _small_state(n, seed, wide=True)


def assert_state(want: Any, got: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert bits_equal(got, want), where
    else:
        assert got.keys() == want.keys(), where
        for k in want:
            assert_state(want[k], got[k], f"{where}/{k}")


def files(path: Path, sub: str) -> list[str]:
    root = path / sub
    return sorted(str(p.relative_to(path)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def packs_of(path: Path) -> list[str]:
    return [f for f in files(path, "packs") if not f.endswith("zarr.json")]


def test_round_trip_bit_exact_with_few_files_and_format_3(store: Path) -> None:
    state = small_state(300)
    info = dstt.save(store, 0, state)
    assert info.n_tensors == 301
    # 300 small tensors: one pack; the big one: its array document and chunk
    assert packs_of(store) == ["packs/p.0.0.0"]
    big = "tensors/big/@float32_600x500_c600x500_raw"
    # no chunk file, array document or group per small tensor (empty ones,
    # with no chunk to pack, keep their zarr array)
    assert [f for f in files(store, "tensors") if "0x3" not in f and not f.startswith("tensors/layer")] == [
        f"{big}/c.0.0.0", f"{big}/zarr.json", "tensors/big/zarr.json", "tensors/zarr.json"]
    assert all("/p" not in f or "0x3" in f or f.endswith("/zarr.json") and f.count("/") == 3
               for f in files(store, "tensors"))
    root = decode_json((store / "zarr.json").read_bytes(), "root")
    # (packed one-chunk tensors are index rows: format 4, docs/format.md "Index rows")
    assert root["attributes"]["dstt"]["format_version"] == L.ROWS_FORMAT_VERSION
    run = dstt.open(store)
    assert run.commit_info(0)["format_version"] == L.ROWS_FORMAT_VERSION
    assert_state(state, run.state_dict(0))
    e = run.entry("layer3/p36", 0)
    assert e.packs is not None and e.pack(0) is not None and e.sha256[0] is not None
    assert run.entry("big", 0).packs is None
    # sliced reads, export and restore into a live model read packs too
    assert bits_equal(run.read("layer3/p36", 0, index=(slice(1, 3),)), state["layer3"]["p36"][1:3])
    dstt.export(f"{store}:0", store.parent / "out.pt")
    assert_state(state, torch.load(store.parent / "out.pt"))
    report = dstt.verify(store)
    assert report.ok and report.tensors == 301 and report.orphans == {"chunks": 0, "arrays": 0, "bytes": 0}
    model = torch.nn.Sequential(*[torch.nn.LayerNorm(8) for _ in range(20)])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    dstt.save(store.parent / "m", 0, dstt.state_of(model=model, rng=False))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dstt.restore(f"{store.parent / 'm'}:0", model=model, rng=False)
    assert_state(want, model.state_dict())


def test_unchanged_tensors_reference_earlier_pack_ranges(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = small_state(200)
    dstt.save(store, 0, state)
    # a new writer (dstt.save opens one per call): unchanged small tensors are
    # proven equal by the recorded sha256, no pack range read back, nothing written
    reads: list[str] = []
    from dstt.format.backends.local import LocalBackend

    original = LocalBackend.get_range

    def counting(self: LocalBackend, key: str, start: int, length: int) -> bytes | None:
        reads.append(key)
        return original(self, key, start, length)

    monkeypatch.setattr(LocalBackend, "get_range", counting)
    info = dstt.save(store, 1, state)
    assert info.bytes_written == 0 and reads == []
    assert packs_of(store) == ["packs/p.0.0.0"]
    monkeypatch.undo()
    changed = {k: dict(v) if isinstance(v, dict) else v for k, v in state.items()}
    changed["layer4"]["p41"] = changed["layer4"]["p41"] + 1
    with Writer(store) as w:
        info = w.write(2, changed)
        assert 0 < info.bytes_written < 4096  # only the changed tensor (2,240 bytes), in a pack of step 2
        info = w.write(3, changed)  # same writer: dedup against the in-memory chain
        assert info.bytes_written == 0
    assert packs_of(store) == ["packs/p.0.0.0", "packs/p.2.0.0"]
    run = dstt.open(store)
    e0, e3 = run.entry("layer4/p40", 0), run.entry("layer4/p40", 3)
    assert (e3.slots, e3.packs) == (e0.slots, e0.packs)
    assert run.entry("layer4/p41", 3).slots == [2]
    for s, want in ((0, state), (1, state), (2, changed), (3, changed)):
        assert_state(want, run.state_dict(s), f"step {s}")
    assert dstt.verify(store).ok


def test_packs_are_sealed_at_the_target_size(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files per step grow with bytes, not tensor count: 2,000 tensors of
    1 KiB in packs of ~64 KiB make ~32 packs."""
    monkeypatch.setattr(P, "PACK_TARGET_BYTES", 64 << 10)
    state = {f"t{i:05d}": torch.full((256,), float(i)) for i in range(2000)}
    before = sum(len(fs) for _, _, fs in os.walk(store)) if store.exists() else 0
    dstt.save(store, 0, state)
    created = sum(len(fs) for _, _, fs in os.walk(store)) - before
    n_packs = len(packs_of(store))
    data_bytes = 2000 * (1024 + 4)
    assert n_packs == -(-data_bytes // ((64 << 10) + 1028)) or n_packs == -(-data_bytes // (64 << 10))
    assert created <= n_packs + 12  # the packs + a constant (root, groups, step documents, head, lock)
    got = dstt.open(store).state_dict(0)
    assert all(bits_equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("compression", ["zstd", "shuffle-zstd", "delta", "auto"])
def test_compression_modes_round_trip_packed(store: Path, compression: str) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"small": {f"w{i}": torch.randn(64, generator=g) for i in range(40)},
             "ints": torch.arange(1000), "big": torch.randn(400, 700, generator=g)}
    steps = []
    with Writer(store, WriteOptions(compression=compression)) as w:
        for s in range(4):
            state = {"small": {k: v + (0.01 if i % 3 == 0 else 0.0) for i, (k, v) in enumerate(state["small"].items())},
                     "ints": state["ints"], "big": state["big"] + 1e-3}
            w.write(s, state)
            steps.append(state)
    run = dstt.open(store)
    for s, want in enumerate(steps):
        assert_state(want, run.state_dict(s), f"{compression} step {s}")
    e = run.entry("small/w1", 3)
    assert e.pack(0) is not None and e.keyframe(0) is None
    if compression == "delta":  # the large tensor is still delta coded
        assert any(k is not None for k in run.entry("big", 3).keyframes or [])
    assert dstt.verify(store).ok


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_damaged_pack_is_found_by_verify_and_by_reads(store: Path) -> None:
    state = small_state(60)
    dstt.save(store, 0, state)
    dstt.save(store, 1, state)  # references step 0's ranges
    run = dstt.open(store)
    e = run.entry("layer2/p21", 0)
    rng = e.pack(0)
    assert rng is not None
    pack = store / P.pack_key(e.slots[0], rng.rank, rng.n)
    _flip(pack, rng.offset + 3)
    report = dstt.verify(store)
    bad = sorted({(p.step, p.tensor, p.kind) for p in report.problems})
    assert bad == [(0, "layer2/p21", "checksum"), (1, "layer2/p21", "checksum")]
    with pytest.raises(ChecksumMismatchError, match="layer2/p21"):
        dstt.open(store).read("layer2/p21", 1)
    assert bits_equal(dstt.open(store).read("layer2/p20", 1), state["layer2"]["p20"])  # its neighbours are fine
    # a truncated pack: ranges past its end are refused, named
    pack.write_bytes(pack.read_bytes()[: rng.offset + 2])
    with pytest.raises(CorruptStoreError, match="truncated"):
        dstt.open(store).read("layer2/p21", 0)
    assert any("truncated" in p.message for p in dstt.verify(store).problems)
    pack.unlink()
    problems = dstt.verify(store).problems
    assert problems and all(p.kind == "chunk" and "missing" in p.message for p in problems)


def test_hostile_pack_entries_are_refused(store: Path) -> None:
    dstt.save(store, 0, {"a": torch.ones(8), "b": torch.zeros(4)})
    where = store / L.step_dir("main", 0)
    index = (where / L.INDEX_FILE).read_bytes()
    import json

    doc = json.loads(index)
    # "a" is an index row (format 4): [name, type, array, slot, crc, sha256, written, rank, n, offset, length]
    assert doc["tensors"][0][0] == "a"
    doc["tensors"][0][7:] = [0, 0, 0, 1 << 35]  # a range no 32-byte chunk can take
    data = json.dumps(doc).encode()
    (where / L.INDEX_FILE).write_bytes(data)
    commit = json.loads((where / L.COMMIT_FILE).read_bytes())
    from dstt.format.manifest import sha256_hex

    commit["files"][L.INDEX_FILE] = {"sha256": sha256_hex(data), "size": len(data)}
    (where / L.COMMIT_FILE).write_bytes(json.dumps(commit).encode())
    with pytest.raises(CorruptStoreError, match="at most"):
        dstt.open(store).read("a", 0)
    doc["tensors"][0][7:] = [0, 0, "x", 4]
    data = json.dumps(doc).encode()
    (where / L.INDEX_FILE).write_bytes(data)
    commit["files"][L.INDEX_FILE] = {"sha256": sha256_hex(data), "size": len(data)}
    (where / L.COMMIT_FILE).write_bytes(json.dumps(commit).encode())
    with pytest.raises(CorruptStoreError, match="pack offset must be an integer"):
        dstt.open(store).read("a", 0)


def test_prune_and_gc_keep_packs_while_any_range_is_referenced(store: Path) -> None:
    states = []
    state = small_state(40)
    for s in range(4):
        state = {k: ({n: (t + 1 if int(n[1:]) % 4 == s and t.dtype in (torch.float32, torch.float64) else t)
                      for n, t in v.items()}
                     if isinstance(v, dict) else v) for k, v in state.items()}
        dstt.save(store, s, state)
        states.append(state)
    assert packs_of(store) == [f"packs/p.{s}.0.0" for s in range(4)]
    dry = prune(store, keep_last=1, dry_run=True)
    assert dry.bytes_freed is not None and dry.bytes_freed > 0
    prune(store, keep_last=1)
    report = gc(store)
    run = dstt.open(store)
    live = {P.pack_key(slot, p.rank, p.n) for e in run.record(3).entries if e.packs
            for slot, p in zip(e.slots, e.packs) if p is not None}
    # step 0's pack still holds the ranges of tensors that never changed
    assert "packs/p.0.0.0" in live
    assert set(packs_of(store)) == live
    assert report.chunks_removed == 4 - len(live)
    assert_state(states[3], run.state_dict(3))
    v = dstt.verify(store)
    assert v.ok and v.orphans == {"chunks": 0, "arrays": 0, "bytes": 0}
    # an unreferenced pack (a crashed step's) is an orphan for verify and garbage for gc
    (store / "packs" / "p.77.0.0").write_bytes(b"x" * 10)
    assert dstt.verify(store).orphans == {"chunks": 1, "arrays": 0, "bytes": 10}
    assert gc(store).chunks_removed == 1 and not (store / "packs" / "p.77.0.0").exists()


def test_an_older_reader_refuses_a_packed_store(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dstt.save(store, 0, {"a": torch.ones(3)})
    monkeypatch.setattr(L, "READ_VERSIONS", (1, 2))
    with pytest.raises(FormatVersionError):
        dstt.open(store)


def test_a_failed_pack_write_is_never_referenced_later(store: Path) -> None:
    """Step 1's pack cannot be written: step 1 fails; step 2, equal to step
    1, must store those tensors again, not reference the lost range."""
    s0 = {"a": torch.zeros(16), "b": torch.ones(16)}
    s1 = {"a": torch.full((16,), 2.0), "b": torch.ones(16)}
    with Writer(store) as w:
        w.write(0, s0)
        put = w.backend.put

        def failing(key: str, data: Any) -> None:
            if key.startswith("packs/p."):
                raise OSError(28, "No space left on device")
            put(key, data)

        w.backend.put = failing  # type: ignore[method-assign]
        with pytest.raises(CaptureError, match="step 1"):
            w.write(1, s1)
        w.backend.put = put  # type: ignore[method-assign]
        info = w.write(2, s1)
        assert info.bytes_written > 0
    run = dstt.open(store)
    assert run.steps() == [0, 2]
    assert_state(s1, run.state_dict(2))
    assert dstt.verify(store).ok


def _train(path: Path, helper: bool) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.LayerNorm(8) for _ in range(30)], torch.nn.Linear(8, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = []
    with dstt.Capture(path, helper=helper) as cap:
        for step in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            expected.append({k: v.detach().clone() for k, v in dstt.state_of(model=model, optimizer=opt,
                                                                             rng=False)["model"].items()})
    return expected


@pytest.mark.parametrize("helper", [False, True])
def test_capture_writes_packs_in_thread_and_in_the_helper_process(tmp_path: Path, helper: bool) -> None:
    path = tmp_path / "run"
    expected = _train(path, helper)
    run = dstt.open(path)
    assert run.steps() == [0, 1, 2]
    for step, want in enumerate(expected):
        assert_state(want, run.state_dict(step)["model"], f"step {step}")
        assert all(e.packs is not None for e in run.record(step).entries)
    assert 1 <= len(packs_of(path)) <= 3  # one per step (186 tensors), none per tensor
    assert dstt.verify(path).ok


@pytest.mark.distributed
def test_two_ranks_each_write_their_own_packs(tmp_path: Path) -> None:
    from tests.system.test_capture_dist import assert_bits, torchrun

    torchrun(2, tmp_path, "ok")
    out = tmp_path / "ok"
    expected = torch.load(out / "expected.pt")
    run = dstt.open(out / "run")
    for step, state in expected.items():
        assert_bits(state, run.state_dict(step), f"step {step}")
    ranks = {P.parse_pack_key(k)[1] for k in packs_of(out / "run")}  # type: ignore[index]
    assert ranks == {0, 1}
    assert dstt.verify(out / "run").ok


def test_empty_tensors_survive_gc_and_export(store: Path) -> None:
    """Two defects found beside packs: gc removed an empty tensor's array
    document (no chunk referenced it) and verify then reported it missing;
    export of an empty tensor failed (numpy cannot cast a zero-size view)."""
    dstt.save(store, 0, {"e": torch.empty(0, 3), "a": torch.ones(2)})
    dstt.save(store, 1, {"e": torch.empty(0, 3), "a": torch.ones(2) + 1})
    assert dstt.verify(store).orphans == {"chunks": 0, "arrays": 0, "bytes": 0}
    prune(store, keep_last=1)
    gc(store)
    report = dstt.verify(store)
    assert report.ok and report.orphans == {"chunks": 0, "arrays": 0, "bytes": 0}
    dstt.export(f"{store}:1", store.parent / "out.pt")
    got = torch.load(store.parent / "out.pt")
    assert got["e"].shape == (0, 3) and bits_equal(got["a"], torch.ones(2) + 1)


def test_a_writer_packing_less_writes_the_array_document(store: Path) -> None:
    """Packed at step 0 (no zarr.json), stored as a chunk file at step 1 by
    a writer with packing off: its array document must be written (the
    writer took every array of the previous step for known)."""
    dstt.save(store, 0, {"w": torch.zeros(8), "same": torch.ones(4)})
    with Writer(store, WriteOptions(pack_chunk_bytes=0)) as w:
        w.write(1, {"w": torch.full((8,), 3.0), "same": torch.ones(4)})
    run = dstt.open(store)
    assert run.entry("w", 1).packs is None and run.entry("same", 1).pack(0) is not None  # still referenced
    assert (store / run.entry("w", 1).array / "zarr.json").exists()
    assert bits_equal(run.read("w", 1), torch.full((8,), 3.0)) and bits_equal(run.read("same", 1), torch.ones(4))
    assert dstt.verify(store).ok


def test_a_writer_that_lost_its_lock_writes_no_last_pack(store: Path) -> None:
    """After dstt unlock --force another writer may own the slot: a writer
    whose lock check fails at commit must not write its open pack."""
    from dstt.errors import StoreLockedError

    with Writer(store) as w:
        w.write(0, {"a": torch.zeros(8)})
        plan = w.plan(1, {"a": torch.ones(8)})
        results = [w.flush_chunk(plan, t) for t in plan.tasks]

        def lost() -> None:
            raise StoreLockedError("lost the write lock (test)")

        w.branch_lock.check = lost  # type: ignore[method-assign]
        with pytest.raises(CaptureError, match="lost the write lock"):
            w.commit(plan, results)
        w.branch_lock.check = lambda: None  # type: ignore[method-assign]
    assert packs_of(store) == ["packs/p.0.0.0"]
    assert dstt.open(store).steps() == [0]
