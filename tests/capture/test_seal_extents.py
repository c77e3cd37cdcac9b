"""Issue 16, session 5: seal records of format 3 describe a step's pool
bytes by extents (a group block copied in one call, or one task), with one
CRC-32C per extent, so the trainer makes no view per grouped task. What
must hold: every chunk round-trips bit-exact, a byte changed anywhere in a
sealed step's chunks is a stale seal (never committed), a malformed record
is refused, records of formats 1 and 2 (rings of an older dstt) still
replay, and a SIGKILLed trainer's sealed steps are recovered bit-exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import google_crc32c
import pytest
import torch

import dstt
from dstt.capture import ring as R
from dstt.capture.copygroups import group_tasks
from dstt.capture.hostpool import HostPool
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer

ROOT = Path(__file__).resolve().parents[2]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(7, 3, generator=g), "b": torch.arange(5.0), "c": torch.randn(2, 2, 2, generator=g),
            "i": torch.arange(9, dtype=torch.int16), "big": torch.randn(20_000, generator=g),  # > 64 KiB: alone
            "s": torch.tensor(3.5), "e": torch.empty(0)}


def _stage(plan, pool: HostPool) -> tuple[list, list]:
    """Stage ``plan`` as the capture helper's stager does: small CPU tasks
    in groups (one block each, no view per task), the rest one by one."""
    groups, rest = group_tasks(plan.tasks)
    staged_groups = [(g, g.fill(pool.allocate(g.nbytes))) for g in groups]
    views = []
    for t in rest:
        v = pool.view_as(pool.allocate(t.data_nbytes), t.source, t.shape)
        v.copy_(t.source)
        views.append((t, v))
    return staged_groups, views


def _same(plan, got) -> None:
    assert len(got.tasks) == len(plan.tasks)
    for a, b in zip(got.tasks, plan.tasks):
        assert (a.layout.name, a.index, a.coords, a.offset, a.shape) == \
            (b.layout.name, b.index, b.coords, b.offset, b.shape)
        assert a.source.dtype == b.source.dtype and a.source.shape == b.source.shape
        assert torch.equal(a.source.reshape(-1).view(torch.uint8), b.source.reshape(-1).view(torch.uint8))


def test_grouped_steps_seal_one_crc_per_block_and_round_trip_bit_exact(tmp_path: Path) -> None:
    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 22)
    state = _state()
    try:
        for step in range(3):
            state["a"].add_(1)
            plan = w.plan(step, state, track=False)
            groups, views = _stage(plan, pool)
            assert len(groups) >= 2 and max(len(g.tasks) for g, _ in groups) >= 3  # (float32, int16)
            data = R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, views, groups=groups))
            doc = json.loads(data)
            assert doc["version"] == R.SEAL_VERSION and len(doc["extents"]) == len(groups) + len(views) < len(plan.tasks)
            record = R.read_record(data)
            _same(plan, R.plan_of(record, pool.buffer, verify=True))
            pool.release_many([b for _, b in groups] + [v for _, v in views])
    finally:
        w.close()


def test_one_changed_byte_of_a_sealed_block_is_a_stale_seal(tmp_path: Path) -> None:
    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 22)
    try:
        plan = w.plan(0, _state(), track=False)
        groups, views = _stage(plan, pool)
        record = R.read_record(R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, views,
                                                             groups=groups)))
        raw = pool.buffer
        base = raw.data_ptr()
        # one byte in the middle of each group block, then in the last byte of
        # the large task staged alone: each is seen, and undone is fine again
        places = [b.data_ptr() - base + g.nbytes // 2 for g, b in groups]
        places.append(views[0][1].data_ptr() - base + views[0][1].nbytes - 1)
        for at in places:
            raw[at] ^= 0x10
            with pytest.raises(R.StaleSeal, match="step 0"):
                R.plan_of(record, pool.buffer, verify=True)
            R.plan_of(record, pool.buffer, verify=False)  # (the live helper trusts its trainer's ring)
            raw[at] ^= 0x10
            _same(plan, R.plan_of(record, pool.buffer, verify=True))
    finally:
        w.close()


def test_a_record_that_misses_or_repeats_a_chunk_is_refused(tmp_path: Path) -> None:
    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 22)
    try:
        plan = w.plan(0, _state(), track=False)
        groups, views = _stage(plan, pool)
        with pytest.raises(dstt.CaptureError, match="chunks staged for"):
            R.seal_record(plan, "pool-0.bin", pool.buffer, views[1:], groups=groups)
        with pytest.raises(dstt.CaptureError, match="chunks staged for"):
            R.seal_record(plan, "pool-0.bin", pool.buffer, views + views[:1], groups=groups)
        good = R.read_record(R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, views,
                                                           groups=groups)))
        extents = good["tasks"]["extents"]
        first, crc, positions = extents[0]
        bad = [
            extents[1:],  # a group's chunks in no extent
            [*extents, [first, crc, positions[:1]]],  # a chunk twice
            [[first, crc, [*positions, len(plan.tasks)]], *extents[1:]],  # a chunk the plan lacks
            [[pool.buffer.numel() - 4, crc, positions], *extents[1:]],  # past the pool's end
            [[first, "x", positions], *extents[1:]],
            {"not": "a list"},
        ]
        for extents_doc in bad:
            doc = {**good, "tasks": {**good["tasks"], "extents": extents_doc}}
            with pytest.raises(R.CorruptRing):
                R.plan_of(doc, pool.buffer, verify=False)
    finally:
        w.close()


def _old_records(plan, pool: HostPool, staged: list) -> tuple[dict, bytes]:
    """A first-format record (a dict per task) and the bytes of a second-format
    one (per task start, nbytes, CRC; the static part apart), as earlier
    dstt versions wrote them into their rings."""
    record = R.read_record(R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, staged)))
    static = record["tasks"]["static"]
    base = pool.buffer.data_ptr()
    of = {id(t): v for t, v in staged}
    starts = [of[id(t)].data_ptr() - base for t in plan.tasks]
    sizes = [of[id(t)].nbytes for t in plan.tasks]
    crcs = [google_crc32c.value(of[id(t)].reshape(-1).view(torch.uint8).numpy().tobytes()) for t in plan.tasks]
    first = {k: record[k] for k in ("format", "step", "seq", "pool", "tree", "layouts", "meta")}
    first["tasks"] = [{"layout": s[0], "index": s[1], "coords": s[2], "offset": s[3], "shape": s[4], "dtype": s[5],
                       "start": a, "nbytes": n, "crc": c} for s, a, n, c in zip(static, starts, sizes, crcs)]
    tree = json.dumps(plan.tree).encode()
    stat = json.dumps({"layouts": record["layouts"], "meta": record["meta"], "tasks": static}).encode()
    head = {"format": R.SEAL_FORMAT, "version": 2, "step": plan.step, "seq": plan.seq, "pool": "pool-0.bin",
            "start": starts, "nbytes": sizes, "crc": crcs, "tree_bytes": len(tree), "static_bytes": len(stat)}
    second = json.dumps(head)[:-1].encode() + b', "tree": ' + tree + b', "static": ' + stat + b"}"
    return first, second


def test_records_of_formats_1_and_2_still_replay_and_catch_a_stale_chunk(tmp_path: Path) -> None:
    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 22)
    try:
        plan = w.plan(4, _state(), track=False)
        staged = []
        for t in plan.tasks:
            v = pool.view_as(pool.allocate(t.data_nbytes), t.source, t.shape)
            v.copy_(t.source)
            staged.append((t, v))
        first, second = _old_records(plan, pool, staged)
        docs = [R.read_record(json.dumps(first).encode()), R.read_record(second),
                R.read_record(second.replace(b', "tree"', b' , "tree"'))]  # (the slow reader)
        assert isinstance(docs[1]["tasks"], dict) and "crc" in docs[1]["tasks"] and "crc" in docs[2]["tasks"]
        for doc in docs:
            _same(plan, R.plan_of(doc, pool.buffer, verify=True))
        staged[0][1].reshape(-1).view(torch.uint8)[-1] ^= 1
        for doc in docs:
            with pytest.raises(R.StaleSeal):
                R.plan_of(doc, pool.buffer, verify=True)
    finally:
        w.close()


def test_the_capture_helper_path_seals_groups_without_per_task_views(tmp_path: Path) -> None:
    """The live path: a Capture with its helper (no memory tier) keeps
    groups whole to the seal and the release; every step stored bit-exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen: list[tuple[int, int]] = []
    expect = {}
    with dstt.Capture(tmp_path / "run", helper=True) as cap:
        assert cap.parts.ring is not None
        ring_dir = cap.parts.ring.dir

        def spy(job):
            seen.append((len(job.ring.groups), len(job.ring.views)))
            record = R.read_record(R.read_bounded(ring_dir / f"seal-{job.plan.step:020d}.json"))
            # no CRC pass on the trainer: its blocks are held until the seal is gone
            assert all(crc is None for _, crc, _ in record["tasks"]["extents"])

        cap.after_seal = spy
        for step in range(6):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            expect[step] = {k: v.clone() for k, v in model.state_dict().items()}
        cap.wait()
        assert cap.pool is not None and cap.pool.in_use == 0  # every held block went back
    assert seen and all(g >= 1 and v == 0 for g, v in seen), seen
    run = dstt.open(tmp_path / "run")
    assert run.steps() == list(range(6))
    for step, want in expect.items():
        got = run.state_dict(step)["model"]
        assert all(torch.equal(got[k], v) for k, v in want.items())


