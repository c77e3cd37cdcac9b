"""Issue 16 / issue 11 item 5: the cost of ``dstt.save`` and of finding the
latest step do not grow with the number of committed steps (branch heads).

    python benchmarks/bench_heads.py [--steps 100000] [--reps 30] [--listing-reps 3] [--dir /tmp/dstt-bench-heads]

Two stores on the same filesystem: one with 10 committed steps, one with
``--steps``. The long one is built quickly: 10 real steps, then commit
markers for steps 10..N-2 copied from a real one (step and seq rewritten:
listing checks only markers), then one more real ``dstt.save`` so its head
and latest index are real. Then, alternating between the stores so both see
the same machine state, ``--reps`` times: ``dstt.save`` of a small state
(two tensors of 64 floats) at the next step, and ``dstt.open(store).latest()``.
The same with the head record removed before the call (``--listing-reps``
times) shows what listing every step costs: every save and every 'latest'
before heads, and stores written before heads existed now (first save). Reported: medians
and the ratio long/short.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402
from dstt.format import layout as L  # noqa: E402
from dstt.format.heads import head_key  # noqa: E402


def state(k: int) -> dict:
    return {"model": {"w": torch.full((64,), float(k)), "b": torch.arange(64.0)}, "k": k}


def build(path: str, steps: int) -> None:
    for s in range(min(steps, 10)):
        dstt.save(path, s, state(s))
    if steps <= 10:
        return
    src = os.path.join(path, L.step_dir("main", 9), L.COMMIT_FILE)
    doc = json.load(open(src))
    for s in range(10, steps - 1):
        d = os.path.join(path, L.step_dir("main", s))
        os.mkdir(d)
        doc["step"], doc["seq"] = s, s
        with open(os.path.join(d, L.COMMIT_FILE), "w") as f:
            json.dump(doc, f)
    # The last step for real, resuming by listing (the head still names step 9).
    os.unlink(os.path.join(path, head_key("main")))
    _rewrite_latest(path, steps - 2)
    dstt.save(path, steps - 1, state(steps - 1))


def _rewrite_latest(path: str, step: int) -> None:
    """Give the newest fabricated marker real step files (a writer resuming
    from it reads its index.json, checked against the marker)."""
    real = os.path.join(path, L.step_dir("main", 9))
    where = os.path.join(path, L.step_dir("main", step))
    for f in (L.INDEX_FILE, L.NAMES_FILE, L.STATS_FILE):
        shutil.copy(os.path.join(real, f), os.path.join(where, f))
    doc = json.load(open(os.path.join(real, L.COMMIT_FILE)))
    doc["step"], doc["seq"] = step, step
    with open(os.path.join(where, L.COMMIT_FILE), "w") as f:
        json.dump(doc, f)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--listing-reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dstt-bench-heads")
    args = ap.parse_args()
    base = fresh_dir(args.dir)
    stores = {"short": os.path.join(base, "short"), "long": os.path.join(base, "long")}
    t = time.perf_counter()
    build(stores["short"], 10)
    build(stores["long"], args.steps)
    print(f"built stores ({args.steps} steps) in {time.perf_counter() - t:.1f} s", flush=True)
    next_step = {"short": 10, "long": args.steps}
    res: dict[str, dict[str, list[float]]] = {k: {"save": [], "latest": [], "save_listing": [],
                                                   "latest_listing": []} for k in stores}
    for rep in range(args.reps):
        for k, path in stores.items():
            s = next_step[k]
            res[k]["save"].append(timed(lambda p=path, n=s: dstt.save(p, n, state(n))))
            res[k]["latest"].append(timed(lambda p=path: dstt.open(p).latest()))
            next_step[k] = s + 1
            if rep < args.listing_reps:  # (slow on the long store: a few suffice)
                os.unlink(os.path.join(path, head_key("main")))  # as a store written before heads
                res[k]["latest_listing"].append(timed(lambda p=path: dstt.open(p).latest()))
                res[k]["save_listing"].append(timed(lambda p=path, n=s + 1: dstt.save(p, n, state(n))))
                next_step[k] = s + 2
    print(machine())
    print(f"{'':16} {'10 steps':>12} {f'{args.steps} steps':>14} {'ratio':>7}")
    for op in ("save", "latest", "save_listing", "latest_listing"):
        a = statistics.median(res["short"][op]) * 1e3
        b = statistics.median(res["long"][op]) * 1e3
        print(f"{op:16} {a:10.2f}ms {b:12.2f}ms {b / a:7.2f}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
