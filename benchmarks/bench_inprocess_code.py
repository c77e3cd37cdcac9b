"""Issue 27: what predictive coding would cost a trainer if it ran in the
trainer's own process (``helper=False``).

    python benchmarks/bench_inprocess_code.py [--iters 40] [--steps 4] [--threads 1,2]

With ``helper=False`` a capture writes from threads of the trainer's
process. Predictive coding there would run on those threads, beside the
training loop. This measures what that costs the loop.

* the **trainer**: bench_delta.py's model (2.1M parameters, AdamW, CPU, one
  torch thread), ``--iters`` training iterations timed alone, then timed
  again while N background threads code steps of the same model
  (``Writer.prepare_pred`` on steps planned beforehand, in a loop: what the
  flush threads would run per captured step);
* the **coding**: CPU seconds per step coded, and MB/s of raw state.

Reported: the iteration time alone and beside the coder (their ratio),
and the coder's rate. The trainer's torch thread count is set to 1 in this
process (a benchmark, not a capture: dstt itself never changes it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_delta import batch, build  # noqa: E402
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402
from dstt.store.writer import Writer  # noqa: E402

VOCAB = 2000


def train_iters(model: torch.nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, n: int) -> float:
    """Seconds per training iteration over ``n`` iterations."""
    t = time.perf_counter()
    for _ in range(n):
        x, y = batch(VOCAB, g)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t) / n


def coder_loop(path: str, states: list[Any], stop: threading.Event, out: dict[str, float]) -> None:
    """Code ``states`` as consecutive steps, over and over, until ``stop``."""
    coded = 0
    cpu = time.thread_time()
    raw = 0
    rounds = 0
    while not stop.is_set():
        shutil.rmtree(path, ignore_errors=True)
        with Writer(path, compression="predictive", threads=1) as w:
            for step, state in enumerate(states):
                plan = w.plan(step, state)
                w.ensure_arrays(plan)
                w.prepare_pred(plan)
                if step:
                    coded += 1
                    raw += sum(t.nbytes for t in plan.tasks)
                w.commit(plan, w.flush_chunks(plan, plan.tasks)[0])
                if stop.is_set():
                    break
        rounds += 1
    out["cpu_s_per_step"] = (time.thread_time() - cpu) / max(1, coded)
    out["raw_bytes"] = raw
    out["steps"] = coded


def cloned(tree: Any) -> Any:
    """``tree`` with every tensor cloned (the optimizer updates its state in place)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: cloned(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [cloned(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(cloned(v) for v in tree)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--steps", type=int, default=4, help="steps of state coded in a loop")
    ap.add_argument("--threads", default="1,2", help="background coding threads to compare")
    ap.add_argument("--dir", default="/tmp/dstt-bench-inprocess")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = fresh_dir(args.dir)
    torch.set_num_threads(1)
    model = build(VOCAB, 192, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(1)
    states = []
    for _ in range(args.steps):
        train_iters(model, opt, g, 1)
        states.append(cloned(dstt.state_of(model=model, optimizer=opt, rng=False)))
    # a fresh model to train beside the coder (the states above stay as they are)
    trainer = build(VOCAB, 192, 3, seed=1)
    topt = torch.optim.AdamW(trainer.parameters(), lr=3e-4)
    train_iters(trainer, topt, g, 2)  # warm-up
    result: dict[str, Any] = {"machine": machine(), "iters": args.iters, "alone_s": train_iters(trainer, topt, g,
                                                                                               args.iters)}
    for n in (int(x) for x in args.threads.split(",")):
        stop = threading.Event()
        outs: list[dict[str, float]] = [{} for _ in range(n)]
        threads = [threading.Thread(target=coder_loop, args=(os.path.join(root, f"c{n}-{i}"), states, stop, outs[i]))
                   for i in range(n)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the coders running
        beside = train_iters(trainer, topt, g, args.iters)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        raw = sum(o.get("raw_bytes", 0) for o in outs)
        cpu = sum(o.get("cpu_s_per_step", 0.0) * o.get("steps", 0) for o in outs)
        result[f"threads={n}"] = {"beside_s": beside, "slowdown": beside / result["alone_s"],
                                  "coder_mb_s_per_cpu_s": raw / cpu / 1e6 if cpu else 0.0,
                                  "steps_coded": sum(int(o.get("steps", 0)) for o in outs)}
    print(f"training iteration alone: {1e3 * result['alone_s']:.1f} ms")
    for n in (int(x) for x in args.threads.split(",")):
        r = result[f"threads={n}"]
        print(f"beside {n} coding thread(s): {1e3 * r['beside_s']:.1f} ms ({r['slowdown']:.2f}x); "
              f"coder {r['coder_mb_s_per_cpu_s']:.0f} MB per CPU second, {r['steps_coded']} steps coded")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
