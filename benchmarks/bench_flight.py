"""Issue 14: the flight recorder -- a loop whose step is much shorter than
one step's persist time, captured every iteration.

    python benchmarks/bench_flight.py [--size-mb 200] [--iters 30] [--iter-ms 72 | --compute-ms 40] [--dir ...]

One process, one run, every figure compared with others of the same run:

* time per iteration with no capture, with ``memory_steps=4,
  persist="newest"`` -- the tier in the trainer's process (``helper=False``)
  and in the capture helper (``helper=True``, issue 25; "refused" where
  this dstt cannot run it there) --, with ``on_full="wait"`` (every step
  stored: backpressure), ``on_full="skip"`` and ``dcp.async_save`` every
  iteration (each save awaited before the next); the time added over no
  capture, in % of the iteration;
* the disk: bytes the capture stored per second of the loop vs one raw
  fsync'ed sequential write of the same state (``raw_fsync_write``), and how
  many of the captured steps each mode stored; and "durable": every byte
  the mode put on disk (the files of its directory, all ranks') over the
  loop *and* its drain (until the last step is durable: the steps still in
  the ring at the loop's end count, as the time to store them), vs the raw
  write of every rank's state at once (the device's rate, shared by the
  ranks as in the loop);
* the raw copy floor: the same loop doing only a plain copy of the state
  into preallocated (already touched) memory each iteration, no dstt --
  what capturing every step into memory costs at the least on this
  machine's cores; the report says how much of each mode's added time per
  iteration that copy is;
* rewind latency: ``Capture.rewind`` from the memory tier vs ``dstt.restore``
  from the store vs ``torch.load`` + ``load_state_dict`` of the same step, vs
  one memcpy of the state (goal: ring rewind <= 2x one memcpy).

An iteration is a stand-in compute of ``--compute-ms`` (not touching the
state) followed by ``optimizer.step()`` (updates every parameter and Adam
tensor in place); ``--iter-ms`` sets the compute so that an iteration with
no capture takes that long (the issue's 72 ms at 200 MB).

``--ranks 2`` runs the same loop under ``torchrun`` with gloo (each rank
holding ``--size-mb`` / ranks of state, replicated layout): time added
per iteration, the drain after the loop (``wait()``: commit latency of the
last steps), and how many steps each policy persists, per rank 0; the
collective rewind from every rank's helper tier vs ``dstt.restore`` and
``torch.load`` on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import best_of, fresh_dir, fsync_file, machine, model_and_adam, raw_fsync_write  # noqa: E402

import dstt  # noqa: E402
from dstt.errors import CaptureError, ConfigError  # noqa: E402


def fresh(path: str) -> str:
    """An empty directory for a phase's store: made by rank 0 alone under
    torch.distributed (every rank's rmtree of a store the others already
    write to would race), the others waiting for it."""
    if not torch.distributed.is_initialized():
        return fresh_dir(path)
    if torch.distributed.get_rank() == 0:
        fresh_dir(path)
    torch.distributed.barrier()
    return path


def compute(ms: float, x: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        x.mul_(1.0000001)


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def loop(model: Any, opt: Any, iters: int, compute_ms: float, cap: Any = None) -> list[float]:
    x = torch.ones(4096)
    times = []
    for step in range(iters):
        t0 = time.perf_counter()
        compute(compute_ms, x)
        for p in model.parameters():
            p.grad = p.detach() * 1e-3  # cheap, deterministic gradients
        opt.step()
        if cap is not None:
            cap.snapshot(step, model=model, optimizer=opt)
        times.append(time.perf_counter() - t0)
    return times


def phase(name: str, root: str, model: Any, opt: Any, args: Any, **options: Any) -> dict[str, Any]:
    path = fresh(os.path.join(root, name))
    print(f"bench_flight: {name}", file=sys.stderr, flush=True)
    try:
        cap = dstt.Capture(path, **options)
        t0 = time.perf_counter()
        times = loop(model, opt, args.iters, args.compute_ms, cap)
    except (CaptureError, ConfigError) as e:  # (a mode this dstt refuses)
        return {"refused": str(e).split("\n")[0][:300]}
    loop_s = time.perf_counter() - t0
    stored_in_loop = cap.bytes_written
    t1 = time.perf_counter()
    cap.wait()
    drain_s = time.perf_counter() - t1
    cap.close()
    steps = dstt.open(path).steps()
    return {"iter_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3,
            "loop_s": loop_s, "stored_steps": len(steps), "captured": args.iters - len(cap.skipped),
            "disk_mb_s": stored_in_loop / loop_s / 1e6, "drain_s": drain_s,
            "durable_mb_s": on_disk(path) / (loop_s + drain_s) / 1e6,
            "tier_where": getattr(cap, "tier_where", None)}


def on_disk(path: str) -> int:
    """Bytes of every file under ``path`` (every rank's: a shared directory),
    once every rank is done writing there."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def floor_phase(model: Any, opt: Any, args: Any) -> dict[str, Any]:
    """The raw copy floor: the loop with a plain copy of every state tensor
    into preallocated memory (touched once before: no page faults in the
    loop) after each ``optimizer.step()`` -- no dstt at all."""
    tensors = state_tensors(model, opt)
    bufs = [torch.zeros_like(t) for t in tensors]
    x = torch.ones(4096)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        compute(args.compute_ms, x)
        for p in model.parameters():
            p.grad = p.detach() * 1e-3
        opt.step()
        for b, t in zip(bufs, tensors):
            b.copy_(t)
        times.append(time.perf_counter() - t0)
    return {"iter_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3}


def dcp_phase(root: str, model: Any, opt: Any, args: Any) -> dict[str, Any]:
    """``dcp.async_save`` every iteration (the previous save awaited first)."""
    import torch.distributed.checkpoint as dcp

    path = fresh(os.path.join(root, "dcp"))
    pending: Any = None
    x = torch.ones(4096)
    times, nbytes = [], 0
    state_bytes = sum(t.numel() * t.element_size() for t in state_tensors(model, opt))
    t0 = time.perf_counter()
    for step in range(args.iters):
        t = time.perf_counter()
        compute(args.compute_ms, x)
        for p in model.parameters():
            p.grad = p.detach() * 1e-3
        opt.step()
        if pending is not None:
            pending.result()
            nbytes += state_bytes
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        pending = dcp.async_save(sd, checkpoint_id=os.path.join(path, f"s{step}"),
                                 **({} if torch.distributed.is_initialized() else {"no_dist": True}))
        times.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - t0
    pending.result()
    drain_s = time.perf_counter() - t0 - loop_s
    return {"iter_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3, "loop_s": loop_s,
            "stored_steps": args.iters, "captured": args.iters, "disk_mb_s": nbytes / loop_s / 1e6,
            "drain_s": drain_s, "durable_mb_s": on_disk(path) / (loop_s + drain_s) / 1e6}


def rewind_latency(root: str, model: Any, opt: Any, args: Any) -> dict[str, float]:
    """Ring rewind vs dstt.restore vs torch.load + load_state_dict vs memcpy."""
    path = fresh(os.path.join(root, "rewind"))
    tensors = state_tensors(model, opt)
    bufs = [torch.empty_like(t) for t in tensors]
    out: dict[str, float] = {}
    out["memcpy_s"] = best_of(lambda: [b.copy_(t) for b, t in zip(bufs, tensors)])
    if torch.distributed.is_initialized():
        # The rewind is collective: every rank copies its share at once, so
        # the floor is a memcpy of every rank at the same time.
        def together() -> float:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for b, t in zip(bufs, tensors):
                b.copy_(t)
            return time.perf_counter() - t0

        out["memcpy_all_ranks_s"] = min(together() for _ in range(3))
    with dstt.Capture(path, memory_steps=4, persist="all", helper=True) as cap:
        loop(model, opt, 3, 1, cap)
        cap.wait()
        ring, switch, phases = [], [], []
        for i in range(3):
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # (the rewind's time, not how far apart the ranks came to it)
            t0 = time.perf_counter()
            cap.rewind(2 + i, model=model, optimizer=opt, branch=f"r{i}")  # the latest step: in the ring
            ring.append(time.perf_counter() - t0)
            rewinder = getattr(cap, "rewinder", None)
            phases.append({**getattr(rewinder, "phases", {}),
                           **{f"{k}_bytes": v for k, v in getattr(rewinder, "exchanged", {}).items()}})
            t0 = time.perf_counter()
            cap.snapshot(3 + i, model=model, optimizer=opt)  # the next step: opens the branch
            switch.append(time.perf_counter() - t0)
            cap.wait()
        out["ring_rewind_s"] = min(ring)
        out["ring_phases_s"] = phases[ring.index(min(ring))]  # (where the fastest one's time went)
        # (the branch switch -- with the tier in the helper, the old branch's
        # helper closed and the new one's started -- happens at this snapshot)
        out["snapshot_after_rewind_s"] = min(switch)
    out["dstt_restore_s"] = best_of(lambda: dstt.restore(f"{path}:1", model=model, optimizer=opt))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    pt = os.path.join(root, f"state{rank}.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, pt)
    fsync_file(pt)

    def torch_load() -> None:
        sd = torch.load(pt)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    out["torch_load_s"] = best_of(torch_load)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compute-ms", type=float, default=40)
    ap.add_argument("--iter-ms", type=float, default=None,
                    help="an iteration with no capture takes this long (sets --compute-ms)")
    ap.add_argument("--dir", default="/tmp/dstt-bench-flight")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ranks", type=int, default=1, help="run under torchrun with this many ranks (gloo)")
    ap.add_argument("--only", choices=("all", "rewind"), default="all",
                    help="rewind: only the rewind latencies (no loops)")
    args = ap.parse_args()
    if args.ranks > 1 and "RANK" not in os.environ:
        sys.exit(launch(args))
    dist = "RANK" in os.environ
    if dist:
        torch.distributed.init_process_group("gloo")
        args.dir = os.path.join(args.dir, "dist")
    rank = torch.distributed.get_rank() if dist else 0
    world = torch.distributed.get_world_size() if dist else 1
    root = fresh_dir(args.dir) if rank == 0 else args.dir
    if dist:
        torch.distributed.barrier()
    model, opt = model_and_adam(int(args.size_mb * 1e6 / world), n_params=50)
    tensors = state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    raw, raw_all = [], []
    for i in range(3):
        if dist:
            torch.distributed.barrier()  # (every rank writes at once: the device shared, as in the loop)
        t0 = time.perf_counter()
        raw_fsync_write(os.path.join(root, f"raw{rank}-{i}.bin"), tensors)
        took = time.perf_counter() - t0
        raw.append(state_bytes / took / 1e6)
        if dist:
            box = torch.tensor([took])
            torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX)
            took = float(box[0])
        raw_all.append(state_bytes * world / took / 1e6)
        os.unlink(os.path.join(root, f"raw{rank}-{i}.bin"))
    res: dict[str, Any] = {"machine": machine(), "ranks": world, "state_mb": state_bytes / 1e6 * world,
                           "raw_fsync_mb_s": raw, "raw_all_ranks_mb_s": raw_all}
    if args.iter_ms is not None:
        step_ms = statistics.median(loop(model, opt, 5, 0.0)) * 1e3  # optimizer.step alone
        args.compute_ms = max(0.0, args.iter_ms - step_ms)
        if dist:  # (every rank the same compute: the slowest rank's step sets the pace)
            box = [args.compute_ms]
            torch.distributed.broadcast_object_list(box, src=0)
            args.compute_ms = box[0]
    res["compute_ms"] = args.compute_ms
    if args.only == "rewind":
        res["rewind"] = rewind_latency(root, model, opt, args)
        if dist:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        if rank == 0:
            report_rewind(res)
        return
    base = loop(model, opt, args.iters, args.compute_ms)
    res["none"] = {"iter_ms": statistics.median(base) * 1e3, "mean_ms": statistics.mean(base) * 1e3}
    res["copy_floor"] = floor_phase(model, opt, args)
    res["newest"] = phase("newest", root, model, opt, args, memory_steps=4, persist="newest", helper=False)
    res["newest_helper"] = phase("newest_helper", root, model, opt, args, memory_steps=4, persist="newest",
                                 helper=True)
    if dist:
        for policy in ("all", 4):
            res[f"helper_{policy}"] = phase(f"helper_{policy}", root, model, opt, args, memory_steps=4,
                                            persist=policy, helper=True)
    res["wait"] = phase("wait", root, model, opt, args, on_full="wait")
    res["skip"] = phase("skip", root, model, opt, args, on_full="skip")
    res["dcp_async_save"] = dcp_phase(root, model, opt, args)
    try:
        res["rewind"] = rewind_latency(root, model, opt, args)
    except (CaptureError, ConfigError) as e:  # (a mode this dstt refuses)
        res["rewind"] = {"refused": str(e).split("\n")[0][:300]}
    if dist:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if rank != 0:
            return
    report(res, args, state_bytes * world, statistics.median(raw))


def launch(args: Any) -> int:
    """Run this script under torchrun with ``args.ranks`` ranks (gloo, CPU)."""
    import subprocess

    argv = [a for a in sys.argv[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           os.path.abspath(__file__), *argv]
    return subprocess.call(cmd)


def report(res: dict[str, Any], args: Any, state_bytes: int, raw_mb_s: float) -> None:
    if args.json:
        print(json.dumps(res, indent=1))
        return
    raw = res["raw_fsync_mb_s"]
    print(f"# {res['machine']}" + (f", {res['ranks']} ranks (torchrun, gloo)" if res["ranks"] > 1 else ""))
    print(f"state {res['state_mb']:.0f} MB; raw fsync'ed write {min(raw):.0f}-{max(raw):.0f} MB/s "
          f"(one step persists in ~{state_bytes / 1e6 / raw_mb_s:.2f} s at best); iteration "
          f"{res['none']['iter_ms']:.0f} ms with no capture (median of {args.iters}; compute "
          f"{res['compute_ms']:.0f} ms of it)")
    raw_all_mb_s = statistics.median(res["raw_all_ranks_mb_s"])
    print(f"raw fsync'ed write of every rank at once: {raw_all_mb_s:.0f} MB/s (the device's rate; 'durable' below "
          "is every byte the mode put on disk over the loop and its drain, vs it)")
    print("mode            iter ms (median)  added   stored/captured  disk MB/s  vs raw  drain s  durable MB/s  vs raw"
          "  tier")
    none_ms = res["none"]["iter_ms"]
    floor_ms = res["copy_floor"]["iter_ms"]
    print(f"{'raw copy floor':14s}  {floor_ms:7.0f}  {(floor_ms - none_ms) / none_ms * 100:+5.0f}%  "
          "(a plain copy of the state into preallocated memory each iteration, no dstt)")
    for k in ("newest", "newest_helper", "helper_all", "helper_4", "wait", "skip", "dcp_async_save"):
        r = res.get(k)
        if r is None:
            continue
        if "refused" in r:
            print(f"{k:14s}  refused: {r['refused']}")
            continue
        added = (r["iter_ms"] - res["none"]["iter_ms"]) / res["none"]["iter_ms"] * 100
        print(f"{k:14s}  {r['iter_ms']:7.0f}  {added:+5.0f}%  {r['stored_steps']:6d}/{r['captured']:<8d}  "
              f"{r['disk_mb_s']:9.0f}  {r['disk_mb_s'] / raw_mb_s:5.2f}x  {r.get('drain_s', 0):6.2f}  "
              f"{r['durable_mb_s']:12.0f}  {r['durable_mb_s'] / raw_all_mb_s:5.2f}x  {r.get('tier_where') or '-'}")
    for k in ("newest", "newest_helper"):
        r = res.get(k)
        if r is not None and "refused" not in r and r["iter_ms"] > none_ms:
            share = (floor_ms - none_ms) / (r["iter_ms"] - none_ms) * 100
            print(f"{k}: the raw copy floor is {share:.0f}% of its added {r['iter_ms'] - none_ms:.1f} ms "
                  "per iteration")
    report_rewind(res)


def report_rewind(res: dict[str, Any]) -> None:
    rw = res.get("rewind")
    if rw and "refused" in rw:
        print(f"rewind: refused: {rw['refused']}")
    elif rw:
        if res["ranks"] > 1:
            print(f"rewind with {res['ranks']} ranks (torchrun, gloo; rank 0's figures, each rank holding "
                  f"{res['state_mb'] / res['ranks']:.0f} MB):")
        print(f"rewind: ring {rw['ring_rewind_s'] * 1e3:.0f} ms ({rw['ring_rewind_s'] / rw['memcpy_s']:.2f}x one "
              f"memcpy of {rw['memcpy_s'] * 1e3:.0f} ms), dstt.restore {rw['dstt_restore_s'] * 1e3:.0f} ms, "
              f"torch.load + load_state_dict {rw['torch_load_s'] * 1e3:.0f} ms; the snapshot after it (opens "
              f"the new branch) {rw['snapshot_after_rewind_s'] * 1e3:.0f} ms")
        if rw.get("memcpy_all_ranks_s"):
            both = rw["memcpy_all_ranks_s"]
            print(f"  vs every rank's memcpy at once ({both * 1e3:.0f} ms, the collective's floor): "
                  f"{rw['ring_rewind_s'] / both:.2f}x")
        if rw.get("ring_phases_s"):
            ph = rw["ring_phases_s"]
            print("  ring rewind by phase: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()
                                                      if not k.endswith("_bytes")))
            if any(k.endswith("_bytes") for k in ph):  # (under torch.distributed: the other ranks' chunks)
                print("  other ranks' chunks: " + ", ".join(f"{k[:-6]} {v / 1e6:.1f} MB" for k, v in ph.items()
                                                          if k.endswith("_bytes")))


if __name__ == "__main__":
    main()
