"""Train with the flight recorder and plant a NaN at a known step
(tests/capture/test_flight_recorder.py, issue 23 item 2).

    python tests/scripts/nan_watch.py STORE REF.pt --nan-at S --steps N --k K [--seed SEED]

Torch runs at the machine's default thread count (the parent removes
OMP_NUM_THREADS): the trainer uses every core, the NaN/Inf watcher gets what
is left. The weights of every step are written to REF.pt for the parent to
compare with the store bit for bit.
"""

from __future__ import annotations

import argparse
import sys

import torch

import dstt


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("ref")
    p.add_argument("--nan-at", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref: dict[int, dict[str, torch.Tensor]] = {}
    with dstt.Capture(a.store, helper=False, memory_steps=a.k, persist="newest") as cap:
        for step in range(a.steps):
            model(torch.randn(64, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == a.nan_at:
                with torch.no_grad():
                    model[2].weight[3, 5] = float("nan")
            cap.snapshot(step, model=model, optimizer=opt)
            ref[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(ref, a.ref)


if __name__ == "__main__":
    main(sys.argv[1:])
