"""Worker for tests/system/test_tier_dist.py, run under torchrun (gloo, CPU):
a collective rewind from the memory tier in every rank's capture helper
(issue 25), FSDP2-sharded state.

    python -m torch.distributed.run --nproc-per-node 2 tier_rewind.py OUT

OUT/run: ``memory_steps=3, persist=100`` (only step 0 persisted by the
policy); steps 0..7, rank 1 alone raises an incident at step 5; then, on
every rank, a rewind to step 1 (memory-only, evicted: StepNotFoundError
everywhere), a rewind to different steps per rank (StepOrderError
everywhere), and ``rewind(6)`` (memory-only, held by every rank's helper:
read from the rings), after which training continues with steps 7..9 on
branch ``retry``. The batch of step s is drawn from seed 1000 + s, so the
retry's step 7 must equal the first run's step 7 bit for bit.

OUT/run2: rank 0 keeps 5 steps in memory, rank 1 two: after steps 0..6,
``rewind(3)`` finds step 3 in rank 0's helper only, and not stored: a
StepNotFoundError on every rank, naming rank 1.

Rank 0 saves the unsharded state of every step (``full``) to
OUT/expected.pt; every rank writes what it saw to OUT/rank<r>.json.
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
from dstt.capture.rewind import Rewinder
from dstt.errors import DsttError


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 + step)  # the batch of a step, whichever branch trains it
    opt.zero_grad()
    model(torch.randn(5, 6)).square().mean().backward()
    opt.step()


def refused(cap: dstt.Capture, step: int, model: Any, opt: Any) -> str:
    """The dstt error of a refused rewind (type: message), "" if it went ahead."""
    try:
        cap.rewind(step, model=model, optimizer=opt)
    except DsttError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    from_store: list[int] = []
    stored_step = Rewinder._stored_step

    def spy(self: Rewinder, step: int) -> Any:  # (observes which rewinds read the store; changes nothing)
        from_store.append(step)
        return stored_step(self, step)

    Rewinder._stored_step = spy  # type: ignore[method-assign]
    seen: dict[str, Any] = {}
    expected: dict[str, dict[int, Any]] = {"main": {}, "retry": {}}
    cap = dstt.Capture(out / "run", memory_steps=3, persist=100, max_chunk_bytes=256, background_timeout_s=90)
    for step in range(8):
        train(model, opt, step)
        cap.snapshot(step, model=model, optimizer=opt)  # (rng: every rank its own, restored by the rewind)
        expected["main"][step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
        if step == 5:
            cap.wait_staged()
            if rank == 1:
                cap.incident("loss spike seen on rank 1 only")
            dist.barrier()
    cap.wait()  # steps 0, 2..5 stored: step 1 (memory-only) evicted by every helper in the same round
    seen["evicted"] = refused(cap, 1, model, opt)
    seen["different"] = refused(cap, 6 if rank == 0 else 7, model, opt)
    seen["unchanged"] = bool(same_state(full(dstt.state_of(model=model, optimizer=opt, rng=False)), expected["main"][7]))
    n_store = len(from_store)
    cap.rewind(6, model=model, optimizer=opt, branch="retry")
    seen["from_memory"] = len(from_store) == n_store
    seen["restored"] = bool(same_state(full(dstt.state_of(model=model, optimizer=opt, rng=False)), expected["main"][6]))
    for step in range(7, 10):
        train(model, opt, step)
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        expected["retry"][step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
    cap.close()

    # A step one rank's helper still holds and another's lost (a smaller memory tier on rank 1).
    model2, _ = build()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    cap2 = dstt.Capture(out / "run2", memory_steps=5 if rank == 0 else 2, persist=100, max_chunk_bytes=256,
                        background_timeout_s=90)
    for step in range(7):
        train(model2, opt2, step)
        cap2.snapshot(step, model=model2, optimizer=opt2, rng=False)
    cap2.wait()  # step 0 stored; rank 1's helper evicted steps 1..4 in the same round, rank 0's keeps 2..6
    n_store = len(from_store)
    seen["lost_on_one_rank"] = refused(cap2, 3, model2, opt2)
    seen["run2_from_store"] = from_store[n_store:]
    cap2.close()

    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save(expected, out / "expected.pt")
    dist.barrier()
    dist.destroy_process_group()


def same_state(a: Any, b: Any) -> bool:
    """Bit-identical nested states."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    return bool(a == b)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
