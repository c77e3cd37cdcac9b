"""Worker for tests/system/test_node_loss.py: one "node" of a job that
loses a node (issue 26), run under torchrun (gloo, CPU), one agent per node.

    python -m torch.distributed.run --nnodes N --node-rank I ... node_ranks.py OUT PHASE SCHEME [STEPS]

PHASE ``train``: FSDP2 (every rank its own shards; NODE_RANKS_STATE=ddp:
the same state on every rank, gradients all-reduced; =hsdp: sharded within
a node, replicated across nodes; =crossed: :class:`Crossed`), STEPS steps captured
with ``memory_steps=3``, ``persist=1000`` (step 0 stored, every other step
in memory only) and ``redundancy=SCHEME``; rank 0 saves the unsharded state
of every step to OUT/expected.pt; each rank writes OUT/rank<r>.json (its
helper's pid) once the steps the tier holds are protected on every rank
(or, ``none``, at once), then waits to be killed (its node lost).
PHASE ``recover``: a new job on the same store (some node a replacement):
its Capture's recovery rebuilds and commits what it can; each rank writes
OUT/recovered<r>.json (the steps committed, the warnings seen) and closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from capture_fsdp import build, full

import dstt
from dstt.format import redundancy as RD
from dstt.format import tier as T
from dstt.format.backends import open_backend


def protected(out: Path) -> list[int]:
    backend = open_backend(str(out / "run"), create=False)
    _, ranges = RD.protected_steps(RD.read_protected(backend, "main"))
    return [s for a, b in ranges for s in range(a, b + 1)]


def held_by_all(out: Path) -> set[int]:
    """The steps every rank's tier says it holds (its published record)."""
    records = T.read_held(open_backend(str(out / "run"), create=False), "main")
    sets = [{s for a, b in r.steps for s in range(a, b + 1)} for r in records]
    return set.intersection(*sets) if len(sets) == dist.get_world_size() else set()


def write(path: Path, doc: dict[str, Any]) -> None:
    """``doc`` as JSON at ``path``, whole or not at all (the test polls for it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(path)


def build_state() -> torch.nn.Module:
    """FSDP2 (every rank its own shards), or with NODE_RANKS_STATE=ddp the
    same plain model on every rank, its gradients all-reduced (DDP: the
    state replicated on every rank, redundancy="replicas")."""
    kind = os.environ.get("NODE_RANKS_STATE", "fsdp")
    if kind == "hsdp":
        return _hsdp()
    if kind == "crossed":
        return Crossed()
    if kind != "ddp":
        return build()[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 2))
    return torch.nn.parallel.DistributedDataParallel(model)


def _hsdp() -> torch.nn.Module:
    """HSDP over nodes x ranks per node: sharded within a node, replicated across nodes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 2))
    per = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // per, per), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Crossed(torch.nn.Module):
    """4 ranks (each a node of its own) on the mesh [[0, 1], [2, 3]], two
    tensors replicated crosswise: ``a`` sharded along the mesh's second
    dimension and replicated along its first (its shards held by ranks
    {0, 2} and {1, 3}), ``b`` the other way round ({0, 1} and {2, 3}).
    Rank 3 shares ``a``'s shard with rank 1 and ``b``'s with rank 2: no
    single survivor holds its whole part (redundancy="replicas" from
    several survivors)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 2))
        self.a = torch.nn.Parameter(distribute_tensor(torch.randn(64, 4), mesh, [Replicate(), Shard(0)]))
        self.b = torch.nn.Parameter(distribute_tensor(torch.randn(64, 4), mesh, [Shard(0), Replicate()]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (of the whole tensors: the same loss on every rank, so the replicas' gradients are the same, as
        # HSDP's all-reduce makes them)
        return (self.a.full_tensor().square().sum() + self.b.full_tensor().cos().sum()) * x.mean()


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam, one tensor at a time (the crossed state's tensors live on two meshes)."""
    return torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)


def stall_seal(out: Path, step: int) -> None:
    """This rank's trainer stops for good as it seals ``step`` (its bytes
    copied into the ring, its seal not written): OUT/stalled says so."""
    from dstt.capture.ring import Ring

    seal = Ring.seal

    def stalled(self: Any, record: dict[str, Any]) -> None:
        if record["step"] == step:
            write(out / "stalled.json", {"step": step})
            time.sleep(600)
        seal(self, record)

    Ring.seal = stalled  # type: ignore[method-assign]


