"""Worker for tests/system/test_tier_dist.py, run under torchrun (gloo, CPU):
the memory tier in every rank's capture helper (issue 25).

    python -m torch.distributed.run --nproc-per-node N tier_ranks.py OUT LAYOUT POLICY [incident]

LAYOUT ``fsdp`` (FSDP2: every rank holds its shards) or ``replicated``
(DDP-style: every rank the same full state). 10 steps captured with
``memory_steps=3`` and ``persist=POLICY`` (``all``, ``newest`` or an
integer); with ``incident``, rank 1 alone calls ``cap.incident()`` at step
6 (the other ranks never do). Rank 0 saves the unsharded state of every
step to OUT/expected.pt; every rank writes OUT/rank<r>.json (its helper's
pid, where its tier ran, its memory bound).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from capture_fsdp import build, full

import dstt


def main(out: Path, layout: str, policy: str, incident: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if layout == "fsdp":
        model, _ = build()
    else:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    persist: Any = int(policy) if policy.isdigit() else policy
    cap = dstt.Capture(out / "run", memory_steps=3, persist=persist, max_chunk_bytes=256, background_timeout_s=90)
    expected: dict[int, Any] = {}
    torch.manual_seed(7)  # the same batches on every rank: a replicated state stays replicated
    for step in range(10):
        opt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        if layout == "replicated":  # (DDP's all-reduce of the gradients, by hand)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
        if incident and step == 6:
            cap.wait_staged()
            if rank == 1:
                cap.incident("loss spike seen on rank 1 only")
            dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"tier_where": cap.tier_where,
                                                      "memory_bytes": cap.memory_bytes}))
    cap.close()
    if rank == 0:
        torch.save(expected, out / "expected.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "incident")
