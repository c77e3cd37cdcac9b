"""A small deterministic training loop that captures every step with the asynchronous
:class:`dstt.Capture`, for the
bit-exact resume test.

    python tests/scripts/resume_train.py STORE --steps 12 --out final.pt
    python tests/scripts/resume_train.py STORE --steps 1000000        # killed from outside
    python tests/scripts/resume_train.py STORE --resume STORE:6 --branch resumed --steps 12 --out final.pt

Everything that makes the run's future depend on its past is in play: dropout
(torch RNG), a per-epoch shuffled data order (numpy RNG), input noise
(Python ``random``), Adam state, an LR schedule and the data position, kept in
``extra``. It prints ``committed <step>`` once each step is durable.
"""

from __future__ import annotations

import argparse
import os
import random
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dstt  # noqa: E402

N_SAMPLES, BATCH = 40, 8


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, object, torch.Tensor, torch.Tensor]:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(N_SAMPLES, 8, generator=g)
    ys = torch.randn(N_SAMPLES, 4, generator=g)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    return model, opt, sched, xs, ys


def report(cap: dstt.Capture, done: int) -> int:
    """Print ``committed <step>`` for steps made durable since the last call
    (``done``: the newest step printed so far). One read of ``cap.committed``:
    commits land on a background thread (several at once with group commit),
    and it holds only the latest ones, so positions in it are not stable."""
    for info in cap.committed:
        if info.step > done:
            print(f"committed {info.step}", flush=True)
            done = info.step
    return done


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, required=True, help="train until this step count")
    ap.add_argument("--resume", help="reference to restore from first")
    ap.add_argument("--branch", default="main", help="branch to capture on")
    ap.add_argument("--no-rng", action="store_true", help="restore without RNG states (a control)")
    ap.add_argument("--out", help="torch.save the final model and optimizer state here")
    args = ap.parse_args(argv)

    model, opt, sched, xs, ys = setup()
    pos = {"epoch": 0, "batch": 0, "order": np.random.permutation(N_SAMPLES).tolist()}
    start, parent = 0, None
    if args.resume:
        run = dstt.open(args.resume)
        parent = run.resolve()
        pos = dstt.restore(run, model=model, optimizer=opt, scheduler=sched, rng=not args.no_rng)
        start = parent[1]
    batches = N_SAMPLES // BATCH
    reported = start
    with dstt.Capture(args.store, branch=args.branch, parent=parent) as cap:
        for step in range(start + 1, args.steps + 1):
            idx = pos["order"][pos["batch"] * BATCH:(pos["batch"] + 1) * BATCH]
            noise = random.gauss(0.0, 0.1)
            x = xs[idx] + noise
            model.train()
            loss = (model(x) - ys[idx]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            pos["batch"] += 1
            if pos["batch"] == batches:
                pos = {"epoch": pos["epoch"] + 1, "batch": 0, "order": np.random.permutation(N_SAMPLES).tolist()}
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched, rng=True, extra=dict(pos))
            reported = report(cap, reported)
        cap.wait()
        report(cap, reported)
    if args.out:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
