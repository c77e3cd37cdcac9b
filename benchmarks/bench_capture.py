"""Issues 3 and 12: what lazy asynchronous capture costs a training loop (CPU).

    python benchmarks/bench_capture.py [--size-gb 1.0] [--iters 10] [--compute-s 1.0] [--dir ...]

dstt is measured twice in the same run: with its capture helper process
(issue 12: writes and commits in a process of its own, staging in /dev/shm)
and with the previous in-thread pipeline (``helper=False``).

The stand-in compute is calibrated against the clock (repeated until three
timed calls agree with --compute-s within 10%), and the raw fsync'ed write
rate is measured three times (before, between and after the checkpointers)
and reported with its spread.

One process, one state (fp32 parameters + Adam, ~size-gb in ~400 tensors),
one run; every figure is compared with others from the same run:

* stall per capture: time the loop is blocked by the checkpointer (dstt:
  ``snapshot()`` + the optimizer hook's wait; DCP: ``async_save()`` + waiting
  for its staging and for the previous save) vs one memcpy of the state into a
  warm buffer and vs ``torch.save`` (+fsync);
* end to end: N iterations capturing every iteration vs none, ``torch.save``
  every iteration and ``dcp.async_save`` every iteration;
* persist throughput: dstt's background flush (stats + sha256 + write +
  syncfs) vs one raw fsync'ed sequential write of the same bytes;
* peak RSS vs the process's own + host_buffer_bytes (dstt phases run first,
  so the peak is theirs).

An "iteration" is a fixed compute workload standing in for forward/backward
(it does not touch the state, as forward/backward only read parameters)
followed by ``optimizer.step()``, which updates every parameter and Adam
tensor in place.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, fsync_file, machine, model_and_adam, raw_fsync_write, timed  # noqa: E402

import dstt  # noqa: E402
from dstt.store.tree import flatten  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensors_of(state: Any) -> list[torch.Tensor]:
    return [t for t in flatten(state)[1].values() if isinstance(t, torch.Tensor)]


class Loop:
    """The stand-in training loop."""

    def __init__(self, size_gb: float, compute_s: float) -> None:
        self.model, self.opt = model_and_adam(int(size_gb * 2**30))
        self.work = torch.randn(512, 512)
        self.reps = 1
        self.compute_s = self.calibrate(compute_s)

    def calibrate(self, target_s: float) -> float:
        """Set ``reps`` so one compute() takes ``target_s`` by the clock; the
        median of three timed calls after the last adjustment."""
        for _ in range(6):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                self.compute()
                times.append(time.perf_counter() - t)
            took = sorted(times)[1]
            if abs(took - target_s) <= 0.1 * target_s:
                return took
            self.reps = max(1, round(self.reps * target_s / max(took, 1e-5)))
        return took

    def compute(self) -> None:
        x = self.work
        for _ in range(self.reps):
            x = torch.tanh(x @ self.work)

    def state(self) -> dict:
        return dstt.state_of(model=self.model, optimizer=self.opt, rng=False)

    def step(self) -> None:
        self.compute()
        self.opt.step()


def run_plain(loop: Loop, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        loop.step()
    return time.perf_counter() - t


def helper_peak_mib(cap: Any) -> float:
    h = getattr(cap, "_helper", None)
    if h is None:
        return 0.0
    try:
        with open(f"/proc/{h.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_dstt(loop: Loop, iters: int, path: str, helper: bool) -> tuple[float, list[float], float, float]:
    """(total, stall per capture, final drain, helper peak RSS): the loop runs
    ``iters`` iterations like the others; the total includes waiting until
    the last step is durable (the drain), as torch.save's includes its last write."""
    stalls: list[float] = []
    cap = dstt.Capture(fresh_dir(path), helper=helper)  # auto-sized pool: two steps
    hook_waits: list[float] = []
    fence = cap.stager._fence
    fence._wait = timed(hook_waits, fence._wait)  # instrument the optimizer hook's wait
    t = time.perf_counter()
    for i in range(iters):
        loop.compute()
        loop.opt.step()  # the hook may wait here (for the previous capture's copy)
        s = time.perf_counter()
        cap.snapshot(i, model=loop.model, optimizer=loop.opt, rng=False)
        stalls.append(time.perf_counter() - s)
    s = time.perf_counter()
    cap.wait()
    drain = time.perf_counter() - s
    total = time.perf_counter() - t
    helper_peak = helper_peak_mib(cap)
    cap.close()
    # snapshot i's stall plus the wait of the optimizer step after it (the
    # fence is installed by the first snapshot; none follows the last)
    per = [s + w for s, w in zip(stalls, hook_waits + [0.0])]
    return total, per, drain, helper_peak


