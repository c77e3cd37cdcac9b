"""Issue 2: synchronous dstt.save against torch.save and a raw fsync'ed write.

    python benchmarks/bench_store.py [--size-gb 1.0] [--small 2000] [--dir /tmp/dstt-bench]

Every contender is durable when its time stops: dstt.save syncs the store's
filesystem before its atomic commit; torch.save is followed by fsync of its
file; the raw write fsyncs. Results are ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, machine, model_and_adam, raw_fsync_write  # noqa: E402

import dstt  # noqa: E402
from dstt.store.writer import Writer  # noqa: E402


def all_tensors(state: object) -> list[torch.Tensor]:
    from dstt.store.tree import flatten

    _, tensors, _ = flatten(state)
    return [t for t in tensors.values() if isinstance(t, torch.Tensor)]


def big_state(args: argparse.Namespace) -> dict:
    model, opt = model_and_adam(int(args.size_gb * 2**30))
    state = dstt.state_of(model=model, optimizer=opt, rng=False)
    tensors = all_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"state: {len(tensors)} tensors, {nbytes / 2**30:.2f} GiB")
    return state


def bench_big(args: argparse.Namespace, state: dict) -> dict[str, float]:
    base = fresh_dir(args.dir)
    tensors = all_tensors(state)
    out: dict[str, float] = {}
    for rep in range(args.reps):
        t = time.perf_counter()
        raw_fsync_write(f"{base}/raw.bin", tensors)
        out.setdefault("raw", []).append(time.perf_counter() - t)  # type: ignore[union-attr]
        os.unlink(f"{base}/raw.bin")

        t = time.perf_counter()
        with open(f"{base}/ckpt.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        out.setdefault("torch.save", []).append(time.perf_counter() - t)  # type: ignore[union-attr]
        os.unlink(f"{base}/ckpt.pt")

        store = fresh_dir(f"{base}/store{rep}")
        os.rmdir(store)
        t = time.perf_counter()
        dstt.save(store, 0, state)
        out.setdefault("dstt.save", []).append(time.perf_counter() - t)  # type: ignore[union-attr]
        # a second step with every tensor changed (no dedup): steady-state cost
        for tt in tensors:
            tt.add_(1.0)
        t = time.perf_counter()
        dstt.save(store, 1, state)
        out.setdefault("dstt.save (next step)", []).append(time.perf_counter() - t)  # type: ignore[union-attr]
        t = time.perf_counter()
        dstt.save(store, 2, state)
        out.setdefault("dstt.save (unchanged)", []).append(time.perf_counter() - t)  # type: ignore[union-attr]
    return {k: min(v) for k, v in out.items()}  # type: ignore[arg-type]


def bench_small(args: argparse.Namespace) -> dict[str, float]:
    base = fresh_dir(args.dir + "-small")
    n = args.small
    state = {"model": {f"p{i}": torch.randn(16) for i in range(n)}}
    out: dict[str, float] = {}
    store = f"{base}/store"
    with Writer(store) as w:
        t = time.perf_counter()
        w.write(0, state)
        out["first step"] = (time.perf_counter() - t) / n * 1e3
        times = []
        for step in range(1, 4):
            for v in state["model"].values():
                v.add_(1)
            t = time.perf_counter()
            w.write(step, state)
            times.append(time.perf_counter() - t)
        out["later steps (changed)"] = min(times) / n * 1e3
        t = time.perf_counter()
        w.write(4, state)
        out["later step (unchanged)"] = (time.perf_counter() - t) / n * 1e3
    # zarr-python's own per-array costs, for reference
    import numpy as np
    import zarr

    zs = f"{base}/zarr"
    k = 50
    t = time.perf_counter()
    arrays = [zarr.create_array(zs, name=f"a{i}", shape=(16,), chunks=(16,), dtype="float32") for i in range(k)]
    out["zarr.create_array"] = (time.perf_counter() - t) / k * 1e3
    data = np.ones(16, dtype=np.float32)
    t = time.perf_counter()
    for a in arrays:
        a[:] = data
    out["zarr array write (setitem)"] = (time.perf_counter() - t) / k * 1e3
    t = time.perf_counter()
    for i in range(k):
        zarr.open_array(zs, path=f"a{i}", mode="r")[:]
    out["zarr open_array + read"] = (time.perf_counter() - t) / k * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/dstt-bench-store")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    state = big_state(args)
    big = bench_big(args, state)
    raw = big["raw"]
    print(f"\n{'contender (durable)':32s} {'seconds':>8s} {'vs raw fsync':>13s} {'vs torch.save':>14s}")
    for k, v in big.items():
        print(f"{k:32s} {v:8.3f} {v / raw:12.2f}x {v / big['torch.save']:13.2f}x")
    small = bench_small(args)
    print(f"\n{args.small} small tensors (16 floats each), ms per tensor:")
    for k, v in small.items():
        print(f"  {k:32s} {v:8.3f}")


if __name__ == "__main__":
    main()
