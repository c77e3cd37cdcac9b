"""A trainer for the sealed-step fault tests (tests/capture/test_sealed_steps.py):
it captures steps 0..N-1 of a state that is a pure function of the step
(:func:`state`), with faults on the way, and prints one line per step:
``sealed S`` (``wait_staged()`` returned and the step is sealed in the
staging ring or already committed: from then on it must survive a SIGKILL),
``unsealed S`` (it returned, but the step is in no seal: only this process
holds it) or ``failed S MESSAGE``.

usage: sealed_worker.py STORE SPEC_JSON

SPEC keys: ``mode`` ("helper", "threads" or "tier"), ``steps``, ``k``
(memory_steps of "tier"), ``kill_helper_at`` (SIGKILL the capture helper
before that step), ``faults`` (ring operations failing with EIO from step
``faults_from`` on: Ring.before_op; "reseal" is a seal written again for a
step), ``slow_writer_s`` (each chunk write of the in-process writer sleeps
that long), ``shm_root`` (the directory the staging ring lives under
instead of /dev/shm), ``fill_at`` / ``unfill_at`` (before that step, fill
``shm_root`` with a file until ENOSPC / remove it), ``kill_at`` (SIGKILL
itself once that step is sealed).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch


def state(step: int) -> dict[str, torch.Tensor]:
    """The state captured at ``step`` (as ``extra=``): 128 KiB of float32,
    a bfloat16 vector, an integer."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 256, generator=g), "b": torch.full((64,), float(step)).to(torch.bfloat16),
            "i": torch.tensor(step)}


class Faults:
    def __init__(self, ops: set[str]) -> None:
        self.ops, self.on, self.sealed = ops, False, set()

    def __call__(self, op: str, path: str) -> None:
        again = op == "seal" and path in self.sealed
        if op == "seal":
            self.sealed.add(path)
        if op == "unseal" and not os.path.exists(path):
            return  # (the kernel says ENOENT for a seal the helper removed already)
        if self.on and (op in self.ops or (again and "reseal" in self.ops)):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)


def fill(root: Path) -> None:
    try:
        with open(root / "filler", "wb") as f:
            while True:
                f.write(b"\xff" * (1 << 16))
                f.flush()
    except OSError:
        pass  # full


def committed(store: str, step: int) -> bool:
    from dstt.format import layout as L

    return os.path.exists(os.path.join(store, L.step_dir("main", step), L.COMMIT_FILE))


def main() -> None:
    store, spec = sys.argv[1], json.loads(sys.argv[2])

    if spec.get("shm_root"):
        os.environ["DSTT_SHM_DIR"] = spec["shm_root"]  # where the ring lives (ringowner.shm_base)
    import dstt

    mode = spec["mode"]
    kw: dict[str, Any] = {"helper": mode == "helper"}
    if mode == "tier":
        kw = {"memory_steps": spec.get("k", 3), "persist": "newest"}
    cap = dstt.Capture(store, **kw)
    faults = Faults(set(spec.get("faults", [])))
    if cap.parts.ring is not None:
        cap.parts.ring.before_op = faults
    if spec.get("slow_writer_s"):
        inner, pause = cap.writer.flush_chunks, float(spec["slow_writer_s"])

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(pause)
            return inner(*a, **k)

        cap.writer.flush_chunks = slow  # type: ignore[method-assign]
    root = Path(spec.get("shm_root") or "/dev/shm")
    for step in range(int(spec["steps"])):
        faults.on = step >= spec.get("faults_from", 0)
        if step == spec.get("kill_helper_at"):
            cap.wait()
            os.kill(cap.parts.helper.pid, signal.SIGKILL)  # type: ignore[union-attr]
            cap.parts.helper.proc.wait(30)  # type: ignore[union-attr]
        if step == spec.get("fill_at"):
            fill(root)
        if step == spec.get("unfill_at"):
            (root / "filler").unlink()
        failed: set[int] = set()
        for call in (lambda: cap.snapshot(step, rng=False, extra=state(step)), cap.wait_staged):
            try:
                call()
            except dstt.CaptureError as e:  # (it names the step that failed: this one or an earlier one)
                failed.add(report(e, step))
        if step in failed:
            continue
        ring = cap.parts.ring
        sealed = ring is not None and os.path.exists(ring.dir / f"seal-{step:020d}.json")
        print("sealed" if sealed or committed(store, step) else "unsealed", step, flush=True)
        if step == spec.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        cap.close()
    except dstt.CaptureError as e:
        report(e, -1)


def report(e: Exception, step: int) -> int:
    """Print ``failed S MESSAGE`` for the step the error names (else ``step``)."""
    named = re.search(r"step (\d+)", str(e))
    failed = int(named.group(1)) if named else step
    print("failed", failed, str(e).replace("\n", " "), flush=True)
    return failed


if __name__ == "__main__":
    main()
