"""Issue 4: inspection commands on a large store, and diff against raw reads.

    python benchmarks/bench_inspect.py [--steps 1000] [--tensors 300] [--diff-gb 1.0] [--dir /tmp/dstt-bench-inspect]

* ``dstt ls STORE``, ``dstt ls STORE:STEP`` and ``dstt history STORE TENSOR``
  on a store of ``--steps`` × ``--tensors`` small tensors, each as the wall
  time of a fresh subprocess (best of 3) beside ``python -c "import dstt"``.
* ``dstt diff`` of two ~``--diff-gb`` steps whose every chunk changed, in a
  fresh process each: the diff's time and peak RSS against reading both
  steps' bytes (streaming every chunk, and ``run.state_dict`` with 4 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402


def build_small(path: str, steps: int, tensors: int) -> float:
    t = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    model = {f"t{i:04d}": torch.randn(64, generator=g) for i in range(tensors)}
    with dstt.Writer(path) as w:
        for s in range(steps):
            for v in model.values():
                v.mul_(0.999).add_(0.001)
            w.write(s, {"model": model})
    return time.perf_counter() - t


def build_big(path: str, gb: float) -> int:
    n = 16
    per = int(gb * 2**30) // n // 4
    g = torch.Generator().manual_seed(1)
    model = {f"w{i:02d}": torch.randn(per, generator=g) for i in range(n)}
    with dstt.Writer(path) as w:
        w.write(0, {"model": model})
        for v in model.values():
            v.add_(1e-3)
        w.write(1, {"model": model})
    return sum(v.numel() * 4 for v in model.values())


def wall(cmd: list[str], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t)
    return best


SNIPPET = """
import json, resource, sys, time
import dstt
what, path = sys.argv[1], sys.argv[2]
run = dstt.open(path)
t = time.perf_counter()
if what == "diff":
    rows = run.diff(0, 1, threads=2)
    assert all(r["status"] == "changed" for r in rows)
elif what == "stream":
    for s in (0, 1):
        for name in run.record(s).names:
            for _ in run.iter_chunks(name, s):
                pass
elif what == "state_dict":
    for s in (0, 1):
        sd = run.state_dict(s, threads=4)
        del sd
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def in_fresh_process(what: str, path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SNIPPET, what, path], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--diff-gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/dstt-bench-inspect")
    ap.add_argument("--reuse", action="store_true", help="keep a small store built by an earlier run with the same sizes")
    args = ap.parse_args()
    small = os.path.join(args.dir, "small")
    reuse = args.reuse and os.path.isdir(small) and len(dstt.open(small).steps()) == args.steps
    base = args.dir if reuse else fresh_dir(args.dir)
    print(machine())
    if reuse:
        print(f"reusing {args.steps} steps x {args.tensors} tensors in {small}")
    else:
        secs = build_small(small, args.steps, args.tensors)
        print(f"building {args.steps} steps x {args.tensors} tensors: {secs:.1f} s")
    py = [sys.executable]
    cli = py + ["-m", "dstt.cli.main"]
    imp = wall(py + ["-c", "import dstt"])
    cli_imp = wall(cli + ["--version"])
    print(f"python -c 'import dstt'        {imp:6.2f} s")
    print(f"dstt --version                 {cli_imp:6.2f} s")
    for label, cmd in [
        ("dstt ls STORE --json", cli + ["ls", small, "--json"]),
        ("dstt ls STORE", cli + ["ls", small]),
        ("dstt ls STORE:500", cli + ["ls", f"{small}:500"]),
        ("dstt history STORE t0123", cli + ["history", small, "model/t0123"]),
        ("dstt history STORE t0123 --json", cli + ["history", small, "model/t0123", "--json"]),
        ("dstt find STORE", cli + ["find", small]),
    ]:
        t = wall(cmd)
        print(f"{label:30s} {t:6.2f} s   ({t - imp:+.2f} s beyond import dstt)")

    big = fresh_dir(os.path.join(base, "big"))
    os.rmdir(big)
    nbytes = build_big(big, args.diff_gb)
    print(f"diff: two steps of {nbytes / 2**30:.2f} GiB each (16 tensors, every chunk changed)")
    in_fresh_process("stream", big)  # warm the page cache
    res = {w: in_fresh_process(w, big) for w in ("stream", "state_dict", "diff")}
    for w, r in res.items():
        print(f"  {w:10s} {r['seconds']:6.2f} s   peak RSS {r['peak_rss_mib']:7.0f} MiB")
    best_read = min(res["stream"]["seconds"], res["state_dict"]["seconds"])
    print(f"  diff / fastest read of both steps: {res['diff']['seconds'] / best_read:.2f}x")


if __name__ == "__main__":
    main()