def train(out: Path, scheme: str, steps: int) -> None:
    """(NODE_RANKS_STALL=S: the last step S is snapshotted after the others
    are protected, and rank 1's trainer stops while sealing it.)"""
    rank = dist.get_rank()
    stall = int(os.environ.get("NODE_RANKS_STALL", "-1"))
    if stall >= 0 and rank == 1:
        stall_seal(out, stall)
    wrapped = build_state()
    model = getattr(wrapped, "module", wrapped)
    opt = optimizer(model)
    cap = dstt.Capture(out / "run", memory_steps=3, persist=1000, redundancy=scheme, max_chunk_bytes=256,
                       background_timeout_s=90)
    expected: dict[int, Any] = {}
    torch.manual_seed(7)
    for step in range(steps if stall < 0 else stall):
        opt.zero_grad()
        wrapped(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
    cap.wait_staged()
    if rank == 0:
        torch.save(expected, out / "expected.pt.tmp")
        (out / "expected.pt.tmp").rename(out / "expected.pt")
    last = steps if stall < 0 else stall
    want = set(range(last - 3, last))
    deadline = time.monotonic() + 60
    nowait = os.environ.get("NODE_RANKS_NOWAIT") == "1"  # lost at once: copies may be under way
    chosen = cap.redundancy_chosen  # (redundancy="auto": what it chose at step 0)
    guarded = chosen != "none"  # (replicas too: its helpers publish the steps their seals protect)
    while not nowait and not (want <= held_by_all(out) and (not guarded or want <= set(protected(out)))) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    helper = cap.parts.helper.pid if cap.parts.helper is not None else None
    info = {"helper": helper, "trainer": os.getpid(), "protected": protected(out), "chosen": chosen}
    if rank == 0 and os.environ.get("NODE_RANKS_LS"):  # what `dstt ls` says of the branch meanwhile
        import subprocess

        info["ls"] = subprocess.run([sys.executable, "-c", "from dstt.cli.main import main; main()", "ls",
                                     str(out / "run")], capture_output=True, text=True, timeout=120).stdout
    if stall >= 0:  # one more step, which rank 1 never seals
        if rank == 1:
            write(out / f"rank{rank}.json", info)
        opt.zero_grad()
        wrapped(torch.randn(5, 6)).square().mean().backward()
        opt.step()
        cap.snapshot(stall, model=model, optimizer=opt, rng=False)
        cap.wait_staged()
    write(out / f"rank{rank}.json", info)
    time.sleep(600)  # the node is lost while its tier holds the steps


def recover(out: Path, scheme: str) -> None:
    """(NODE_RANKS_RESTORE=1: the newest recovered step is then restored
    -- ``cap.restore`` and ``cap.rewind`` -- with the store's chunk data
    moved away: :func:`restore_unread`.)"""
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cap = dstt.Capture(out / "run", memory_steps=3, persist=1000, redundancy=scheme, max_chunk_bytes=256,
                           background_timeout_s=90)
    if cap.parts.helper is not None:
        (out / f"pid-helper-{cap.parts.helper.pid}").touch()
    recovered = list(getattr(cap, "recovered", []) or [])
    restored = restore_unread(out, cap, max(recovered)) if os.environ.get("NODE_RANKS_RESTORE") and recovered else {}
    cap.close()
    write(out / f"recovered{rank}.json", {
        "recovered": recovered, "warnings": [str(w.message) for w in seen if "NodeLoss" in type(w.message).__name__],
        "restored": restored})
    dist.barrier()


#: The store's chunk data (the rest is its metadata: steps, indexes, branches).
CHUNK_DIRS = ("tensors", "packs")


def restore_unread(out: Path, cap: Any, step: int) -> dict[str, Any]:
    """Restore ``step`` into a fresh model and optimizer through
    ``cap.restore`` and then ``cap.rewind``, with the store's chunk data
    moved away meanwhile (rank 0; a read of any chunk fails): for each,
    whether every tensor is bit-exact against the unsharded reference
    (or the error), and how long it took."""
    expected = torch.load(out / "expected.pt")[step]
    hidden = out / "hidden"
    if dist.get_rank() == 0:
        hidden.mkdir()
        for name in CHUNK_DIRS:
            if (out / "run" / name).exists():
                (out / "run" / name).rename(hidden / name)
    dist.barrier()
    result: dict[str, Any] = {"step": step}
    try:
        for how in ("restore", "rewind"):
            wrapped = build_state()
            model = getattr(wrapped, "module", wrapped)
            opt = optimizer(model)
            t0 = time.perf_counter()
            try:
                getattr(cap, how)(step, model=model, optimizer=opt, rng=False)
            except Exception as e:  # noqa: BLE001 - the test reads it (on every rank alike: collective reads)
                result[how] = f"{type(e).__name__}: {e}"
                continue
            took = time.perf_counter() - t0
            got = full(dstt.state_of(model=model, optimizer=opt, rng=False))
            result[how] = same_bits(expected, got)
            result[f"{how}_s"] = took
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            for name in CHUNK_DIRS:
                if (hidden / name).exists():
                    (hidden / name).rename(out / "run" / name)
            hidden.rmdir()
    return result


def same_bits(expected: Any, got: Any) -> bool | str:
    """True if every tensor of ``expected`` is in ``got`` with the same dtype, shape and bits; else where not."""
    if isinstance(expected, dict):
        for k, v in expected.items():
            if not isinstance(got, dict) or k not in got:
                return f"{k} missing"
            inner = same_bits(v, got[k])
            if inner is not True:
                return f"{k}/{inner}"
        return True
    if isinstance(expected, torch.Tensor):
        ok = (isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape
              and torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)))
        return True if ok else "differs"
    return True if expected == got else f"{expected!r} != {got!r}"


def main(out: Path, phase: str, scheme: str, steps: int) -> None:
    # (torchrun starts each worker in a session of its own: the test kills it by this pid)
    (out / f"pid-{phase}-{os.getpid()}").touch()
    dist.init_process_group("gloo")
    if phase == "train":
        train(out, scheme, steps)
    else:
        recover(out, scheme)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 8)
