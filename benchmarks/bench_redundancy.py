"""Peer redundancy of the memory tier (issue 26): what ``redundancy="pair"``
and ``"replicas"`` cost and what they buy, against ``redundancy="none"`` in
the same run.

Two "nodes" on this machine (one torchrun agent each, its own
DSTT_SHM_DIR and DSTT_NODE_ID, one rank each, gloo), a model of ``--mb``
MB of parameters (Adam: ~3x that of state, half on each rank under FSDP2),
``memory_steps=3``, ``persist=1000`` (only the first step stored):

* time per training iteration (a step of training + ``snapshot``), median,
  with ``none`` then ``pair`` in the same job;
* extra host memory per node (the copies it keeps for its partner) and
  bytes sent per step per rank (one framed step image);
* ``replicas`` on the same model kept whole on each rank (DDP), against
  ``none`` on that state: time per iteration, the staging ring's memory in
  use (the replicas' shares each ring holds too), bytes sent (0);
* node 1 is then lost (SIGKILL of its processes, its memory directory
  removed) and the job restarted: time from the restart to the restored
  state (the Capture's recovery rebuilding and committing node 1's shards,
  then reading the newest step) vs restoring from the store alone (the
  newest stored step: ``--steps`` - 1 steps older).

    python benchmarks/bench_redundancy.py [--mb 64] [--steps 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ----------------------------------------------------------------------------- the workers (under torchrun)


def _ring_bytes(cap: Any) -> int:
    """Bytes of memory this rank's staging ring (its pool files in /dev/shm) takes now."""
    from dstt.capture import ringowner as O

    w = cap.writer
    return _dir_bytes(O.group_dir(str(w.backend.url), w.branch.name, None, w.rank))


