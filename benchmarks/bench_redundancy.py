"""Peer redundancy of the memory tier (issue 26): what each
``redundancy=`` scheme costs and what it buys, against ``redundancy="none"``
in the same run.

``--nodes`` "nodes" on this machine (one torchrun agent each, its own
DSTT_SHM_DIR and DSTT_NODE_ID, one rank each, gloo), a model of ``--mb``
MB of parameters (Adam: ~3x that of state, 1/N on each rank under FSDP2),
``memory_steps=3``, ``persist=1000`` (only the first step stored); the
schemes of ``--schemes`` one after the other in the same job:

* time per training iteration (a step of training + ``snapshot``), median;
* extra host memory per node (``pair``: the copies it keeps for its
  partner; ``parity:k``: the parities it keeps, 1/k of a step image each;
  ``parity:k+m``: its Reed-Solomon fragments, m/k of a step image each)
  and bytes sent per step per rank (``pair``: one framed step image;
  ``parity:k``: k stripes of 1/k of it; ``parity:k+m``: its k stripes, each
  to m holders: m images);
* node 1 (``--lose N``: nodes 1..N) is then lost while the last scheme's capture runs (SIGKILL of its
  processes, its memory directory removed) and the job restarted: time
  from the restart to the restored state -- the Capture's recovery
  (rebuilding and committing node 1's shards), then the newest rebuilt
  step restored into the live model and optimizer from the rebuilt memory
  (``cap.restore``, no chunk read from the store) -- vs the same recovery
  followed by restoring that step from the store (``dstt.restore``). Put
  the scheme whose recovery to time last.

``--transports p2p,store`` (the default): each scheme other than ``none``
runs once over each transport of its blocks -- ``p2p``, point to point
over a gloo group of the helpers (capture/transport.py), and ``store``,
the job's c10d TCPStore as their mailbox (``DSTT_REDUNDANCY_TRANSPORT``;
shown as ``<scheme>/store``) -- the store variant first, so the node is
lost under ``p2p``. The launcher serves the TCPStore the helpers meet at
(``DSTT_REDUNDANCY_STORE``) and looks at it every 20 ms: the most bytes
of blocks it held at once, per scheme (0 where they go point to point),
and the time from the last snapshot until its last 3 steps are protected.

    python benchmarks/bench_redundancy.py [--mb 64] [--steps 20] [--nodes 3] [--schemes none,pair,parity:2] \
        [--transports p2p,store] [--json]
    python benchmarks/bench_redundancy.py --nodes 4 --lose 2 --schemes none,pair,parity:2,parity:2+2
    BENCH_DDP=1 python benchmarks/bench_redundancy.py --nodes 2 --schemes none,replicas

(``BENCH_DDP=1``: the model whole on every rank, gradients all-reduced --
the replicated state ``replicas`` protects; its extra memory is what each
ring holds beyond ``none``'s, and it sends nothing.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def _store(out: Path, scheme: str) -> Path:
    """A scheme's store (no ':' in its name: ``dstt.open("a:b")`` reads as a store and a branch)."""
    return out / f"run-{scheme.replace(':', '').replace('/', '-')}"


def _labels(schemes: list[str], transports: list[str]) -> list[str]:
    """Each scheme over each transport (``none`` once; ``p2p`` last: the node is lost under it).

    >>> _labels(["none", "pair"], ["p2p", "store"])
    ['none', 'pair/store', 'pair']
    """
    order = sorted(transports, key=lambda t: t == "p2p")
    return [s if s == "none" else (s if t == "p2p" else f"{s}/{t}") for s in schemes for t in
            (["p2p"] if s == "none" else order)]


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ----------------------------------------------------------------------------- the workers (under torchrun)


