"""Issue 27: bytes per step with predictive coding of optimizer state, on bench_delta.py's trajectory.

    python benchmarks/bench_predict.py [--steps 64] [--keyframes 8,16,32] [--json out.json]

One process trains bench_delta.py's transformer (token embedding,
``nn.TransformerEncoder``, output projection; AdamW lr 3e-4; 2.1M
parameters with the defaults) and, with ``--small``, a model of many small
tensors (4 layers, d=96, vocab 512: every tensor under 1 MiB), and codes
every captured step (parameters, ``exp_avg``, ``exp_avg_sq``; ``other``:
the step counters and the torch RNG state) in memory with each mode:

* ``none`` (raw), ``zstd`` (level 1), ``shuffle-zstd`` (dstt's keyframes);
* ``star delta K=k`` (today's ``compression="delta"``: every chunk a
  difference to its keyframe, a keyframe every k steps, a delta kept only
  below 0.95 of its keyframe's size);
* ``chained delta K=k`` (each step against the previous one);
* ``predictive K=k`` (dstt/format/codecs/predictive.py: parameters and
  ``exp_avg_sq`` predicted by the optimizer's update rule, the rest chained
  deltas; hyperparameters of step t or t-1, whichever predicts the first
  block better).

Chained and predictive coding are then run again with *aligned packs*
(:func:`aligned_packs`): the tensors under 1 MiB of each role concatenated
in the same parameter order, so a pack of parameters and the packs of their
optimizer state line up element by element and code as one chunk each (the
0-d step counters packed too) -- what packs would need to become for small
tensors to be predicted as well as large ones.

Every coded chunk of every step is decoded from the decoded previous step
(so from its keyframe, through the chain) and checked bit-exact. Figures:
stored / raw per tensor kind, the fraction of elements predicted exactly,
and codec throughput per core (blosc threads off) on the last steps:
encode, decode, and decode of the last step from its keyframe (K=8).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_delta import batch, build  # noqa: E402
from common import machine  # noqa: E402

from dstt.format.codecs import predictive as pc  # noqa: E402
from dstt.format.codecs.delta import blosc_decode, blosc_encode, undo_delta, zigzag_delta  # noqa: E402
from dstt.format.codecs.optimspec import ParamState, delta, param_codings  # noqa: E402
from dstt.format.codecs.predictors import Coding  # noqa: E402
from dstt.format.codecs.stepcoder import NOISE_ROLES  # noqa: E402

KINDS = ("param", "exp_avg", "exp_avg_sq", "other")
ROLE_ORDER = ("exp_avg", "momentum_buffer", "exp_avg_sq", "max_exp_avg_sq", "param")
DT = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "uint8",
      torch.int64: "int64"}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DELTA_MAX_RATIO = 0.95  # as dstt/format/codecs/keyframes.py


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().reshape(-1)
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(signed).numpy().view(UINT[t.element_size()]).copy()


@dataclass
class Tensor:
    name: str
    kind: str
    dtype: str
    raw: np.ndarray
    param: str | None = None  # the parameter it belongs to
    role: str | None = None


@dataclass
class Step:
    tensors: dict[str, Tensor]
    params: dict[str, tuple[dict[str, Any], ParamState]]  # parameter -> (its group, its state summary)


def capture(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Step:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, Tensor] = {}
    params = {}
    for g in opt.param_groups:
        group = {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"}
        for p in g["params"]:
            n = names[id(p)]
            tensors[f"model/{n}"] = Tensor(f"model/{n}", "param", DT[p.dtype], bits(p), n, "param")
            st = opt.state.get(p, {})
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim():
                    kind = k if k in KINDS else "other"
                    tensors[f"optim/{n}/{k}"] = Tensor(f"optim/{n}/{k}", kind, DT[v.dtype], bits(v), n, k)
                elif torch.is_tensor(v):
                    tensors[f"optim/{n}/{k}"] = Tensor(f"optim/{n}/{k}", "other", DT[v.dtype], bits(v.reshape(1)))
            step = float(st["step"]) if "step" in st else None
            params[n] = (group, ParamState(DT[p.dtype], {k: DT[v.dtype] for k, v in st.items()
                                                         if torch.is_tensor(v) and v.dim()}, step))
    tensors["rng/torch"] = Tensor("rng/torch", "other", "uint8", torch.get_rng_state().numpy().copy())
    return Step(tensors, params)


def trajectory(vocab: int, d_model: int, layers: int, steps: int, lr: float) -> Callable[[], Any]:
    def run() -> Any:
        model = build(vocab, d_model, layers)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = batch(vocab, g)
            torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            yield capture(model, opt)
    return run


def aligned_packs(step: Step, limit: int = 1 << 20) -> Step:
    """The step with its small tensors (under ``limit`` bytes) packed the way
    predictive coding needs: one flat tensor per (role, dtype, step count),
    parameters in the same order in each, so the pack of parameters and the
    packs of their ``exp_avg`` and ``exp_avg_sq`` line up element by
    element and code as one chunk each; the 0-d step counters as one too."""
    buckets: dict[tuple[str, float | None], list[str]] = {}
    for pname, (_, state) in step.params.items():
        own = [t for t in step.tensors.values() if t.param == pname and t.role]
        if all(t.raw.nbytes < limit for t in own):
            buckets.setdefault((state.dtype, state.step), []).append(pname)
    tensors = dict(step.tensors)
    params = {n: v for n, v in step.params.items() if not any(n in b for b in buckets.values())}
    for i, (_, names) in enumerate(sorted(buckets.items(), key=lambda kv: str(kv[0]))):
        group, state = step.params[names[0]]
        roles = {t.role: t for t in tensors.values() if t.param == names[0] and t.role}
        for role, first in roles.items():
            parts = [tensors.pop(f"model/{n}" if role == "param" else f"optim/{n}/{role}") for n in names]
            name = f"model/pack{i}" if role == "param" else f"optim/pack{i}/{role}"
            tensors[name] = Tensor(name, first.kind, first.dtype, np.concatenate([t.raw for t in parts]),
                                   f"pack{i}", role)
        params[f"pack{i}"] = (group, state)
    counters = [n for n, t in tensors.items() if t.name.endswith("/step") and t.raw.size == 1]
    if counters:
        raw = np.concatenate([tensors.pop(n).raw for n in sorted(counters)])
        tensors["optim/steps"] = Tensor("optim/steps", "other", "float32", raw)
    return Step(tensors, params)


# ----------------------------------------------------------------------------- modes


@dataclass
class Mode:
    """One storage mode: bytes stored per kind, and its decoded previous step."""

    name: str
    keyframe_every: int = 0
    stored: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in (*KINDS, "total")})
    exact: dict[str, list[int]] = field(default_factory=dict)  # role -> [elements, exactly predicted]
    prev: dict[str, np.ndarray] = field(default_factory=dict)  # decoded previous step
    keys: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)  # star: keyframe raw, its size

    def add(self, t: Tensor, nbytes: int) -> None:
        for k in (t.kind, "total"):
            self.stored[k][0] += nbytes
            self.stored[k][1] += t.raw.nbytes


def code_simple(mode: Mode, step: Step) -> None:
    from numcodecs import Zstd

    for t in step.tensors.values():
        if mode.name == "none":
            mode.add(t, t.raw.nbytes)
        elif mode.name == "zstd":
            mode.add(t, len(Zstd(1).encode(t.raw)))
        else:
            mode.add(t, len(blosc_encode(t.raw, t.raw.itemsize)))


def code_star(mode: Mode, step: Step, index: int) -> None:
    """Today's delta coding: every delta against the chunk's keyframe."""
    for t in step.tensors.values():
        size = t.raw.itemsize
        key = mode.keys.get(t.name)
        if key is not None and index % mode.keyframe_every and key[0].shape == t.raw.shape:
            blob = blosc_encode(zigzag_delta(t.raw, key[0], size), size)
            if len(blob) < DELTA_MAX_RATIO * key[1]:
                back = undo_delta(key[0], blosc_decode(blob, t.raw.nbytes, t.name), size)
                assert back.tobytes() == t.raw.tobytes(), t.name
                mode.add(t, len(blob))
                continue
        blob = blosc_encode(t.raw, size)
        mode.keys[t.name] = (t.raw, len(blob))
        mode.add(t, len(blob))


def codings_of(step: Step, prev: Step, predictive: bool) -> dict[str, Coding | None]:
    """The coding of every tensor of ``step`` (None: stored whole), and the
    alternative from step t-1's hyperparameters (lr schedulers)."""
    out: dict[str, Coding | None] = {}
    for name, t in step.tensors.items():
        p = prev.tensors.get(name)
        out[name] = delta(t.role or "other", t.dtype) if p is not None and p.raw.shape == t.raw.shape else None
    if not predictive:
        return out
    for pname, (group, state) in step.params.items():
        before = prev.params.get(pname)
        cs = param_codings("AdamW", group, state, before[1] if before else None)
        alt = param_codings("AdamW", before[0], state, before[1]) if before else cs
        for role, c in cs.items():
            name = f"model/{pname}" if role == "param" else f"optim/{pname}/{role}"
            out[name] = c
            out[name + "#alt"] = alt[role]
    return out