def run_torch_save(loop: Loop, iters: int, path: str) -> tuple[float, list[float]]:
    fresh_dir(path)
    f = os.path.join(path, "ckpt.pt")
    stalls = []
    t = time.perf_counter()
    for _ in range(iters):
        loop.step()
        s = time.perf_counter()
        torch.save(loop.state(), f)
        fsync_file(f)
        stalls.append(time.perf_counter() - s)
    return time.perf_counter() - t, stalls


def dcp_variants() -> dict[str, dict[str, Any]]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return {
        "thread": {"async_checkpointer_type": AsyncCheckpointerType.THREAD},
        "thread+async-stager": {
            "async_checkpointer_type": AsyncCheckpointerType.THREAD,
            "async_stager": lambda: DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                                 use_async_staging=True,
                                                                 use_non_blocking_copy=False)),
        },
    }


def run_dcp(loop: Loop, iters: int, path: str, variant: dict[str, Any]) -> tuple[float, list[float]]:
    """dcp.async_save every iteration; the loop waits for staging before the
    next optimizer step (else DCP stores post-update values, pytorch #144657)
    and for the previous save before starting a new one."""
    import torch.distributed.checkpoint as dcp

    fresh_dir(path)
    kwargs = dict(variant)
    if "async_stager" in kwargs:
        kwargs["async_stager"] = kwargs["async_stager"]()
    stalls = []
    pending: Any = None
    staging: Any = None
    t = time.perf_counter()
    for i in range(iters):
        loop.compute()
        s = time.perf_counter()
        if staging is not None:
            staging.result()
        w = time.perf_counter() - s
        loop.opt.step()
        s = time.perf_counter()
        if pending is not None:
            pending.result()
        resp = dcp.async_save(loop.state(), checkpoint_id=os.path.join(path, f"step{i}"), no_dist=True, **kwargs)
        if hasattr(resp, "upload_completion"):
            pending, staging = resp.upload_completion, resp.staging_completion
        else:
            pending, staging = resp, None
        stalls.append(w + time.perf_counter() - s)
    if staging is not None:
        staging.result()
    pending.result()
    return time.perf_counter() - t, stalls


def persist_throughput(loop: Loop, path: str, helper: bool, nbytes: int, steps: int = 3) -> float:
    """Bytes per second of back-to-back captures with nothing else running
    (dedup off so every byte is written)."""
    with dstt.Capture(fresh_dir(path), helper=helper, dedup=False) as cap:
        t = time.perf_counter()
        for i in range(steps):
            cap.snapshot(i, model=loop.model, optimizer=loop.opt, rng=False)
        cap.wait()
        return steps * nbytes / (time.perf_counter() - t)