def _model(mb: int) -> Any:
    """FSDP2 (each rank 1/N of the state), or with BENCH_DDP=1 the whole model
    on each rank, its gradients all-reduced (the state replicated: ``replicas``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = 512
    layers = max(1, mb * (1 << 20) // (4 * width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    if os.environ.get("BENCH_DDP") == "1":
        return torch.nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loop(out: Path, label: str, mb: int, steps: int) -> tuple[Any, list[float]]:
    import torch

    import dstt

    model = _model(mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    scheme, _, how = label.partition("/")
    os.environ["DSTT_REDUNDANCY_TRANSPORT"] = how or "p2p"  # (read by the helper this Capture starts)
    cap = dstt.Capture(_store(out, label), memory_steps=3, persist=1000, redundancy=scheme,
                       background_timeout_s=120)
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


def _ring_bytes(cap: Any) -> int:
    """Bytes of memory this rank's staging ring (its pool files) takes now."""
    from dstt.capture import ringowner as O

    w = cap.writer
    return _dir_bytes(O.group_dir(str(w.backend.url), w.branch.name, None, w.rank))


def _kept_bytes(scheme: str) -> tuple[int, int]:
    """(bytes this node keeps for the others, bytes one rank sends per step) of
    ``scheme``'s run (``replicas``: kept in the ring itself, see _ring_bytes; 0 sent)."""
    shm = Path(os.environ["DSTT_SHM_DIR"])
    if scheme == "pair":
        copies = shm / f"dstt-{os.getuid()}-copies"
        blks = sorted(copies.rglob("*.blk"))
        return _dir_bytes(copies), blks[-1].stat().st_size if blks else 0
    if scheme.startswith("parity:"):
        parity = shm / f"dstt-{os.getuid()}-parity"
        pars = sorted(parity.rglob("*.par"))
        k = int(scheme.split(":")[1].split("+")[0])  # (k+m: k files of m/k of an image = m images sent)
        return _dir_bytes(parity), k * pars[-1].stat().st_size if pars else 0
    return 0, 0


def worker_train(out: Path, mb: int, steps: int, schemes: list[str]) -> None:
    import torch.distributed as dist

    from dstt.format import redundancy as RD
    from dstt.format.backends import open_backend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    for i, scheme in enumerate(schemes):
        cap, res[f"{scheme}_s"] = _loop(out, scheme, mb, steps)
        res[f"{scheme}_run"] = cap.crashsafe.run_id
        want = set(range(steps - 3, steps))
        t = time.monotonic()
        deadline = t + 120
        while scheme not in ("none", "replicas") and time.monotonic() < deadline:
            _, ranges = RD.protected_steps(RD.read_protected(open_backend(str(_store(out, scheme))), "main"))
            if want <= {s for a, b in ranges for s in range(a, b + 1)}:
                break
            time.sleep(0.02)
        res[f"{scheme}_protect_s"] = time.monotonic() - t
        res[f"{scheme}_kept"], res[f"{scheme}_sent"] = _kept_bytes(scheme.partition("/")[0])
        res[f"{scheme}_ring"] = _ring_bytes(cap)
        if i < len(schemes) - 1:
            cap.close()
            dist.barrier()
    res.update(helper=cap.parts.helper.pid if cap.parts.helper is not None else None, trainer=os.getpid())
    tmp = out / f"train{rank}.tmp"
    tmp.write_text(json.dumps(res))
    tmp.rename(out / f"train{rank}.json")
    time.sleep(3600)