def code_chain(mode: Mode, step: Step, prev: Step | None, index: int, predictive: bool,
               timer: dict[str, float] | None = None) -> dict[str, tuple[Coding, bytes]]:
    """Chained or predictive coding of a step against the decoded previous
    one; returns what it stored coded (for replays)."""
    keyframe = prev is None or index % mode.keyframe_every == 0
    codings = {} if keyframe or prev is None else codings_of(step, prev, predictive)
    decoded: dict[str, np.ndarray] = {}
    blobs: dict[str, tuple[Coding, bytes]] = {}
    order = sorted(step.tensors.values(), key=lambda t: ROLE_ORDER.index(t.role) if t.role in ROLE_ORDER else -1)
    for t in order:
        c = codings.get(t.name)
        key_size = mode.keys.get(t.name, (None, 0))[1]
        if c is not None:
            ins = {}
            for nd in pc.plan(c):
                src = mode.prev if nd.when == "prev" else decoded
                ins[nd.when, nd.role] = src[t.name if nd.role == (t.role or "other") else
                                            (f"model/{t.param}" if nd.role == "param" else f"optim/{t.param}/{nd.role}")]
            alt = codings.get(t.name + "#alt")
            if alt is not None and alt != c and pc.plan(alt) == pc.plan(c):
                c = pc.pick([c, alt], t.raw, ins)
            t0 = time.perf_counter()
            enc = pc.encode(c, t.raw, ins, noise=t.role in NOISE_ROLES)  # (the writer's containers: stepcoder.py)
            t1 = time.perf_counter()
            back = pc.decode(c, enc.blob, len(t.raw), ins)
            if timer is not None:
                timer["encode"] += t1 - t0
                timer["decode"] += time.perf_counter() - t1
                timer["bytes"] += t.raw.nbytes
            assert back.tobytes() == t.raw.tobytes(), (t.name, c)
            if len(enc.blob) < DELTA_MAX_RATIO * key_size:
                e = mode.exact.setdefault(f"{t.role or 'other'} ({c.predictor})", [0, 0])
                e[0] += len(t.raw)
                e[1] += enc.exact
                mode.add(t, len(enc.blob))
                decoded[t.name] = back
                blobs[t.name] = (c, enc.blob)
                continue
        blob = blosc_encode(t.raw, t.raw.itemsize, noise=True)  # (keyframes: the lz4 container)
        mode.keys[t.name] = (t.raw, len(blob))
        mode.add(t, len(blob))
        decoded[t.name] = t.raw
    mode.prev = decoded
    return blobs


