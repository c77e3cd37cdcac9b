"""The capture helper's write path made cheaper (issue 16, session 5): packs
filled in reused page-aligned buffers (written with O_DIRECT where the
filesystem allows), and sha256 only for dedup candidates and first-seen
packed chunks. Every shortcut must keep round trips bit-exact, dedup exact
(never aliasing different bytes) and verify clean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.format import packs as P
from dstt.format.backends import open_backend
from dstt.format.localio import DIRECT_ALIGN, address
from dstt.store.writer import Writer
from tests.format.test_store_format import forge_crc_collision

DSTT_PACKING = True  # (tests/conftest.py: packing is off elsewhere)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _flip_one_bit(t: torch.Tensor, byte: int = 5) -> torch.Tensor:
    raw = bytearray(_bits(t))
    raw[byte] ^= 0x01
    return torch.frombuffer(raw, dtype=t.dtype).clone()


def _check_steps(path: Path, steps: dict[int, dict[str, torch.Tensor]]) -> None:
    run = dstt.open(path)
    assert run.steps() == sorted(steps)
    for step, state in steps.items():
        for name, t in state.items():
            assert _bits(run.read(name, step)) == _bits(t), (step, name)
    report = dstt.verify(path)
    assert report.ok, report


def test_pack_buffers_are_page_aligned_reused_and_grow_bit_exact(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "_BUFFERS", P._Buffers(P.PACK_BUFFERS_KEEP_BYTES, P.PACK_BUFFERS_KEPT))
    backend = open_backend(str(tmp_path / "s"), create=True)
    chunks = [bytes(range(7)) * 3, b"x" * 5000, bytes(range(256)) * 40]
    first = P.StepPacks(backend, slot=1, rank=0, target_bytes=64 << 10)
    placed, err = first.add_many([[c] for c in chunks])
    assert err is None
    f = placed[0][0]
    assert f.buf is not None and address(f.data()) % DIRECT_ALIGN == 0
    buf = f.buf
    first.close()
    assert f.state == "written" and f.buf is None
    # the pack's bytes are the chunks back to back, exactly
    assert bytes(backend.get("packs/p.1.0.0") or b"") == b"".join(chunks)
    # the next step's pack fills the same buffer (pages already backed)
    second = P.StepPacks(backend, slot=2, rank=0, target_bytes=64 << 10)
    g, _ = second.add([b"new"])
    assert g.buf is buf
    # a chunk larger than the room left: the buffer grows, bytes kept
    big = bytes(range(251)) * (len(buf) // 251 + 10)
    _, rng = second.add([big])
    second.close()
    data = bytes(backend.get("packs/p.2.0.0") or b"")
    assert data == b"new" + big and (rng.offset, rng.length) == (3, len(big))
    assert bytes(backend.get("packs/p.1.0.0") or b"") == b"".join(chunks)  # the earlier pack untouched


def test_a_failed_pack_write_gives_its_buffer_back_and_raises(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_backend(str(tmp_path / "s"), create=True)
    packs = P.StepPacks(backend, slot=1, rank=0, target_bytes=1 << 30)
    f, _ = packs.add([b"abc"])

    def refuse(key: str, data: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(backend, "put", refuse)
    with pytest.raises(OSError, match="No space"):  # (the commit fails the step with it)
        packs.close()
    assert f.state == "failed" and f.buf is None and isinstance(f.error, OSError)


def test_changed_chunks_skip_the_hash_and_dedup_stays_exact(tmp_path: Path) -> None:
    """One writer across steps (as the capture helper): a first step's chunks
    are hashed, a changed chunk is not, an unchanged one after a change is
    proven equal by reading its range back (then hashed), a one-bit change
    and a forged CRC collision are stored, never aliased."""
    path = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    a0, frozen = torch.randn(1000, generator=g), torch.randn(64, generator=g)
    steps: dict[int, dict[str, torch.Tensor]] = {}
    w = Writer(str(path))
    try:
        steps[0] = {"a": a0, "frozen": frozen}
        w.write(0, steps[0])
        steps[1] = {"a": a0 + 1, "frozen": frozen}
        info1 = w.write(1, steps[1])
        assert info1.bytes_written > 0
        steps[2] = {"a": (a0 + 1).clone(), "frozen": frozen}
        info2 = w.write(2, steps[2])
        assert info2.bytes_written == 0  # unchanged: every chunk referenced
        steps[3] = {"a": _flip_one_bit(steps[2]["a"]), "frozen": frozen}
        assert w.write(3, steps[3]).bytes_written > 0
        forged = forge_crc_collision(_bits(steps[3]["a"]))
        steps[4] = {"a": torch.frombuffer(bytearray(forged), dtype=torch.float32).clone(), "frozen": frozen}
        assert w.write(4, steps[4]).bytes_written > 0  # same CRC as step 3, other bytes: stored
    finally:
        w.close()
    run = dstt.open(path)
    assert all(run.entry("a", s).packs is not None for s in steps)  # (the packed path is under test)
    sha = {s: run.entry("a", s).sha256[0] for s in steps}
    assert sha[0] is not None  # first step: hashed
    assert sha[1] is None and sha[3] is None  # changed: no hash
    assert sha[2] is not None  # proven equal to step 1 and referenced: hashed from then on
    assert run.entry("a", 2).slots == run.entry("a", 1).slots
    assert run.entry("frozen", 4).slots == run.entry("frozen", 0).slots  # deduplicated by hash
    assert run.entry("a", 4).slots != run.entry("a", 3).slots
    _check_steps(path, steps)


def test_unchanged_after_a_change_while_the_pack_is_unwritten_is_stored_anew(tmp_path: Path) -> None:
    """The helper flushes queued steps before committing them (group
    commit): step 2's chunk equals step 1's changed one, whose pack is not
    written yet and which has no hash -- stored again, exactly, not aliased."""
    path = tmp_path / "run"
    a0 = torch.randn(500, generator=torch.Generator().manual_seed(1))
    steps = {0: {"a": a0}, 1: {"a": a0 * 2}, 2: {"a": a0 * 2}}
    w = Writer(str(path))
    try:
        w.write(0, steps[0])
        plans = []
        for step in (1, 2):
            plan = w.plan(step, steps[step])
            w.ensure_arrays(plan)
            results, error = w.flush_chunks(plan, plan.tasks)
            assert error is None
            plans.append((plan, results))
        infos = [w.commit(plan, results) for plan, results in plans]
    finally:
        w.close()
    assert infos[1].bytes_written > 0  # not proven equal (nothing to compare with yet): written
    run = dstt.open(path)
    assert run.entry("a", 2).sha256[0] is not None  # a candidate: hashed, the next step dedups by hash
    _check_steps(path, steps)


def test_a_group_block_is_reused_but_never_under_a_waiting_chunk(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Group blocks (the flusher: the values a group concatenates) are reused
    from group to group; a chunk waiting for its predecessor keeps a slice of
    its block, which then is not reused: step 2 flushed before step 1 (its
    chunks wait), step 1's group must not overwrite step 2's bytes."""
    from dstt.store import flusher as B

    blocks = B._Blocks(2 * B.GROUP_BYTES)
    monkeypatch.setattr(B, "_GROUP_BUFFERS", blocks)
    path = tmp_path / "run"
    g = torch.Generator().manual_seed(2)
    steps = {s: {"a": torch.randn(300, generator=g), "b": torch.randn(40, generator=g)} for s in range(4)}
    w = Writer(str(path))
    try:
        w.write(0, steps[0])
        given = blocks._free[0]
        w.write(1, steps[1])
        assert blocks._free[0] is given  # taken for step 1's group and given back
        p2, p3 = w.plan(2, steps[2]), w.plan(3, steps[3])
        for p in (p2, p3):
            w.ensure_arrays(p)
        r3, e3 = w.flush_chunks(p3, p3.tasks)  # waits for step 2's chunks: keeps its block
        assert e3 is None and blocks._free == []
        want3 = steps[3]["a"].clone()
        steps[3]["a"].fill_(7.0)  # (the sources may change: the block holds step 3's bytes)
        r2, e2 = w.flush_chunks(p2, p2.tasks)  # a new block: step 3's is still sliced
        assert e2 is None
        w.commit(p2, r2)
        w.commit(p3, r3)
    finally:
        w.close()
    steps[3]["a"] = want3  # what was captured: the values before the fill
    _check_steps(path, steps)


