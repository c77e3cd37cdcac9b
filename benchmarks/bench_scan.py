"""Scans over tensor data on executors (issue 28): throughput of verify,
diff, export --format zarr and a data history (``history --metric l1``)
over a store of ``--gb`` GB, raw and delta-coded, run

* inline (today's single process: the code path before issue 28),
* on dstt's local process pool with 1 and 2 workers, and 2 threads,
* on a ``dask.distributed.LocalCluster`` (2 worker processes, 1 thread each),

against reading the same raw arrays with zarr-python + ``dask.array.from_zarr``
(a sum of squares over every chunk: decoding plus one pass, what the
cheapest scan does), with dask's threaded scheduler at 1 and 2 workers.
One run, ratios within it. The store is read from the page cache after the
first pass (every configuration the same), so this measures decoding and
computing, not the disk.

    python benchmarks/bench_scan.py [--gb 4] [--steps 4] [--out DIR] [--skip-dask] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np
import torch
from common import machine

import dstt
from dstt.format.codecs import keyframes
from dstt.format.verify import verify
from dstt.format.writeoptions import WriteOptions
from dstt.store.writer import Writer
from dstt.timetravel.zarr_export import export_zarr

TENSOR_MB = 16


def write_store(path: str, gb: float, steps: int, compression: str) -> int:
    """``steps`` steps of ~gb/steps GB each: fp32 matrices of TENSOR_MB MB,
    each step a small update of the last (what delta coding is for)."""
    n = max(1, int(gb * 1024 / steps / TENSOR_MB))
    rows = TENSOR_MB * (1 << 20) // 4 // 1024
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(n)}
    saved = keyframes.DELTA_MAX_RATIO
    keyframes.DELTA_MAX_RATIO = math.inf
    try:
        with Writer(path, WriteOptions(compression=compression, keyframe_every=steps + 1, max_chunk_bytes=4 << 20)) as w:
            for s in range(steps):
                if s:
                    for t in state.values():
                        t.add_(torch.randn(t.shape, generator=g), alpha=1e-3)
                w.write(s, {"model": state})
    finally:
        keyframes.DELTA_MAX_RATIO = saved
    return n * rows * 1024 * 4 * steps


def zarr_dask_sumsq(plain: str, workers: int) -> float:
    """Σx² over every array of a plain Zarr v3 group (the raw store exported
    uncompressed: the same bytes and chunks) with zarr-python + dask.array.from_zarr."""
    import dask
    import dask.array as da
    import zarr

    g = zarr.open_group(plain, mode="r")
    parts = [da.from_zarr(a) for name, a in g["model"].arrays() if name not in ("step", "time")]
    with dask.config.set(scheduler="threads", num_workers=workers):
        return float(sum((p.astype(np.float64) ** 2).sum() for p in parts).compute())


def _warm(secs: float) -> int:
    """Import what the scans' tasks import, and hold the worker a moment (so each of a pool's workers starts)."""
    import dstt.analysis.diff  # noqa: F401
    import dstt.analysis.metrics  # noqa: F401
    import dstt.format.verify  # noqa: F401
    import dstt.timetravel.zarr_export  # noqa: F401

    time.sleep(secs)
    return os.getpid()


def timed(fn: Callable[..., Any], *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def scans(path: str, out_dir: str) -> dict[str, Callable[[Any], Any]]:
    run = dstt.open(path)
    steps = run.steps()

    def export(where: Any) -> Any:
        out = os.path.join(out_dir, "export.zarr")
        shutil.rmtree(out, ignore_errors=True)
        try:
            return export_zarr(path, out, steps=[steps[0], steps[-1]], **where)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    return {
        "verify": lambda where: verify(path, **where),
        "diff": lambda where: run.diff(steps[0], steps[-1], **where),
        "export zarr (2 steps)": export,
        "history --metric l1": lambda where: run.history("model/*", "l1", **where),
    }


def bytes_of(kind: str, total: int, steps: int) -> int:
    """Bytes of tensor data each scan reads (decoded)."""
    per_step = total // steps
    return {"verify": total, "diff": 2 * per_step, "export zarr (2 steps)": 2 * per_step,
            "history --metric l1": total}[kind]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-dask", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    base = args.out or tempfile.mkdtemp(prefix="dstt-bench-scan-")
    os.makedirs(base, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "gb": args.gb, "steps": args.steps, "rows": []}
    # warm pools (started once, like a long-lived analysis session); the
    # "started per scan" column pays the start, as one CLI command does
    pools = {n: cf.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) for n in (1, 2)}
    for n, p in pools.items():
        assert len(set(p.map(_warm, [1.0] * n))) == n
    client = None
    if not args.skip_dask:
        import distributed

        cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
        client = distributed.Client(cluster)
    try:
        for compression in ("none", "delta"):
            path = os.path.join(base, f"run-{compression}")
            shutil.rmtree(path, ignore_errors=True)
            t = time.perf_counter()
            total = write_store(path, args.gb, args.steps, compression)
            print(f"# {compression}: wrote {total / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
            wheres: dict[str, dict[str, Any]] = {
                "single process (today)": {"executor": "inline"},
                "processes x1": {"executor": pools[1]},
                "processes x2": {"executor": pools[2]},
                "processes x2, started per scan": {"executor": "processes", "workers": 2},
                "threads x2": {"executor": "threads", "workers": 2},
            }
            if client is not None:
                wheres["LocalCluster 2x1"] = {"executor": client.get_executor()}
            for kind, fn in scans(path, base).items():
                fn({"executor": "inline"})  # warm the page cache
                row: dict[str, Any] = {"store": compression, "scan": kind}
                for label, where in wheres.items():
                    secs = timed(fn, where)
                    row[label] = round(bytes_of(kind, total, args.steps) / secs / 1e9, 3)
                one, two = row["processes x1"], row["processes x2"]
                row["x2 / x1"] = round(two / one, 2)
                row["x2 / today"] = round(two / row["single process (today)"], 2)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            if compression == "none":
                plain = os.path.join(base, "plain.zarr")
                export_zarr(path, plain, compression="none", workers=2)
                zarr_dask_sumsq(plain, 2)  # warm
                for w in (1, 2):
                    secs = timed(zarr_dask_sumsq, plain, w)
                    row = {"store": "none", "scan": f"zarr-python + dask.from_zarr, sum of squares, {w} thread(s)",
                           "GB/s": round(total / secs / 1e9, 3)}
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
                shutil.rmtree(plain, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        for p in pools.values():
            p.shutdown()
        if client is not None:
            client.close()
        if not args.out:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(f"# {results['machine']}  (GB/s of tensor data; 'x2 / x1': processes x2 over x1)")


if __name__ == "__main__":
    main()
