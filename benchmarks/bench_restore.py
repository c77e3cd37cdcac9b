"""Restore and export benchmark (issue 5).

Builds a ~SIZE GB fp32 model with a populated Adam state (so 3x SIZE GB of
state), stores the same state three ways and times, in one process:

* ``dstt.restore``  -- dstt store → live model + optimizer
* ``torch.load``    -- torch.save file, then ``load_state_dict`` on both
* ``dcp.load``      -- torch.distributed.checkpoint directory, loaded in place,
                       then ``optimizer.load_state_dict``
* ``export``        -- ``dstt.export`` of the step to .safetensors, against
                       ``run.state_dict`` (reading the step) alone.

Page cache is warm for every method (each was written just before). Ratios,
not absolute times, are the result; the machine is shared.

    python benchmarks/bench_restore.py --gb 1 --dir /tmp/bench_restore --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from typing import Any

import torch

import dstt

sys.path.insert(0, os.path.dirname(__file__))
from common import best_of  # noqa: E402


def build(gb: float, width: int = 4096) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    n_layers = max(1, round(gb * (1 << 30) / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(n_layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="model size in GB (Adam adds 2x)")
    ap.add_argument("--dir", default="/tmp/dstt_bench_restore")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    model, opt = build(args.gb)
    nbytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    store, pt, dcp_dir, sf = (os.path.join(args.dir, n) for n in ("store", "state.pt", "dcp", "state.safetensors"))

    dstt.save(store, 1, dstt.state_of(model=model, optimizer=opt, rng=False))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, pt)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=dcp_dir)

    def with_dstt() -> None:
        dstt.restore(f"{store}:1", model=model, optimizer=opt, rng=False)

    def with_torch() -> None:
        sd = torch.load(pt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def with_dcp() -> None:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=dcp_dir)
        opt.load_state_dict(sd["optim"])

    run = dstt.open(store)
    res: dict[str, Any] = {"state_gb": nbytes / 1e9, "repeat": args.repeat, "torch": torch.__version__,
                           "cpus": os.cpu_count(), "machine": platform.machine()}
    res["dstt.restore"] = best_of(with_dstt, args.repeat)
    res["torch.load+load_state_dict"] = best_of(with_torch, args.repeat)
    res["dcp.load"] = best_of(with_dcp, args.repeat)
    res["run.state_dict"] = best_of(lambda: dstt.open(store).state_dict(1), args.repeat)
    res["export.safetensors"] = best_of(lambda: dstt.export(f"{store}:1", sf), args.repeat)
    del run
    for k in ("dstt.restore", "torch.load+load_state_dict", "dcp.load", "run.state_dict", "export.safetensors"):
        res[k + " GB/s"] = nbytes / 1e9 / res[k]
    res["restore / torch.load"] = res["dstt.restore"] / res["torch.load+load_state_dict"]
    res["restore / dcp.load"] = res["dstt.restore"] / res["dcp.load"]
    res["export / state_dict"] = res["export.safetensors"] / res["run.state_dict"]
    print(json.dumps(res, indent=2))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