@pytest.mark.parametrize("cancelling", [1, 3, 12])
def test_batch_m2_is_exact_where_the_shortcut_would_cancel(cancelling: int) -> None:
    """stats.batch_partials takes M2 = sumsq - total * mean where that is
    safe and the two-pass formula where it cancels (|mean| >> std: one
    segment at a time for a few, the whole block for many); both match an
    exactly rounded reference, one-value segments have M2 0."""
    import math

    from dstt.store.stats import batch_partials

    g = torch.Generator().manual_seed(cancelling)
    segs = [torch.randn(int(n), generator=g, dtype=torch.float64) for n in torch.randint(2, 400, (40,), generator=g)]
    for k in range(cancelling):  # 1e6 + tiny noise: sumsq - n*mean^2 loses every digit
        segs[3 * k] = 1e6 + 1e-4 * segs[3 * k]
    segs[-1] = torch.tensor([5.0], dtype=torch.float64)
    rows = batch_partials(torch.cat(segs), [s.numel() for s in segs])
    for s, row in zip(segs, rows):
        vals = s.tolist()
        mean = math.fsum(vals) / len(vals)
        want = math.fsum((x - mean) ** 2 for x in vals)
        assert row[2] == pytest.approx(want, rel=1e-9, abs=1e-300), (len(vals), row[1])


