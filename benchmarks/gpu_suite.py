"""One prepared GPU check (issue 25): everything dstt wants measured on a GPU,
in one command of at most ~8 minutes on one H100, one JSON + Markdown summary.

    python benchmarks/gpu_suite.py [--out DIR] [--budget-s 470] [--size-gb 1.0]

A GPU is lent only now and then, for minutes: whoever has one runs this
first and records the figures (docs/benchmarks.md, with the machine).
Sections, each a subprocess with its own time limit (a hang or crash in
one is reported, the others still run):

1. ``tests``: the CUDA tests (``tests/system/test_cuda.py``, marker ``cuda``);
2. ``stalls``: ``bench_capture_gpu.py`` -- the first-snapshot and steady
   stalls vs one raw pinned copy, capture every iteration vs ``dcp.async_save``;
3. ``flight``: the GPU flight-recorder loop -- a CUDA model + Adam, a
   stand-in forward/backward of ~``--compute-ms``, captured with
   ``memory_steps=8, persist="newest"``: time added per iteration vs no
   capture, the first snapshot's stall vs one raw pinned copy (goal <= 2x),
   steps persisted;
4. ``firstprof``: where the first and a later ``snapshot()`` of a fresh
   process's first Capture go (cProfile, wall clock: ``firstprof.log``);
5. ``later``: ``bench_stall.py --device cuda``: the later stall of 400 and
   2,000-tensor AdamW states with ``rng`` on and off;
6. ``predictor``: the optimizer-aware predictor's exactness under CUDA
   AdamW, ``foreach`` and ``fused`` (skipped where
   ``dstt.format.codecs.predictors`` is missing): per role, the share of
   elements predicted bit-exactly, and every coded chunk decoded bit-exact.

The summary goes to ``--out`` (default ``$OUT``, else ``./gpu-suite-out``):
``gpu_suite.json`` and ``gpu_suite.md``. Without a GPU it says so and
exits 0 (``--help`` and ``--check`` work anywhere); ``--section predictor
--device cpu`` runs that section on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Seconds per section (scaled down to fit --budget-s).
LIMITS = {"tests": 160, "stalls": 170, "flight": 140, "firstprof": 60, "later": 80, "predictor": 90}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-suite-out", help="where the summary goes")
    ap.add_argument("--budget-s", type=float, default=470, help="the whole suite's time limit")
    ap.add_argument("--size-gb", type=float, default=1.0, help="state size of the stalls and flight loops")
    ap.add_argument("--iters", type=int, default=24, help="iterations of the flight-recorder loop")
    ap.add_argument("--compute-ms", type=float, default=40, help="stand-in forward/backward per iteration")
    ap.add_argument("--dir", default="/tmp/dstt-gpu-suite", help="scratch directory for the stores")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--section", default="", help=argparse.SUPPRESS)  # (a section's own process)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help="parse arguments and exit")
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- sections (own processes)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(cmd: list[str], limit: float) -> tuple[int | None, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=limit)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out + f"\n(timed out after {limit:.0f} s)", time.perf_counter() - t0


def section_tests(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    code, out, took = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda or not cuda",
                            "tests/system/test_cuda.py"], limit)
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}
    _keep_log(args, "tests", out)
    return {"exit": code, "seconds": round(took, 1), "counts": counts, "summary": tail, "log_tail": out[-3000:]}


def _keep_log(args: argparse.Namespace, name: str, out: str) -> None:
    """The section's whole output beside the summary (``<name>.log``)."""
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{name}.log").write_text(out)
    except OSError as e:
        print(f"gpu_suite: could not keep {name}.log: {e}", flush=True)