def replay(window: list[tuple[Step, dict[str, tuple[Coding, bytes]]]], key: Step) -> float:
    """Seconds to decode the last step of ``window`` from ``key`` (its keyframe
    step, stored whole): every step in between decoded in order."""
    prev = {n: t.raw for n, t in key.tensors.items()}
    t0 = time.perf_counter()
    for step, blobs in window:
        decoded: dict[str, np.ndarray] = {}
        order = sorted(step.tensors.values(), key=lambda t: ROLE_ORDER.index(t.role) if t.role in ROLE_ORDER else -1)
        for t in order:
            if t.name not in blobs:
                decoded[t.name] = t.raw
                continue
            c, blob = blobs[t.name]
            ins = {}
            for nd in pc.plan(c):
                src = prev if nd.when == "prev" else decoded
                ins[nd.when, nd.role] = src[t.name if nd.role == (t.role or "other") else
                                            (f"model/{t.param}" if nd.role == "param" else f"optim/{t.param}/{nd.role}")]
            decoded[t.name] = pc.decode(c, blob, len(t.raw), ins)
        prev = decoded
    elapsed = time.perf_counter() - t0
    last = window[-1][0]
    assert all(prev[n].tobytes() == t.raw.tobytes() for n, t in last.tensors.items())
    return elapsed


