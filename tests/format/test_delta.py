"""Delta coding between steps with keyframes (issue 13): bit-exact reads of
every dtype, the keyframe rule, retention, integrity checks, plain-zarr
readability, and bytes that do not depend on the capture's timing."""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

import dstt
from dstt.api import gc
from dstt.errors import ChecksumMismatchError, ConfigError, CorruptStoreError
from dstt.format.codecs import keyframes
from dstt.format.codecs.delta import blosc_decode, blosc_encode, undo_delta, zigzag_delta
from dstt.format.gc import prune
from dstt.format.verify import verify
from dstt.format.writeoptions import WriteOptions
from dstt.store.flusher import Flusher
from dstt.store.plan import ChunkTask, StepPlan
from dstt.store.writer import Writer
from tests.conftest import bits_equal

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
]


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every delta, however large (random test data compresses badly)."""
    monkeypatch.setattr(keyframes, "DELTA_MAX_RATIO", math.inf)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(rng.integers(0, 256, size=n * itemsize, dtype=np.uint8))
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def nudge(t: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """``t`` with a few bits of some elements flipped: a small, exact change."""
    out = t.clone()
    flat = out.view(-1)
    if out.dtype == torch.bool:
        flat[0] = ~flat[0]
        return out
    bits = flat.view(torch.uint8)
    idx = torch.from_numpy(rng.integers(0, bits.numel(), size=max(1, bits.numel() // 7)))
    bits[idx] ^= 1
    return out


def special(dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    t = random_bits((9, 7), dtype, rng)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        t[0, 0], t[0, 1], t[0, 2] = -0.0, float("nan"), float("inf")
    if dtype == torch.float32:  # NaN payloads
        t[1, :4] = torch.tensor([0x7FC00001, 0x7F800123, -0x3F41, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    return t


# ----------------------------------------------------------------------------- the codec


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=64), key=st.binary(min_size=64, max_size=64),
       itemsize=st.sampled_from([1, 2, 4, 8]))
def test_zigzag_delta_inverts_exactly(data: bytes, key: bytes, itemsize: int) -> None:
    new = (data + bytes(64))[:64]
    z = zigzag_delta(new, key, itemsize)
    assert undo_delta(key, z, itemsize).tobytes() == new
    blob = blosc_encode(z, itemsize)
    assert bytes(blosc_decode(blob, 64, "t")) == z.tobytes()


def test_zigzag_makes_small_changes_small() -> None:
    key = np.array([0, 5, 100], np.uint32)
    new = np.array([1, 4, 100], np.uint32)
    assert zigzag_delta(new, key, 4).tolist() == [2, 1, 0]  # +1 -> 2, -1 -> 1


def test_blosc_decode_checks_the_size_before_decoding() -> None:
    blob = blosc_encode(np.arange(100, dtype=np.uint32), 4)
    with pytest.raises(CorruptStoreError, match="holds 400 bytes, expected 4000"):
        blosc_decode(blob, 4000, "t")
    with pytest.raises(CorruptStoreError, match="records"):
        blosc_decode(blob[:-3], 400, "t")
    with pytest.raises(CorruptStoreError, match="truncated"):
        blosc_decode(blob[:10], 400, "t")


def test_unknown_compression_and_bad_keyframe_spacing_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'delta'"):
        dstt.save(tmp_path / "a", 0, {"t": torch.ones(2)}, compression="deltas")
    with pytest.raises(ConfigError, match="keyframe_every"):
        Writer(tmp_path / "b", WriteOptions(compression="delta", keyframe_every=0))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_through_deltas(tmp_path: Path, dtype: torch.dtype, forced: None) -> None:
    rng = np.random.default_rng(1)
    t = special(dtype, rng)
    saved = []
    with Writer(tmp_path / "run", WriteOptions(compression="delta", keyframe_every=3, max_chunk_bytes=4 * 7 * 16)) as w:
        for step in range(5):
            state = {"t": t, "scalar": t[2, 2].clone(), "strided": t[:, ::2]}
            w.write(step, state)
            saved.append({k: v.clone() for k, v in state.items()})
            t = nudge(t, rng)
    run = dstt.open(tmp_path / "run")
    for step, state in enumerate(saved):
        back = run.state_dict(step)
        for k, v in state.items():
            assert bits_equal(back[k], v), (step, k)
        assert bits_equal(run.read("t", step, index=(slice(3, 8), 4)), state["t"][3:8, 4].contiguous())
    e = run.entry("t", 1)
    if dtype == torch.complex128:
        assert e.keyframes is None
    else:
        assert e.keyframes is not None and all(k is not None for k in e.keyframes), e.keyframes
    assert verify(tmp_path / "run").ok


def test_keyframe_every_bounds_what_a_read_touches(tmp_path: Path, forced: None) -> None:
    rng = np.random.default_rng(2)
    t = random_bits((64,), torch.float32, rng)
    with Writer(tmp_path / "run", WriteOptions(compression="delta", keyframe_every=4)) as w:
        for step in range(10):
            w.write(step, {"t": t})
            t = nudge(t, rng)
    run = dstt.open(tmp_path / "run")
    keys = [run.entry("t", s).keyframes[0] for s in range(10)]
    slot = [run.entry("t", s).slots[0] for s in range(10)]
    assert keys == [None, slot[0], slot[0], slot[0], None, slot[4], slot[4], slot[4], None, slot[8]]


@pytest.mark.parametrize("helper", [False, None])
def test_capture_takes_the_keyframe_spacing(tmp_path: Path, helper: bool | None) -> None:
    """Capture(keyframe_every=) reaches the writer, in-thread and in the helper process."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    saved = []
    with dstt.Capture(tmp_path / "run", compression="delta", keyframe_every=3, helper=helper) as cap:
        for step in range(6):
            cap.snapshot(step, extra={"w": w}, rng=False)
            cap.wait_staged()
            saved.append(w.clone())
            w += 1e-4 * torch.randn(w.shape, generator=g)
    run = dstt.open(tmp_path / "run")
    slot = [run.entry("extra/w", s).slots[0] for s in range(6)]
    keys = [run.entry("extra/w", s).keyframes[0] for s in range(6)]
    assert keys == [None, slot[0], slot[0], None, slot[3], slot[3]]
    for step, want in enumerate(saved):
        assert bits_equal(run.read("extra/w", step), want)
    with pytest.raises(ConfigError, match="keyframe_every"):
        dstt.Capture(tmp_path / "other", compression="delta", keyframe_every=0)


