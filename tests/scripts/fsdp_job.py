"""FSDP2 on CPU/gloo: capture a step with N ranks, or restore one with M ranks.

    python tests/scripts/fsdp_job.py capture STORE OUTDIR --world 2
    python tests/scripts/fsdp_job.py restore REF OUTDIR --world 3

Each rank writes ``OUTDIR/rank<r>.pt``: its local shards (with global
offsets), what it read from the store, and a few RNG draws taken right
after the capture or restore, so a test can check the resharding bit by bit.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch._dynamo  # noqa: F401 - fully_shard imports it lazily (seconds) in every rank otherwise
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dstt  # noqa: F401 - imported before forking the ranks (imports cost seconds here)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 7 and 3 rows: uneven shards over 2 and 3 ranks (and an empty one over 4).
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def shard(model: torch.nn.Module, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)  # same batch on every rank
    x = torch.randn(6, 5, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def local_view(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from dstt.store.shards import dtensor_regions

    out = {}
    for name, p in model.named_parameters():
        _r, off, local = dtensor_regions(p)
        out[f"model/{name}"] = (off, local.detach().clone())
        for key, v in opt.state[p].items():
            if hasattr(v, "to_local"):
                _r, off, local = dtensor_regions(v)
                out[f"optim/{name}/{key}"] = (off, local.detach().clone())
            else:
                out[f"optim/{name}/{key}"] = ((), v.detach().clone())
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from dstt.api import Run

    model = build_model()
    shard(model, world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    boxes: list = []
    result: dict = {}
    if args.mode == "capture":
        for i in range(2):
            train_step(model, opt, seed=i)
        torch.manual_seed(100 + rank)
        dstt.save(args.target, 2, dstt.state_of(model=model, optimizer=opt, rng=True, extra={"pos": 12}))
    else:
        orig = Run._read_box

        def counting(self, e, off, shape, verify):  # record every box this rank reads
            boxes.append((e.name, tuple(off), tuple(shape)))
            return orig(self, e, off, shape, verify)

        Run._read_box = counting
        result["extra"] = dstt.restore(args.target, model=model, optimizer=opt)
        Run._read_box = orig
    result["rand"] = torch.rand(4)
    result["local"] = local_view(model, opt)
    result["boxes"] = boxes
    train_step(model, opt, seed=7)  # the restored optimizer state must be usable
    result["after"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    torch.save(result, os.path.join(args.outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["capture", "restore"])
    ap.add_argument("target", help="store (capture) or reference (restore)")
    ap.add_argument("outdir")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    # fork: the children inherit the imported torch (importing it costs seconds here)
    mp.start_processes(worker, args=(args.world, free_port(), args), nprocs=args.world, join=True, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1:])
