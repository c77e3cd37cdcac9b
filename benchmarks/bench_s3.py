"""CLI commands on an object store vs the same store on a local path, with
each object-store client: obstore (the default where installed) and
fsspec/s3fs (``DSTT_OBJECT_CLIENT=fsspec``).

Starts the local S3-compatible server the tests use (moto in server mode,
tests/s3_server.py), writes the same run to ``s3://`` and to a local
directory, then times real ``dstt`` subprocesses (what a user waits for):
``ls``, ``ls STORE:latest``, ``diff``, ``verify``, against a bare
``python -c pass`` (interpreter start). Reports medians and the ratios
s3 / local per client (issue 29: ``dstt ls s3://...`` <= 2x local). The issue's goal: ``dstt ls s3://...`` of a 10-step store within
2x the local one plus the interpreter's start.

    python benchmarks/bench_s3.py [--steps 10] [--tensors 50] [--repeat 5] [--latency-ms 20]

``--latency-ms`` delays every request on the server: moto answers in a few
ms of Python on this machine, a real S3 bucket in ~10-30 ms of network round
trip, which is where concurrent listing and reads pay off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import machine  # noqa: E402

import dstt  # noqa: E402


def _state(n_tensors: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(n_tensors)},
            "lr": 1e-3}


def _time(cmd: list[str], env: dict[str, str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="Delay every server request (an emulated round trip to a real S3 region).")
    args = ap.parse_args()
    import s3_server

    with s3_server.serve(latency_s=args.latency_ms / 1000) as server, tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "run")
        remote = server.url("run")
        for store in (local, remote):
            for s in range(args.steps):
                dstt.save(store, s, _state(args.tensors, s))
        env = server.subprocess_env()
        dstt_cmd = [sys.executable, "-m", "dstt.cli.main"]
        base = _time([sys.executable, "-c", "pass"], env, args.repeat)
        clients = {c: {**env, "DSTT_OBJECT_CLIENT": c} for c in ("obstore", "fsspec")}
        rows = {}
        for name, tail in (("ls STORE", lambda s: ["ls", s]),
                           ("ls STORE:latest", lambda s: ["ls", f"{s}:latest"]),
                           ("diff :0 :latest", lambda s: ["diff", f"{s}:0", ":latest", "--no-progress"]),
                           ("verify", lambda s: ["verify", s, "-q"])):
            t_local = _time(dstt_cmd + tail(local), env, args.repeat)
            row: dict = {"local_s": round(t_local, 3)}
            for client, client_env in clients.items():
                t_s3 = _time(dstt_cmd + tail(remote), client_env, args.repeat)
                row[client] = {"s3_s": round(t_s3, 3), "ratio": round(t_s3 / t_local, 2),
                               "ratio_after_start": round((t_s3 - base) / max(1e-9, t_local - base), 2)}
            rows[name] = row
        print(json.dumps({"machine": machine(), "steps": args.steps, "tensors": args.tensors,
                          "latency_ms": args.latency_ms,
                          "interpreter_start_s": round(base, 3), "commands": rows}, indent=2))


if __name__ == "__main__":
    main()
