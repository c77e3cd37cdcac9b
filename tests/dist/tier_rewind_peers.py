"""Worker for tests/system/test_rewind_peers.py, run under torchrun (gloo,
CPU): the collective rewind from memory of DDP-style replicated state, whose
chunks are spread over the ranks' rings (each written once), so each rank
must restore the other ranks' share too (issue 25).

    python -m torch.distributed.run --nproc-per-node 2 tier_rewind_peers.py OUT

One Capture (``memory_steps=3, persist=100``: only step 0 stored, the rest
held in memory only), every rank the same model and batches:

* ``inplace``: ``rewind(3)``; the other rank's chunks are read from its
  ring in /dev/shm (``Rewinder.exchanged``: mapped, nothing over gloo);
* ``changed``: ``rewind(4)`` with rank 1's read of rank 0's ring torn on
  purpose (``peerring.after_map``: the bytes rank 1 mapped overwritten in
  its private copy, and rank 0's lease rewritten, as an owner letting the
  step go would): rank 1 takes them again over gloo and restores again;
* ``other_host``: ``rewind(5)`` with each rank its own DSTT_NODE_ID (other
  hosts, as far as dstt can tell): everything over gloo;
* ``unmapped``: ``rewind(6)`` with rank 1's mapping of rank 0's ring
  failing (``peerring.after_map`` raises): rank 1 restores only after the
  last collective, from the chunks then sent over gloo.

Each rewind is preceded by one more training step (the live state differs
from the step's); after each, every rank compares its live state with its
own copy of the step's, bit for bit, and writes what it saw to
OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tier_rewind import same_state

import dstt
from dstt.capture import peerring


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 64)).square().mean().backward()
    for p in model.parameters():  # (DDP's all-reduce of the gradients, by hand)
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()


def copy_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    return _clone(dstt.state_of(model=model, optimizer=opt, rng=False))


def _clone(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def tear(m: peerring.PeerMap) -> None:
    """Rank 1's read of rank 0's ring, torn: what it mapped overwritten (in
    its own private copy of the pages: rank 0's file is untouched), and
    rank 0's lease rewritten (a new file of the same bytes)."""
    for v in m.views:
        v.fill_(7)
    tmp = m.lease.with_name(m.lease.name + ".again")
    tmp.write_bytes(m.lease.read_bytes())
    os.replace(tmp, m.lease)


def fail(m: peerring.PeerMap) -> None:
    raise OSError("a mapping refused on purpose")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(7)  # the same batches on every rank: a replicated state stays replicated
    cap = dstt.Capture(out / "run", memory_steps=3, persist=100, max_chunk_bytes=4096, background_timeout_s=90)
    steps: dict[int, Any] = {}
    for step in range(4):
        train(model, opt)
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        steps[step] = copy_of(model, opt)
    seen: dict[str, Any] = {}

    def rewind(name: str, step: int) -> None:
        train(model, opt)  # (one step more: the live state is not the step's)
        assert not same_state(copy_of(model, opt), steps[step])
        cap.rewind(step, model=model, optimizer=opt, rng=False, branch=name)
        seen[name] = {"exchanged": dict(cap.rewinder.exchanged), "bit_exact": same_state(copy_of(model, opt), steps[step])}
        # (the other rank's ring is checked unchanged only after this rank's
        # restore: nothing of it may be left once the rewind returned)
        seen[name]["leases_left"] = sorted(p.name for p in Path(cap.crashsafe.ring.dir).glob("rewind-*"))
        cap.snapshot(step + 1, model=model, optimizer=opt, rng=False)  # (opens the new branch)
        steps[step + 1] = copy_of(model, opt)

    rewind("inplace", 3)
    if rank == 1:
        peerring.after_map = tear
    rewind("changed", 4)
    peerring.after_map = None
    os.environ["DSTT_NODE_ID"] = f"node-{rank}"
    rewind("other_host", 5)
    del os.environ["DSTT_NODE_ID"]
    if rank == 1:
        peerring.after_map = fail
    rewind("unmapped", 6)
    peerring.after_map = None
    cap.close()
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