KILLED = """
import os, signal, sys, time, torch, dstt
from dstt.format.localio import pid_alive
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
model.register_buffer("big", torch.randn(20_000))  # > 64 KiB: staged alone, eagerly
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
def train():
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step(); opt.zero_grad()
cap = dstt.Capture(sys.argv[1], helper=True)
train(); cap.snapshot(0, model=model, optimizer=opt, rng=False); cap.wait()
open(sys.argv[3], "w").close()  # from now on the helper's chunk writes fail (FAILING_DISK)
train()
try:
    cap.snapshot(1, model=model, optimizer=opt, rng=False)
    cap.wait()
except dstt.CaptureError:
    pass  # (the helper failed it: sealed all the same)
assert cap.parts.last_job.ring.sealed and cap.pool.in_use == 0  # settled: its blocks may be reused from now on
os.kill(cap.parts.helper.pid, signal.SIGKILL)  # the whole job dies: step 1 stays sealed in the ring
while pid_alive(cap.parts.helper.pid):
    time.sleep(0.01)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
os.kill(os.getpid(), signal.SIGKILL)
"""


#: The capture helper's chunk writes fail while the file $DSTT_TEST_FULL exists.
FAILING_DISK = """
import errno, os
from dstt.format.backends import local

_put = local.LocalBackend.put

def put(self, key, data):
    if key.startswith("tensors/") and "/c." in key and os.path.exists(os.environ.get("DSTT_TEST_FULL", "/nonexistent")):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _put(self, key, data)

local.LocalBackend.put = put
"""


