"""The flight recorder at 3 a.m.: a loss spike, the steps that led to it
stored in full, a rewind from memory, the bad batches skipped.

    python examples/flight_recorder.py                 # into runs/flight
    python examples/flight_recorder.py --store /tmp/f --steps 60

A small MLP regresses a made-up target. Every step is captured into memory
(``memory_steps=8``); the disk stores what it can (``persist="newest"``:
the trainer never waits for it). At step ``--poison`` a batch of garbage
arrives and the loss spikes; the trainer's own spike test raises an
incident (the 8 steps in memory go to the store) and rewinds to a step
before the spike, continuing on a new branch past the poisoned batches.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import dstt


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of the data, reproducible from the index alone."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="runs/flight")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--poison", type=int, default=25, help="the step whose batches are garbage")
    args = p.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses: list[float] = []
    position, step, skip_before = 0, 0, -1  # data position: the next batch index
    with dstt.Capture(args.store, memory_steps=8, persist="newest") as cap:
        while step < args.steps:
            x, y = batch(position)
            if position in (args.poison, args.poison + 1) and position >= skip_before:
                x = x * 1e3  # a corrupted shard
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            position += 1
            cap.snapshot(step, model=model, optimizer=opt, extra={"position": position, "loss": loss.item()})
            spiked = len(losses) > 5 and loss.item() > 10 * statistics.median(losses[-20:])
            losses.append(loss.item())
            if spiked:
                back = step - 3
                cap.incident(f"loss {loss.item():.3g} > 10x the median of the last 20 steps")
                extra = cap.rewind(back, model=model, optimizer=opt, branch="after-spike")
                skip_before = position + 1  # the batches from the rewound step on are dropped
                position = skip_before
                print(f"step {step}: loss spike {loss.item():.3g}; rewound to step {back} "
                      f"(its data position {extra['position']}), skipping to batch {position}")
                losses = losses[: back + 1]
                step = back
            step += 1
    run = dstt.open(args.store)
    print(f"main: {run.steps('main')}")
    print(f"after-spike (from {run.branch_info('after-spike').parent}): {run.steps('after-spike')}")
    print("\nwhat a user would run next:")
    print(f"  dstt ls {args.store}                      # captured vs persisted steps, the incident")
    print(f"  dstt find {args.store}                    # the incident beside dstt's own detections")
    print(f"  dstt history {args.store} extra/loss -b main -b after-spike")
    print(f"  dstt diff {args.store}@main:latest {args.store}@after-spike:latest")


if __name__ == "__main__":
    main()
