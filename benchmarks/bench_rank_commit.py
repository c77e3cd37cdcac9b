"""Issue 12 item 2: committing a distributed step through per-rank records
(a capture helper per rank; rank 0's helper commits from the records)
versus the in-process pipeline (each rank's committer gathers its results
to rank 0 over dstt's gloo group, rank 0 commits).

    python benchmarks/bench_rank_commit.py [--nproc 2] [--tensors 200] [--kib 16] [--steps 12]

Runs one torchrun job; each mode runs in it, one after the other, on a
fresh store. Per step, rank 0 measures the time from ``snapshot()`` to
``wait()`` returning (the step committed and durable) -- capture
end to end, of which the commit is the part that differs -- and the
trainer's stall (``snapshot()`` alone). Reports the median of each and the
ratio helpers / in-process. The first two steps (helper start-up, array
creation) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(out: Path, tensors: int, kib: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import dstt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = kib * 256  # float32 elements
    results = {}
    for mode in ("in-process", "helpers"):
        store = out / f"run-{mode}"
        state = {f"t{i}": torch.randn(n) for i in range(tensors)}  # per-rank values (rng-like: every rank writes)
        cap = dstt.Capture(store, helper=mode == "helpers")
        totals, stalls = [], []
        for step in range(steps):
            for t in state.values():
                t.add_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            cap.snapshot(step, extra={f"rank{rank}": state}, rng=False)
            t1 = time.perf_counter()
            cap.wait()
            t2 = time.perf_counter()
            if step >= 2:
                stalls.append(t1 - t0)
                totals.append(t2 - t0)
        cap.close()
        results[mode] = {"commit_s": statistics.median(totals), "stall_s": statistics.median(stalls),
                         "spread_s": [min(totals), max(totals)]}
    if rank == 0:
        (out / "result.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker), args.tensors, args.kib, args.steps)
        return
    out = Path(tempfile.mkdtemp(prefix="dstt-bench-rank-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                    "--master-addr=127.0.0.1", f"--master-port={port}", __file__, "--worker", str(out),
                    "--tensors", str(args.tensors), "--kib", str(args.kib), "--steps", str(args.steps)],
                   check=True, env=env)
    res = json.loads((out / "result.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    mb = args.nproc * args.tensors * args.kib / 1024
    print(f"{args.nproc} ranks, {args.tensors} tensors x {args.kib} KiB per rank ({mb:.1f} MiB per step), "
          f"median of {args.steps - 2} steps")
    for mode, r in res.items():
        print(f"  {mode:10s}  snapshot->committed {r['commit_s'] * 1e3:8.1f} ms "
              f"(min {r['spread_s'][0] * 1e3:.1f}, max {r['spread_s'][1] * 1e3:.1f})  "
              f"stall {r['stall_s'] * 1e3:7.1f} ms")
    h, p = res["helpers"], res["in-process"]
    print(f"  ratio helpers / in-process: committed {h['commit_s'] / p['commit_s']:.2f}x, "
          f"stall {h['stall_s'] / p['stall_s']:.2f}x")


if __name__ == "__main__":
    main()
