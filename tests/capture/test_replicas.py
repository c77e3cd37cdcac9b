"""redundancy="replicas" (issue 26): each rank's ring holds the replicated
chunks other holders write (staged and sealed, never written by it), and a
lost rank's step is rebuilt from a survivor's ring, bit-exact and checked.
The multi-node trials are in tests/system/test_node_loss.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dstt.capture import replicaguard, stepimage
from dstt.capture import ring as R
from dstt.capture.sealcheck import check_record
from dstt.capture.sealplan import plan_of
from dstt.capture.seals import StaleSeal, encode_record, read_record, seal_record
from dstt.format import replicas as RP
from dstt.store.plan import StepPlan, hold_replicas, plan_step

WORLD = 2


def _plan_ranks(state: dict[str, Any], hold: bool) -> list[StepPlan]:
    """Step 1 of ``state`` planned by WORLD ranks holding it whole (DDP),
    on threads that all-gather their descriptions as torch.distributed does."""
    slots: list[Any] = [None] * WORLD
    barrier = threading.Barrier(WORLD, timeout=30)
    out: list[Any] = [None] * WORLD

    def plan(rank: int) -> None:
        def gather(obj: Any) -> list[Any]:
            slots[rank] = obj
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got
        cache: dict[Any, Any] = {}
        if hold:
            hold_replicas(cache)
        out[rank] = plan_step(1, state, rank=rank, exchange=gather, max_chunk_bytes=1024, layout_cache=cache)

    threads = [threading.Thread(target=plan, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(p is not None for p in out)
    return out


def _seal(plan: StepPlan) -> tuple[dict[str, Any], torch.Tensor]:
    """``plan``'s seal record (as the helper's trainer writes it: crc=False)
    and the pool its chunks were staged in, read back and checked."""
    sizes = [t.source.numel() * t.source.element_size() for t in plan.tasks]
    pool = torch.zeros(sum(-(-n // 64) * 64 for n in sizes) + 64, dtype=torch.uint8)
    staged, at = [], 0
    for t, n in zip(plan.tasks, sizes):
        view = pool[at:at + n]
        view.copy_(t.source.contiguous().reshape(-1).view(torch.uint8))
        staged.append((t, view))
        at += -(-n // 64) * 64
    plan.seq = 0
    record = read_record(encode_record(seal_record(plan, "pool-x", pool, staged, crc=False)))
    check_record(record, step=1, pool_sizes={"pool-x": pool.numel()})
    return record, pool


def _chunks(plan: StepPlan) -> dict[tuple[str, int], bytes]:
    return {(t.layout.name, t.index): t.source.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for t in plan.tasks}


def test_each_ring_holds_every_replicated_chunk_and_a_lost_ranks_step_is_rebuilt_from_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    plain = _plan_ranks(state, hold=False)
    held = _plan_ranks(state, hold=True)
    every = {(t.layout.name, t.index) for t in plain[0].tasks} | {(t.layout.name, t.index) for t in plain[1].tasks}
    for rank in range(WORLD):
        mine = {(t.layout.name, t.index) for t in held[rank].own_tasks}
        assert mine == {(t.layout.name, t.index) for t in plain[rank].tasks}  # the store still gets each chunk once
        assert {(t.layout.name, t.index) for t in held[rank].tasks} == every  # ... and every ring holds them all
        assert held[rank].replicas == len(every) - len(mine) > 0
        assert RP.held_bytes(held[rank].layouts, rank) == sum(t.source.numel() * t.source.element_size()
                                                              for t in held[rank].tasks[-held[rank].replicas:])

    record, pool = _seal(held[0])
    # The helper (and a crash's recovery) never sees the held chunks as the rank's own.
    assert _chunks(plan_of(record, pool)) == _chunks(plain[0])
    ext = record["tasks"]["extents"]
    assert all(e[1] is not None for e in ext[-held[0].replicas:]) and ext[0][1] is None  # held chunks: CRC'd

    # Rank 1's node is lost: its step, rebuilt from rank 0's ring, is its own.
    owner = {"store": "s", "branch": "main", "branch_id": 1, "branch_created": 1.0, "rank": 0, "world": WORLD,
             "run": "r1"}
    images = replicaguard.derive_images(record, plan_of(record, pool, held=True), owner)
    assert [r for r, _, _ in images] == [1]
    ring = stepimage.materialize(images[0][1], tmp_path)
    [seal] = R.read_seals(ring, complete=False)
    rebuilt = plan_of(seal, R.map_pool(ring, seal["pool"]))
    assert _chunks(rebuilt) == _chunks(plain[1])  # bit-exact
    assert [lay.name for lay in rebuilt.meta_arrays] == [lay.name for lay in plain[1].meta_arrays]
    assert rebuilt.tree == plain[1].tree

    # A held chunk changed after its seal is never used.
    start = ext[-1][0]
    pool[start] ^= 0xFF
    with pytest.raises(StaleSeal):
        plan_of(record, pool, held=True)
    plan_of(record, pool)  # (the rank's own part is still its own)


def test_auto_sees_replicated_state_from_its_layouts(tmp_path: Path) -> None:
    """redundancy="auto" picks replicas only where every region of every
    tensor has holders on two nodes; its record reads back, junk does not."""
    from dstt.format.backends import open_backend
    from dstt.format.codecs.spec import CodecSpec
    from dstt.format.geometry import build_layout

    def layout(regions: list[Any]) -> Any:
        return build_layout("w", ("param", "float32", (4, 4), "global", regions), CodecSpec(), 16)

    ddp = layout([((0, 0), (4, 4), (0, 1))])
    hsdp = layout([((0, 0), (2, 4), (0, 2)), ((2, 0), (2, 4), (1, 3))])  # shard dim within a node, replicate across
    fsdp = layout([((0, 0), (2, 4), (0,)), ((2, 0), (2, 4), (1,))])
    assert RP.replicated_elsewhere([ddp], ["a", "b"]) == []
    assert RP.replicated_elsewhere([hsdp], ["a", "a", "b", "b"]) == []
    assert RP.replicated_elsewhere([hsdp], ["a", "b", "a", "b"]) == ["w"]  # replicas on the same node: no use
    assert RP.replicated_elsewhere([fsdp], ["a", "b"]) == ["w"]
    backend = open_backend(str(tmp_path / "s"), create=True)
    RP.write_choice(backend, "main", {"redundancy": "replicas", "step": 0, "why": "x", "nodes": 2})
    assert RP.read_choice(backend, "main")["redundancy"] == "replicas"  # type: ignore[index]
    backend.put_atomic(RP.choice_key("main"), b'{"format": "dstt-redundancy-choice", "redundancy": "raid"}')
    assert RP.read_choice(backend, "main") is None
