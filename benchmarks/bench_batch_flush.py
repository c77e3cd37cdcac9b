"""Issue 16: the flush phase of a step of many small chunks, one chunk at a
time (``Writer.flush_chunk``, what every path did before) vs in groups
(``Writer.flush_chunks``, dstt/store/flusher.py), in the same process,
alternating, best of ``--repeat``: first step (everything written into
packs) and a fully unchanged second step (everything deduplicated).

    python benchmarks/bench_batch_flush.py --tensors 100000

Planning and commit are outside the timed region (bench_scale.py times
whole ``dstt.save`` calls). Thread time is the flushing thread's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import machine  # noqa: E402

from dstt.store.writer import Writer  # noqa: E402


def flush_step(w: Writer, step: int, state: dict[str, torch.Tensor], batched: bool) -> tuple[float, float]:
    """(wall s, thread CPU s) of flushing one planned step; then commits it."""
    plan = w.plan(step, state)
    w.ensure_arrays(plan)
    t, c = time.perf_counter(), time.thread_time()
    if batched:
        results, error = w.flush_chunks(plan, plan.tasks)
    else:
        results, error = [w.flush_chunk(plan, task) for task in plan.tasks], None
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    w.commit(plan, results, error)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--values", type=int, default=256, help="fp32 values per tensor (256: 1 KiB)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(args.values) for i in range(args.tensors)}
    best: dict[str, dict[str, tuple[float, float]]] = {}
    for _ in range(args.repeat):
        for mode in ("one_by_one", "batched"):
            work = tempfile.mkdtemp(prefix="bench_batch_flush_")
            try:
                with Writer(os.path.join(work, "run")) as w:
                    for step, case in ((0, "first"), (1, "unchanged")):
                        got = flush_step(w, step, state, mode == "batched")
                        old = best.setdefault(mode, {}).get(case)
                        if old is None or got[0] < old[0]:
                            best[mode][case] = got
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {machine()}")
    out: dict[str, Any] = {"tensors": args.tensors, "values": args.values}
    for case in ("first", "unchanged"):
        (ow, oc), (bw, bc) = best["one_by_one"][case], best["batched"][case]
        out[case] = {"one_by_one_s": round(ow, 3), "batched_s": round(bw, 3), "one_by_one_cpu_s": round(oc, 3),
                     "batched_cpu_s": round(bc, 3), "speedup": round(ow / bw, 2),
                     "us_per_chunk_batched": round(1e6 * bw / args.tensors, 1)}
        print(f"{case:9} one by one {ow:6.2f} s  batched {bw:6.2f} s  ({ow / bw:.1f}x; "
              f"{1e6 * bw / args.tensors:.1f} us per chunk)")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "bench_batch_flush.json"), "w") as f:
        json.dump({"machine": machine(), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
