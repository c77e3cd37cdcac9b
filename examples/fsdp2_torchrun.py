"""FSDP2 (fully_shard) on CPU with gloo, launched by torchrun, captured with dstt.Capture.

    torchrun --standalone --nproc_per_node 2 examples/fsdp2_torchrun.py --store runs/fsdp

Every rank builds the same Capture and calls snapshot() for the same steps:
each rank stages and writes only its own shards (DTensor placements give the
global offsets) and rank 0 commits a step once every rank's data is durable.
The store holds one logical tensor per parameter, whatever the world size,
so it restores onto any number of ranks (or none).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dstt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="runs/fsdp")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    # 10 and 7 output rows: uneven shards on 2 or 3 ranks
    model = torch.nn.Sequential(torch.nn.Linear(16, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    with dstt.Capture(a.store, every=1) as cap:
        for step in range(a.steps):
            g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data shard
            x = torch.randn(8, 16, generator=g)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt, extra={"loss": loss.item()})
    if rank == 0:
        print(f"captured {a.steps} steps of a {world}-rank FSDP2 run into {a.store}")
        print(f"""
what a user would run next:
  dstt ls {a.store}:latest                    # one logical tensor per parameter (shards reassembled)
  dstt verify {a.store}                       # every chunk against its checksum
  dstt diff {a.store}:0 :latest               # what training changed
  dstt export {a.store}:latest --only model --out model.safetensors   # a plain single-file checkpoint
  # and in Python, on any number of ranks: dstt.restore("{a.store}:latest", model=model, optimizer=opt)""")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
