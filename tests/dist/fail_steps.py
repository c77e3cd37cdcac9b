"""Worker for tests/system/test_dist_failure.py, run under torchrun (gloo, CPU):
a step that fails in the background on ONE rank must fail on every rank,
promptly, and the Capture must go on with the next step.

    python -m torch.distributed.run --nproc-per-node 2 fail_steps.py OUT MODE[,MODE]

Each MODE runs in OUT/MODE (one after the other, same process group; a
MODE ending in ``+packed`` runs with small chunks packed, the default):
steps 0-1 captured and waited for; then the mode's fault is armed
(faults.py) and step 2 captured and waited for (it must fail); the fault is
disarmed and step 3 captured and waited for (it must commit). Every rank
writes OUT/MODE/result<rank>.json: the errors it saw at step 2 and 3 and
the seconds from step 2's snapshot to its error. Rank 0 writes
OUT/MODE/expected.pt (steps 0, 1 and 3 unsharded). Mode ``helper-die1``:
rank 1 exits (status 3) once step 2 is sealed in its ring; torchrun stops
rank 0; the capture helpers finish step 2 (OUT/MODE/helper<rank>.pid).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import faults  # noqa: E402
from capture_fsdp import build, full  # noqa: E402

import dstt  # noqa: E402
from dstt.errors import CaptureError, DsttError  # noqa: E402

#: mode -> (capture helper, fault kind, rank, process, optimizer given: lazy copies)
MODES: dict[str, tuple[bool, str, int, str, bool]] = {
    "gloo-unpicklable": (False, "unpicklable", 1, "trainer", True),
    "gloo-sync": (False, "sync", 1, "trainer", True),
    "gloo-flush-eager": (False, "chunk-put", 1, "trainer", False),
    "gloo-index0": (False, "index-put", 0, "trainer", True),
    "helper-flush1": (True, "chunk-put", 1, "helper", True),
    "helper-flush0": (True, "chunk-put", 0, "helper", True),
    "helper-sync1": (True, "sync", 1, "helper", True),
    "helper-index0": (True, "index-put", 0, "helper", True),
    "helper-record1": (True, "record-put", 1, "helper", True),
    "helper-die1": (True, "die", 1, "trainer", True),
    # planning (the trainer's thread, collective): rank 1's state holds an
    # object it may not pickle; the script goes on after snapshot() raised
    "gloo-plan1": (False, "plan", 1, "trainer", True),
    "helper-plan1": (True, "plan", 1, "trainer", True),
    # Capture() itself (collective recovery at construction) failing on one rank
    "init-ring1": (True, "init-ring", 1, "trainer", True),
    "init-recover0": (True, "init-recover", 0, "trainer", True),
}


def init_fails(where: Path, kind: str, bad_rank: int) -> None:
    """Capture() fails on ``bad_rank`` alone (its staging ring cannot be
    made / rank 0's recovery commit raises): every rank must raise."""
    from dstt.capture import crashsafe
    from dstt.capture import ranks

    rank = dist.get_rank()
    saved = crashsafe.Ring, ranks.commit_recorded

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, f"No space left on device (injected, rank {rank})")

    if rank == bad_rank:
        if kind == "init-ring":
            crashsafe.Ring = refuse  # type: ignore[assignment,misc]
        else:
            ranks.commit_recorded = refuse
    result: dict[str, Any] = {"init": None}
    try:
        dstt.Capture(where / "run", max_chunk_bytes=64, helper=True).close()
    except CaptureError as e:
        result["init"] = str(e)
    finally:
        crashsafe.Ring, ranks.commit_recorded = saved
    (where / f"result{rank}.json").write_text(json.dumps(result))


def setup_hook(out: Path) -> None:
    """Faults in this process and, through a sitecustomize, in the capture helpers."""
    os.environ["DSTT_TEST_FAULTS"] = str(out / "faults")
    (out / "faults").mkdir(parents=True, exist_ok=True)
    hook = out / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport faults\nfaults.install()\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    faults.install()


def main(out: Path, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        setup_hook(out)
    dist.barrier()
    if dist.get_rank() != 0:
        setup_hook(out)
    (out / f"trainer{dist.get_rank()}.pid").write_text(str(os.getpid()))  # (the test kills a hung run)
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        print(f"rank {dist.get_rank()}: mode {mode}", flush=True)
        packing = os.environ.get("DSTT_PACK_CHUNK_BYTES")
        if mode.endswith("+packed"):  # small chunks packed (the default): written at commit, not at flush
            os.environ.pop("DSTT_PACK_CHUNK_BYTES", None)
        try:
            run_mode(out, out / mode, mode.removesuffix("+packed"))
        finally:
            if packing is not None:
                os.environ["DSTT_PACK_CHUNK_BYTES"] = packing
        dist.barrier()
    dist.destroy_process_group()


def step(cap: Any, k: int, model: Any, opt: Any, lazy: bool) -> None:
    if k:
        opt.zero_grad()
        model(torch.randn(5, 6)).square().mean().backward()
        opt.step()
    extra = {"note": object()} if faults.armed("plan") else None  # not a tensor, not to be pickled
    cap.snapshot(k, model=model, optimizer=opt if lazy else None, rng=False, extra=extra)


def run_mode(out: Path, where: Path, mode: str) -> None:
    helper, kind, bad_rank, proc, lazy = MODES[mode]
    rank = dist.get_rank()
    if kind.startswith("init-"):
        init_fails(where, kind, bad_rank)
        return
    torch.manual_seed(0)
    model, _ = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cap = dstt.Capture(where / "run", max_chunk_bytes=64, helper=helper)
    assert (cap.parts.helper is not None) == helper, (mode, cap.parts.helper)
    if cap.parts.helper is not None:
        (where / f"helper{rank}.pid").write_text(str(cap.parts.helper.pid))
    expected: dict[int, Any] = {}
    result: dict[str, Any] = {"step2": None, "step3": None, "close": None}
    for k in (0, 1):
        step(cap, k, model, opt, lazy)
        expected[k] = full(dstt.state_of(model=model, optimizer=opt if lazy else None, rng=False))
    cap.wait()
    dist.barrier()
    if rank == 0:
        faults.arm(out / "faults", kind, bad_rank, proc)
    dist.barrier()
    start = time.monotonic()
    if kind == "die":
        step(cap, 2, model, opt, lazy)
        cap.wait_staged()  # sealed in every rank's ring: the helpers finish it
        dist.barrier()
        if rank == bad_rank:
            print(f"rank {rank}: dying", flush=True)
            os._exit(3)
        cap.wait()  # (torchrun stops this rank meanwhile, or it commits first)
        time.sleep(60)
    try:
        step(cap, 2, model, opt, lazy)
        cap.wait()
    except DsttError as e:  # CaptureError from the background; a planning error from snapshot() itself
        result["step2"] = str(e)
    result["fail_s"] = round(time.monotonic() - start, 2)
    print(f"rank {rank}: {mode}: step 2 -> {result['step2']!r} after {result['fail_s']} s", flush=True)
    dist.barrier()
    if rank == 0:
        faults.disarm(out / "faults", kind)
    dist.barrier()
    try:
        step(cap, 3, model, opt, lazy)
        expected[3] = full(dstt.state_of(model=model, optimizer=opt if lazy else None, rng=False))
        cap.wait()
    except CaptureError as e:
        result["step3"] = str(e)
    try:
        cap.close()
    except CaptureError as e:
        result["close"] = str(e)
    (where / f"result{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save(expected, where / "expected.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
