"""Issue 25: where the capture helper's time goes while it persists a step
of the memory tier -- its persist path run on a given state, without a
trainer, each phase timed, against a raw fsync'ed write of the same bytes
in the same run.

    python benchmarks/bench_persist.py [--size-mb 200] [--steps 6] [--n-params 50] [--compression auto]
        [--auto fast|code] [--dir ...] [--profile] [--json] [--compare DSTT_ROOT [--rounds 2]]

``--size-mb 100`` has the chunk sizes of one rank of bench_flight's
2-rank run at 200 MB (663 KiB tensors: packed); 200 MB those of its
one-process run (1.3 MB tensors: chunk files). ``--compare DSTT_ROOT``
runs the same measurement with the dstt package found under DSTT_ROOT
(e.g. ``git archive main dstt | tar -x -C /tmp/before``: "before") and
with this checkout's, alternately, ``--rounds`` times each, in one run.

What runs is the helper's own code (capture/helperops.py
``HelperOps.persist`` and ``HelperOps.check``, the NaN/Inf watch), on a
Writer of a fresh store, with the state's tensors staged in page-aligned
host memory as the trainer stages them in its ring (two slots, alternating:
each step's update statistics compare with the slot of the step before,
as ``persist="all"`` does). The state is the Adam model of bench_flight
(``--n-params`` fp32 matrices plus exp_avg and exp_avg_sq), changed a
little before each step, so no chunk is deduplicated.

Per phase (thread-seconds summed over the helper's two flush threads, so
their sum may exceed the step's wall time) and its rate over the state's
bytes:

* ``check``: the NaN/Inf watch of the step;
* ``encode``: predictive coding before the flush (``compression="auto"``
  or ``"predictive"``; ``--auto fast``, the default: every step stored
  fast, as the helper does without a spare core);
* ``stats``: the per-chunk statistics with the update against the previous step;
* ``crc``: CRC-32C of the chunks;
* ``write``: the chunk files (``backend.put``), packs included;
* ``code``: the rest of a chunk's store (dedup test, encoding), without its writes;
* ``flush_other``: the rest of the flush (its Python, views, links);
* ``commit``: the step's commit (index files, commit marker) without ``sync``;
* ``sync``: the durability point(s) (``backend.sync``: syncfs).

Then the step's wall time, its rate, and that rate vs the raw fsync'ed write
(``raw_fsync_write``: the same tensors to one file, fsynced), median of
``--steps`` steps (the first, which writes the arrays' documents, left out).
``--profile``: a cProfile of the steps after the first (top 25 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, machine, model_and_adam, raw_fsync_write  # noqa: E402

from dstt.capture.helperops import HelperOps  # noqa: E402
from dstt.capture.hostpool import HostPool  # noqa: E402
from dstt.format.writeoptions import WriteOptions  # noqa: E402
from dstt.store import flusher as F  # noqa: E402
from dstt.store.writer import AUTO_BEHIND, Writer  # noqa: E402

PHASES = ("check", "encode", "stats", "crc", "code", "write", "flush_other", "commit", "sync")


class Timers:
    """Per phase: thread-seconds and CPU seconds of the timed calls, each
    without the timed calls it makes (a chunk's write inside its store, the
    sync inside the commit), summed over threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.s: dict[str, float] = dict.fromkeys((*PHASES, "flush"), 0.0)
        self.cpu = dict(self.s)
        self.local = threading.local()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            stack: list[list[float]] = self.local.__dict__.setdefault("stack", [])
            stack.append([0.0, 0.0])  # (time, CPU) of the timed calls made inside this one
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                inner = stack.pop()
                if stack:
                    stack[-1][0] += dt
                    stack[-1][1] += dc
                with self.lock:
                    self.s[name] += dt - inner[0]
                    self.cpu[name] += dc - inner[1]
        return timed

    def reset(self) -> tuple[dict[str, float], dict[str, float]]:
        """(thread-seconds, CPU seconds) per phase since the last reset."""
        with self.lock:
            out = (dict(self.s), dict(self.cpu))
            self.s = dict.fromkeys(self.s, 0.0)
            self.cpu = dict(self.s)
        out[0]["flush_other"] = out[0].pop("flush")
        out[1]["flush_other"] = out[1].pop("flush")
        return out