def section_stalls(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    code, out, took = _run([sys.executable, str(HERE / "bench_capture_gpu.py"), "--size-gb", str(args.size_gb),
                            "--iters", "6", "--dir", os.path.join(args.dir, "stalls")], limit)
    _keep_log(args, "stalls", out)
    figures: dict[str, float] = {}
    for key, pat in {"raw_copy_s": r"raw pinned copy_.*?([\d.]+) s", "first_stall_s": r"dstt first stall\s+([\d.]+) s",
                     "later_stall_s": r"dstt later stall \(median\)\s+([\d.]+) s",
                     "every_stall_s": r"dstt stall \(median\)\s+([\d.]+) s",
                     "dcp_async_stall_s": r"dcp.async_save stall \(median\)\s+([\d.]+) s",
                     "device_copy_s": r"GPU-side copy of the state.*?([\d.]+) s",
                     "first_stall_off_s": r"dstt first stall \[off\]\s+([\d.]+) s",
                     "later_stall_off_s": r"dstt later stall \(median\) \[off\]\s+([\d.]+) s",
                     "first_stall_auto2_s": r"(?s)\[off\].*dstt first stall \[auto\]\s+([\d.]+) s",
                     "later_stall_auto2_s": r"(?s)\[off\].*dstt later stall \(median\) \[auto\]\s+([\d.]+) s"}.items():
        m = re.search(pat, out)
        if m:
            figures[key] = float(m.group(1))
    raw = figures.get("raw_copy_s")
    for key in [k for k in figures if k.endswith("stall_s") or k.endswith("_stall_off_s") or k == "device_copy_s"]:
        if raw:
            figures[key.removesuffix("_s") + "_vs_raw"] = round(figures[key] / raw, 3)
    return {"exit": code, "seconds": round(took, 1), "figures": figures, "log_tail": out[-3000:]}


def section_firstprof(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    """Where the first and a later snapshot() of a process's first Capture
    go (cProfile, wall clock; its own process, so nothing is warm)."""
    code, out, took = _run([sys.executable, str(HERE / "bench_capture_gpu.py"), "--size-gb", str(args.size_gb),
                            "--iters", "5", "--profile-first", "--dir", os.path.join(args.dir, "firstprof")], limit)
    _keep_log(args, "firstprof", out)
    m = re.search(r"stalls of that run.*", out)
    return {"exit": code, "seconds": round(took, 1), "stalls": m.group(0) if m else None, "log": "firstprof.log"}


def section_later(args: argparse.Namespace, limit: float) -> dict[str, Any]:
    """The later stall of a many-tensor AdamW state on the GPU, rng on and
    off (``bench_stall.py --device cuda``)."""
    code, out, took = _run([sys.executable, str(HERE / "bench_stall.py"), "--device", "cuda", "--tensors", "400,2000",
                            "--iters", "20", "--dir", os.path.join(args.dir, "later")], limit)
    _keep_log(args, "later", out)
    rows = [line.strip() for line in out.splitlines() if re.match(r"\s+(rng=|\d+ tensors)|\d+ tensors", line)]
    return {"exit": code, "seconds": round(took, 1), "rows": rows, "log": "later.log"}


def _own(args: argparse.Namespace, name: str, limit: float) -> dict[str, Any]:
    """Run section ``name`` in a process of its own; its JSON (last line)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--size-gb", str(args.size_gb),
           "--iters", str(args.iters), "--compute-ms", str(args.compute_ms), "--dir", args.dir,
           "--device", args.device]
    code, out, took = _run(cmd, limit)
    doc: dict[str, Any] = {"exit": code, "seconds": round(took, 1)}
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                doc.update(json.loads(line))
            except ValueError:
                pass
            break
    if code != 0:
        doc["log_tail"] = out[-3000:]
    return doc


def flight(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU flight-recorder loop (run in its own process)."""
    import torch

    sys.path.insert(0, str(HERE))
    from common import fresh_dir, raw_copy_s

    import dstt

    dev = torch.device(args.device)
    torch.manual_seed(0)
    n_params = 50
    rows = max(1, int(args.size_gb * 2**30) // 3 // n_params // 4 // 1024)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, 1024, device=dev)) for _ in range(n_params)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    state = dstt.state_of(model=model, optimizer=opt, rng=False)
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    work = torch.randn(2048, 2048, device=dev)

    def compute() -> None:
        end = time.perf_counter() + args.compute_ms / 1000
        x = work
        while time.perf_counter() < end:
            x = torch.tanh(x @ work)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def loop(cap: Any) -> tuple[list[float], float | None]:
        """Iteration times; the first snapshot's stall: snapshot() + the next
        optimizer step's wait for its copies (the step's pre-hook)."""
        times, first, waits = [], None, []
        if cap is not None:
            fence = cap.stager._fence
            wait = fence._wait

            def timed() -> None:
                t = time.perf_counter()
                try:
                    wait()
                finally:
                    waits.append(time.perf_counter() - t)
            fence._wait = timed
        for i in range(args.iters):
            t0 = time.perf_counter()
            compute()
            waits.clear()
            opt.step()
            if i == 1 and first is not None:
                first += sum(waits)
            if cap is not None:
                t = time.perf_counter()
                cap.snapshot(i, model=model, optimizer=opt, rng=False)
                if i == 0:
                    first = time.perf_counter() - t
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times, first

    raw_s = raw_copy_s(tensors)
    base, _ = loop(None)
    path = fresh_dir(os.path.join(args.dir, "flight"))
    cap = dstt.Capture(path, memory_steps=8, persist="newest")
    times, first = loop(cap)
    staged = cap.stager.device_staging.steps
    t = time.perf_counter()
    cap.close()
    close_s = time.perf_counter() - t
    persisted = len(dstt.open(path).steps())
    fresh_dir(args.dir)
    # The same with device staging off (the usual path), in the same run.
    os.environ["DSTT_DEVICE_STAGING"] = "off"
    cap_off = dstt.Capture(fresh_dir(os.path.join(args.dir, "flight-off")), memory_steps=8, persist="newest")
    times_off, first_off = loop(cap_off)
    cap_off.close()
    os.environ.pop("DSTT_DEVICE_STAGING", None)
    fresh_dir(args.dir)

    def med(xs: list[float]) -> float:
        xs = sorted(xs[2:])  # (the first iterations warm up)
        return xs[len(xs) // 2]

    b, c = med(base), med(times)
    return {"state_gib": round(nbytes / 2**30, 3), "iters": args.iters, "iteration_no_capture_s": round(b, 5),
            "iteration_memory_tier_s": round(c, 5), "added_pct": round(100 * (c - b) / b, 2),
            "first_snapshot_stall_s": round(first or 0.0, 5), "raw_pinned_copy_s": round(raw_s, 5),
            "first_vs_raw": round((first or 0.0) / raw_s, 3), "close_s": round(close_s, 3),
            "steps_persisted": persisted, "where_the_tier_runs": getattr(cap, "tier_where", "trainer"),
            "steps_staged_on_the_gpu": staged,
            "staging_off": {"iteration_memory_tier_s": round(med(times_off), 5),
                            "added_pct": round(100 * (med(times_off) - b) / b, 2),
                            "first_snapshot_stall_s": round(first_off or 0.0, 5),
                            "first_vs_raw": round((first_off or 0.0) / raw_s, 3)}}


def predictor(args: argparse.Namespace) -> dict[str, Any]:
    """Exactness of the AdamW predictor on this device (own process)."""
    try:
        from dstt.format.codecs import predictive
        from dstt.format.codecs.optimspec import AdamHyper, adam_codings
    except ImportError as e:
        return {"skipped": f"dstt.format.codecs.predictors not importable: {e}"}
    import numpy as np
    import torch

    dev = torch.device(args.device)
    out: dict[str, Any] = {}
    variants = ["foreach", "fused"] if dev.type == "cuda" else ["single", "foreach"]
    for variant in variants:
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.randn(1 << 20, device=dev))
        kw = {"fused": True} if variant == "fused" else {"foreach": variant == "foreach"}
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
        snaps = []
        for _ in range(4):
            p.grad = torch.randn_like(p)
            opt.step()
            st = opt.state[p]
            snaps.append({"param": p.detach().cpu().clone(), "exp_avg": st["exp_avg"].cpu().clone(),
                          "exp_avg_sq": st["exp_avg_sq"].cpu().clone(), "step": float(st["step"])})
        h = AdamHyper.from_group(opt.param_groups[0], decoupled=True, device=dev.type)
        roles: dict[str, Any] = {}
        for prev, cur in zip(snaps, snaps[1:]):
            codings = adam_codings(h, cur["step"], prev["step"], param_dtype="float32", state_dtype="float32")
            for role, coding in codings.items():
                if coding is None or coding.predictor != "adam":
                    continue
                inputs = {(need.when, need.role): (prev if need.when == "prev" else cur)[need.role].numpy()
                          for need in predictive.plan(coding)}
                actual = cur[role].numpy()
                enc = predictive.encode(coding, actual, inputs)
                back = predictive.decode(coding, enc.blob, enc.n, inputs)
                r = roles.setdefault(role, {"exact": 0, "n": 0, "roundtrip_bit_exact": True})
                r["exact"] += enc.exact
                r["n"] += enc.n
                r["roundtrip_bit_exact"] &= bool(np.array_equal(back, actual.view(np.uint32)))
                r["coded_bytes"] = r.get("coded_bytes", 0) + len(enc.blob)
        for r in roles.values():
            r["exact_share"] = round(r["exact"] / max(r["n"], 1), 5)
            r["coded_over_raw"] = round(r.pop("coded_bytes") / max(4 * r["n"], 1), 4)
        out[variant] = {"variant": h.variant, "roles": roles, "capture": _capture_ratio(args, variant)}
    return out


def _capture_ratio(args: argparse.Namespace, variant: str, steps: int = 16) -> dict[str, Any]:
    """Capture's defaults on this device's AdamW ``variant``: stored/raw over
    ``steps`` steps (every file of the store counted) and the last step read
    back bit-exact."""
    import torch

    sys.path.insert(0, str(HERE))
    from common import fresh_dir

    import dstt

    dev = torch.device(args.device)
    torch.manual_seed(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
    kw: dict[str, Any] = {"fused": True} if variant == "fused" else {"foreach": variant == "foreach"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **kw)
    path = fresh_dir(os.path.join(args.dir, f"ratio-{variant}"))
    raw = 0
    with dstt.Capture(path) as cap:
        for step in range(steps):
            opt.zero_grad()
            model(torch.randn(64, 1024, device=dev)).square().mean().backward()
            opt.step()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            cap.wait()  # (the helper keeps up: every step coded, none stored fast)
            state = dstt.state_of(model=model, optimizer=opt, rng=False)
            raw += sum(t.numel() * t.element_size() for t in _leaves(state) if isinstance(t, torch.Tensor))
    last = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    got = dstt.open(path).state_dict(steps - 1)["model"]
    exact = all(torch.equal(got[k].view(torch.uint8), last[k].view(torch.uint8)) for k in last)
    stored = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    fresh_dir(path)
    return {"steps": steps, "stored_over_raw": round(stored / raw, 4), "last_step_bit_exact": exact}


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return [v for k in x for v in _leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [v for k in x for v in _leaves(k)]
    return [x]


# ----------------------------------------------------------------------------- the suite


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# GPU suite ({doc['machine']})", "", f"{doc['started']} UTC, {doc['seconds']:.0f} s in all", ""]
    for name, sec in doc["sections"].items():
        lines.append(f"## {name} ({sec.get('seconds', 0):.0f} s, exit {sec.get('exit')})")
        lines.append("")
        for k, v in sec.items():
            if k in ("log_tail", "seconds", "exit"):
                continue
            lines.append(f"- {k}: `{json.dumps(v)}`")
        if sec.get("log_tail") and sec.get("exit") not in (0,):
            lines += ["", "```", sec["log_tail"][-1500:], "```"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.check:
        return 0
    if args.section:
        fn = {"flight": flight, "predictor": predictor}[args.section]
        print(json.dumps(fn(args)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU on this machine; nothing measured")
        return 0
    sys.path.insert(0, str(HERE))
    from common import machine

    t0 = time.perf_counter()
    only = [s for s in args.only.split(",") if s] or list(LIMITS)
    scale = min(1.0, args.budget_s / sum(LIMITS[s] for s in only))
    doc: dict[str, Any] = {"machine": f"{machine()}, GPU {torch.cuda.get_device_name()}",
                           "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "sections": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runners = {"tests": section_tests, "stalls": section_stalls, "firstprof": section_firstprof,
               "later": section_later,
               "flight": lambda a, lim: _own(a, "flight", lim), "predictor": lambda a, lim: _own(a, "predictor", lim)}
    for name in only:
        left = args.budget_s - (time.perf_counter() - t0)
        limit = min(LIMITS[name] * scale, left - 5)
        if limit < 20:
            doc["sections"][name] = {"skipped": f"out of time ({left:.0f} s left)"}
            continue
        print(f"gpu_suite: {name} (limit {limit:.0f} s)", flush=True)
        doc["sections"][name] = runners[name](args, limit)
        doc["seconds"] = time.perf_counter() - t0
        (out / "gpu_suite.json").write_text(json.dumps(doc, indent=1))  # (after each: a cut run keeps what it has)
    doc["seconds"] = time.perf_counter() - t0
    (out / "gpu_suite.json").write_text(json.dumps(doc, indent=1))
    (out / "gpu_suite.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