def run_model(label: str, make: Callable[[], Any], keyframes: list[int], packed: bool = False) -> dict[str, Any]:
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False  # one core
    tag = " (aligned packs)" if packed else ""
    modes = [] if packed else [Mode("none"), Mode("zstd"), Mode("shuffle-zstd")]
    modes += [] if packed else [Mode(f"star delta K={k}", k) for k in keyframes]
    modes += [Mode(f"chained delta K={k}{tag}", k) for k in keyframes]
    modes += [Mode(f"predictive K={k}{tag}", k) for k in keyframes]
    prev: Step | None = None
    timer = {"encode": 0.0, "decode": 0.0, "bytes": 0.0}
    window: list[tuple[Step, dict[str, tuple[Coding, bytes]]]] = []
    key_step: Step | None = None
    n_steps = 0
    t_start = time.perf_counter()
    for index, step in enumerate(make()):
        step = aligned_packs(step) if packed else step
        n_steps += 1
        for m in modes:
            if m.name in ("none", "zstd", "shuffle-zstd"):
                code_simple(m, step)
            elif m.name.startswith("star"):
                code_star(m, step, index)
            else:
                predictive = m.name.startswith("predictive")
                timed = timer if predictive and m.keyframe_every == keyframes[0] and index % m.keyframe_every else None
                blobs = code_chain(m, step, prev, index, predictive, timed)
                if predictive and m.keyframe_every == keyframes[0]:
                    if index % m.keyframe_every == 0:
                        key_step, window = step, []
                    else:
                        window.append((step, blobs))
        prev = step
    first_params = sum(t.raw.size for t in prev.tensors.values() if t.kind == "param") if prev else 0
    out: dict[str, Any] = {
        "label": label + tag, "steps": n_steps, "params": first_params, "seconds": time.perf_counter() - t_start,
        "raw_bytes_per_step": sum(t.raw.nbytes for t in prev.tensors.values()) if prev else 0,
        "tensors": len(prev.tensors) if prev else 0,
        "largest_tensor_bytes": max(t.raw.nbytes for t in prev.tensors.values()) if prev else 0,
        "modes": {m.name: {"ratio": {k: v[0] / v[1] if v[1] else 0.0 for k, v in m.stored.items()},
                           "exact": {k: v[1] / v[0] for k, v in sorted(m.exact.items())}} for m in modes},
    }
    mb = timer["bytes"] / 1e6
    out["codec_mb_s_per_core"] = {"predictive encode (predict + residual + shuffle + zstd-1)": mb / timer["encode"],
                                  "predictive decode": mb / timer["decode"]}
    if key_step is not None and window:
        secs = replay(window, key_step)
        raw = sum(t.raw.nbytes for t in window[-1][0].tensors.values())
        out["replay"] = {"steps_after_keyframe": len(window), "seconds": secs,
                         "mb_s_of_the_target_step": raw / secs / 1e6}
    return out


def report(r: dict[str, Any]) -> str:
    lines = [f"{r['label']}: {r['params']:,} parameters in {r['tensors']} tensors (largest "
             f"{r['largest_tensor_bytes'] / 2**20:.2f} MiB), {r['raw_bytes_per_step'] / 1e6:.1f} MB per step raw, "
             f"{r['steps']} steps, {r['seconds']:.0f} s", "",
             "| mode | params | exp_avg | exp_avg_sq | other | **total** |", "|---|---|---|---|---|---|"]
    for m, v in r["modes"].items():
        q = v["ratio"]
        lines.append(f"| {m} | {q['param']:.3f} | {q['exp_avg']:.3f} | {q['exp_avg_sq']:.3f} | {q['other']:.3f} "
                     f"| **{q['total']:.3f}** |")
    lines += ["", "| mode | exactly predicted (role, predictor: fraction of elements) |", "|---|---|"]
    lines += [f"| {m} | " + ", ".join(f"{k} {f:.4f}" for k, f in v["exact"].items()) + " |"
              for m, v in r["modes"].items() if v["exact"] and m.startswith("predictive")]
    lines += ["", "| codec (one core) | MB/s of raw bytes |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in r["codec_mb_s_per_core"].items()]
    if "replay" in r:
        rp = r["replay"]
        lines.append(f"| decode of a step {rp['steps_after_keyframe']} steps after its keyframe (the whole chain) "
                     f"| {rp['mb_s_of_the_target_step']:.0f} ({rp['seconds'] * 1e3:.0f} ms) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--keyframes", default="8,16,32")
    ap.add_argument("--small", action="store_true", help="also the model of many small tensors")
    ap.add_argument("--small-d-model", type=int, default=96)
    ap.add_argument("--small-layers", type=int, default=4)
    ap.add_argument("--small-vocab", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    np.seterr(all="ignore")
    keyframes = [int(k) for k in args.keyframes.split(",")]
    results = {"machine": machine(), "runs": []}
    runs = [(f"transformer d={args.d_model} x{args.layers}, vocab {args.vocab}, AdamW lr {args.lr}",
             trajectory(args.vocab, args.d_model, args.layers, args.steps, args.lr))]
    if args.small:
        runs.append((f"many small tensors: d={args.small_d_model} x{args.small_layers}, vocab {args.small_vocab}",
                     trajectory(args.small_vocab, args.small_d_model, args.small_layers, args.steps, args.lr)))
    print(f"machine: {results['machine']}")
    for label, make in runs:
        for packed in (False, True):
            r = run_model(label, make, keyframes, packed)
            results["runs"].append(r)
            print()
            print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
