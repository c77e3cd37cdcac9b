"""Issue 27: the writer's predictive encode rate with 1, 2, N threads vs the raw fsync'ed disk rate.

    python benchmarks/bench_encode.py [--steps 12] [--threads 1,2] [--small] [--dir /tmp/dstt-bench-encode]

Trains bench_delta.py's model (2.1M parameters, AdamW; ``--small``: 4
layers, d=96, vocab 512) and, for each thread count, writes every step with
``Writer(path, WriteOptions(compression="predictive", threads=N))``, timing
``Writer.prepare_pred`` -- what the capture helper runs per step before
its flush: the step's groups coded in parallel on N threads -- separately
from the flush and commit. Reported: MB/s of raw state coded (steps after
the first, which are keyframes), the same per thread, and the rate at
which this machine writes and fsyncs the same bytes to a file (what
coding has to keep up with), and MB per CPU-second (the process's CPU time
over the same calls: the rate per core, whatever else runs on the machine). Every step is read back and compared with
the trained state bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_delta import batch, build  # noqa: E402
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402
from dstt.format.writeoptions import WriteOptions
from dstt.store.tree import flatten  # noqa: E402
from dstt.store.writer import Writer  # noqa: E402


def disk_rate(root: str, nbytes: int) -> float:
    """MB/s of writing ``nbytes`` to a new file and fsyncing it."""
    data = os.urandom(min(nbytes, 64 << 20))
    path = os.path.join(root, "disk.bin")
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(data[: min(left, len(data))])
            left -= len(data)
        f.flush()
        os.fsync(f.fileno())
    rate = nbytes / (time.perf_counter() - t) / 1e6
    os.unlink(path)
    return rate


def run(args: argparse.Namespace, threads: int, root: str) -> dict[str, Any]:
    model = build(args.vocab, args.d_model, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1)
    path = fresh_dir(os.path.join(root, f"t{threads}"))
    coded_s = coded_cpu = flush_s = 0.0
    coded_bytes = 0
    kept: list[dict[str, torch.Tensor]] = []
    with Writer(path, WriteOptions(compression="predictive", threads=threads, keyframe_every=args.keyframe_every)) as w:
        for step in range(args.steps):
            x, y = batch(args.vocab, g)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            state = dstt.state_of(model=model, optimizer=opt, rng=False)
            kept.append({n: v.detach().clone() for n, v in flatten(state)[1].items()})
            plan = w.plan(step, state)
            w.ensure_arrays(plan)
            t, c = time.perf_counter(), time.process_time()
            w.prepare_pred(plan)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if step:
                coded_s += dt
                coded_cpu += dc
                coded_bytes += plan.local_bytes
            t = time.perf_counter()
            results, error = w.flush_chunks(plan, plan.tasks)
            w.commit(plan, results, error)
            flush_s += time.perf_counter() - t
    r = dstt.open(path)
    same = all(torch.equal(r.read(n, s).reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
               for s, state in enumerate(kept) for n, v in state.items())
    written = sum(r.commit_info(s)["bytes_written"] for s in r.steps())
    total = sum(r.commit_info(s)["bytes_total"] for s in r.steps())
    return {"threads": threads, "encode_mb_s": coded_bytes / coded_s / 1e6,
            "encode_mb_s_per_thread": coded_bytes / coded_s / 1e6 / threads,
            "encode_mb_per_cpu_s": coded_bytes / coded_cpu / 1e6,
            "flush_commit_ms_per_step": 1e3 * flush_s / args.steps, "ratio": written / total, "bit_exact": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--keyframe-every", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dir", default="/tmp/dstt-bench-encode")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.small:
        args.vocab, args.d_model, args.layers = 512, 96, 4
    root = fresh_dir(args.dir)
    torch.set_num_threads(1)
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False  # one core per coding thread
    rows = [run(args, int(n), root) for n in args.threads.split(",")]
    model = build(args.vocab, args.d_model, args.layers)
    step_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"machine": machine(), "steps": args.steps, "step_mb": step_bytes / 1e6,
              "disk_fsync_mb_s": disk_rate(root, max(step_bytes, 64 << 20)), "rows": rows}
    print(f"machine: {result['machine']}; {result['step_mb']:.1f} MB of parameters + AdamW state per step; "
          f"file write + fsync: {result['disk_fsync_mb_s']:.0f} MB/s")
    print("| threads | encode MB/s | per thread | MB per CPU-second | flush+commit ms/step | stored/raw | bit-exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['encode_mb_s']:.0f} | {r['encode_mb_s_per_thread']:.0f} | "
              f"{r['encode_mb_per_cpu_s']:.0f} | "
              f"{r['flush_commit_ms_per_step']:.0f} | {r['ratio']:.3f} | {r['bit_exact']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
