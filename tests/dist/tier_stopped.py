"""Worker for tests/system/test_tier_dist.py, run under torchrun (gloo, CPU):
rank 0's capture helper is SIGSTOPped (issue 25).

    python -m torch.distributed.run --nproc-per-node 2 tier_stopped.py OUT [plain|killed]

``memory_steps=2, persist="newest"`` (with ``plain``: no memory tier, each
step committed by the helpers), ``background_timeout_s=4``: after 3 steps
stored, rank 0 stops its own helper; both ranks go on capturing and call
``wait()``. Rank 0's trainer must find its helper silent; rank 1's helper,
alive but waiting for rank 0's persist decisions or commits (its polls of
the store are no progress), must not hold rank 1's trainer past the bound
either. Every rank writes OUT/rank<r>.json: the error it saw and when.

With ``killed``, rank 1 SIGKILLs its own helper instead (the memory tier
on): rank 0's helper closes cleanly at the end, rank 1's never does.
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

import dstt
from dstt.errors import DsttError


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters())
    cap = (dstt.Capture(out / "run", background_timeout_s=4) if mode == "plain"
           else dstt.Capture(out / "run", memory_steps=2, persist="newest", background_timeout_s=4))
    assert cap.parts.helper is not None
    for step in range(3):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        cap.snapshot(step, model=model, optimizer=opt)
    cap.wait()
    dist.barrier()
    if mode == "killed":
        if rank == 1:
            os.kill(cap.parts.helper.pid, signal.SIGKILL)
    elif rank == 0:
        os.kill(cap.parts.helper.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    seen: dict[str, object] = {"error": "", "after_s": -1.0}
    try:
        for step in range(3, 40):
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            time.sleep(0.05)
        cap.wait()
        seen["after_s"] = time.monotonic() - t0
        seen["stored"] = dstt.open(out / "run").steps()
    except DsttError as e:
        seen = {"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0 and mode != "killed":
        try:
            os.kill(cap.parts.helper.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # (killed and reaped by its trainer already)
    try:
        cap.close()
    except DsttError:
        pass


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