def _model(mb: int, ddp: bool = False) -> Any:
    """FSDP2 (each rank half the state), or with ``ddp`` the whole model on
    each rank, its gradients all-reduced (the state replicated: ``replicas``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = 512
    layers = max(1, mb * (1 << 20) // (4 * width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    if ddp:
        return torch.nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loop(out: Path, scheme: str, mb: int, steps: int, ddp: bool = False) -> tuple[Any, list[float]]:
    import torch

    import dstt

    model = _model(mb, ddp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cap = dstt.Capture(out / f"run-{scheme}{'-ddp' if ddp else ''}", memory_steps=3, persist=1000,
                       redundancy=scheme, background_timeout_s=120)
    times = []
    x = torch.randn(8, 512)
    for step in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        cap.snapshot(step, model=model, optimizer=opt, rng=False)
        times.append(time.perf_counter() - t)
    cap.wait_staged()
    return cap, times


def worker_train(out: Path, mb: int, steps: int) -> None:
    import torch.distributed as dist

    from dstt.format import redundancy as RD
    from dstt.format.backends import open_backend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    # replicas vs none on the same replicated (DDP) state: time, and the ring's memory in use
    for scheme in ("none", "replicas"):
        cap, res[f"{scheme}_ddp_s"] = _loop(out, scheme, mb, steps, ddp=True)
        res[f"{scheme}_ddp_ring_bytes"] = _ring_bytes(cap)
        if scheme == "replicas":
            from dstt.format.geometry import TensorLayout
            from dstt.format.replicas import held_bytes

            layouts = [v for v in cap.writer._layout_cache.values() if isinstance(v, TensorLayout)]
            res["held_bytes_per_step"] = held_bytes(layouts, rank)  # (what this rank stages for the others)
        cap.close()
        dist.barrier()
    cap, res["none_s"] = _loop(out, "none", mb, steps)
    cap.close()
    dist.barrier()
    cap, res["pair_s"] = _loop(out, "pair", mb, steps)
    want = set(range(steps - 3, steps))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _, ranges = RD.protected_steps(RD.read_protected(open_backend(str(out / "run-pair")), "main"))
        if want <= {s for a, b in ranges for s in range(a, b + 1)}:
            break
        time.sleep(0.05)
    copies = Path(os.environ["DSTT_SHM_DIR"]) / f"dstt-{os.getuid()}-copies"
    blks = sorted(copies.rglob("*.blk"))
    res.update(copies_bytes=_dir_bytes(copies), block_bytes=blks[-1].stat().st_size if blks else 0,
               helper=cap.parts.helper.pid if cap.parts.helper is not None else None, trainer=os.getpid())
    tmp = out / f"train{rank}.tmp"
    tmp.write_text(json.dumps(res))
    tmp.rename(out / f"train{rank}.json")
    time.sleep(3600)


def worker_recover(out: Path, steps: int) -> None:
    import torch.distributed as dist

    import dstt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = time.perf_counter()
    cap = dstt.Capture(out / "run-pair", memory_steps=3, persist=1000, redundancy="pair")
    recovered = list(cap.recovered or [])
    cap.close()
    dist.barrier()
    res: dict[str, Any] = {"recovered": recovered}
    if rank == 0:
        run = dstt.open(out / "run-pair")
        run.state_dict(max(run.steps()))
        res["loss_to_restored_s"] = time.perf_counter() - t
        t = time.perf_counter()
        dstt.open(out / "run-none").state_dict(0)
        res["store_restore_s"] = time.perf_counter() - t
    (out / f"recover{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the launcher


def _launch(tmp: Path, phase: str, args: argparse.Namespace) -> dict[int, subprocess.Popen[bytes]]:
    port = _free_port()
    procs = {}
    for node in (0, 1):
        shm = tmp / f"shm{node}"
        shm.mkdir(exist_ok=True)
        (tmp / "tmp").mkdir(exist_ok=True)
        env = {**os.environ, "DSTT_SHM_DIR": str(shm), "TMPDIR": str(tmp / "tmp"), "DSTT_NODE_ID": f"node{node}", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(HERE),
               "--worker", phase, "--out", str(tmp), "--mb", str(args.mb), "--steps", str(args.steps)]
        with open(tmp / f"{phase}{node}.log", "ab") as log:
            procs[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    return procs


def _wait_files(tmp: Path, name: str, procs: dict[int, Any], timeout_s: float = 900) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = [tmp / f"{name}{r}.json" for r in (0, 1)]
        if all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files]
        if any(p.poll() not in (None, 0) for p in procs.values()):
            break
        time.sleep(0.2)
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp.glob("*.log")))
    raise SystemExit(f"{name} not written by both nodes:\n{logs}")


def _killpg(pid: Any) -> None:
    if isinstance(pid, int):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-redundancy-"))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        procs = _launch(tmp, "train", args)
        train = _wait_files(tmp, "train", procs)
        for node in (1, 0):  # node 1 lost; the job torn down with it
            _killpg(train[node]["helper"])
            _killpg(train[node]["trainer"])
            _killpg(procs[node].pid)
            procs[node].wait()
        shutil.rmtree(tmp / "shm1")
        procs = _launch(tmp, "recover", args)
        rec = _wait_files(tmp, "recover", procs)
        for p in procs.values():
            p.wait(120)
    finally:
        for p in procs.values():
            _killpg(p.pid)
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    med = {s: statistics.median(t for r in train for t in r[f"{s}_s"][2:])
           for s in ("none", "pair", "none_ddp", "replicas_ddp")}
    return {
        "machine": _machine(), "mb": args.mb, "steps": args.steps,
        "iteration_none_ms": med["none"] * 1e3, "iteration_pair_ms": med["pair"] * 1e3,
        "pair_vs_none": med["pair"] / med["none"],
        "extra_memory_per_node_mb": max(r["copies_bytes"] for r in train) / 1e6,
        "sent_per_step_per_rank_mb": max(r["block_bytes"] for r in train) / 1e6,
        "iteration_none_ddp_ms": med["none_ddp"] * 1e3, "iteration_replicas_ms": med["replicas_ddp"] * 1e3,
        "replicas_vs_none": med["replicas_ddp"] / med["none_ddp"],
        "replicas_extra_ring_per_node_mb": max(r["replicas_ddp_ring_bytes"] - r["none_ddp_ring_bytes"]
                                               for r in train) / 1e6,
        "replicas_held_per_step_per_rank_mb": max(r["held_bytes_per_step"] for r in train) / 1e6,
        "replicas_sent_per_step_mb": 0.0,  # (nothing crosses the network: the replicas are the trainers')
        "recovered_steps": rec[0]["recovered"],
        "loss_to_restored_s": rec[0]["loss_to_restored_s"], "store_restore_s": rec[0]["store_restore_s"],
    }


def _machine() -> str:
    sys.path.insert(0, str(HERE.parent))
    from common import machine

    return machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="MB of parameters (all ranks)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=("train", "recover"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "train":
        worker_train(args.out, args.mb, args.steps)
        return
    if args.worker == "recover":
        worker_recover(args.out, args.steps)
        return
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"# {res['machine']}, 2 nodes x 1 rank (torchrun, gloo), {res['mb']} MB of parameters, "
          f"{res['steps']} steps")
    print(f"iteration (median)     none {res['iteration_none_ms']:.1f} ms, pair {res['iteration_pair_ms']:.1f} ms "
          f"({(res['pair_vs_none'] - 1) * 100:+.1f} %)")
    print(f"extra memory per node  {res['extra_memory_per_node_mb']:.1f} MB (pair)")
    print(f"sent per step per rank {res['sent_per_step_per_rank_mb']:.2f} MB")
    print(f"replicas (DDP state)   none {res['iteration_none_ddp_ms']:.1f} ms, replicas "
          f"{res['iteration_replicas_ms']:.1f} ms ({(res['replicas_vs_none'] - 1) * 100:+.1f} %); extra ring memory "
          f"per node {res['replicas_extra_ring_per_node_mb']:.1f} MB ({res['replicas_held_per_step_per_rank_mb']:.1f} "
          f"MB held for the other rank per step); sent per step 0 MB")
    print(f"node 1 lost: steps {res['recovered_steps']} rebuilt; restart to restored state "
          f"{res['loss_to_restored_s']:.2f} s vs restore from the store {res['store_restore_s']:.2f} s "
          f"(step 0: {res['steps'] - 1} steps older)")


if __name__ == "__main__":
    main()
