"""capture/flatcast.py: chunks of any dtype and odd sizes broadcast from
each rank as one flat tensor over a real gloo group of two processes,
bit-exact, and viewed back as their dtype and shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = r'''
import json, sys
import torch
import torch.distributed as dist
from dstt.capture import flatcast as F
from dstt.store.coord import DistCoordinator

rank, path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
coord = DistCoordinator()

def chunks(r):
    g = torch.Generator().manual_seed(r)
    return [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.rand(7, generator=g) > 0.5,
            torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randint(0, 255, (13,), generator=g).to(torch.uint8),
            torch.randn(4, generator=g, dtype=torch.complex64)]

got = {}
for src in range(2):
    mine = chunks(src)
    flat, starts = F.cast(coord, src, [F.nbytes(t) for t in mine], chunks(rank) if rank == src else None)
    views = [F.view_of(flat, at, t.dtype, tuple(t.shape)) for t, at in zip(mine, starts)]
    got[src] = all(torch.equal(v.view(torch.uint8) if v.dtype != torch.bool else v, t.view(torch.uint8) if t.dtype != torch.bool else t)
                   for v, t in zip(views, mine))
    got[f"starts{src}"] = starts
json.dump(got, open(out, "w"))
coord.close()
dist.destroy_process_group()
'''


def test_chunks_of_every_dtype_arrive_bit_exact_from_each_rank(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "rdv"), str(tmp_path / f"r{r}.json")],
                              env=env) for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["0"] is True and got["1"] is True, got
        assert all(s % 64 == 0 for s in got["starts0"]), got  # (each chunk aligned for a view as its dtype)
