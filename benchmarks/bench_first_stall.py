"""Issue 25: the first snapshot's stall on CPU, before and after the pool
file is reserved in pieces (capture/reserve.py), in one run.

    python benchmarks/bench_first_stall.py [--size-gb 0.3,1] [--iters 6] [--compute-ms 0]

For each state size (fp32 matrices + Adam state, ~400 tensors):

* raw: one ``copy_`` of every state tensor into a buffer allocated and
  touched beforehand (median of 3) -- the floor of any consistent snapshot;
* for ``Capture()`` defaults and ``Capture(memory_steps=8, persist="newest")``,
  each ``before`` (the whole pool file reserved before its first block is
  handed out, as up to round three: one reservation piece as large as the
  pool) and ``after`` (pieces of reserve.PIECE_BYTES, the pool hands out
  what is reserved): the first stall (``snapshot()`` + the next optimizer
  step's wait for its copies), the median later stall (each commit awaited
  outside the timed region), and ``close()``; as ratios to raw.

``--compute-ms``: a stand-in forward/backward (matmuls) between snapshots,
during which the stager copies. Speed is measured here, never asserted in
tests. Measured beside other work, the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, model_and_adam, raw_copy_s, timed  # noqa: E402

import dstt  # noqa: E402
from dstt.capture import reserve  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {"defaults": {}, "memory_steps=8,newest": {"memory_steps": 8, "persist": "newest"}}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", default="0.3,1", help="comma-separated state sizes (parameters + Adam)")
    ap.add_argument("--iters", type=int, default=6, help="snapshots per run (the first, then later ones)")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="stand-in forward/backward per iteration")
    ap.add_argument("--tensors", type=int, default=400, help="state tensors (parameters x 3 with Adam)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--device", default="cpu", help="where the state lives (cuda: raw is a pinned copy)")
    args = ap.parse_args(argv)
    args.sizes = [float(s) for s in args.size_gb.split(",") if s]
    if not args.sizes or min(args.sizes) <= 0 or args.iters < 3 or args.compute_ms < 0:
        ap.error("--size-gb must be > 0, --iters >= 3, --compute-ms >= 0")
    return args


def state_on(device: torch.device, size_gb: float, n_params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 matrices and their Adam state (~``size_gb`` in all) on ``device``."""
    if device.type == "cpu":
        return model_and_adam(int(size_gb * 2**30), n_params=n_params)
    torch.manual_seed(0)
    rows = max(1, int(size_gb * 2**30) // 3 // n_params // 4 // 1024)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, 1024, device=device))
                                    for _ in range(n_params)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def one_run(store: str, kw: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer, iters: int,
            compute: Callable[[], None]) -> dict[str, float]:
    """Stalls of one Capture: snapshot() + the next optimizer step's wait for its copies."""
    stalls: list[float] = []
    waits: list[float] = []
    cap = dstt.Capture(store, **kw)
    fence = cap.stager._fence  # (the optimizer hook's wait: part of the stall)
    fence._wait = timed(waits, fence._wait)
    for i in range(iters):
        if i > 1:
            cap.wait()  # (later stalls: the disk keeping up, outside the timed region)
        compute()
        waits.clear()
        opt.step()
        if i:
            stalls[i - 1] += sum(waits)
        t = time.perf_counter()
        cap.snapshot(i, model=model, optimizer=opt, rng=False)
        stalls.append(time.perf_counter() - t)
    waits.clear()
    opt.step()
    stalls[-1] += sum(waits)
    t = time.perf_counter()
    cap.close()
    closed = time.perf_counter() - t
    return {"first": stalls[0], "later": statistics.median(stalls[1:]), "close": closed}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    base = args.dir or tempfile.mkdtemp(prefix="dstt-first-stall-")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_first_stall: no CUDA GPU on this machine; nothing measured")
        return 0
    work = torch.randn(512, 512, device=device)

    def compute() -> None:
        t = time.perf_counter()
        while (time.perf_counter() - t) * 1e3 < args.compute_ms:
            torch.mm(work, work)
        if device.type == "cuda":
            torch.cuda.synchronize()

    piece = reserve.PIECE_BYTES
    print(f"machine: {machine()}")
    print(f"compute between snapshots: {args.compute_ms} ms; reservation pieces: {piece >> 20} MiB (after)")
    results: list[dict[str, Any]] = []
    try:
        for size in args.sizes:
            model, opt = state_on(device, size, max(1, args.tensors // 3))
            tensors = [p.detach() for p in model.parameters()]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            raw = raw_copy_s(tensors)
            print(f"\nstate {nbytes / 2**30:.2f} GiB in {len(tensors)} tensors on {device}; raw copy {raw:.4f} s "
                  f"({nbytes / raw / 1e9:.1f} GB/s)")
            print(f"  {'config':24} {'when':7} {'first s':>8} {'x raw':>6} {'later s':>8} {'x raw':>6} {'close s':>7}")
            for name, kw in CONFIGS.items():
                for when in ("before", "after"):
                    reserve.PIECE_BYTES = 1 << 62 if when == "before" else piece
                    store = os.path.join(base, f"{size}-{name}-{when}")
                    shutil.rmtree(store, ignore_errors=True)
                    r = one_run(store, kw, model, opt, args.iters, compute)
                    shutil.rmtree(store, ignore_errors=True)
                    print(f"  {name:24} {when:7} {r['first']:8.4f} {r['first'] / raw:6.2f} {r['later']:8.4f} "
                          f"{r['later'] / raw:6.3f} {r['close']:7.2f}", flush=True)
                    results.append({"size_gb": size, "config": name, "when": when, "raw_s": raw, **r})
            del model, opt, tensors
    finally:
        reserve.PIECE_BYTES = piece
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