def test_a_single_writer_commits_a_step_with_one_store_sync_after_all_its_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """committer: a single writer's step syncs the store once -- after its
    packs, chunk files and index files, before its commit marker (the sync
    before the index files only mattered for other ranks' chunks)."""
    from dstt.format.backends.local import LocalBackend

    ops: list[str] = []
    real_sync, real_put, real_atomic = LocalBackend.sync, LocalBackend.put, LocalBackend.put_atomic

    def sync(self: LocalBackend) -> None:
        ops.append("sync")
        real_sync(self)

    def put(self: LocalBackend, key: str, data: object) -> None:
        ops.append("put " + key)
        real_put(self, key, data)  # type: ignore[arg-type]

    def put_atomic(self: LocalBackend, key: str, data: object) -> None:
        ops.append("put_atomic " + key)
        real_atomic(self, key, data)  # type: ignore[arg-type]

    path = tmp_path / "run"
    states = {s: {"a": torch.full((100,), float(s)), "big": torch.full((300_000,), float(s))} for s in range(2)}
    dstt.save(path, 0, states[0])
    monkeypatch.setattr(LocalBackend, "sync", sync)
    monkeypatch.setattr(LocalBackend, "put", put)
    monkeypatch.setattr(LocalBackend, "put_atomic", put_atomic)
    dstt.save(path, 1, states[1])
    assert ops.count("sync") == 1
    at = ops.index("sync")
    assert any(o.startswith("put packs/") for o in ops[:at]) and any("/c." in o for o in ops[:at])
    assert any(o.endswith("/index.json") for o in ops[:at]) and not any(o.startswith("put ") for o in ops[at + 1:])
    assert ops[-1].startswith("put_atomic ") and ops[-1].endswith("/commit.json")
    monkeypatch.undo()
    _check_steps(path, states)


