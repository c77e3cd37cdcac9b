"""Worker for tests/system/test_tier_dist.py, run under torchrun (gloo, CPU):
trainers killed with the memory tier in every rank's capture helper (issue 25).

    python -m torch.distributed.run --nproc-per-node 2 tier_crash.py OUT WHO

FSDP2, ``memory_steps=3, persist=100`` (only step 0 stored by the policy);
steps 0..5, rank 1 alone raises an incident at step 4 (every rank's tier
dumps 1..4). Rank 0 saves the unsharded state of every step to
OUT/expected.pt, then every rank writes OUT/ready<r> and:

* WHO ``job``: waits to be killed (the test SIGKILLs every trainer);
* WHO ``rank1``: rank 1 SIGKILLs itself; rank 0 goes on capturing and
  writes the dstt error it got, and after how long, to OUT/rank0.json.

WHO ``resume`` (after a ``job`` run was killed with its helpers): every
rank only opens a new Capture on the store -- which salvages what the dead
run's rings sealed -- writes ``cap.recovered`` to OUT/recovered<r>.json
and closes it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from capture_fsdp import build, full

import dstt
from dstt.errors import DsttError


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 + step)
    opt.zero_grad()
    model(torch.randn(5, 6)).square().mean().backward()
    opt.step()


def main(out: Path, who: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if who == "resume":
        cap = dstt.Capture(out / "run", memory_steps=3, persist=100, max_chunk_bytes=256, background_timeout_s=10)
        (out / f"recovered{rank}.json").write_text(json.dumps(cap.recovered))
        cap.close()
        dist.destroy_process_group()
        return
    model, _ = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cap = dstt.Capture(out / "run", memory_steps=3, persist=100, max_chunk_bytes=256, background_timeout_s=10)
    expected = {}
    for step in range(6):
        train(model, opt, step)
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
        if step == 4:
            cap.wait_staged()
            if rank == 1:
                cap.incident("loss spike seen on rank 1 only")
            dist.barrier()
    cap.wait_staged()
    if rank == 0:
        torch.save(expected, out / "expected.pt")
    dist.barrier()
    (out / f"ready{rank}").write_text(str(os.getpid()))
    if who == "job" or rank == 1:
        if who == "rank1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    t0 = time.monotonic()
    seen = {"error": "", "after_s": -1.0}
    try:
        for step in range(6, 30):
            train(model, opt, step)
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
        cap.wait()
    except (DsttError, RuntimeError) as e:  # (a gloo collective with a dead peer: RuntimeError)
        seen = {"error": f"{type(e).__name__}: {e}"[:2000], "after_s": time.monotonic() - t0}
    (out / "rank0.json").write_text(json.dumps(seen))
    os._exit(0)  # (the process group has a dead member: no orderly teardown)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
