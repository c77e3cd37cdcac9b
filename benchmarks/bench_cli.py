"""Issues 11 and 29: wall time of whole CLI processes (interpreter start included).

    python benchmarks/bench_cli.py [--repeat 5] [--out benchmarks/out/cli] [--label after]
    PYTHONPATH=/tmp/before python benchmarks/bench_cli.py --label before   # another checkout

Three stores are built once and cached under ``--out``: the demo store
(``dstt demo``: 20 steps of a small MLP with Adam, a scheduler, RNG and
extra values) and, with ``dstt.save`` (small float32 tensors that change
every step), 1,000 steps x 300 tensors and 200 steps x 100 tensors. Every
command is measured on each: the read-only ones (ls, show of a tensor and of
a value, diff, history, find, verify) and those that write (export to
safetensors and .pt, branch, gc) -- issue 29 asks each to answer in <= 0.5 s
on the demo store. Before/after: run once with ``PYTHONPATH`` at main's
checkout (``--label before``), once at the branch's (``--label after``). Each command runs as a fresh ``python`` process that
imports ``dstt.cli.main`` from wherever ``dstt`` resolves (so ``PYTHONPATH``
pointing at another checkout measures that checkout on the same stores);
the figures are the best of ``--repeat`` runs, of wall time and of the
child's CPU time (user + system; nearly immune to other load on a shared
machine). ``python -c pass`` and
``python -c "import torch"`` are measured beside them as floors.
Results go to stdout as JSON lines and to ``--out/<label>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

_CLI = "import sys; from dstt.cli.main import main; sys.argv[0] = 'dstt'; main()"


def build(path: str, steps: int, tensors: int) -> float:
    """A store of ``steps`` x ``tensors`` (64 float32 each), via dstt.save."""
    import torch

    import dstt

    t = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i:03d}.weight": torch.randn(64, generator=g) for i in range(tensors)}
    for s in range(steps):
        for v in model.values():
            v.mul_(0.999).add_(0.001)
        dstt.save(path, s, {"model": model, "extra": {"loss": 1.0 / (s + 1)}})
    return time.perf_counter() - t


def ensure_store(out: str, steps: int, tensors: int) -> str:
    path = os.path.join(out, f"store-{steps}x{tensors}")
    done = path + ".done"
    if not os.path.exists(done):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        secs = build(path, steps, tensors)
        with open(done, "w") as f:
            f.write(f"{secs:.1f}\n")
        print(json.dumps({"built": path, "seconds": round(secs, 1)}), file=sys.stderr)
    return path


def ensure_demo(out: str) -> str:
    """The demo store (``dstt demo``), built once."""
    path = os.path.join(out, "demo")
    if not os.path.exists(path + ".done"):
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        subprocess.run([sys.executable, "-c", _CLI, "demo", path, "--steps", "20"], check=True,
                       stdout=subprocess.DEVNULL, cwd=out)
        with open(path + ".done", "w") as f:
            f.write("demo\n")
    return path


def commands(store: str, scratch: str, label: str, first: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of every command on ``store``; what writes goes under
    ``scratch`` (exports; branches get names unique to the run)."""
    tensor = "model/0.weight" if store.endswith("demo") else "model/layer000.weight"
    value = "optim/param_groups/0/lr" if store.endswith("demo") else "extra/loss"
    return [
        ("ls STORE", ["ls", store]), ("ls STORE --limit 0", ["ls", store, "--limit", "0"]),
        ("ls STORE:latest", ["ls", f"{store}:latest"]),
        ("show TENSOR", ["show", f"{store}:latest", tensor]), ("show VALUE", ["show", f"{store}:latest", value]),
        ("diff first latest", ["diff", f"{store}:{first}", ":latest", "--no-progress"]),
        ("history STORE NAME", ["history", store, tensor]),
        ("history STORE 'model/*'", ["history", store, "model/*"]),
        ("history STORE VALUE", ["history", store, value]), ("find STORE", ["find", store]),
        ("verify STORE:latest", ["verify", f"{store}:latest", "-q"]),
        ("export .safetensors", ["export", f"{store}:latest", "--out", os.path.join(scratch, "x.safetensors"),
                                 "-q", "--overwrite"]),
        ("export .pt", ["export", f"{store}:latest", "--out", os.path.join(scratch, "x.pt"), "-q", "--overwrite"]),
        ("export refused (exists)", ["export", f"{store}:latest", "--out", os.path.join(scratch, "exists.pt")]),
        ("branch", ["branch", store, "{branch}", "--from", f":{first}"]),
        ("gc -n", ["gc", store, "-n"]),
    ]


def wall(argv: list[str], repeat: int, cwd: str, ok_codes: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds: user + system of the child) over
    ``repeat`` runs. CPU time barely moves with other load on the machine;
    wall time is what a user waits."""
    best, best_cpu = float("inf"), float("inf")
    for i in range(repeat):
        run_argv = [a.replace("{branch}", f"bench-{os.getpid()}-{time.monotonic_ns()}-{i}") for a in argv]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        # cwd: not the checkout (``python -c`` puts the cwd first on sys.path,
        # which would shadow a PYTHONPATH pointing at another checkout)
        p = subprocess.run(run_argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd)
        elapsed = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode not in ok_codes:
            raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        best = min(best, elapsed)
        best_cpu = min(best_cpu, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    return best, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "cli"))
    ap.add_argument("--label", default="after")
    ap.add_argument("--stores", default="demo,1000x300,200x100",
                    help="Stores to measure: 'demo' and STEPSxTENSORS sizes (e.g. 'demo,20x10' to try the script).")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stores = {}
    for label in args.stores.split(","):
        if label == "demo":
            stores[label] = os.path.abspath(ensure_demo(args.out))
        else:
            steps, tensors = (int(x) for x in label.split("x"))
            stores[label] = os.path.abspath(ensure_store(args.out, steps, tensors))
    scratch = os.path.join(os.path.abspath(args.out), "scratch")
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, "exists.pt"), "wb") as f:
        f.write(b"not overwritten")
    py = [sys.executable]
    out = os.path.abspath(args.out)
    where = subprocess.run([*py, "-c", "import dstt.cli.main as m; print(m.__file__)"], cwd=out,
                           capture_output=True, text=True, check=True).stdout.strip()

    results: dict[str, tuple[float, float]] = {
        "python -c pass": wall([*py, "-c", "pass"], args.repeat, out),
        "python -c 'import torch'": wall([*py, "-c", "import torch"], args.repeat, out),
        "dstt --help": wall([*py, "-c", _CLI, "--help"], args.repeat, out),
    }
    for label, store in stores.items():
        for name, cmd in commands(store, scratch, args.label, "0"):
            codes = (1, 2) if name.startswith("export refused") else (0,)
            results[f"{name} [{label}]"] = wall([*py, "-c", _CLI, *cmd], args.repeat, out, codes)
    doc = {"label": args.label, "dstt_cli": where, "repeat": args.repeat,
           "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
           "wall_s": {k: round(v[0], 3) for k, v in results.items()},
           "cpu_s": {k: round(v[1], 3) for k, v in results.items()}}
    with open(os.path.join(args.out, f"{args.label}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for k, v in results.items():
        print(json.dumps({"label": args.label, "command": k, "wall_s": round(v[0], 3), "cpu_s": round(v[1], 3)}))


if __name__ == "__main__":
    main()