def worker_recover(out: Path, mb: int, scheme: str) -> None:
    """The restarted job: its Capture's recovery (rebuilding and committing
    node 1's shards), then the newest rebuilt step restored into a fresh
    model and optimizer from the rebuilt memory (``cap.restore``: no chunk
    read from the store), then the same step again from the store
    (``dstt.restore``), each timed on every rank between barriers."""
    import torch
    import torch.distributed as dist

    import dstt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model(mb)  # (as the training phase snapshotted it: DDP keeps its "module." names)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    dist.barrier()
    t = time.perf_counter()
    label, (scheme, _, how) = scheme, scheme.partition("/")
    os.environ["DSTT_REDUNDANCY_TRANSPORT"] = how or "p2p"
    cap = dstt.Capture(_store(out, label), memory_steps=3, persist=1000, redundancy=scheme)
    recovered = list(cap.recovered or [])
    dist.barrier()
    res: dict[str, Any] = {"recovered": recovered, "recovery_s": time.perf_counter() - t}
    if recovered:
        step = max(recovered)
        t = time.perf_counter()
        cap.restore(step, model=model, optimizer=opt, rng=False)
        dist.barrier()
        res["memory_restore_s"] = time.perf_counter() - t  # (the first restore: the optimizer's state made)
        t = time.perf_counter()
        dstt.restore(f"{_store(out, label)}:{step}", model=model, optimizer=opt, rng=False)
        dist.barrier()
        res["store_restore_s"] = time.perf_counter() - t
        t = time.perf_counter()
        cap.restore(step, model=model, optimizer=opt, rng=False)  # (again, as warm as the store's)
        dist.barrier()
        res["memory_restore_warm_s"] = time.perf_counter() - t
    cap.close()
    (out / f"recover{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the launcher


class BlockPeaks:
    """Per run, the most bytes of blocks (the store mailbox's keys
    ``blk``/``pst``/``img``/``par``) the job's store held at once
    (dstt.testing.storewatch looks every 20 ms)."""

    _BLOCK = re.compile(r"dstt-redundancy/([^/]+)//(blk|pst|img|par)/")

    def __init__(self) -> None:
        self.peak: dict[str, int] = {}

    def see(self, held: list[tuple[str, bytes]]) -> None:
        now: dict[str, int] = {}
        for key, value in held:
            m = self._BLOCK.match(key)
            if m is not None:
                now[m.group(1)] = now.get(m.group(1), 0) + len(value)
        for run, n in now.items():
            self.peak[run] = max(self.peak.get(run, 0), n)


def _launch(tmp: Path, phase: str, args: argparse.Namespace, store: str) -> dict[int, subprocess.Popen[bytes]]:
    port = _free_port()
    procs = {}
    for node in range(args.nodes):
        shm = tmp / f"shm{node}"
        shm.mkdir(exist_ok=True)
        (tmp / "tmp").mkdir(exist_ok=True)
        env = {**os.environ, "DSTT_SHM_DIR": str(shm), "TMPDIR": str(tmp / "tmp"), "DSTT_NODE_ID": f"node{node}", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
               "DSTT_REDUNDANCY_STORE": store}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}", f"--node-rank={node}",
               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(HERE),
               "--worker", phase, "--out", str(tmp), "--mb", str(args.mb), "--steps", str(args.steps),
               "--schemes", ",".join(args.labels)]
        with open(tmp / f"{phase}{node}.log", "ab") as log:
            procs[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    return procs


def _wait_files(tmp: Path, name: str, procs: dict[int, Any], timeout_s: float = 900) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = [tmp / f"{name}{r}.json" for r in range(len(procs))]
        if all(f.exists() for f in files):
            return [json.loads(f.read_text()) for f in files]
        if any(p.poll() not in (None, 0) for p in procs.values()):
            break
        time.sleep(0.2)
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp.glob("*.log")))
    raise SystemExit(f"{name} not written by every node:\n{logs}")