def instrument(w: Writer, ops: HelperOps, timers: Timers) -> None:
    """Time the phases of ``ops.persist`` (module docstring)."""
    F.chunk_partial = timers.wrap("stats", F.chunk_partial)
    F.batch_partials = timers.wrap("stats", F.batch_partials)
    F.crc32c = timers.wrap("crc", F.crc32c)
    F.google_crc32c = SimpleNamespace(extend=timers.wrap("crc", F.google_crc32c.extend))  # (grouped chunks)
    F.code_chunk = timers.wrap("code", F.code_chunk)
    backend: Any = w.backend
    backend.put = timers.wrap("write", backend.put)
    backend.sync = timers.wrap("sync", backend.sync)
    w.commits.commit = timers.wrap("commit", w.commits.commit)  # type: ignore[method-assign]
    w.flusher.flush_chunks = timers.wrap("flush", w.flusher.flush_chunks)  # type: ignore[method-assign]
    w.prepare_pred = timers.wrap("encode", w.prepare_pred)  # type: ignore[method-assign]
    check = ops.check
    ops.check = timers.wrap("check", check)  # type: ignore[method-assign]


def stage(pool: HostPool, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in ``pool`` (page-aligned where large, as the ring's)."""
    return [pool.stage(t) for t in tensors]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-params", type=int, default=50)
    ap.add_argument("--dir", default="/tmp/dstt-bench-persist")
    ap.add_argument("--compression", default="auto",
                    help="the writer's (the helper's default: auto; none, zstd, predictive, ...)")
    ap.add_argument("--auto", choices=("fast", "code"), default="fast",
                    help="compression=auto: every step stored fast (the helper without a spare core: "
                         "helpercpu.py) or every step coded")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", metavar="DSTT_ROOT", default=None,
                    help="also run with the dstt package under DSTT_ROOT (e.g. an export of main: 'before'), "
                         "alternating before/after --rounds times in this run; report both")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(args))
    torch.set_num_threads(1)  # (as the helper process runs: capture/helper.py serve)
    root = fresh_dir(args.dir)
    model, opt = model_and_adam(int(args.size_mb * 1e6), n_params=args.n_params)
    tensors = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    raw = []
    for i in range(3):
        t0 = time.perf_counter()
        raw_fsync_write(os.path.join(root, f"raw{i}.bin"), tensors)
        raw.append(state_bytes / (time.perf_counter() - t0) / 1e6)
        os.unlink(os.path.join(root, f"raw{i}.bin"))
    res: dict[str, Any] = {"machine": machine(), "state_mb": state_bytes / 1e6, "tensors": len(tensors),
                           "raw_fsync_mb_s": raw}
    res.update(persist_run(os.path.join(root, "store"), tensors, state_bytes, args))
    rate = res["step_mb_s"]
    res["vs_raw"] = rate / statistics.median(raw)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"# {res['machine']}")
    print(f"state {res['state_mb']:.0f} MB in {res['tensors']} tensors; raw fsync'ed write "
          f"{min(raw):.0f}-{max(raw):.0f} MB/s")
    print(f"persist one step (helper path, median of {res['steps_timed']}): {res['step_s'] * 1e3:.0f} ms = "
          f"{rate:.0f} MB/s = {res['vs_raw']:.2f}x raw")
    print(f"CPU per step (all threads): {res['cpu_s'] * 1e3:.0f} ms = {state_bytes / res['cpu_s'] / 1e6:.0f} MB "
          "per CPU-second")
    print("phase         thread-ms/step  CPU-ms/step  MB per CPU-s  share of the step's wall time")
    for k in PHASES:
        s, c = res["phase_s"][k], res["phase_cpu_s"][k]
        mbs = f"{state_bytes / c / 1e6:12.0f}" if c > 1e-4 else f"{'-':>12s}"
        print(f"{k:12s}  {s * 1e3:12.1f}  {c * 1e3:11.1f}  {mbs}  {s / res['step_s'] * 100:5.0f}%")
    if "profile" in res:
        print(res["profile"])


