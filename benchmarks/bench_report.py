"""``dstt report`` on a long run: 1,000 steps x 300 tensors (30 layers x 10
parameters, small tensors: the cost is the step index, not tensor data).

Times, in fresh processes: ``dstt report`` (whole command), and the two
peers that read the same index -- ``dstt history STORE 'model/*'`` (every
tensor's norm over every step) and ``dstt ls STORE`` -- and in this process
the split between reading (collect) and drawing (render_html). Reports the
report's wall time as a ratio of history's.

    python benchmarks/bench_report.py [--steps 1000] [--layers 30] [--dir /tmp/dstt-bench-report] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402

PARAMS = ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight", "mlp.w1.weight",
          "mlp.w2.weight", "mlp.w3.weight", "norm1.weight", "norm2.weight", "mlp.w1.bias")


def build(path: str, steps: int, layers: int) -> float:
    t = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.{p}": torch.randn(32, generator=g) for i in range(layers) for p in PARAMS}
    with dstt.Writer(path) as w:
        for s in range(steps):
            for v in model.values():
                v.mul_(0.999).add_(0.001)
            if s == steps // 2:  # something for find to report
                model["layers.3.mlp.w1.weight"].mul_(100.0)
            w.write(s, {"model": model})
    return time.perf_counter() - t


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dstt-bench-report")
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args()
    store = os.path.join(args.dir, "run")
    if not (args.reuse and os.path.isdir(store) and len(dstt.open(store).steps()) == args.steps):
        fresh_dir(args.dir)
        print(f"built {args.steps} steps x {args.layers * len(PARAMS)} tensors in {build(store, args.steps, args.layers):.1f} s",
              file=sys.stderr)
    from dstt.analysis.report import collect, render_html
    from dstt.format.index import RunIndex

    t = time.perf_counter()
    data = collect(RunIndex(store))
    t_collect = time.perf_counter() - t
    t = time.perf_counter()
    page = render_html(data)
    t_render = time.perf_counter() - t
    out = os.path.join(args.dir, "report.html")
    cli = [sys.executable, "-m", "dstt.cli.main"]
    t_report = wall(cli + ["report", store, "-o", out], args.repeat)
    t_history = wall(cli + ["history", store, "model/*"], args.repeat)
    t_ls = wall(cli + ["ls", store], args.repeat)
    print(json.dumps({
        "machine": machine(), "steps": args.steps, "tensors": args.layers * len(PARAMS),
        "collect_s": round(t_collect, 2), "render_s": round(t_render, 2), "html_bytes": len(page.encode()),
        "dstt_report_s": round(t_report, 2), "dstt_history_all_s": round(t_history, 2), "dstt_ls_s": round(t_ls, 2),
        "report_over_history": round(t_report / t_history, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