def _page_aligned(n: int, seed: int) -> torch.Tensor:
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    out = raw[skip:skip + n]
    out.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def test_borrowed_page_aligned_chunks_are_packed_where_they_lie(tmp_path: Path) -> None:
    """Issue 25: with ``borrow`` (the helper's tier: the ring slot outlives
    the step's write) a chunk of whole pages on a page boundary goes into a
    gathered pack uncopied -- what the pack holds is the buffer's bytes at
    the write, not at add() -- each range on a page boundary, zeros to the
    next; anything else is copied into an ordinary pack. Every range reads
    back exactly, with one read per pack (the gaps under a page)."""
    from dstt.format.chunks import MAX_PACK_GAP_BYTES
    from dstt.format.codecs.spec import crc32c

    backend = open_backend(str(tmp_path / "s"), create=True)
    packs = P.StepPacks(backend, slot=1, rank=0)
    packs.borrow = True
    bodies = [_page_aligned(n, i) for i, n in enumerate((64 << 10, 17 * 4096, 128 << 10))]
    placed, trailers = [], []
    for b in bodies:
        view = memoryview(b.numpy()).cast("B")
        trailers.append(crc32c(view).to_bytes(4, "little"))
        placed.append(packs.add([view, trailers[-1]]))
    small, small_rng = packs.add([b"tiny chunk", b"\x00\x01\x02\x03"])  # copied: an ordinary pack
    odd = _page_aligned((64 << 10) + 4096, 9)[1:]  # off the page boundary: copied
    odd_f, odd_rng = packs.add([memoryview(odd.numpy()).cast("B"), b"abcd"])
    assert {f.n for f, _ in placed} == {0} and small.n == odd_f.n == 1 and placed[0][0].segments is not None
    assert [r.offset % 4096 for _, r in placed] == [0, 0, 0]
    assert all(0 < b.offset - (a.offset + a.length) <= MAX_PACK_GAP_BYTES
               for (_, a), (_, b) in zip(placed, placed[1:]))
    bodies[1][100] ^= 0xFF  # changed after add(): the write takes the buffer as it is then
    packs.close()
    for b, trailer, (f, rng) in zip(bodies, trailers, placed):
        assert f.state == "written"
        assert P.read_range(backend, f.key, rng, rng.length, "test") == bytes(b.numpy()) + trailer
    data = bytes(backend.get(placed[0][0].key) or b"")
    last = placed[-1][1]
    assert len(data) == last.offset + last.length - 4 + 4096
    assert data[placed[0][1].length:placed[1][1].offset] == bytes(placed[1][1].offset - placed[0][1].length)
    assert P.read_range(backend, small.key, small_rng, 14, "t") == b"tiny chunk\x00\x01\x02\x03"
    assert P.read_range(backend, odd_f.key, odd_rng, odd_rng.length, "t") == bytes(odd.numpy()) + b"abcd"
    # without borrow, or on a backend that cannot write buffers where they lie: copied, back to back
    for b2, borrow in ((backend, False), (open_backend("memory://gather-test", create=True), True)):
        plain = P.StepPacks(b2, slot=2, rank=0)
        plain.borrow = borrow
        view = memoryview(bodies[0].numpy()).cast("B")
        f, rng = plain.add([view, b"wxyz"])
        f2, rng2 = plain.add([view, b"wxyz"])
        assert f.segments is None and (rng.offset, rng2.offset) == (0, rng.length)
        plain.close()


@pytest.mark.slow
def test_the_helpers_tier_packs_page_aligned_chunks_where_they_lie(tmp_path: Path) -> None:
    """End to end, the tier in the capture helper, persist="all": chunks of
    whole pages (here 64 KiB) are written from the ring slot into gathered
    packs (each pack longer than its ranges: the padding), every step reads
    back bit-exact and the store verifies clean."""
    path = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    values = {f"w{i}": torch.randn(16384, generator=g) for i in range(4)}
    values["b"] = torch.randn(7, generator=g)  # small: an ordinary pack
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in values.items()})
    state = {k: p.data for k, p in model.items()}
    want: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(path, memory_steps=2, persist="all", background_timeout_s=60, compression="none") as cap:
        assert cap.tier_where == "helper"
        for step in range(3):
            for t in state.values():
                t.add_(0.5)
            cap.snapshot(step, model=model, rng=False)
            want[step] = {f"model/{k}": v.clone() for k, v in state.items()}
    _check_steps(path, want)
    from dstt.format import layout as L
    from dstt.format.manifest import parse_index

    entries = parse_index((path / L.step_dir("main", 2) / L.INDEX_FILE).read_bytes(), "index.json")[0]
    ranges: dict[str, int] = {}
    for e in entries:
        if e.name != "model/b":
            p = e.pack(0)
            assert p is not None and p.offset % 4096 == 0 and p.length == (64 << 10) + 4
    sizes = {f.name: f.stat().st_size for f in (path / "packs").iterdir() if f.name.startswith("p.")}
    for e in entries:
        p = e.pack(0)
        assert p is not None
        key = f"p.{e.slots[0]}.{p.rank}.{p.n}"
        ranges[key] = ranges.get(key, 0) + p.length
    assert any(sizes[k] > n for k, n in ranges.items())  # a gathered pack: padded


