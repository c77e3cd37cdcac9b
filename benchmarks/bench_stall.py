"""Issue 25: the later snapshot's stall of a many-tensor AdamW state on the
CPU, with ``rng=True`` (the default: RNG states captured) against
``rng=False``, in one run.

    python benchmarks/bench_stall.py [--tensors 400,2000] [--iters 30] [--mib 8] [--profile FILE] [--device cuda]

For each tensor count (an AdamW state: a parameter, ``step``, ``exp_avg``
and ``exp_avg_sq`` per parameter, ~``--mib`` MiB in all) and each of
``rng=False`` / ``rng=True`` / ``rng=True`` with a fresh scalar in
``extra`` (a loss tensor: a new tensor object every step, like the RNG
state), a fresh ``Capture`` takes ``--iters`` snapshots; the stall is
``snapshot()`` plus the next optimizer step's wait for its copies, each
commit awaited outside the timed region. Printed: the median later stall
(the first snapshot left out), per tensor, and as a ratio to ``rng=False``
and to one raw ``copy_`` of the state (median of 3).

``--profile FILE``: cProfile of the later snapshots of the last
configuration of the largest count (the trainer's thread), written to FILE
(``python -m pstats FILE``).

The RNG state is a new tensor at every step (``torch.get_rng_state()``,
``np.random.get_state()``): before issue 25's fix it made the whole-step
plan memo (store/plan.py) and every cache keyed on the task list miss, so
every step was planned tensor by tensor. Speed is measured here, never
asserted in tests; measured beside other work, the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, raw_copy_s, timed  # noqa: E402

import dstt  # noqa: E402

#: name -> (rng, a fresh scalar tensor in extra)
CONFIGS: dict[str, tuple[bool, bool]] = {"rng=False": (False, False), "rng=True": (True, False),
                                         "rng=True+extra": (True, True)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="400,2000", help="comma-separated state tensor counts (4 per parameter)")
    ap.add_argument("--iters", type=int, default=30, help="snapshots per configuration (the first left out)")
    ap.add_argument("--mib", type=float, default=8.0, help="state size in MiB")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    ap.add_argument("--profile", default=None, help="cProfile output of the largest count's last configuration")
    ap.add_argument("--helper", type=int, default=1, choices=(0, 1), help="Capture(helper=...)")
    ap.add_argument("--device", default="cpu", help="where the state lives (cuda: raw is a pinned copy)")
    args = ap.parse_args(argv)
    args.counts = [int(s) for s in args.tensors.split(",") if s]
    if not args.counts or min(args.counts) < 4 or args.iters < 3 or args.mib <= 0:
        ap.error("--tensors must be >= 4, --iters >= 3, --mib > 0")
    return args


def adamw_state(n_tensors: int, mib: float, device: str = "cpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``n_tensors // 4`` fp32 parameters and their AdamW state on ``device``, ~``mib`` MiB in all."""
    torch.manual_seed(0)
    n_params = max(1, n_tensors // 4)
    numel = max(1, int(mib * 2**20) // 3 // 4 // n_params)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(n_params)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def one_run(store: str, model: torch.nn.Module, opt: torch.optim.Optimizer, iters: int, rng: bool,
            extra: bool, helper: bool, profile: cProfile.Profile | None) -> list[float]:
    """The later stalls of one Capture (snapshot() + the next step's wait for its copies)."""
    stalls: list[float] = []
    waits: list[float] = []
    cap = dstt.Capture(store, helper=helper)
    fence = cap.stager._fence  # (the optimizer hook's wait: part of the stall)
    fence._wait = timed(waits, fence._wait)
    try:
        for i in range(iters):
            if i > 1:
                cap.wait()  # (the disk keeping up, outside the timed region)
            waits.clear()
            opt.step()
            if i:
                stalls[i - 1] += sum(waits)
            loss = {"loss": torch.tensor(float(i), device=next(iter(model.parameters())).device)} if extra else None
            if profile is not None and i:
                profile.enable()
            t = time.perf_counter()
            cap.snapshot(i, model=model, optimizer=opt, rng=rng, extra=loss)
            stalls.append(time.perf_counter() - t)
            if profile is not None:
                profile.disable()
        waits.clear()
        opt.step()
        stalls[-1] += sum(waits)
    finally:
        cap.close()
    return stalls[1:]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_stall: no CUDA GPU on this machine; nothing measured")
        return 0
    base = args.dir or tempfile.mkdtemp(prefix="dstt-stall-")
    print(f"machine: {machine()}")
    print(f"state ~{args.mib} MiB on {args.device}, {args.iters} snapshots per configuration, "
          f"helper={bool(args.helper)}")
    results: list[dict[str, Any]] = []
    try:
        for n in args.counts:
            model, opt = adamw_state(n, args.mib, args.device)
            tensors = [p.detach() for p in model.parameters()]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            raw = raw_copy_s(tensors)
            print(f"\n{len(tensors)} tensors; raw copy {raw * 1e3:.2f} ms")
            print(f"  {'config':16} {'median ms':>9} {'us/tensor':>9} {'x rng=False':>11} {'x raw':>7}")
            base_ms = None
            for name, (rng, extra) in CONFIGS.items():
                store = os.path.join(base, f"{n}-{name}")
                shutil.rmtree(store, ignore_errors=True)
                prof = cProfile.Profile() if args.profile and n == max(args.counts) and \
                    name == list(CONFIGS)[-1] else None
                stalls = one_run(store, model, opt, args.iters, rng, extra, bool(args.helper), prof)
                shutil.rmtree(store, ignore_errors=True)
                med = statistics.median(stalls)
                base_ms = med if base_ms is None else base_ms
                print(f"  {name:16} {med * 1e3:9.2f} {med * 1e6 / len(tensors):9.2f} {med / base_ms:11.2f} "
                      f"{med / raw:7.2f}", flush=True)
                results.append({"tensors": len(tensors), "config": name, "median_s": med, "raw_s": raw})
                if prof is not None:
                    prof.dump_stats(args.profile)
                    print(f"  (profile of {name}: {args.profile})")
            del model, opt, tensors
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