def compare(args: Any) -> int:
    """Before (``--compare``'s dstt) and after (this script's), each run
    ``--rounds`` times alternately in subprocesses; the median of each."""
    import subprocess

    here = str(Path(__file__).resolve().parents[1])
    argv = _drop_values(sys.argv[1:], ("--compare", "--rounds", "--json"))
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for side, root in (("before", args.compare), ("after", here)):
            env = {**os.environ, "PYTHONPATH": root}
            out = subprocess.run([sys.executable, __file__, *argv, "--json"], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs[side].append(json.loads(out))
    print(f"# {runs['after'][0]['machine']}; state {runs['after'][0]['state_mb']:.0f} MB in "
          f"{runs['after'][0]['tensors']} tensors; before: {args.compare}; median of {args.rounds} alternating runs")
    print("side     step ms   MB/s   vs raw   CPU ms/step   " + "  ".join(f"{k:>11s}" for k in PHASES))
    for side, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("step_s", "step_mb_s", "vs_raw", "cpu_s")}
        cpu = {k: statistics.median(r["phase_cpu_s"].get(k, 0.0) for r in rs) for k in PHASES}
        print(f"{side:7s}  {med['step_s'] * 1e3:7.0f}  {med['step_mb_s']:5.0f}  {med['vs_raw']:6.2f}x  "
              f"{med['cpu_s'] * 1e3:11.0f}   " + "  ".join(f"{cpu[k] * 1e3:11.1f}" for k in PHASES))
    print("(phases: CPU ms per step)")
    return 0


def _drop_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` (and their values)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = a != "--json"
            continue
        if a.split("=", 1)[0] in names:
            continue
        out.append(a)
    return out


def persist_run(path: str, tensors: list[torch.Tensor], state_bytes: int, args: Any) -> dict[str, Any]:
    """Persist ``args.steps`` steps through ``HelperOps.persist``, timed."""
    w = Writer(path, WriteOptions(compression=args.compression))
    if args.auto == "fast":
        w.backlog = AUTO_BEHIND  # (as the helper's queue behind: every step stored fast)
    else:
        w.auto_cpu_cores = float("inf")
    ring = Path(path + "-ring")
    ring.mkdir(parents=True, exist_ok=True)
    flush = __import__("concurrent.futures").futures.ThreadPoolExecutor(2, thread_name_prefix="dstt-helper")
    ops = HelperOps(w, ring, {}, None, lambda line: None, flush)
    timers = Timers()
    instrument(w, ops, timers)
    slots = [stage(HostPool(state_bytes + 4096 * (len(tensors) + 2)), tensors) for _ in range(2)]
    names = [f"t{i:04d}" for i in range(len(tensors))]
    walls: list[float] = []
    cpus: list[float] = []
    phases: list[dict[str, float]] = []
    phase_cpu: list[dict[str, float]] = []
    prof = cProfile.Profile() if args.profile else None
    try:
        for step in range(args.steps):
            for t in tensors:
                t.add_(1e-3)  # every chunk changes (no dedup)
            views = slots[step % 2]
            for v, t in zip(views, tensors):
                v.copy_(t)
            plan = w.plan(step, dict(zip(names, views)))
            ops.steps[step] = (plan, {})
            timers.reset()
            if prof is not None and step > 0:
                prof.enable()
            t0, c0 = time.perf_counter(), time.process_time()
            ops.check(step)
            ops.persist(step, step - 1 if step > 0 else None, [])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if prof is not None:
                prof.disable()
            if step > 0:
                walls.append(wall)
                cpus.append(cpu)
                tw, tc = timers.reset()
                phases.append(tw)
                phase_cpu.append(tc)
            ops.steps.pop(step - 1, None)  # (its slot is staged again at the next step)
    finally:
        flush.shutdown(wait=True)
        w.close()
    out: dict[str, Any] = {"steps_timed": len(walls), "step_s": statistics.median(walls),
                           "cpu_s": statistics.median(cpus),
                           "phase_s": {k: statistics.median(p[k] for p in phases) for k in PHASES},
                           "phase_cpu_s": {k: statistics.median(p[k] for p in phase_cpu) for k in PHASES}}
    out["step_mb_s"] = state_bytes / out["step_s"] / 1e6
    if prof is not None:
        import io

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out["profile"] = buf.getvalue()
    return out


if __name__ == "__main__":
    main()