@pytest.mark.parametrize("nbytes,itemsize", [(663552, 4), (64 << 10, 2), (100, 4), (7, 1), ((3 << 20) + 12, 8)])
def test_a_fast_blosc_chunk_is_its_header_and_the_raw_bytes_uncopied(nbytes: int, itemsize: int) -> None:
    """Issue 25: a chunk stored fast (compression="auto" behind) is the
    very container Blosc makes -- header and the bytes as they are -- given
    as [header, raw, trailer] (raw not copied), its trailer the CRC-32C of
    the whole body from the raw bytes' CRC (not a second pass)."""
    import numpy as np

    from dstt.format.codecs.crccombine import combine
    from dstt.format.codecs.delta import blosc_encode
    from dstt.format.codecs.spec import CodecSpec, crc32c, encode_chunk

    raw = memoryview(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)).cast("B")
    want = blosc_encode(raw, itemsize, stored=True)
    for given in (crc32c(raw), None):
        parts = encode_chunk(raw, CodecSpec("auto"), raw_crc=given, itemsize=itemsize, fast=True)
        assert len(parts) == 3 and parts[1] is raw
        assert b"".join(bytes(p) for p in parts) == want + crc32c(want).to_bytes(4, "little")
    assert combine(crc32c(b"x" * 16), crc32c(raw), len(raw)) == crc32c(b"x" * 16 + bytes(raw))


def test_fast_blosc_chunks_of_whole_pages_are_gathered_and_read_back(tmp_path: Path) -> None:
    """The helper's fast steps (compression="auto" behind): each chunk's
    Blosc header goes on a page of zeros before its bytes, which are
    written where they lie; every step reads back bit-exact, verifies
    clean, and dedups an unchanged chunk against a gathered range."""
    from dstt.capture.hostpool import HostPool
    from dstt.format.writeoptions import WriteOptions
    from dstt.store.writer import AUTO_BEHIND

    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(16384 * (i + 1), generator=g) for i in range(3)}
    state["frozen"] = torch.randn(16384, generator=g)
    state["small"] = torch.randn(10, generator=g)
    want: dict[int, dict[str, torch.Tensor]] = {}
    with Writer(tmp_path / "s", WriteOptions(compression="auto")) as w:
        w.backlog = AUTO_BEHIND  # every step stored fast
        for step in range(3):
            for k, t in state.items():
                if k != "frozen":
                    t.add_(1.0)
            pool = HostPool(8 << 20)
            staged = {k: pool.stage(v) for k, v in state.items()}
            plan = w.plan(step, staged)
            assert plan.fast
            plan.packs.borrow = True
            w.ensure_arrays(plan)
            results, error = w.flush_chunks(plan, plan.tasks, None, [None] * len(plan.tasks))
            assert error is None
            info = w.commit(plan, results)
            want[step] = {k: v.clone() for k, v in state.items()}
            if step:
                assert info.bytes_referenced >= state["frozen"].nbytes  # the unchanged chunk: referenced
    _check_steps(tmp_path / "s", want)
    from dstt.format import layout as L
    from dstt.format.manifest import parse_index

    for step in range(3):
        index = (tmp_path / "s" / L.step_dir("main", step) / L.INDEX_FILE).read_bytes()
        for e in parse_index(index, "index.json")[0]:
            if e.name.startswith("w"):  # the raw bytes on a page boundary, the 16-byte header just before
                rng = e.pack(0)
                assert rng is not None and (rng.offset + 16) % 4096 == 0 and rng.length == e.nbytes + 20, e.name
    # the ranges of a gathered pack are read with one request, across the padding
    from dstt.format.chunks import read_packed

    backend = open_backend(str(tmp_path / "s"))
    calls: list[tuple[str, int, int]] = []
    real = backend.get_range
    backend.get_range = lambda key, start, n: calls.append((key, start, n)) or real(key, start, n)  # type: ignore[method-assign]
    ws = [e for e in parse_index(index, "index.json")[0] if e.name.startswith("w")]
    got = read_packed(backend, [(e, 0) for e in ws])
    assert len(calls) == 1 and [bytes(b) for b in got] == [_bits(want[2][e.name]) for e in ws]


