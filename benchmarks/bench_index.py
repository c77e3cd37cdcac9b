"""Issue 16: the per-tensor cost of a step index -- writing it, parsing it,
opening a step (``record``) and the per-tensor part of ``state_dict`` --
for N one-chunk 1 KiB tensors, before vs after.

Each version runs in a subprocess with its own checkout on PYTHONPATH
(``--before DIR``, e.g. ``git worktree add --detach /tmp/before-index
5aa2e60``) and builds its own store, so each parses the index format it
writes; both run in the same invocation, so the ratios compare like with
like. Times are CPU time (all threads), the best of a few repetitions, per tensor.

    python benchmarks/bench_index.py --before /tmp/before-index --tensors 100000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def best_us(fn: Callable[[], Any], n: int, reps: int = 3) -> float:
    """Best CPU time (this process, all threads) of ``fn`` over ``reps``
    runs, in microseconds per tensor: on a machine shared with other jobs,
    CPU time varies far less than wall time."""
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best / n * 1e6


def measure(n: int, work: str) -> dict[str, Any]:
    import torch

    import dstt
    from dstt.format import layout as L
    from dstt.format import manifest

    state = {f"t{i:06d}": torch.full((256,), float(i)) for i in range(n)}  # 1 KiB each
    path = os.path.join(work, "run")
    dstt.save(path, 0, state)
    data = open(os.path.join(path, L.step_dir("main", 0), L.INDEX_FILE), "rb").read()
    version = json.loads(data)["format_version"]
    entries, tree = manifest.parse_index(data, "index")

    def fresh_record() -> Any:
        manifest._LAST_INDEX = None  # (the writer's remembered entries: a reader in another process has none)
        return dstt.open(path).record(0)

    run = dstt.open(path)
    run.record(0)
    out = {
        "format_version": version,
        "index_bytes_per_tensor": round(len(data) / n),
        "parse_us": best_us(lambda: manifest.parse_index(data, "index"), n),
        "write_us": best_us(lambda: manifest.index_document(version, "main", 0, entries, tree), n),
        "record_us": best_us(fresh_record, n, reps=2),
        "state_dict_cached_us": best_us(lambda: run.state_dict(0), n, reps=2),
    }
    got = run.state_dict(0)
    if not all(torch.equal(got[k], v) for k, v in list(state.items())[:: max(1, n // 100)]):
        raise SystemExit("read back differs")
    return out


def run_version(src: str, n: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{src}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=20_000)
    ap.add_argument("--before", help="checkout of the older code (PYTHONPATH)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as work:
            print(json.dumps(measure(args.child, work)))
        return
    import platform

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    results = {"after": run_version(ROOT, args.tensors)}
    if args.before:
        results["before"] = run_version(os.path.abspath(args.before), args.tensors)
    for name, r in results.items():
        print(f"{name:6} n={args.tensors}: " + ", ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.before:
        a, b = results["after"], results["before"]
        for k, v in a.items():
            if k.endswith("_us") and v:
                print(f"{k:22} before/after = {b[k] / v:.1f}x")


if __name__ == "__main__":
    main()