def _killpg(pid: Any) -> None:
    if isinstance(pid, int):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-redundancy-"))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    from dstt.testing.storewatch import StoreWatch

    peaks = BlockPeaks()
    watch = StoreWatch(peaks.see, interval_s=0.02, timeout_s=60)
    try:
        procs = _launch(tmp, "train", args, watch.addr)
        train = _wait_files(tmp, "train", procs)
        lost = list(range(1, 1 + args.lose))
        for node in [*lost, *(n for n in range(args.nodes) if n not in lost)]:  # lost; the job torn down with them
            _killpg(train[node]["helper"])
            _killpg(train[node]["trainer"])
            _killpg(procs[node].pid)
            procs[node].wait()
        for node in lost:
            shutil.rmtree(tmp / f"shm{node}")
        procs = _launch(tmp, "recover", args, watch.addr)
        rec = _wait_files(tmp, "recover", procs)
        for p in procs.values():
            p.wait(120)
    finally:
        watch.close()
        for p in procs.values():
            _killpg(p.pid)
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    schemes = args.labels
    med = {s: statistics.median(t for r in train for t in r[f"{s}_s"][2:]) for s in schemes}
    return {
        "machine": _machine(), "mb": args.mb, "steps": args.steps, "nodes": args.nodes, "schemes": schemes,
        "iteration_ms": {s: med[s] * 1e3 for s in schemes},
        "vs_none": {s: med[s] / med["none"] for s in schemes if "none" in med},
        "extra_memory_per_node_mb": {s: max(r[f"{s}_kept"] if s != "replicas" else  # (the ring's own growth)
                                            r["replicas_ring"] - r["none_ring"] for r in train) / 1e6
                                     for s in schemes},
        "sent_per_step_per_rank_mb": {s: max(r[f"{s}_sent"] for r in train) / 1e6 for s in schemes},
        "store_peak_block_mb": {s: peaks.peak.get(train[0][f"{s}_run"], 0) / 1e6 for s in schemes},
        "last_protected_after_s": {s: max(r[f"{s}_protect_s"] for r in train) for s in schemes},
        "lost_scheme": schemes[-1], "lost_nodes": list(range(1, 1 + args.lose)), "recovered_steps": rec[0]["recovered"],
        "recovery_s": rec[0]["recovery_s"],
        "memory_restore_s": rec[0].get("memory_restore_s"), "store_restore_s": rec[0].get("store_restore_s"),
        "memory_restore_warm_s": rec[0].get("memory_restore_warm_s"),
        "loss_to_restored_s": rec[0]["recovery_s"] + rec[0].get("memory_restore_s", float("nan")),
        "loss_to_restored_via_store_s": rec[0]["recovery_s"] + rec[0].get("store_restore_s", float("nan")),
    }


def _machine() -> str:
    sys.path.insert(0, str(HERE.parent))
    from common import machine

    return machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="MB of parameters (all ranks)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--schemes", default="none,pair,parity:2",
                    help="comma-separated, 'none' first; node 1 is lost under the last")
    ap.add_argument("--transports", default="p2p,store",
                    help="how blocks travel, each scheme once per transport: p2p (gloo, point to point), store")
    ap.add_argument("--lose", type=int, default=1, help="nodes lost at once (1..N) under the last scheme")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=("train", "recover"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    schemes = args.schemes.split(",")
    if args.worker is None:
        transports = args.transports.split(",")
        if not transports or set(transports) - {"p2p", "store"}:
            ap.error("--transports: p2p and/or store")
        args.labels = _labels(schemes, transports)
        schemes = args.labels
    if args.worker == "train":
        worker_train(args.out, args.mb, args.steps, schemes)
        return
    if args.worker == "recover":
        worker_recover(args.out, args.mb, schemes[-1])
        return
    if schemes[0] != "none" or len(schemes) < 2 or args.nodes < 2 or not 1 <= args.lose < args.nodes:
        ap.error("--schemes must start with 'none' and name another; --nodes at least 2; 1 <= --lose < --nodes")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"# {res['machine']}, {res['nodes']} nodes x 1 rank (torchrun, gloo), {res['mb']} MB of parameters, "
          f"{res['steps']} steps")
    for s in schemes:
        print(f"{s:10s} iteration (median) {res['iteration_ms'][s]:8.1f} ms ({(res['vs_none'][s] - 1) * 100:+.1f} % "
              f"vs none), extra memory per node {res['extra_memory_per_node_mb'][s]:.1f} MB, sent per step per "
              f"rank {res['sent_per_step_per_rank_mb'][s]:.2f} MB, held by the job's store at most "
              f"{res['store_peak_block_mb'][s]:.1f} MB, last 3 steps protected {res['last_protected_after_s'][s]:.2f} s "
              f"after the last snapshot")
    print(f"nodes {res['lost_nodes']} lost under {res['lost_scheme']}: steps {res['recovered_steps']} rebuilt; "
          f"restart to restored "
          f"state {res['loss_to_restored_s']:.2f} s (recovery {res['recovery_s']:.2f} s + the newest step restored "
          f"from the rebuilt memory {res['memory_restore_s'] or float('nan'):.3f} s) vs "
          f"{res['loss_to_restored_via_store_s']:.2f} s restoring it from the store "
          f"({res['store_restore_s'] or float('nan'):.3f} s; from memory again, as warm: "
          f"{res['memory_restore_warm_s'] or float('nan'):.3f} s)")


if __name__ == "__main__":
    main()