def test_the_helpers_persist_packs_its_ring_slot_where_it_lies(tmp_path: Path) -> None:
    """HelperOps.persist (the tier in the capture helper) borrows the slot
    its step lies in: a chunk of whole pages is packed on a page boundary,
    uncopied; the step reads back bit-exact. (End to end, with a real
    helper: the slow test above.)"""
    from concurrent.futures import ThreadPoolExecutor

    from dstt.capture.helperops import HelperOps
    from dstt.capture.hostpool import HostPool
    from dstt.format import layout as L
    from dstt.format.manifest import parse_index
    from dstt.format.writeoptions import WriteOptions

    g = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(32768, generator=g), "b": torch.randn(5, generator=g)}
    pool = HostPool(1 << 20)
    staged = {k: pool.stage(v) for k, v in state.items()}
    flush = ThreadPoolExecutor(2)
    with Writer(tmp_path / "s", WriteOptions()) as w:
        ops = HelperOps(w, tmp_path / "ring", {}, None, lambda line: None, flush)
        ops.steps[0] = (w.plan(0, staged), {})
        ops.persist(0, None, [])
    flush.shutdown()
    _check_steps(tmp_path / "s", {0: state})
    index = (tmp_path / "s" / L.step_dir("main", 0) / L.INDEX_FILE).read_bytes()
    entries = {e.name: e for e in parse_index(index, "index.json")[0]}
    rng, small = entries["w"].pack(0), entries["b"].pack(0)
    assert rng is not None and small is not None and rng.n != small.n  # a gathered pack of its own
    assert rng.offset % 4096 == 0 and rng.length == 32768 * 4 + 4
    key = f"p.{entries['w'].slots[0]}.{rng.rank}.{rng.n}"
    assert (tmp_path / "s" / "packs" / key).stat().st_size == 32768 * 4 + 4096  # the trailer's page of zeros


def test_the_in_process_tier_packs_its_slots_where_they_lie(tmp_path: Path) -> None:
    """The memory tier in the trainer's process (helper=False) holds a
    step's slot until it is committed too: its chunks of whole pages are
    packed uncopied, on page boundaries; every step reads back bit-exact."""
    from dstt.format import layout as L
    from dstt.format.manifest import parse_index

    g = torch.Generator().manual_seed(6)
    model = torch.nn.ParameterDict({f"w{i}": torch.nn.Parameter(torch.randn(16384, generator=g)) for i in range(2)})
    want: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(tmp_path / "run", helper=False, memory_steps=2, persist="all", compression="none") as cap:
        for step in range(2):
            with torch.no_grad():
                for p in model.values():
                    p.add_(1.0)
            cap.snapshot(step, model=model, rng=False)
            want[step] = {f"model/{k}": p.detach().clone() for k, p in model.items()}
    _check_steps(tmp_path / "run", want)
    for step in range(2):
        index = (tmp_path / "run" / L.step_dir("main", step) / L.INDEX_FILE).read_bytes()
        for e in parse_index(index, "index.json")[0]:
            rng = e.pack(0)
            assert rng is not None and rng.offset % 4096 == 0 and rng.length == 16384 * 4 + 4
        sizes = [f.stat().st_size for f in (tmp_path / "run" / "packs").iterdir() if f.name.startswith("p.")]
        assert sizes and all(n % 4096 == 0 for n in sizes)  # gathered: each range's page of zeros after it