def run_killed_trainer(work: Path, store: Path, want: Path, *, env: dict[str, str] | None = None,
                       prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run :data:`KILLED` (``prefix`` before it: e.g. a PID namespace):
    its capture helper fails step 1 (a full disk, :data:`FAILING_DISK`),
    then the helper and the trainer are SIGKILLed -- step 1 stays sealed in
    the ring, its seal rewritten with CRCs (its blocks were freed); the
    trainer's state at step 1 is saved to ``want``."""
    full, hook = work / "full", work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_DISK)
    env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]), "DSTT_TEST_FULL": str(full)}
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(KILLED), str(store), str(want), str(full)],
                          env=env, capture_output=True, text=True, timeout=300)


def _killed_trainer(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A trainer whose capture helper failed step 1, both SIGKILLed (run_killed_trainer)."""
    store, want = tmp_path / "run", tmp_path / "want.pt"
    proc = run_killed_trainer(tmp_path, store, want)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    return store, torch.load(want)


def _sealed(store: Path) -> tuple[Path, dict]:
    (ring,) = R.group_dir(str(store), "main").iterdir()
    (seal,) = ring.glob("seal-*.json")
    record = R.read_record(R.read_bounded(seal))
    assert record["version"] == R.SEAL_VERSION and record["step"] == 1
    # sealed without CRCs, rewritten with them when the step failed (before its blocks were freed)
    assert all(isinstance(crc, int) for _, crc, _ in record["tasks"]["extents"])
    return ring, record


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_sigkilled_trainers_sealed_step_is_recovered_bit_exact(tmp_path: Path) -> None:
    store, want = _killed_trainer(tmp_path)
    _, record = _sealed(store)
    assert len(record["tasks"]["extents"]) < len(record["tasks"]["static"])  # grouped: fewer CRCs than chunks
    with dstt.Capture(store, helper=False) as cap:
        assert cap.recovered == [1]
    run = dstt.open(store)
    assert run.steps() == [0, 1]
    got = run.state_dict(1)["model"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert dstt.verify(store).ok


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_sigkilled_trainers_step_with_one_damaged_byte_is_skipped_as_stale(tmp_path: Path) -> None:
    store, _ = _killed_trainer(tmp_path)
    ring, record = _sealed(store)
    first, _, positions = max(record["tasks"]["extents"], key=lambda e: len(e[2]))
    assert len(positions) > 1  # a group block
    with open(ring / record["pool"], "r+b") as f:  # one byte of the block, as a reuse after a failure would
        f.seek(first + 5)
        byte = f.read(1)
        f.seek(first + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    with dstt.Capture(store, helper=False) as cap:
        assert cap.recovered == []
    assert dstt.open(store).steps() == [0]
    assert not R.group_dir(str(store), "main").exists() or not list(R.group_dir(str(store), "main").iterdir())
    assert dstt.verify(store).ok


def test_tree_text_is_json_dumps_exactly_while_subtrees_are_shared() -> None:
    """The seal's tree text reuses the text of subtrees shared with the last
    tree (by identity); it must equal json.dumps's, leaf types included."""
    import random

    from dstt.capture import seals as S

    rnd = random.Random(7)
    leaves = [0, 1, -5, 10**30, True, False, None, 1.0, -0.0, 0.1, 5e-324, 1e300, "x", "é\n\"\\\u2028", "",
              1.5, 2**63]

    def make(depth: int) -> object:
        r = rnd.random()
        if depth <= 0 or r < 0.3:
            return rnd.choice(leaves)
        if r < 0.6:
            return [make(depth - 1) for _ in range(rnd.randrange(4))]
        if r < 0.65:
            return {rnd.randrange(3): make(depth - 1)}  # (json turns int keys into strings)
        if r < 0.7:
            return (make(depth - 1), make(depth - 1))
        return {rnd.choice(["a", "b", "$tensor", "ü", "k\t"]) + str(i): make(depth - 1) for i in range(rnd.randrange(5))}

    import copy

    prev: object = make(5)
    older: list[object] = []
    for _ in range(400):
        r = rnd.random()
        if r < 0.4:  # the last tree shared whole, beside new parts
            tree: object = {"kept": prev, "new": make(4), "lr": rnd.choice([1, 1.0, True])}
        elif r < 0.6:  # only parts of earlier trees shared, one level down or more
            tree = [{"w": rnd.choice(older or [None])}, make(3), [rnd.choice(older or [0])]]
        elif r < 0.8:  # equal to the last one, nothing shared
            tree = copy.deepcopy(prev)
        else:
            tree = make(5)
        assert S._TREE_TEXT.encode(tree) == json.dumps(tree, allow_nan=False).encode()
        older = [*older[-5:], tree]
        prev = tree
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            S._TREE_TEXT.encode({"x": [bad]})


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_step_the_helper_failed_is_resealed_with_crcs_before_its_blocks_go_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seal without CRCs must never outlive its bytes: when the helper
    fails a step, its seal is rewritten with CRCs before its blocks are
    reused -- or removed if that fails -- or else the blocks stay reserved."""
    from test_capture_process import FULL_DISK

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_DISK)  # the helper's chunk writes fail
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    cap = dstt.Capture(tmp_path / "run", helper=True)
    try:
        assert cap.parts.ring is not None
        seals = cap.parts.ring.dir
        state = {f"t{i}": torch.full((8,), float(i)) for i in range(6)}
        outcomes = {}
        import dstt.capture.crashsafe as crashsafe

        def refused(*args: object, **kwargs: object) -> None:
            raise OSError("refused")

        def no_crc_seal(*args: object, **kwargs: object) -> dict:
            if kwargs.get("crc", True):
                raise OSError("refused")  # (the rewrite with CRCs; the first seal has none)
            return R.seal_record(*args, **kwargs)  # type: ignore[arg-type]

        for step, breaks in enumerate([(), ("seal",), ("seal", "unseal")]):
            if "seal" in breaks:
                monkeypatch.setattr(crashsafe, "seal_record", no_crc_seal)
            if "unseal" in breaks:
                monkeypatch.setattr(cap.parts.ring, "unseal", refused)
            cap.snapshot(step, extra=state, rng=False)
            with pytest.raises(dstt.CaptureError, match=rf"step {step} .*No space left"):
                cap.wait()
            path = seals / f"seal-{step:020d}.json"
            record = R.read_record(R.read_bounded(path)) if path.exists() else None
            assert cap.pool is not None
            outcomes[step] = (record is not None and all(isinstance(c, int) for _, c, _ in
                                                         record["tasks"]["extents"]), cap.pool.in_use)
            monkeypatch.setattr(crashsafe, "seal_record", R.seal_record)
            monkeypatch.setattr(cap.parts.ring, "unseal", type(cap.parts.ring).unseal.__get__(cap.parts.ring))
        assert outcomes[0] == (True, 0)  # rewritten with CRCs, then freed
        assert outcomes[1][1] == 0 and not (seals / f"seal-{1:020d}.json").exists()  # removed, then freed
        assert outcomes[2][1] > 0  # neither: its blocks stay reserved
    finally:
        cap.close()
