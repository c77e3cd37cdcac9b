"""A training process that captures every iteration, for crash and
concurrency tests.

The state of step k is a pure function of k (:func:`expected_state`), so a
test can check every committed step bit-exactly without talking to the
writer. Run as::

    python -m tests.crash_worker write STORE BRANCH N_STEPS [save|capture|auto|staged|delta [PAUSE_S]]
    python -m tests.crash_worker zygote

``write`` resumes after the branch's last committed step and captures
N_STEPS more (0 = forever). ``staged`` captures 1-4 steps at once, calls
``wait_staged()``, appends the last of them and the pid of its capture
helper (0: none) to ``STORE.staged`` and stops
itself with SIGSTOP, so a test can SIGKILL it right after ``wait_staged()``. ``zygote`` imports torch once, then forks one
writer per ``fork`` command on stdin, so a test can SIGKILL many real writer
processes without paying the torch import each time. Protocol, one line
each way: ``fork STORE BRANCH N MODE [PAUSE_S]`` → ``pid P``; ``wait P`` → ``status S``;
``quit``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed.tensor  # noqa: F401 - imported once in the zygote, not per writer
import zarr.storage  # noqa: F401

import dstt
from dstt.format.writeoptions import WriteOptions

#: Small chunks so every step writes several chunk files per tensor.
MAX_CHUNK_BYTES = 2048


def expected_state(step: int) -> dict[str, Any]:
    """The state captured at ``step`` (as ``state_of(extra=user_state(step), rng=False)``)."""
    return {"extra": user_state(step)}


def user_state(step: int) -> dict[str, Any]:
    """Changing, frozen (dedup) and odd-dtype tensors plus loop values."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.randn(24, 40, generator=g),
            "b": torch.randn(40, generator=g).to(torch.bfloat16),
            "frozen": torch.arange(600, dtype=torch.float32),  # same every step: referenced
            # a little different every step: delta coded under compression="delta"
            "smooth": torch.linspace(-1.0, 1.0, 960).reshape(24, 40) + 1e-3 * step,
        },
        "optim": {"exp_avg": torch.randn(24, 40, generator=g), "step": torch.tensor(float(step))},
        "loop": {"step": step, "loss": 1.0 / (step + 1), "tag": f"s{step}"},
    }


def has_capture() -> bool:
    return hasattr(dstt, "Capture")


def _last_step(store: str, branch: str) -> int:
    try:
        run = dstt.open(store)
        steps = run.steps(branch)
    except dstt.DsttError:
        return -1
    return steps[-1] if steps else -1


def write(store: str, branch: str, n_steps: int, mode: str = "auto", pause: float = 0.0) -> int:
    """Capture steps after the last committed one (``pause`` seconds of
    "training" between steps); the last step attempted."""
    use_capture = mode in ("capture", "staged", "delta") or (mode == "auto" and has_capture())
    if use_capture:
        return _write_capture(store, branch, n_steps, pause, staged=mode == "staged",
                              compression="delta" if mode == "delta" else "none")
    start = _last_step(store, branch) + 1
    stop = start + n_steps if n_steps > 0 else 1 << 62
    w = dstt.Writer(store, WriteOptions(branch=branch, max_chunk_bytes=MAX_CHUNK_BYTES))
    try:
        for step in range(start, stop):
            w.write(step, dstt.state_of(extra=user_state(step), rng=False))
            time.sleep(pause)
    finally:
        w.close()
    return stop - 1


def _write_capture(store: str, branch: str, n_steps: int, pause: float, staged: bool = False,
                   compression: str = "none") -> int:
    # The Capture first: it commits what a killed predecessor sealed, and
    # the steps go on after that.
    if compression == "delta":  # (a forked writer: this process only) chunks this small would be
        os.environ["DSTT_PACK_CHUNK_BYTES"] = "0"  # packed, and packed chunks are never delta coded
    cap = dstt.Capture(store, branch=branch, max_chunk_bytes=MAX_CHUNK_BYTES, compression=compression)
    start = -1 if cap.writer.last_step is None else cap.writer.last_step
    start += 1
    stop = start + n_steps if n_steps > 0 else 1 << 62
    try:
        for step in range(start, stop):
            cap.snapshot(step, rng=False, extra=user_state(step))
            if staged and (step - start) % 4 == (os.getpid() % 4):
                cap.wait_staged()  # from here on the steps up to `step` must survive a SIGKILL
                helper = cap.parts.helper.pid if cap.parts.helper is not None else 0
                with open(f"{store}.staged", "a") as f:
                    f.write(f"{step} {helper}\n")
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, threads included
            time.sleep(pause)
    finally:
        cap.close()
    return stop - 1


def zygote() -> None:
    out = sys.stdout
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            return
        if cmd[0] == "fork":
            pid = os.fork()
            if pid == 0:  # the writer: dies by SIGKILL or finishes
                code = 0
                try:
                    sys.stdin.close()
                    write(cmd[1], cmd[2], int(cmd[3]), cmd[4], float(cmd[5]) if len(cmd) > 5 else 0.0)
                except BaseException as e:  # noqa: BLE001 - reported through the exit code
                    print(f"writer failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    code = 3
                os._exit(code)
            out.write(f"pid {pid}\n")
        elif cmd[0] == "wait":
            _, status = os.waitpid(int(cmd[1]), 0)
            out.write(f"status {status}\n")
        out.flush()


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote()
    elif sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "auto",
              float(sys.argv[6]) if len(sys.argv) > 6 else 0.0)
    else:
        sys.exit(f"unknown command {sys.argv[1]!r}")
