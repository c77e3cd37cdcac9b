"""Issue 13: bytes per step with delta coding between steps, on a real trajectory.

    python benchmarks/bench_delta.py [--steps 64] [--d-model 192] [--layers 3] [--dir /tmp/dstt-bench-delta]

One process, one training run (a small transformer built from a config in
code: token embedding, ``nn.TransformerEncoder``, output projection; AdamW,
lr 3e-4, on a synthetic next-token task), every step saved to one store per
storage mode in lockstep, so every mode stores exactly the same states:

* stored / raw bytes per tensor kind (parameters, exp_avg, exp_avg_sq, the
  rest) and overall, for ``none``, ``zstd`` (level 1), ``shuffle-zstd`` and
  ``delta`` at several keyframe spacings (star deltas);
* codec throughput per core (MB/s of raw bytes) on the final step's fp32
  tensors: delta encode (subtract + zigzag + shuffle + zstd-1) and decode,
  keyframe encode and decode, plain zstd-1;
* write time per step of each mode (one flush thread, fsync included);
* reading one random step (``state_dict``) and a diff of two steps from the
  delta store vs the uncompressed one, with the results checked identical;
* ``predictive`` at several keyframe spacings (issue 27: parameters and
  optimizer state predicted by the optimizer's update rule, the rest
  chained deltas; ``--pred-keyframes``), every step of every mode read
  back and compared bit-exact with ``none``;
* reading one tensor at a step in the middle of a chain vs at a keyframe
  step, and ``history`` with data (one tensor over every step) vs ``none``;
* ``--small``: the same on a model of many small tensors (4 layers, d=96,
  vocab 512: every tensor under 1 MiB, all in packs);
* ``dstt.Capture`` every iteration with ``compression="none"`` vs
  ``"delta"`` vs no capture, end to end, in two regimes: the CPU trains (the
  iteration is the real forward/backward/AdamW on this CPU) and the CPU is
  idle while a stand-in accelerator computes (the iteration plus a sleep).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import fresh_dir, machine  # noqa: E402

import dstt  # noqa: E402
from dstt.format.chains import ChainReader  # noqa: E402
from dstt.format.codecs.delta import blosc_decode, blosc_encode, undo_delta, zigzag_delta  # noqa: E402
from dstt.format.writeoptions import WriteOptions  # noqa: E402
from dstt.store.writer import Writer  # noqa: E402

KINDS = ("param", "exp_avg", "exp_avg_sq", "other")


def build(vocab: int, d_model: int, layers: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model,
                                             dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, d_model),
                               torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                               torch.nn.Linear(d_model, vocab))


def batch(vocab: int, g: torch.Generator, n: int = 16, length: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where token t+1 = (token t * 3 + 1) mod vocab half the time: learnable."""
    x = torch.randint(0, vocab, (n, length), generator=g)
    rule = (x * 3 + 1) % vocab
    noise = torch.randint(0, vocab, (n, length), generator=g)
    y = torch.where(torch.rand(n, length, generator=g) < 0.5, rule, noise)
    return x, y


def kind_of(name: str) -> str:
    if name.startswith("model/"):
        return "param"
    if name.endswith("/exp_avg"):
        return "exp_avg"
    if name.endswith("/exp_avg_sq"):
        return "exp_avg_sq"
    return "other"


def sizes(path: str) -> dict[str, list[int]]:
    """[stored, raw] bytes per tensor kind over every step of a store."""
    run = dstt.open(path)
    out = {k: [0, 0] for k in (*KINDS, "total")}
    for s in run.steps():
        for t in run.tensors(s):
            for k in (kind_of(t.name), "total"):
                out[k][0] += t.written
                out[k][1] += t.nbytes
    return out


