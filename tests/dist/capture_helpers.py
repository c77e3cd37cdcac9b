"""Worker for tests/system/test_rank_helpers.py, run under torchrun (gloo, CPU):
a distributed Capture with a capture helper per rank (ranks.py).

    python -m torch.distributed.run --nproc-per-node 2 capture_helpers.py OUT MODE

MODE ``ok``: steps 0-3 of an FSDP2 model captured and committed by the
helpers; rank 0 saves the unsharded state of every step to
OUT/expected.pt. ``kill``: steps 0-2 committed, step 3 snapshotted and
``wait_staged()`` on every rank, then OUT/staged is written and every rank
sleeps (the test SIGKILLs the trainers' process group). ``killall``: the
same, but each rank first SIGKILLs its own helper (so step 3 stays sealed in
the rings only). ``recorded``: as ``kill``, but rank 0's helper cannot
write step 3's index (tests/dist/faults.py, armed before step 3): step 3 is
sealed and recorded by every rank, never committed, and the helpers
exit (its rings gone). ``resume``: a new Capture on the store (recovering
what the dead run left), step 4 captured; OUT/recovered.json names what it
recovered. Every rank writes its helper's pid to OUT/helper<rank>.pid and
its own to OUT/trainer<rank>.pid.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from capture_fsdp import build, full

import dstt
from dstt.errors import CaptureError
from dstt.format.localio import pid_alive


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, reference = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    extra = {"shared": torch.arange(12.0).reshape(3, 4)}
    cap = dstt.Capture(out / "run", max_chunk_bytes=256)
    assert cap.parts.helper is not None, "no capture helper on this rank"
    (out / f"helper{rank}.pid").write_text(str(cap.parts.helper.pid))
    (out / f"trainer{rank}.pid").write_text(str(os.getpid()))
    expected: dict[int, Any] = {}
    if mode == "resume":
        (out / f"recovered{rank}.json").write_text(json.dumps(cap.recovered))
        steps: range = range(4, 5)
    else:
        steps = range(4)
    for step in steps:
        if step:
            opt.zero_grad()
            model(torch.randn(5, 6)).square().mean().backward()
            opt.step()
        if mode != "ok" and step == 3:
            cap.wait()  # steps 0-2 committed
            if mode == "recorded" and rank == 0:  # (only rank 0's helper commits: the fault is armed
                import faults  # before rank 0 seals step 3)

                faults.arm(Path(os.environ["DSTT_TEST_FAULTS"]), "index-put", 0, "helper")
            if mode == "killall":
                os.kill(cap.parts.helper.pid, signal.SIGKILL)
                while pid_alive(cap.parts.helper.pid):
                    time.sleep(0.01)
        try:
            cap.snapshot(step, model=model, optimizer=opt, extra=extra)
        except CaptureError:  # killall: step 3 fails here (its helper is gone), sealed all the same
            if mode != "killall":
                raise
        expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
    if mode in ("kill", "killall", "recorded"):
        try:
            cap.wait_staged()  # step 3 sealed in this rank's ring
        except CaptureError:
            if mode != "killall":
                raise
        assert cap.parts.last_job is not None and cap.parts.last_job.submitted.is_set() and cap.parts.last_job.ring.sealed
        dist.barrier()
        if rank == 0:
            torch.save(expected, out / "expected.pt")
            (out / "staged").write_text("ok")
        while True:  # killed here
            time.sleep(1)
    cap.close()
    if rank == 0:
        torch.save(expected, out / f"expected-{mode}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main(Path(sys.argv[1]), sys.argv[2])
