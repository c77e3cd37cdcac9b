"""Batched flush of small chunks (issue 16; dstt/store/flusher.py):
Writer.flush_chunks stores exactly what flush_chunk stores -- bit-exact round
trips (mixed dtypes, padded, non-contiguous, conjugate and negative views),
dedup of unchanged steps, pending predecessors, failures in the middle of a
batch -- and its vectorized stats equal chunk_partial's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.errors import CaptureError
from dstt.format import layout as L
from dstt.format.manifest import parse_index
from dstt.format.packs import StepPacks
from dstt.format.partials import finalize, merge
from dstt.format.writeoptions import WriteOptions
from dstt.store.flusher import Flusher, batchable
from dstt.store.stats import batch_partials, chunk_partial
from dstt.store.writer import Writer

#: This module runs with packing on (tests/conftest.py turns it off elsewhere).
DSTT_PACKING = True


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """Small tensors of every kind the batch path takes or hands back."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(6, generator=g, dtype=torch.complex64)
    return {
        "f32": {f"w{i}": torch.randn(37, generator=g) for i in range(20)},
        "f64": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "f16": torch.randn(11, generator=g).half(),
        "bf16": torch.randn(13, generator=g).bfloat16(),
        "i64": torch.randint(-(2 ** 40), 2 ** 40, (7,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (4, 4), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "strided": torch.randn(40, generator=g)[::3],
        "conj": c.conj(),  # a lazy conjugate view
        "neg": torch._neg_view(c),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "nan": torch.tensor([1.0, float("nan"), -0.0, float("inf")]),
        "padded": torch.randn(300, generator=g),  # chunks of 64 values: an edge chunk
    }


def assert_state(want: Any, got: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        w = want.resolve_conj().resolve_neg()
        assert bits_equal(got, w.contiguous()), where
    else:
        assert got.keys() == want.keys(), where
        for k in want:
            assert_state(want[k], got[k], f"{where}/{k}")


def flat(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def write_one_by_one(w: Writer, step: int, state: Any) -> Any:
    """A step flushed by flush_chunk alone (what flush_chunks must equal)."""
    plan = w.plan(step, state)
    w.ensure_arrays(plan)
    return w.commit(plan, [w.flush_chunk(plan, t) for t in plan.tasks])


def stats_of(store: Path, step: int) -> dict[str, dict[str, float]]:
    return {e.name: e.stats for e in dstt.open(store).tensors(step)}


def test_mixed_step_round_trips_bit_exact_and_stats_match_flush_chunk(tmp_path: Path) -> None:
    state = mixed_state()
    with Writer(tmp_path / "batch", WriteOptions(max_chunk_bytes=256)) as w:
        plan = w.plan(0, state)
        grouped = [t for t in plan.tasks if batchable(t, t.source)]
        assert len(grouped) >= 20 and len(grouped) < len(plan.tasks)  # both paths taken
        w.write(1, state)  # (write() goes through flush_chunks; step 0 is only planned)
    with Writer(tmp_path / "single", WriteOptions(max_chunk_bytes=256)) as w:
        write_one_by_one(w, 1, state)
    for name in ("batch", "single"):
        assert_state(state, dstt.open(tmp_path / name).state_dict(1))
    got, want = stats_of(tmp_path / "batch", 1), stats_of(tmp_path / "single", 1)
    assert got.keys() == want.keys()
    for name in want:
        for col, v in want[name].items():
            assert got[name][col] == pytest.approx(v, rel=1e-5, abs=1e-6, nan_ok=True), (name, col)


def test_unchanged_step_is_deduplicated_with_nothing_written(store: Path) -> None:
    state = mixed_state(1)
    with Writer(store) as w:
        first = w.write(0, state)
        assert first.bytes_written > 0
        packs = sorted(p.name for p in (store / "packs").iterdir())
        second = w.write(1, state)
        assert second.bytes_written == 0 and second.bytes_referenced > 4000
        assert sorted(p.name for p in (store / "packs").iterdir()) == packs
        state["f32"]["w3"] = state["f32"]["w3"] + 1  # one tensor changes
        third = w.write(2, state)
        assert 0 < third.bytes_written < first.bytes_written // 10
    # a new writer (dstt.save) dedups against the stored index by hash
    assert dstt.save(store, 3, state).bytes_written == 0
    run = dstt.open(store)
    for step in (1, 2, 3):
        assert_state(state if step > 1 else mixed_state(1), run.state_dict(step))
    data = (store / L.step_dir("main", 3) / L.INDEX_FILE).read_bytes()
    slots = {e.name: e.slots[0] for e in parse_index(data, "index.json")[0] if e.slots}
    assert slots["f32/w3"] == L.slot_for(0, 2) and slots["f32/w0"] == L.slot_for(0, 0)


def test_pending_predecessor_is_waited_for(store: Path) -> None:
    """A chunk whose previous step's chunk is not stored yet (flushed later)
    finishes once it is: same dedup as in order."""
    state = {f"t{i}": torch.randn(32) for i in range(50)}
    with Writer(store) as w:
        p0 = w.plan(0, state)
        p1 = w.plan(1, state)
        w.ensure_arrays(p0)
        r1, e1 = w.flush_chunks(p1, p1.tasks)
        assert e1 is None and len(r1) == 50 and all(r.pending is not None for r in r1)
        r0, e0 = w.flush_chunks(p0, p0.tasks)
        assert e0 is None and all(r.pending is None for r in r0)
        w.commit(p0, r0)
        info = w.commit(p1, r1)
    assert info.bytes_written == 0
    assert_state(state, dstt.open(store).state_dict(1))


def test_pack_write_failure_mid_batch_fails_the_step_and_the_next_stores_everything(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(256) + i for i in range(300)}  # 300 KiB: several 64 KiB packs
    monkeypatch.setattr("dstt.format.packs.PACK_TARGET_BYTES", 64 << 10)
    with Writer(store) as w:
        w.write(0, state)
        state = {k: v + 1 for k, v in state.items()}
        real_put = w.backend.put
        calls = []

        def put(key: str, data: Any) -> None:
            if key.startswith("packs/p.") and key.endswith(".1"):
                calls.append(key)
                raise OSError("disk full")
            real_put(key, data)

        monkeypatch.setattr(w.backend, "put", put)
        with pytest.raises(CaptureError, match="disk full"):
            w.write(1, state)
        assert calls
        monkeypatch.setattr(w.backend, "put", real_put)
        info = w.write(2, state)
        # the chunks of the lost pack are stored again; the rest of step 1
        # (written, uncommitted: the previous *captured* step) is referenced
        assert 60 * 1028 <= info.bytes_written < 300 * 1028 and info.bytes_referenced > 0
    run = dstt.open(store)
    assert [s for s in run.steps()] == [0, 2]
    assert_state(state, run.state_dict(2))


def test_add_many_reports_a_failed_pack_and_keeps_the_others(store: Path) -> None:
    from dstt.format.backends import open_backend

    b = open_backend(store, create=True)
    packs = StepPacks(b, slot=9, rank=0, target_bytes=4)
    real_put = b.put
    b.put = lambda key, data: (_ for _ in ()).throw(OSError("no")) if key.endswith(".0") else real_put(key, data)  # type: ignore[method-assign]
    placed, err = packs.add_many([[b"abcd"], [b"efgh"], [b"ij"]])
    assert isinstance(err, OSError)
    assert [f.state for f, _ in placed] == ["failed", "written", "open"]
    with pytest.raises(CaptureError):
        packs.close()
    assert bytes(b.get("packs/p.9.0.1")) == b"efgh" and bytes(b.get("packs/p.9.0.2")) == b"ij"
    with pytest.raises(CaptureError, match="closed"):
        packs.add_many([[b"x"]])


def _want_rows(values: list[torch.Tensor], prevs: list[torch.Tensor | None]) -> list[list[float]]:
    return [chunk_partial(v, p).to_list() for v, p in zip(values, prevs)]


def _assert_rows(got: list[list[float]], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0] and g[6] == w[6]
        # (M2 within 1e-4: chunk_partial's two-pass variance of float32 values is float32)
        assert g[1:6] == pytest.approx(w[1:6], rel=1e-4, abs=1e-5, nan_ok=True)
        assert g[7] == pytest.approx(w[7], rel=1e-5, abs=1e-5, nan_ok=True)
        # merged and finalized, the stats rows agree too
        fg, fw = finalize(merge([_p(g)])), finalize(merge([_p(w)]))
        assert fg == pytest.approx(fw, rel=1e-4, abs=1e-5, nan_ok=True)


def _p(row: list[float]) -> Any:
    from dstt.format.partials import Partial

    return Partial.from_list(row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool])
def test_batch_partials_equal_chunk_partial(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    sizes = [1, 2, 7, 256, 1000, 3]
    values = [(torch.randn(n, generator=g) * 50).to(dtype) for n in sizes]
    prevs: list[torch.Tensor | None] = [(v.double() + 1).to(dtype) for v in values]
    flat_values = torch.cat(values)
    _assert_rows(batch_partials(flat_values, sizes), _want_rows(values, [None] * len(values)))
    _assert_rows(batch_partials(flat_values, sizes, prevs), _want_rows(values, prevs))
    prevs[2] = None  # some without a previous value, one of another size
    prevs[3] = torch.zeros(5, dtype=dtype)
    _assert_rows(batch_partials(flat_values, sizes, prevs), _want_rows(values, prevs))


def test_update_sum_of_boolean_values() -> None:
    """chunk_partial(bool, previous bool) raised (torch refuses to subtract
    booleans): a model's bool buffer failed every step of the memory tier."""
    x, prev = torch.tensor([True, False, True]), torch.tensor([False, False, True])
    assert chunk_partial(x, prev).usq == 1.0
    assert batch_partials(x, [3], [prev])[0][7] == 1.0


def test_batch_partials_of_values_that_require_grad() -> None:
    x = torch.randn(10, requires_grad=True)
    prevs: list[torch.Tensor | None] = [x[:4] + 1, x[4:] * 2]
    values = [x[:4], x[4:]]
    _assert_rows(batch_partials(x, [4, 6], prevs), _want_rows(values, prevs))


def test_batch_partials_non_finite_and_cancellation() -> None:
    inf, nan = math.inf, math.nan
    values = [torch.tensor([1.0, nan, 2.0]), torch.tensor([inf, 1.0]), torch.tensor([-inf, inf]),
              torch.tensor([1e200, 1e200], dtype=torch.float64),  # the sum of squares overflows
              1e4 + torch.randn(500, generator=torch.Generator().manual_seed(1)) * 1e-3,  # |mean| >> std
              torch.tensor([5.0])]
    for dtype in (torch.float32, torch.float64):
        vs = [v.to(dtype) for v in values]
        rows = batch_partials(torch.cat(vs), [v.numel() for v in vs])
        _assert_rows(rows, _want_rows(vs, [None] * len(vs)))
        assert [r[6] for r in rows] == [1, 1, 2, 0 if dtype == torch.float64 else 2, 0, 0]
        # the cancellation case: M2 from the exact two-pass formula, as torch.var gives it
        x = vs[4].double()
        assert rows[4][2] == pytest.approx(float(torch.var(x, correction=0)) * 500, rel=1e-9)
    # finite float32 values whose float32 sum overflows: the batch sums in float64
    big = torch.tensor([3e38, 3e38])
    assert batch_partials(big, [2])[0][:4] == pytest.approx([2, 3e38, 0.0, 1.8e77], rel=1e-6)


def test_capture_memory_tier_batches_with_update_stats(store: Path) -> None:
    """The memory tier's flush of its staged views passes the previous
    step's staged views: update_norm of a batch equals the exact value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with dstt.Capture(store, helper=False, memory_steps=2, persist="all") as cap:
        cap.snapshot(0, model=model, rng=False)
        with torch.no_grad():
            for v in model.parameters():
                v.add_(torch.randn_like(v))
        cap.snapshot(1, model=model, rng=False)
    run = dstt.open(store)
    after = model.state_dict()
    assert_state({f"model/{k}": v for k, v in after.items()},
                 {k: v for k, v in flat(run.state_dict(1)).items()})
    st = {e.name: e.stats for e in run.tensors(1)}
    for k in after:
        want = float((after[k] - before[k]).double().norm())
        assert st[f"model/{k}"]["update_norm"] == pytest.approx(want, rel=1e-6)


def test_in_thread_capture_flushes_staged_groups_together(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture(helper=False) with its staging ring: the small eager tensors
    copied as a group are flushed by one flush_chunks call (the stager's group flush)."""
    sizes: list[int] = []
    real = Writer.flush_chunks

    def spy(self: Writer, plan: Any, tasks: Any, *args: Any, **kw: Any) -> Any:
        sizes.append(len(tasks))
        return real(self, plan, tasks, *args, **kw)

    monkeypatch.setattr(Writer, "flush_chunks", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])
    want = {}
    with dstt.Capture(store, helper=False, shm=True) as cap:
        for step in range(3):
            with torch.no_grad():
                model[step].weight.add_(1.0)  # one tensor changes per step
            cap.snapshot(step, model=model, rng=False)
            cap.wait()
            want[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert max(sizes) == 60  # the 60 small tensors in one call
    run = dstt.open(store)
    for step in range(3):
        assert_state({f"model/{k}": v for k, v in want[step].items()}, flat(run.state_dict(step)))
        st = {e.name: e.stats for e in run.tensors(step)}
        w = want[step]["5.weight"].double()
        assert st["model/5.weight"]["norm"] == pytest.approx(float(w.norm()), rel=1e-9)


@pytest.mark.parametrize("compression", ["none", "zstd", "delta"])
def test_unpacked_groups_store_chunk_files_with_every_codec(store: Path, compression: str) -> None:
    """Packing off: a group's chunks go through the flusher's chunk-file store (chunk files,
    delta coding against keyframes) -- the same bytes over several steps."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(64, generator=g) for i in range(40)}
    want = {}
    with Writer(store, WriteOptions(compression=compression, pack_chunk_bytes=0)) as w:
        for step in range(4):
            state = {k: (v + 0.01 * step if i % 3 else v) for i, (k, v) in enumerate(state.items())}
            info = w.write(step, state)
            want[step] = state
            if step:
                assert info.bytes_referenced > 0  # every third tensor unchanged: deduplicated
    assert not (store / "packs").exists() or not any((store / "packs").glob("p.*"))
    run = dstt.open(store)
    for step in range(4):
        assert_state(want[step], run.state_dict(step))


def test_chunk_file_failure_mid_group_fails_the_step_only(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(32) for i in range(30)}
    with Writer(store, WriteOptions(pack_chunk_bytes=0)) as w:
        w.write(0, state)
        changed = {k: v + 1 for k, v in state.items()}
        real_put = w.backend.put
        n = {"puts": 0}

        def put(key: str, data: Any) -> None:
            if key.startswith("tensors/"):
                n["puts"] += 1
                if n["puts"] == 10:
                    raise OSError("disk full")
            real_put(key, data)

        monkeypatch.setattr(w.backend, "put", put)
        with pytest.raises(CaptureError, match="disk full"):
            w.write(1, changed)
        assert n["puts"] == 30  # every other chunk still written: none left running
        monkeypatch.setattr(w.backend, "put", real_put)
        w.write(2, changed)
    run = dstt.open(store)
    assert run.steps() == [0, 2]
    assert_state(changed, run.state_dict(2))
    assert_state(state, run.state_dict(0))


def test_a_store_error_before_the_write_still_settles_the_link(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grouped chunk whose store fails before anything is written (here:
    the flusher's chunk-file store raising at once) passes its link through: the next step's
    same chunk does not wait for it forever."""
    import threading

    state = {f"t{i}": torch.randn(16) for i in range(50)}
    real_store = Flusher._store

    def failing_store(self: Flusher, plan: Any, task: Any, *args: Any) -> Any:
        if plan.step == 1 and task.layout.name == "t20":
            raise OSError("no")
        return real_store(self, plan, task, *args)

    monkeypatch.setattr(Flusher, "_store", failing_store)
    with Writer(store, WriteOptions(pack_chunk_bytes=0)) as w:
        w.write(0, state)
        changed = {k: v + 1 for k, v in state.items()}
        with pytest.raises(CaptureError, match="no"):
            w.write(1, changed)
        p2 = w.plan(2, changed)
        p3 = w.plan(3, changed)  # (planned after step 2: its chain waits on step 2's links)
        w.ensure_arrays(p2)
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(w.commit(p2, *w.flush_chunks(p2, p2.tasks))), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive() and out[0].step == 2
        w.commit(p3, *w.flush_chunks(p3, p3.tasks))
    assert_state(changed, dstt.open(store).state_dict(3))


def test_a_result_that_waited_for_its_predecessor_settles_picklable() -> None:
    """Under torch.distributed each rank's results are pickled to rank 0: a
    settled result must not carry its Future (it holds a lock), or the step
    fails with "cannot pickle '_thread.RLock'" whenever a chunk had waited."""
    import pickle
    from concurrent.futures import Future

    from dstt.format.commit import ChunkResult

    r = ChunkResult("a", 0, 1, None, 0, 4, 4, [1.0] * 8)
    f: Future[ChunkResult] = Future()
    r.pending = f
    f.set_result(r)  # what _wait_for's run() does: _store returns the same result
    done = r.settled()
    assert done.pending is None and (done.name, done.crc, done.written) == ("a", 1, 4)
    assert pickle.loads(pickle.dumps(done)).crc == 1


def test_chunks_above_the_group_size_are_flushed_alone_with_the_group_stats(tmp_path: Path) -> None:
    """Issue 25: a chunk of 64 KiB and more is flushed alone (its stats a
    few float32 passes where it lies; a group copied it and the previous
    step's into its buffer and widened both to float64), a small one still
    in a group; both round-trip bit-exact, with the group's statistics
    (update statistics against the previous step's staged values included)."""
    g = torch.Generator().manual_seed(5)
    sizes = {"small": 4 << 10, "k64": 64 << 10, "k256": 256 << 10, "k663": 663552}
    prev = {k: torch.randn(n // 4, generator=g) for k, n in sizes.items()}
    prev["bf16"] = torch.randn(32 << 10, generator=g).bfloat16()  # 64 KiB, widened block by block
    state = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) * 1e-2 for k, v in prev.items()}
    with Writer(tmp_path / "s", WriteOptions(max_chunk_bytes=1 << 20)) as w:
        for step, values in ((0, prev), (1, state)):
            plan = w.plan(step, values)
            w.ensure_arrays(plan)
            alone = {t.layout.name for t in plan.tasks if not batchable(t, t.source)}
            assert alone == {"k64", "k256", "k663", "bf16"}
            given = [prev[t.layout.name] if step else None for t in plan.tasks]
            results, error = w.flush_chunks(plan, plan.tasks, None, given)
            assert error is None
            w.commit(plan, results)
    run = dstt.open(tmp_path / "s")
    assert_state(state, run.state_dict(1))
    stats = {e.name: e.stats for e in run.tensors(1)}
    for name, v in state.items():
        row = finalize(merge([_partial_of(batch_partials(v.reshape(-1), [v.numel()], [prev[name].reshape(-1)])[0])]))
        want = dict(zip(L.STATS_COLUMNS, row))
        for col, x in want.items():
            assert stats[name][col] == pytest.approx(x, rel=1e-5, abs=1e-6), (name, col)


def _partial_of(row: list[float]) -> Any:
    from dstt.format.partials import Partial

    return Partial.from_list(row)