def raw_rate(root: str, tensors: list[torch.Tensor], nbytes: int) -> float:
    raw = os.path.join(fresh_dir(os.path.join(root, "raw")), "raw.bin")
    s = time.perf_counter()
    raw_fsync_write(raw, tensors)
    rate = nbytes / (time.perf_counter() - s)
    os.unlink(raw)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compute-s", type=float, default=1.0, help="stand-in forward/backward time per iteration")
    ap.add_argument("--dir", default="/tmp/dstt-bench-capture")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loop = Loop(args.size_gb, args.compute_s)
    tensors = tensors_of(loop.state())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"machine: {machine()}")
    print(f"state: {len(tensors)} tensors, {nbytes / 2**30:.2f} GiB; staging pool auto-sized (two steps); "
          f"{args.iters} iterations of {loop.compute_s:.3f} s compute (asked {args.compute_s}) + Adam step")
    r: dict[str, float] = {}

    # warm buffer memcpy (the floor for any consistent copy)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.zero_()
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buf[off: off + n].view(t.dtype).view(t.shape))
        off += n
    best = float("inf")
    for _ in range(3):
        s = time.perf_counter()
        for v, t in zip(views, tensors):
            v.copy_(t)
        best = min(best, time.perf_counter() - s)
    r["memcpy"] = best
    del buf, views
    own = rss_mib()

    raws = [raw_rate(args.dir, tensors, nbytes)]
    plain_before = run_plain(loop, args.iters)
    for name, helper in (("helper", True), ("thread", False)):
        e2e, stalls, drain, hpeak = run_dstt(loop, args.iters, os.path.join(args.dir, "dstt"), helper)
        r[f"{name}_e2e"], r[f"{name}_drain"], r[f"{name}_peak_helper"] = e2e, drain, hpeak
        r[f"{name}_stall"] = sorted(stalls)[len(stalls) // 2]
        r[f"{name}_stall_first"] = stalls[0]
        r[f"{name}_stall_max"] = max(stalls)
        r[f"{name}_persist"] = persist_throughput(loop, os.path.join(args.dir, "dstt"), helper, nbytes)
        r[f"{name}_peak"] = peak_mib()  # the process's peak so far (helper phase first)
    raws.append(raw_rate(args.dir, tensors, nbytes))
    r["save_e2e"], stalls = run_torch_save(loop, args.iters, os.path.join(args.dir, "torchsave"))
    r["save_stall"] = sorted(stalls)[len(stalls) // 2]
    fresh_dir(os.path.join(args.dir, "torchsave"))
    dcp_best = None
    for name, variant in dcp_variants().items():
        try:
            e2e, stalls = run_dcp(loop, args.iters, os.path.join(args.dir, "dcp"), variant)
        except Exception as e:  # an option this torch build lacks
            print(f"dcp {name}: failed ({type(e).__name__}: {e})")
            continue
        stall = sorted(stalls)[len(stalls) // 2]
        print(f"dcp.async_save [{name}]: stall {stall:.3f} s, end to end {e2e:.2f} s")
        if dcp_best is None or stall < dcp_best[1]:
            dcp_best = (name, stall, e2e)
        fresh_dir(os.path.join(args.dir, "dcp"))
    fresh_dir(args.dir)
    # The shared machine drifts: the no-checkpoint baseline is the mean of a
    # run before and a run after the checkpointers.
    plain_after = run_plain(loop, args.iters)
    r["plain"] = (plain_before + plain_after) / 2
    raws.append(raw_rate(args.dir, tensors, nbytes))
    r["raw"] = sorted(raws)[1]
    # What no checkpointer can beat: writing iters states at the raw disk rate
    # takes this long; whatever of it the training time cannot hide is added.
    r["floor"] = max(0.0, args.iters * nbytes / r["raw"] - r["plain"])

    print()
    rows = [
        ("stand-in compute per iteration (calibrated)", f"{loop.compute_s:.3f} s", f"asked {args.compute_s} s"),
        ("memcpy into a warm buffer", f"{r['memcpy']:.3f} s", f"{nbytes / r['memcpy'] / 1e9:.2f} GB/s"),
        ("torch.save + fsync per checkpoint", f"{r['save_stall']:.3f} s", ""),
    ]
    if dcp_best:
        rows.append((f"dcp.async_save stall [{dcp_best[0]}]", f"{dcp_best[1]:.3f} s", ""))
    rows.append(("raw fsync'ed write (3 runs: median, min-max)", f"{r['raw'] / 1e6:.0f} MB/s",
                 f"{min(raws) / 1e6:.0f}-{max(raws) / 1e6:.0f} MB/s"))
    rows.append((f"end to end, {args.iters} iterations, no checkpoint", f"{r['plain']:.2f} s",
                 f"runs before/after: {plain_before:.2f} / {plain_after:.2f} s"))
    rows.append(("  disk floor (raw-rate writes the training cannot hide)", f"{r['floor']:.2f} s", ""))
    added = {"torch.save": r["save_e2e"] - r["plain"]}
    if dcp_best:
        added["dcp.async_save"] = dcp_best[2] - r["plain"]
    for k, v in added.items():
        rows.append((f"  time added by {k} every iteration", f"{v:.2f} s", ""))
    limit = own + 2 * nbytes / 2**20
    for name in ("helper", "thread"):
        label = "dstt, helper process" if name == "helper" else "dstt, in-thread (helper=False)"
        add = r[f"{name}_e2e"] - r["plain"]
        rows.append((f"{label}: stall per capture (median)", f"{r[f'{name}_stall']:.3f} s",
                     f"{r[f'{name}_stall'] / r['memcpy']:.2f}x memcpy, "
                     f"{100 * r[f'{name}_stall'] / r['save_stall']:.1f}% of torch.save"
                     + (f", {r[f'{name}_stall'] / dcp_best[1]:.2f}x dcp" if dcp_best else "")))
        rows.append(("  first / max stall", f"{r[f'{name}_stall_first']:.3f} s", f"max {r[f'{name}_stall_max']:.3f} s"))
        ratios = [f"{add / added['torch.save']:.2f}x torch.save"]
        if dcp_best:
            ratios.append(f"{add / added['dcp.async_save']:.2f}x dcp")
        rows.append(("  time added every iteration", f"{add:.2f} s",
                     ", ".join(ratios) + f"; drain at the end {r[f'{name}_drain']:.2f} s"))
        rows.append(("  persist throughput (durable)", f"{r[f'{name}_persist'] / 1e6:.0f} MB/s",
                     f"{r[f'{name}_persist'] / r['raw']:.2f}x raw median "
                     f"({r[f'{name}_persist'] / max(raws):.2f}-{r[f'{name}_persist'] / min(raws):.2f}x over its spread)"))
        hp = r[f"{name}_peak_helper"]
        rows.append(("  peak RSS trainer (+ helper)", f"{r[f'{name}_peak']:.0f} MiB",
                     (f"+ helper {hp:.0f} MiB (shares the pool's /dev/shm pages); " if hp else "")
                     + f"own {own:.0f} + 2 steps {2 * nbytes / 2**20:.0f} = {limit:.0f} MiB"))
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:>10}  {c}")


if __name__ == "__main__":
    main()