def test_a_delta_that_does_not_pay_is_stored_as_a_keyframe(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as w:
        for step in range(3):  # unrelated random bits each step: no delta is smaller
            w.write(step, {"t": random_bits((4096,), torch.float32, rng)})
    run = dstt.open(tmp_path / "run")
    assert [run.entry("t", s).keyframes for s in range(3)] == [[None]] * 3


def test_smooth_trajectories_store_deltas_smaller_than_keyframes(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    sizes = []
    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as wr:
        for step in range(4):
            sizes.append(wr.write(step, {"w": w.clone()}).bytes_written)
            w += 1e-4 * torch.randn(w.shape, generator=g)
    assert all(s < 0.8 * sizes[0] for s in sizes[1:]), sizes
    assert dstt.open(tmp_path / "run").entry("w", 3).keyframes == [dstt.open(tmp_path / "run").entry("w", 0).slots[0]]


def test_dstt_save_codes_against_the_stored_keyframe(tmp_path: Path, forced: None) -> None:
    """A new writer per step (dstt.save) reads the keyframe back."""
    rng = np.random.default_rng(4)
    t = random_bits((50,), torch.bfloat16, rng)
    saved = []
    for step in range(3):
        dstt.save(tmp_path / "run", step, {"t": t}, compression="delta")
        saved.append(t.clone())
        t = nudge(t, rng)
    run = dstt.open(tmp_path / "run")
    assert run.entry("t", 2).keyframes == [run.entry("t", 0).slots[0]]
    assert all(bits_equal(run.read("t", s), saved[s]) for s in range(3))


def test_slices_read_only_overlapping_chunks_and_their_keyframes(tmp_path: Path, forced: None) -> None:
    rng = np.random.default_rng(5)
    t = random_bits((64, 4), torch.float32, rng)
    with Writer(tmp_path / "run", WriteOptions(compression="delta", max_chunk_bytes=16 * 4 * 4)) as w:
        w.write(0, {"t": t})
        w.write(1, {"t": nudge(t, rng)})
    run = dstt.open(tmp_path / "run")
    reads: list[str] = []
    original = run.backend.get
    run.backend.get = lambda key, *a, **k: (reads.append(key), original(key, *a, **k))[1]  # type: ignore[method-assign]
    run.read("t", 1, index=slice(17, 20))
    chunk_reads = sorted(k.rsplit("/", 2)[-2:][0][-6:] + "/" + k.rsplit("/", 1)[1] for k in reads if "/c." in k)
    assert len(chunk_reads) == 2, reads  # the delta and its keyframe, nothing else
    assert any(".delta" in k for k in reads if "/c." in k)


def test_diff_and_history_match_uncompressed_storage(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(40, 30, generator=g)
    for comp in ("none", "delta"):
        x = w.clone()
        with Writer(tmp_path / comp, WriteOptions(compression=comp)) as wr:
            for step in range(4):
                wr.write(step, {"w": x.clone(), "b": x[0].to(torch.bfloat16)})
                x += 1e-3 * torch.randn(x.shape, generator=g.manual_seed(step))
    a, b = dstt.open(tmp_path / "none"), dstt.open(tmp_path / "delta")
    assert a.diff(0, 3) == b.diff(0, 3)
    assert a.history("w") == b.history("w")


# ----------------------------------------------------------------------------- integrity and retention


def test_corrupt_keyframe_or_delta_is_reported_never_read_as_data(tmp_path: Path, forced: None) -> None:
    rng = np.random.default_rng(7)
    t = random_bits((300,), torch.float32, rng)
    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as w:
        w.write(0, {"t": t})
        w.write(1, {"t": nudge(t, rng)})
    key = next((tmp_path / "run" / "tensors" / "t").glob("@*bsz1/c.*"))
    data = bytearray(key.read_bytes())
    data[20] ^= 0xFF
    key.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="keyframe"):
        dstt.open(tmp_path / "run").read("t", 1)
    report = verify(tmp_path / "run")
    assert {(p.step, p.kind) for p in report.problems} == {(0, "checksum"), (1, "checksum")}
    key.unlink()
    with pytest.raises(CorruptStoreError, match="missing"):
        dstt.open(tmp_path / "run").read("t", 1)


def test_prune_and_gc_keep_the_keyframes_kept_deltas_use(tmp_path: Path, forced: None) -> None:
    rng = np.random.default_rng(8)
    t = random_bits((100,), torch.float32, rng)
    saved = {}
    with Writer(tmp_path / "run", WriteOptions(compression="delta", keyframe_every=4)) as w:
        for step in range(10):
            w.write(step, {"t": t})
            saved[step] = t.clone()
            t = nudge(t, rng)
    prune(tmp_path / "run", keep_every=3)  # keeps 0, 3, 6, 9: deltas 3 (key 0), 6 (key 4), 9 (key 8)
    report = gc(tmp_path / "run")
    assert report.chunks_removed > 0
    run = dstt.open(tmp_path / "run")
    assert run.steps() == [0, 3, 6, 9]
    for s in run.steps():
        assert bits_equal(run.read("t", s), saved[s])
    assert verify(tmp_path / "run").ok


# ----------------------------------------------------------------------------- format


def test_store_version_is_raised_and_format_1_steps_stay_readable(tmp_path: Path) -> None:
    path = tmp_path / "run"
    dstt.save(path, 0, {"t": torch.arange(5.0)})
    assert json.loads((path / "zarr.json").read_text())["attributes"]["dstt"]["format_version"] == 1
    dstt.save(path, 1, {"t": torch.arange(5.0) + 1}, compression="delta")
    assert json.loads((path / "zarr.json").read_text())["attributes"]["dstt"]["format_version"] == 2
    commit = lambda s: json.loads((path / "meta" / "steps" / "main" / f"{s:020d}" / "commit.json").read_text())  # noqa: E731
    assert (commit(0)["format_version"], commit(1)["format_version"]) == (1, 2)
    run = dstt.open(path)
    assert torch.equal(run.read("t", 0), torch.arange(5.0)) and torch.equal(run.read("t", 1), torch.arange(5.0) + 1)


def test_plain_zarr_reads_keyframes_and_deltas(tmp_path: Path, forced: None) -> None:
    """Both arrays are core Zarr v3 (bytes -> blosc -> crc32c); a delta is
    the keyframe's bits plus the unzigzagged integers of the delta array."""
    rng = np.random.default_rng(9)
    t0 = random_bits((20, 3), torch.float32, rng)
    t1 = nudge(t0, rng)
    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as w:
        w.write(0, {"m": {"t": t0}})
        w.write(1, {"m": {"t": t1}})
    e = dstt.open(tmp_path / "run").entry("m/t", 1)
    root = zarr.open_group(tmp_path / "run", mode="r")
    assert sorted(root["tensors/m/t"].array_keys()) == sorted([e.array.rsplit("/", 1)[1], e.delta_array.rsplit("/", 1)[1]])
    key = root[e.array][e.keyframes[0]]
    z = root[e.delta_array][e.slots[0]]
    assert z.dtype == np.uint32
    bits = key.view(np.uint32) + ((z >> 1) ^ (0 - (z & 1)))
    assert np.array_equal(bits.view(np.float32).view(np.uint32), t1.numpy().view(np.uint32))
    assert np.array_equal(root[e.array][dstt.open(tmp_path / "run").entry("m/t", 0).slots[0]].view(np.uint32),
                          t0.numpy().view(np.uint32))


def test_keyframe_chunks_are_what_zarr_python_writes(tmp_path: Path) -> None:
    t = torch.randn(33, 5)
    with Writer(tmp_path / "run", WriteOptions(compression="shuffle-zstd")) as w:
        w.write(0, {"t": t})
    e = dstt.open(tmp_path / "run").entry("t", 0)
    ours = (tmp_path / "run" / e.array / f"c.{e.slots[0]}.0.0").read_bytes()
    meta = json.loads((tmp_path / "run" / e.array / "zarr.json").read_text())
    other = zarr.create_array(tmp_path / "z", shape=(2, 33, 5), chunks=(1, 33, 5), dtype="float32",
                              serializer=meta["codecs"][0], compressors=meta["codecs"][1:],
                              filters=None, fill_value=0.0)
    other[0] = t.numpy()
    theirs = (tmp_path / "z" / "c" / "0" / "0" / "0").read_bytes()
    assert ours == theirs


# ----------------------------------------------------------------------------- capture: reference = previous captured step


def _train_and_capture(path: Path, jitter: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    frozen = torch.randn(500)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if jitter:  # even steps' flushes finish after the next step's: out of order
        rnd = random.Random(1)
        original = Flusher.flush_chunk

        def slow(self: Flusher, plan: StepPlan, task: ChunkTask, *a: object, **k: object):  # type: ignore[no-untyped-def]
            time.sleep(0.05 if plan.step % 2 == 0 and task in plan.tasks[:2] else rnd.random() * 0.002)
            return original(self, plan, task, *a, **k)

        monkeypatch.setattr(Flusher, "flush_chunk", slow)
    with dstt.Capture(path, compression="delta", flush_threads=3 if jitter else 1,
                      max_chunk_bytes=2048) as cap:
        for step in range(8):
            model(torch.randn(16, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt, extra={"frozen": frozen})
    monkeypatch.undo()


def _stored_bytes(path: Path) -> dict[str, str]:
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and ("/c." in str(p) or p.name == "index.json"):
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_two_identical_captures_store_identical_bytes_whatever_the_timing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train_and_capture(tmp_path / "a", False, monkeypatch)
    _train_and_capture(tmp_path / "b", True, monkeypatch)
    a, b = _stored_bytes(tmp_path / "a"), _stored_bytes(tmp_path / "b")
    assert a == b
    run = dstt.open(tmp_path / "a")
    # the frozen tensor is written once, then referenced by every step
    assert {tuple(run.entry("extra/frozen", s).slots) for s in run.steps()} == {tuple(run.entry("extra/frozen", 0).slots)}
    assert any(k is not None for k in run.entry("model/0.weight", 3).keyframes)
    assert verify(tmp_path / "a").ok


# ----------------------------------------------------------------------------- docs/format.md's recipe


def recipe_code() -> str:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    section = doc.split("## Reading a tensor with zarr-python alone", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def run_recipe(store: str, branch: str, step: int, name: str) -> np.ndarray:
    first = "store, branch, step, name = "
    code = recipe_code()
    assert code.count(first) == 1
    lines = [f"{first}{store!r}, {branch!r}, {step}, {name!r}" if line.startswith(first) else line
             for line in code.splitlines()]
    scope: dict = {}
    exec("\n".join(lines), scope)  # noqa: S102 - the documented recipe itself
    return scope["out"]


def as_tensor(out: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(out.copy())
    return t if t.dtype == dtype else t.view(dtype)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_docs_recipe_reads_every_kind_of_chunk_verbatim(tmp_path: Path, where: str) -> None:
    """The recipe, run as written with zarr-python: multi-chunk tensors in
    mixed slots, delta chunks, a branch's inherited step, bfloat16, float8,
    0-d and empty tensors; on a local path and on memory://."""
    store = str(tmp_path / "run") if where == "local" else f"memory://recipe-{tmp_path.name}"
    g = torch.Generator().manual_seed(10)
    big = torch.randn(40, 3, generator=g)
    state = {"model": {"big": big, "bf": torch.randn(12, 5, generator=g).to(torch.bfloat16),
                       "f8": torch.randn(5, generator=g).to(torch.float8_e5m2), "zero_d": torch.tensor(-0.0),
                       "empty": torch.empty(0, 3), "mask": torch.tensor([True, False])}}
    saved = []
    with Writer(store, WriteOptions(compression="delta", max_chunk_bytes=3 * 4 * 16)) as w:  # 16 rows per chunk
        for step in range(3):
            big[-1] += 1  # only the last chunk of "big" changes: mixed slots
            big[0] += 1e-6
            w.write(step, state)
            saved.append({k: v.clone() for k, v in state["model"].items()})
    with Writer(store, WriteOptions(branch="b", parent=("main", 1), compression="delta")) as w:
        w.write(2, {"model": {"big": big * 2}})
    e = dstt.open(store).entry("model/big", 2)
    assert len(set(e.slots)) == 2 and any(k is not None for k in e.keyframes)
    for name, want in saved[2].items():
        assert bits_equal(as_tensor(run_recipe(store, "main", 2, f"model/{name}"), want.dtype), want), name
    # step 1 of branch b is inherited from main:1
    assert bits_equal(as_tensor(run_recipe(store, "b", 1, "model/big"), torch.float32), saved[1]["big"])
    assert bits_equal(as_tensor(run_recipe(store, "b", 2, "model/big"), torch.float32), big * 2)


def test_docs_recipe_refuses_missing_and_corrupt_chunks(tmp_path: Path, forced: None) -> None:
    store = tmp_path / "run"
    rng = np.random.default_rng(11)
    t = random_bits((30,), torch.float32, rng)
    with Writer(store, WriteOptions(compression="delta")) as w:
        w.write(0, {"t": t})
        w.write(1, {"t": nudge(t, rng)})
    e = dstt.open(store).entry("t", 1)
    delta_chunk = store / e.delta_array / f"c.{e.slots[0]}.0"
    data = delta_chunk.read_bytes()
    delta_chunk.write_bytes(data[:-4] + bytes(4))  # wrong trailer: zarr's crc32c codec refuses it
    with pytest.raises(Exception):  # noqa: B017 - zarr raises its own error type
        run_recipe(str(store), "main", 1, "t")
    delta_chunk.unlink()  # plain zarr would read zeros here
    with pytest.raises(KeyError, match="c.1.0"):
        run_recipe(str(store), "main", 1, "t")
    (store / e.delta_array / f"c.{e.slots[0]}.0").write_bytes(data)
    # a valid chunk in the wrong place (another step's): only the index CRC tells
    other = tmp_path / "plain"
    with Writer(other) as w:
        w.write(0, {"t": t})
        w.write(1, {"t": t + 1})
    a = dstt.open(other).entry("t", 1).array
    (other / a / "c.1.0").write_bytes((other / a / "c.0.0").read_bytes())
    with pytest.raises(AssertionError, match="corrupt"):
        run_recipe(str(other), "main", 1, "t")


def test_a_writer_that_only_plans_keeps_bounded_references(tmp_path: Path) -> None:
    """A trainer's writer whose steps are stored by another process (or never
    committed) must not keep every plan's reference chain alive."""
    from dstt.store.writer import MAX_OPEN_PLANS

    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as w:
        plans = [w.plan(s, {"t": torch.full((4,), float(s))}) for s in range(MAX_OPEN_PLANS + 10)]
        assert w.open_plans == MAX_OPEN_PLANS
        first = next(iter(plans[0].links.values()))
        assert first.peek() == (True, None)  # settled: nothing behind it stays reachable
        untracked = w.plan(MAX_OPEN_PLANS + 10, {"t": torch.zeros(4)}, track=False)
        assert untracked.links == {} and w.open_plans == MAX_OPEN_PLANS


def test_restore_and_export_of_delta_steps_equal_uncompressed(tmp_path: Path) -> None:
    """Restore into a fresh model/optimizer and export to .pt give exactly
    what an uncompressed store gives, at a step stored as deltas."""
    def train(compression: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with Writer(tmp_path / compression, WriteOptions(compression=compression)) as w:
            for step in range(4):
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                w.write(step, dstt.state_of(model=model, optimizer=opt, rng=False))
        return model, opt

    trained, _ = train("delta")
    train("none")
    assert any(k is not None for k in dstt.open(tmp_path / "delta").entry("model/0.weight", 3).keyframes)
    for comp in ("none", "delta"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dstt.restore(f"{tmp_path / comp}:3", model=model, optimizer=opt, rng=False)
        assert all(bits_equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
        dstt.export(f"{tmp_path / comp}:3", tmp_path / f"{comp}.pt")
    a = torch.load(tmp_path / "none.pt", weights_only=True)
    b = torch.load(tmp_path / "delta.pt", weights_only=True)
    assert bits_equal(a["model"]["0.weight"], b["model"]["0.weight"])
    assert bits_equal(a["optim"]["state"][0]["exp_avg"], b["optim"]["state"][0]["exp_avg"])  # (state_dict form: id 0 is 0.weight)


def test_plain_zarr_lists_every_array(tmp_path: Path) -> None:
    """Item 6: a group zarr.json in every directory under tensors/, so a
    hierarchy walk finds every tensor's array."""
    state = {"model": {"layers.0": {"w": torch.ones(2)}, "b": torch.zeros(3)}, "rng": torch.ones(1)}
    dstt.save(tmp_path / "run", 0, state)
    tensors = zarr.open_group(tmp_path / "run", mode="r")["tensors"]
    arrays = sorted(f"tensors/{path}" for path, node in tensors.members(max_depth=None) if isinstance(node, zarr.Array))
    run = dstt.open(tmp_path / "run")
    assert arrays == sorted(e.array for e in run.record(0).entries)


@pytest.mark.parametrize("damage", ["array", "length", "slot", "codec", "dtype"])
def test_hostile_delta_entries_are_refused_with_a_clear_error(tmp_path: Path, forced: None, damage: str) -> None:
    from dstt.format.manifest import parse_entry

    rng = np.random.default_rng(12)
    t = random_bits((10,), torch.float32, rng)
    with Writer(tmp_path / "run", WriteOptions(compression="delta")) as w:
        w.write(0, {"t": t})
        w.write(1, {"t": nudge(t, rng)})
    index = json.loads((tmp_path / "run" / "meta" / "steps" / "main" / f"{1:020d}" / "index.json").read_text())
    entry = index["tensors"][0]
    parse_entry(entry, "index")  # intact: accepted
    if damage == "array":
        entry["delta"]["array"] = "tensors/other/@x.delta"
    elif damage == "length":
        entry["delta"]["keyframes"] = [None, None]
    elif damage == "slot":
        entry["delta"]["keyframes"] = [-1]
    elif damage == "codec":
        entry["codec"][1]["configuration"]["clevel"] = 9  # not what dstt writes
    else:
        entry["dtype"] = "complex128"  # no delta coding for 16-byte items
    with pytest.raises(CorruptStoreError):
        parse_entry(entry, "index")


def test_auto_stores_fast_while_the_writer_is_behind(tmp_path: Path, forced: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """compression="auto": predictive coding, except for steps planned while
    two earlier ones are still being written -- stored without compression
    (the same Blosc chain, readable by any reader), recorded in commit.json,
    and the step after it predicted from it."""
    from dstt.store import writer as W
    from dstt.store.writer import AUTO_BEHIND

    monkeypatch.setattr(W, "AUTO_CPU_CORES", math.inf)  # the backlog rule alone
    g = torch.Generator().manual_seed(13)
    states = [{"w": torch.randn(64, 32, generator=g) + 0.0}]
    for _ in range(AUTO_BEHIND + 2):
        states.append({"w": states[-1]["w"] + 1e-4 * torch.randn(64, 32, generator=g)})
    path = tmp_path / "run"
    with Writer(path, WriteOptions(compression="auto")) as w:
        w.write(0, states[0])
        plans = [w.plan(s, states[s]) for s in range(1, AUTO_BEHIND + 2)]  # nothing committed meanwhile
        assert [p.fast for p in plans] == [False] * AUTO_BEHIND + [True]
        for p in plans:
            w.prepare_pred(p)
            w.commit(p, [w.flush_chunk(p, t) for t in p.tasks])
        w.write(AUTO_BEHIND + 2, states[-1])
    run = dstt.open(path)
    for s, state in enumerate(states):
        assert bits_equal(run.read("w", s), state["w"])
    fast = AUTO_BEHIND + 1
    assert [run.commit_info(s).get("coding") for s in range(len(states))] == \
        [None] * fast + ["fast"] + [None]
    raw = 64 * 32 * 4
    assert run.tensors(fast)[0].written > raw  # stored whole, uncompressed (Blosc header and CRC)
    assert run.entry("w", fast).pred is None  # stored whole
    assert run.entry("w", 1).pred.chunks == [(0, 1, 0)]  # (a chained delta: no optimizer)
    assert run.entry("w", fast + 1).pred.chunks == [(0, fast + 1, fast)]  # the next step is predicted from it
    root = zarr.open_group(path, mode="r")  # plain zarr decodes the uncompressed Blosc chunk too
    e = run.entry("w", fast)
    assert np.array_equal(root[e.array][e.slots[0]], states[fast]["w"].numpy())
    assert verify(path).ok


def test_auto_stores_fast_when_encoding_exceeds_its_cpu_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compression="auto" with a CPU budget of 0 cores: any coding since the
    previous planned step makes the next one fast; every step reads back."""
    from dstt.store import writer as W

    monkeypatch.setattr(W, "AUTO_CPU_CORES", 0.0)
    g = torch.Generator().manual_seed(14)
    w = torch.randn(128, 64, generator=g)
    saved = []
    with Writer(tmp_path / "run", WriteOptions(compression="auto")) as wr:
        for step in range(3):
            wr.write(step, {"w": w})
            saved.append(w.clone())
            w = w + 1e-4 * torch.randn(w.shape, generator=g)
    run = dstt.open(tmp_path / "run")
    assert [run.commit_info(s).get("coding") for s in range(3)] == [None, "fast", "fast"]
    assert all(bits_equal(run.read("w", s), saved[s]) for s in range(3))
