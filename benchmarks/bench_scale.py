"""Issue 16, "Scale in tensor count and small fast loops": many tiny tensors
and a nanoGPT-sized loop captured every iteration, before vs after.

Each case runs in a subprocess (so the dstt imported is the one on
PYTHONPATH): ``--before DIR`` names a checkout of the older code (e.g.
``git worktree add --detach /tmp/before-scale 83d37b8``); both versions run
in the same invocation, so the ratios compare like with like.

    python benchmarks/bench_scale.py --before /tmp/before-scale --tensors 100000 --stall-tensors 20000

Cases: ``save`` (dstt.save of N x 1 KiB fp32 tensors in a flat dict: first
step, a fully unchanged second step, run.state_dict of step 0, files created
per step); ``stall`` (Capture.snapshot() time for N tensors: the median of
the steps after the first); ``loop`` (88 tensors, ~1.2 MB of state, a
~12 ms iteration incl. Adam's step: median iteration with Capture.snapshot
every iteration vs none; also the CPU per step of the trainer's process
and of the capture helper; torch on one thread); ``loop_threads`` (the
same with torch's default thread count: all cores, as nanoGPT runs on this
CPU); ``plan`` (Writer.plan of N x 1 KiB tensors: the
first sighting and an unchanged step, per tensor); ``stall_model``
(snapshot(model=, optimizer=) of N tensors: N/4 parameters of 64 floats
with Adam; the stall and the optimizer step with and without capture).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def count_files(path: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(path))


def case_save(n: int, work: str) -> dict[str, Any]:
    import torch

    import dstt

    state = {f"t{i:06d}": torch.full((256,), float(i)) for i in range(n)}  # 1 KiB each
    path = os.path.join(work, "run")
    out: dict[str, Any] = {}
    t = time.perf_counter()
    dstt.save(path, 0, state)
    out["first_s"] = time.perf_counter() - t
    out["files_first"] = count_files(path)
    out["data_mib"] = round(n * 1024 / (1 << 20), 1)  # the goal: files per step <= data_mib / 4 + a constant
    t = time.perf_counter()
    dstt.save(path, 1, state)
    out["unchanged_s"] = time.perf_counter() - t
    out["files_unchanged"] = count_files(path) - out["files_first"]
    t = time.perf_counter()
    got = dstt.open(path).state_dict(0)
    out["read_s"] = time.perf_counter() - t
    if not all(torch.equal(got[k], v) for k, v in list(state.items())[:: max(1, n // 100)]):
        raise SystemExit("read back differs")
    return out


def case_stall(n: int, work: str) -> dict[str, Any]:
    import torch

    import dstt

    state = {f"t{i:06d}": torch.full((256,), float(i)) for i in range(n)}
    stalls = []
    with dstt.Capture(os.path.join(work, "cap")) as cap:
        for step in range(4):
            for v in list(state.values())[:: max(1, n // 50)]:
                v.add_(1)  # a few tensors change each step
            t = time.perf_counter()
            cap.snapshot(step, extra={"state": state}, rng=False)
            stalls.append(time.perf_counter() - t)
            cap.wait()  # the stall alone, not the pipeline's backlog
    return {"stall_first_s": stalls[0], "stall_median_s": statistics.median(stalls[1:])}


def case_stall_model(n: int, work: str) -> dict[str, Any]:
    """snapshot(model=, optimizer=) of a model with n/4 small parameters and
    Adam (n tensors in all: the parameters, Adam's step, exp_avg and
    exp_avg_sq): the stall, and the optimizer step (its pre-hook may copy
    the previous snapshot's lazy tensors) against the same step uncaptured."""
    import torch

    import dstt

    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(64)) for _ in range(n // 4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    for p in model:
        p.grad = torch.full_like(p, 1e-3)

    def timed_step() -> float:
        t = time.perf_counter()
        opt.step()
        return time.perf_counter() - t

    plain = [timed_step() for _ in range(4)]
    stalls, steps = [], []
    with dstt.Capture(os.path.join(work, "model")) as cap:
        for step in range(6):
            steps.append(timed_step())
            t = time.perf_counter()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            stalls.append(time.perf_counter() - t)
            cap.wait_staged() if step % 2 else cap.wait()  # (half the steps: the hook may copy)
    return {"tensors": len(model) * 4, "stall_first_s": stalls[0], "stall_median_s": statistics.median(stalls[1:]),
            "opt_step_plain_s": statistics.median(plain[1:]), "opt_step_captured_s": statistics.median(steps[2:])}


def case_plan(n: int, work: str) -> dict[str, Any]:
    import torch

    from dstt.store.writer import Writer

    state = {f"t{i:06d}": torch.full((256,), float(i)) for i in range(n)}
    w = Writer(os.path.join(work, "plan"))
    import gc

    gc.collect()  # the process's first full collection (torch's import: ~0.1-0.2 s) is not planning's
    t = time.perf_counter()
    w.plan(0, state)
    first = time.perf_counter() - t
    again = []
    for step in range(1, 4):
        t = time.perf_counter()
        w.plan(step, state)
        again.append(time.perf_counter() - t)
    w.close()
    return {"first_us_per_tensor": first / n * 1e6, "unchanged_us_per_tensor": statistics.median(again) / n * 1e6}


def nanogpt_sized(torch: Any) -> tuple[Any, Any]:
    """66 tensors, ~1.3 MB of state with Adam (22 parameters x 3)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(11):  # 11 x (weight 96x96 + bias) = 22 parameters
        layers += [torch.nn.Linear(96, 96), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def case_loop_threads(iters: int, work: str) -> dict[str, Any]:
    """``loop`` with torch's default thread count (all cores: what a
    nanoGPT run on this CPU uses; OpenMP workers then compete with dstt's
    threads and the capture helper for every core)."""
    return case_loop(iters, work, threads=None)


def case_loop(iters: int, work: str, threads: int | None = 1) -> dict[str, Any]:
    import torch

    import dstt

    if threads is not None:
        torch.set_num_threads(threads)
    model, opt = nanogpt_sized(torch)
    x = torch.randn(64, 96)
    work_m = torch.randn(256, 256)
    reps = [1]

    def compute() -> None:
        y = work_m
        for _ in range(reps[0]):
            y = torch.tanh(y @ work_m)

    def iteration() -> None:
        compute()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(4):  # calibrate to ~12 ms per iteration (the median of a few: one may be a warm-up)
        took = []
        for _ in range(5):
            t = time.perf_counter()
            iteration()
            took.append(time.perf_counter() - t)
        reps[0] = max(1, round(reps[0] * 0.012 / max(statistics.median(took), 1e-5)))
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    n_tensors = len(model.state_dict()) + sum(len(s) for s in opt.state.values())

    cpu_marks: dict[str, float] = {}

    def helper_cpu_s(cap: Any) -> float:
        parts = getattr(cap, "crashsafe", None)  # (the helper's handle: cap.crashsafe.helper; older code: cap._helper)
        helper = getattr(parts, "helper", None) if parts is not None else getattr(cap, "_helper", None)
        if helper is None:
            return 0.0
        with open(f"/proc/{helper.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def median_iter(cap: Any, start: int = 0) -> float:
        times = []
        for i in range(iters):
            if i == 5:  # CPU from here on (not the helper's start-up, nor the first steps')
                cpu_marks.update(cpu=time.process_time(), helper=helper_cpu_s(cap) if cap else 0.0)
            t = time.perf_counter()
            iteration()
            if cap is not None:
                cap.snapshot(start + i, model=model, optimizer=opt, rng=False)
            times.append(time.perf_counter() - t)
        cpu_marks.update(cpu=(time.process_time() - cpu_marks["cpu"]) / (iters - 5),
                         helper=((helper_cpu_s(cap) if cap else 0.0) - cpu_marks["helper"]) / (iters - 5))
        return statistics.median(times[5:])

    plain = [median_iter(None)]
    plain_cpu = cpu_marks["cpu"]
    with dstt.Capture(os.path.join(work, "loop")) as cap:
        for i in range(3):  # the capture helper started (its start-up is off the loop, not measured)
            iteration()
            cap.snapshot(i, model=model, optimizer=opt, rng=False)
        cap.wait()
        captured = median_iter(cap, start=3)
        cpu, helper = cpu_marks["cpu"], cpu_marks["helper"]
        cap.wait()
    plain.append(median_iter(None))  # before and after: the machine's drift
    base = statistics.mean(plain)
    run = dstt.open(os.path.join(work, "loop"))  # compression="auto": steps stored fast (queue depth, CPU)
    fast = sum(run.commit_info(s).get("coding") == "fast" for s in run.steps()) / max(1, len(run.steps()))
    return {"torch_threads": torch.get_num_threads(), "tensors": n_tensors, "state_bytes": state_bytes,
            "fast_share": fast,
            "iter_plain_s": base,
            "iter_captured_s": captured, "added": captured / base - 1,
            "trainer_cpu_added_ms_per_step": (cpu - plain_cpu) * 1e3, "helper_cpu_ms_per_step": helper * 1e3}


def run_case(pythonpath: str, case: str, n: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    work = tempfile.mkdtemp(prefix="bench_scale_")
    try:
        proc = subprocess.run([sys.executable, __file__, "--case", case, "--n", str(n), "--work", work],
                              env=env, capture_output=True, text=True, cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="checkout of the older code (PYTHONPATH)")
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--stall-tensors", type=int, default=20_000)
    ap.add_argument("--loop-iters", type=int, default=60)
    ap.add_argument("--cases", default="save,stall,loop")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        fn = {"save": case_save, "stall": case_stall, "loop": case_loop, "loop_threads": case_loop_threads,
              "plan": case_plan, "stall_model": case_stall_model}[args.case]
        print(json.dumps(fn(args.n, args.work)))
        return
    sys.path.insert(0, HERE)
    from common import machine

    print(f"machine: {machine()}")
    versions = [("after", ROOT)] + ([("before", os.path.abspath(args.before))] if args.before else [])
    sizes = {"save": args.tensors, "stall": args.stall_tensors, "loop": args.loop_iters,
             "loop_threads": args.loop_iters, "plan": args.stall_tensors, "stall_model": args.stall_tensors}
    results: dict[str, dict[str, Any]] = {}
    for case in args.cases.split(","):
        for label, path in versions:
            r = run_case(path, case, sizes[case])
            results[f"{case}/{label}"] = r
            print(f"{case:6} {label:6} n={sizes[case]}: {json.dumps(r)}", flush=True)
    for case in args.cases.split(","):
        a, b = results.get(f"{case}/after", {}), results.get(f"{case}/before", {})
        for k, v in a.items():
            if k.endswith("_s") and isinstance(b.get(k), float) and v > 0:
                print(f"{case:6} {k:18} before/after = {b[k] / v:.1f}x")
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "bench_scale.json"), "w") as f:
        json.dump({"machine": machine(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
