"""Issue 16, small fast loops: what makes a captured step cheaper must keep
it exact. Seal records (format 2: the unchanged parts of a step encoded and
decoded once) round-trip every chunk and the value tree exactly, old
records still replay, and a Capture with the helper stores every step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import dstt
from dstt.capture import ring as R
from dstt.capture.hostpool import HostPool
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer


def _staged(plan, pool: HostPool):
    views = []
    for t in plan.tasks:
        v = pool.view_as(pool.allocate(t.data_nbytes), t.source, t.shape)
        v.copy_(t.source)
        views.append((t, v))
    return views[::-1]  # (any order: the record follows the plan's)


def test_seal_records_round_trip_exactly_while_parts_repeat(tmp_path: Path) -> None:
    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 20)
    state = {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int16), "lr": 1}
    last_static = None
    try:
        for step, (lr, extra) in enumerate([(1, None), (1.0, None), (True, None), (True, torch.ones(2))]):
            state["lr"] = lr  # 1, 1.0 and True are equal in Python, not in JSON
            state["w"].add_(1)
            if extra is not None:
                state["extra"] = extra  # a new layout: a new static part
            plan = w.plan(step, state, track=False)
            staged = _staged(plan, pool)
            data = R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, staged))
            assert json.loads(data)["seq"] == plan.seq  # one JSON document any reader reads
            record = R.read_record(data)
            assert record["tree"] == plan.tree and json.dumps(record["tree"]) == json.dumps(plan.tree)
            static = record["tasks"]["static"]
            assert (static is last_static) == (step in (1, 2))  # decoded once while unchanged
            last_static = static
            got = R.plan_of(record, pool.buffer, verify=True)
            assert [l.name for l in got.layouts] == [l.name for l in plan.layouts]
            assert [l.name for l in got.meta_arrays] == [l.name for l in plan.meta_arrays]
            for a, b in zip(got.tasks, plan.tasks):
                assert (a.layout.name, a.index, a.coords, a.offset, a.shape) == \
                    (b.layout.name, b.index, b.coords, b.offset, b.shape)
                assert a.source.dtype == b.source.dtype and torch.equal(a.source, b.source)
            pool.release_many([v for _, v in staged])
    finally:
        w.close()


def test_a_changed_chunk_is_a_stale_seal_and_a_first_format_record_replays(tmp_path: Path) -> None:
    import google_crc32c

    w = Writer(tmp_path / "plans", WriteOptions(threads=1))
    pool = HostPool(1 << 20)
    try:
        plan = w.plan(0, {"a": torch.arange(6.0), "b": torch.ones(2, 2)}, track=False)
        staged = _staged(plan, pool)
        record = R.read_record(R.encode_record(R.seal_record(plan, "pool-0.bin", pool.buffer, staged)))
        # The first format (one dict per task, each with the CRC-32C of its
        # bytes), as a ring of an older dstt holds it.
        first = {k: record[k] for k in ("format", "step", "seq", "pool", "tree", "layouts", "meta")}
        base = pool.buffer.data_ptr()
        t_of = dict((id(t), v) for t, v in staged)
        first["tasks"] = [
            {"layout": record["tasks"]["static"][j][0], "index": t.index, "coords": list(t.coords),
             "offset": list(t.offset), "shape": list(t.shape), "dtype": "float32",
             "start": t_of[id(t)].data_ptr() - base, "nbytes": t_of[id(t)].nbytes,
             "crc": google_crc32c.value(t_of[id(t)].numpy().tobytes())} for j, t in enumerate(plan.tasks)]
        old = R.plan_of(R.read_record(json.dumps(first).encode()), pool.buffer, verify=True)
        assert all(torch.equal(a.source, b.source) for a, b in zip(old.tasks, plan.tasks))
        t_of[id(plan.tasks[0])].view(-1)[0] += 1  # the bytes changed after the seal
        for doc in (record, first):
            try:
                R.plan_of(doc, pool.buffer, verify=True)
            except R.StaleSeal:
                continue
            raise AssertionError("a changed chunk was not detected")
        R.plan_of(record, pool.buffer, verify=False)  # (the live helper trusts the ring)
    finally:
        w.close()


def test_helper_stores_every_step_of_a_fast_loop_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    expect = {}
    with dstt.Capture(tmp_path / "run", helper=True) as cap:
        for step in range(12):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched, rng=False)
            expect[step] = ({k: v.clone() for k, v in model.state_dict().items()}, sched.get_last_lr()[0])
        cap.wait()
        assert cap.parts.helper is not None
    run = dstt.open(tmp_path / "run")
    assert run.steps() == list(range(12))
    for step, (params, lr) in expect.items():
        got = run.state_dict(step)
        assert all(torch.equal(got["model"][k], v) for k, v in params.items())
        assert got["scheduler"]["_last_lr"][0] == lr