def codec_speed(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> dict[str, float]:
    """Raw MB/s per core of each transform over the fp32 tensors of two steps."""
    import numcodecs.blosc
    from numcodecs import Zstd

    numcodecs.blosc.use_threads = False  # one core
    pairs = [(cur[n].numpy(), prev[n].numpy()) for n in cur if cur[n].dtype == torch.float32 and n in prev]
    raw = sum(a.nbytes for a, _ in pairs)
    out: dict[str, float] = {}

    def rate(fn: Any) -> float:
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return 3 * raw / (time.perf_counter() - t) / 1e6

    deltas = [blosc_encode(zigzag_delta(a, b, 4), 4) for a, b in pairs]
    keys = [blosc_encode(a, 4) for a, _ in pairs]
    out["delta encode"] = rate(lambda: [blosc_encode(zigzag_delta(a, b, 4), 4) for a, b in pairs])
    out["delta decode"] = rate(lambda: [undo_delta(b, blosc_decode(d, a.nbytes, "b"), 4)
                                        for (a, b), d in zip(pairs, deltas)])
    out["keyframe encode"] = rate(lambda: [blosc_encode(a, 4) for a, _ in pairs])
    out["keyframe decode"] = rate(lambda: [blosc_decode(k, a.nbytes, "b") for (a, _), k in zip(pairs, keys)])
    out["zstd-1 encode"] = rate(lambda: [Zstd(1).encode(a) for a, _ in pairs])
    out["subtract+zigzag"] = rate(lambda: [zigzag_delta(a, b, 4) for a, b in pairs])
    return out


def capture_runs(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Seconds per iteration with Capture(compression=...) every iteration vs none."""
    out: dict[str, Any] = {}
    for regime, sleep_s in (("cpu trains", 0.0), (f"cpu idle {args.idle_s}s/iter", args.idle_s)):
        row = {}
        for mode in ("no capture", "none", "delta", "auto"):
            model = build(args.vocab, args.d_model, args.layers)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            g = torch.Generator().manual_seed(1)
            cap = None if mode == "no capture" else dstt.Capture(fresh_dir(os.path.join(root, "cap")), compression=mode)
            t0 = time.perf_counter()
            for step in range(args.capture_iters):
                x, y = batch(args.vocab, g)
                torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
                if sleep_s:
                    time.sleep(sleep_s)
                if cap is not None:
                    cap.snapshot(step, model=model, optimizer=opt)
            loop_s = time.perf_counter() - t0
            if cap is not None:
                cap.close()
            total_s = time.perf_counter() - t0
            row[mode] = {"loop_s_per_iter": loop_s / args.capture_iters, "with_drain_s_per_iter": total_s / args.capture_iters}
            if cap is not None:
                row[mode]["stored_mb"] = sum(f.stat().st_size for f in __import__("pathlib").Path(root, "cap").rglob("c.*")) / 1e6
                run = dstt.open(os.path.join(root, "cap"))
                row[mode]["fast_steps"] = sum(run.commit_info(s).get("coding") == "fast" for s in run.steps())
        out[regime] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--keyframes", default="4,8,16", help="keyframe spacings to compare")
    ap.add_argument("--dir", default="/tmp/dstt-bench-delta")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--capture-iters", type=int, default=16, help="iterations per Capture run (0: skip)")
    ap.add_argument("--idle-s", type=float, default=0.5, help="stand-in accelerator time per iteration")
    ap.add_argument("--only-capture", action="store_true", help="only the Capture comparison")
    ap.add_argument("--pred-keyframes", default="8,16,32", help="keyframe spacings of the predictive modes")
    ap.add_argument("--small", action="store_true", help="many small tensors: 4 layers, d=96, vocab 512")
    args = ap.parse_args()
    if args.small:
        args.vocab, args.d_model, args.layers = 512, 96, 4
    root = fresh_dir(args.dir)
    torch.set_num_threads(1)
    if args.only_capture:
        r = {"machine": machine(), "capture": capture_runs(args, root)}
        print(report_capture(r["capture"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return
    model = build(args.vocab, args.d_model, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    modes: dict[str, dict[str, Any]] = {"none": {}, "zstd": {}, "shuffle-zstd": {}}
    for k in (int(x) for x in args.keyframes.split(",")):
        modes[f"delta K={k}"] = {"compression": "delta", "keyframe_every": k}
    for k in (int(x) for x in args.pred_keyframes.split(",") if x):
        modes[f"predictive K={k}"] = {"compression": "predictive", "keyframe_every": k}
    writers = {m: Writer(os.path.join(root, m.replace(" ", "_").replace("=", "")),
                         WriteOptions(compression=kw.get("compression", m), threads=1,
                                      **{k: v for k, v in kw.items() if k != "compression"}))
               for m, kw in modes.items()}
    write_s = dict.fromkeys(modes, 0.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    prev_state: dict[str, torch.Tensor] = {}
    cur_state: dict[str, torch.Tensor] = {}
    for step in range(args.steps):
        x, y = batch(args.vocab, g)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        state = dstt.state_of(model=model, optimizer=opt, rng=True)
        for m, w in writers.items():
            t = time.perf_counter()
            w.write(step, state)
            write_s[m] += time.perf_counter() - t
        if step >= args.steps - 2:
            from dstt.store.tree import flatten

            prev_state, cur_state = cur_state, {n: v.detach().clone() for n, v in flatten(state)[1].items()}
    for w in writers.values():
        w.close()
    n_params = sum(p.numel() for p in model.parameters())
    raw_step = sum(v.numel() * v.element_size() for v in cur_state.values())
    result: dict[str, Any] = {"machine": machine(), "steps": args.steps, "params": n_params,
                              "raw_bytes_per_step": raw_step, "loss_first": losses[0], "loss_last": losses[-1],
                              "lr": args.lr, "modes": {}}
    for m in modes:
        path = writers[m].backend.url
        s = sizes(path)
        result["modes"][m] = {
            "ratio": {k: (v[0] / v[1] if v[1] else 0.0) for k, v in s.items()},
            "write_ms_per_step": 1e3 * write_s[m] / args.steps,
        }
    result["codec_mb_s_per_core"] = codec_speed(prev_state, cur_state)
    # reading: one random step, and a diff of two steps, delta vs none
    rng = random.Random(0)
    step = rng.randrange(args.steps)
    a, b = sorted(rng.sample(range(args.steps), 2))
    reads: dict[str, Any] = {"step": step, "diff": [a, b]}
    ref_state = ref_diff = None
    for m in ("none", "shuffle-zstd", *(m for m in modes if m.startswith(("delta", "predictive")))):
        run = dstt.open(writers[m].backend.url)
        t = time.perf_counter()
        sd = run.state_dict(step)
        t_read = time.perf_counter() - t
        t = time.perf_counter()
        rows = run.diff(a, b)
        t_diff = time.perf_counter() - t
        from dstt.store.tree import flatten

        flat = {n: v.reshape(-1).view(torch.uint8) if v.dtype != torch.bool else v
                for n, v in flatten(sd)[1].items()}
        if ref_state is None:
            ref_state, ref_diff = flat, rows
        same = flat.keys() == ref_state.keys() and all(torch.equal(flat[n], ref_state[n]) for n in flat)
        reads[m] = {"state_dict_ms": 1e3 * t_read, "diff_ms": 1e3 * t_diff, "identical": bool(same and rows == ref_diff)}
    result["reads"] = reads
    result["chain_reads"] = chain_reads(writers, modes, args.steps)
    if args.capture_iters:
        result["capture"] = capture_runs(args, root)
    print(report(result))
    if "capture" in result:
        print(report_capture(result["capture"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


class LruChains(ChainReader):
    """The decoded-link cache before issue 27's read fix (plain LRU), for
    the before/after figures of ``state_dict`` at a step deep in a chain."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._lru: OrderedDict[Any, np.ndarray] = OrderedDict()

    def _get(self, node: Any) -> np.ndarray | None:
        with self._lock:
            got = self._lru.get(node)
            if got is not None:
                self._lru.move_to_end(node)
            return got

    def _put(self, node: Any, raw: np.ndarray) -> None:
        if raw.nbytes > self.cache_bytes:
            return
        with self._lock:
            if node not in self._lru:
                self._lru[node] = raw
                self._held += raw.nbytes
            while self._held > self.cache_bytes:
                _, old = self._lru.popitem(last=False)
                self._held -= old.nbytes


def whole_step_reads(path: str, step: int) -> dict[str, Any]:
    """``state_dict`` of ``step`` from a fresh reader with the cache policy
    of today and the plain LRU one before it: ms and links decoded."""
    out: dict[str, Any] = {"step": step}
    for policy in ("by-step", "lru"):
        run = dstt.open(path)
        if policy == "lru":
            run.chains = LruChains(run.backend, run._entries_at)
        t = time.perf_counter()
        run.state_dict(step)
        out[policy] = {"ms": 1e3 * (time.perf_counter() - t), "decoded": run.chains.decoded}
    return out


def chain_reads(writers: dict[str, Writer], modes: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per mode: one large tensor read at a keyframe step and at the step
    just before the next keyframe (the longest chain), each from a fresh
    reader, and the tensor at every step in order (history with data)."""
    out: dict[str, Any] = {}
    ref: list[torch.Tensor] | None = None
    for m in ("none", *(m for m in modes if m.startswith(("predictive", "delta")))):
        path = writers[m].backend.url
        run = dstt.open(path)
        name = max(run.tensors(0), key=lambda t: t.nbytes).name
        k = modes[m].get("keyframe_every", 8) if m != "none" else 8
        key_step = min(k, steps - 1) if k < steps else 0
        mid = min(key_step + k - 1, steps - 1)
        t = time.perf_counter()
        dstt.open(path).read(name, key_step)
        key_ms = 1e3 * (time.perf_counter() - t)
        t = time.perf_counter()
        dstt.open(path).read(name, mid)
        mid_ms = 1e3 * (time.perf_counter() - t)
        fresh = dstt.open(path)
        t = time.perf_counter()
        series = [fresh.read(name, s) for s in fresh.steps()]
        hist_ms = 1e3 * (time.perf_counter() - t)
        bits = [v.reshape(-1).view(torch.uint8) for v in series]
        if ref is None:
            ref = bits
        same = len(bits) == len(ref) and all(torch.equal(a, b) for a, b in zip(bits, ref))
        out[m] = {"tensor": name, "keyframe_step": key_step, "keyframe_ms": key_ms, "mid_step": mid, "mid_ms": mid_ms,
                  "history_ms": hist_ms, "identical": bool(same)}
        if m.startswith("predictive"):  # a whole step at the end of a chain: the cache policies compared
            out[m]["state_dict"] = whole_step_reads(path, mid)
    return out


def report_capture(c: dict[str, Any]) -> str:
    modes = ("none", "delta", "auto")
    lines = ["", "| regime | no capture s/iter | " + " | ".join(f"Capture {m} s/iter (with drain)" for m in modes)
             + " | stored MB none / delta / auto | auto: fast steps |", "|---" * (len(modes) + 4) + "|"]
    for regime, row in c.items():
        base = row["no capture"]["loop_s_per_iter"]
        cells = [f"{row[m]['loop_s_per_iter']:.3f} ({row[m]['with_drain_s_per_iter']:.3f}; "
                 f"{row[m]['with_drain_s_per_iter'] / base:.2f}x)" for m in modes]
        mb = " / ".join(f"{row[m]['stored_mb']:.0f}" for m in modes)
        lines.append(f"| {regime} | {base:.3f} | " + " | ".join(cells) + f" | {mb} | {row['auto']['fast_steps']} |")
    return "\n".join(lines)


def report(r: dict[str, Any]) -> str:
    lines = [f"machine: {r['machine']}",
             f"{r['params']:,} parameters, {r['raw_bytes_per_step'] / 1e6:.1f} MB per step raw, "
             f"{r['steps']} steps, AdamW lr {r['lr']}, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}", "",
             "| mode | params | exp_avg | exp_avg_sq | other | **total** | write ms/step |",
             "|---|---|---|---|---|---|---|"]
    for m, v in r["modes"].items():
        q = v["ratio"]
        lines.append(f"| {m} | {q['param']:.3f} | {q['exp_avg']:.3f} | {q['exp_avg_sq']:.3f} | {q['other']:.3f} "
                     f"| **{q['total']:.3f}** | {v['write_ms_per_step']:.0f} |")
    lines += ["", "| codec (fp32, one core) | MB/s of raw bytes |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in r["codec_mb_s_per_core"].items()]
    cr = r.get("chain_reads", {})
    if cr:
        lines += ["", "| read one tensor | keyframe step ms | mid-chain step ms | history with data ms (all steps) "
                  "| identical to none |", "|---|---|---|---|---|"]
        lines += [f"| {m} ({v['tensor']}) | {v['keyframe_ms']:.1f} (step {v['keyframe_step']}) | "
                  f"{v['mid_ms']:.1f} (step {v['mid_step']}) | {v['history_ms']:.0f} | {v['identical']} |"
                  for m, v in cr.items()]
    rd = r["reads"]
    lines += ["", f"| read (step {rd['step']}; diff {rd['diff'][0]} vs {rd['diff'][1]}) | state_dict ms | diff ms "
              "| identical to none |", "|---|---|---|---|"]
    lines += [f"| {m} | {v['state_dict_ms']:.0f} | {v['diff_ms']:.0f} | {v['identical']} |"
              for m, v in rd.items() if isinstance(v, dict)]
    return "\n".join(lines)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
