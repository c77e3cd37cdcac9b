"""A set of training blow-ups on small real models, to score ``dstt find``
with no flags (issue 29): how many does it place at the right step, and how
many clean runs does it leave alone?

Each case trains a small real model (an MLP regressor, a small CNN
classifier, a character-level transformer on this repository's README) with
a plain loop, capturing every step (``dstt.Capture``, the default mode) or
through the flight recorder (``memory_steps=8, persist="newest"``: stored
steps with gaps), storing the loss (and, where a loop would, the grad norm)
in ``extra``. A case injects one of: an lr x100 spike, a NaN batch, a loss
spike (a batch of inputs x30), a bad batch (labels shuffled and inputs
noised), or nothing (controls: constant lr, warmup + cosine, step decay).

Right: a blow-up whose first detection (over every branch) is its step; a
control with no detection. ``find`` runs as a user would run it: ``dstt
find STORE --json``, with PYTHONPATH set to the code under test, so the
same stores score two versions::

    python benchmarks/blowups.py --build /tmp/blowups            # build the stores (once)
    PYTHONPATH=/work/main python benchmarks/blowups.py --score /tmp/blowups
    PYTHONPATH=$PWD python benchmarks/blowups.py --score /tmp/blowups
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

STEPS = 160


@dataclass
class Case:
    name: str
    model: str                   # mlp, cnn, charlm
    fault: str | None            # lr_spike, nan, loss_spike, bad_batch, or None (a control)
    at: int | None               # the step the fault hits
    schedule: str = "const"      # const, warmup_cosine, step_decay
    flight: bool = False         # the flight recorder (stored steps with gaps)
    grad_norm: bool = False      # also store the grad norm in extra
    opt: str = "adamw"


CASES = [
    Case("mlp-lr-x100", "mlp", "lr_spike", 120),
    Case("mlp-nan", "mlp", "nan", 90),
    Case("mlp-loss-spike", "mlp", "loss_spike", 100),
    Case("mlp-bad-batch", "mlp", "bad_batch", 110, opt="sgd"),
    Case("cnn-lr-x100", "cnn", "lr_spike", 70, schedule="warmup_cosine"),
    Case("cnn-nan", "cnn", "nan", 130, grad_norm=True),
    Case("cnn-bad-batch", "cnn", "bad_batch", 95, grad_norm=True),
    Case("charlm-lr-x100", "charlm", "lr_spike", 120),
    Case("charlm-loss-spike", "charlm", "loss_spike", 80, grad_norm=True),
    Case("charlm-nan", "charlm", "nan", 60, schedule="warmup_cosine"),
    Case("flight-mlp-lr-x100", "mlp", "lr_spike", 120, flight=True),
    Case("flight-charlm-loss-spike", "charlm", "loss_spike", 100, flight=True),
    Case("clean-mlp", "mlp", None, None),
    Case("clean-cnn-step-decay", "cnn", None, None, schedule="step_decay", grad_norm=True),
    Case("clean-charlm-warmup-cosine", "charlm", None, None, schedule="warmup_cosine"),
    Case("clean-flight-mlp", "mlp", None, None, flight=True),
]


# ----------------------------------------------------------------------------- models and data

def _models(kind: str, seed: int) -> tuple[Any, Callable[[int], tuple[Any, Any]], Callable[[Any, Any, Any], Any]]:
    """(model, batch(step) -> (x, y), loss(model, x, y))."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "mlp":
        w_true = torch.randn(16, 1, generator=g)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

        def batch(step: int) -> tuple[Any, Any]:
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed * 1000 + step))
            return x, x @ w_true + 0.1 * torch.randn(32, 1, generator=torch.Generator().manual_seed(step))

        return model, batch, lambda m, x, y: F.mse_loss(m(x), y)
    if kind == "cnn":
        protos = torch.randn(4, 1, 12, 12, generator=g)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                    torch.nn.Flatten(), torch.nn.Linear(8 * 36, 4))

        def batch(step: int) -> tuple[Any, Any]:
            gg = torch.Generator().manual_seed(seed * 1000 + step)
            y = torch.randint(0, 4, (32,), generator=gg)
            return protos[y] + 0.8 * torch.randn(32, 1, 12, 12, generator=gg), y

        return model, batch, lambda m, x, y: F.cross_entropy(m(x), y)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_bytes()[:20000]
    data = torch.tensor(list(text), dtype=torch.long)

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(256, 32)
            self.pos = torch.nn.Parameter(torch.zeros(32, 32))
            self.block = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(32, 256)

        def forward(self, x: Any) -> Any:
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.block(self.emb(x) + self.pos[: x.shape[1]], src_mask=mask, is_causal=True))

    def cbatch(step: int) -> tuple[Any, Any]:
        ix = torch.randint(0, len(data) - 33, (16,), generator=torch.Generator().manual_seed(seed * 1000 + step))
        x = torch.stack([data[i: i + 32] for i in ix.tolist()])
        return x, torch.stack([data[i + 1: i + 33] for i in ix.tolist()])

    return CharLM(), cbatch, lambda m, x, y: F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))


def _lr_at(case: Case, step: int, base: float) -> float:
    if case.schedule == "warmup_cosine":
        lr = base * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(step, STEPS) / STEPS))
    elif case.schedule == "step_decay":
        lr = base * (0.1 ** (step // 60))
    else:
        lr = base
    if case.fault == "lr_spike" and case.at is not None and step >= case.at:
        lr *= 100.0
    return lr


def train(case: Case, store: Path) -> None:
    """Train ``case``'s model for STEPS steps, capturing every step."""
    import torch

    import dstt

    model, batch, loss_fn = _models(case.model, seed=len(case.name))
    base = (1e-2 if case.model == "mlp" else 1e-3) if case.opt == "adamw" else 0.05
    opt = (torch.optim.AdamW(model.parameters(), lr=base) if case.opt == "adamw"
           else torch.optim.SGD(model.parameters(), lr=base, momentum=0.9))
    kw: dict[str, Any] = {"memory_steps": 8, "persist": "newest"} if case.flight else {}
    losses: list[float] = []
    with dstt.Capture(str(store), **kw) as cap:
        for step in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = _lr_at(case, step, base)
            x, y = batch(step)
            if case.at == step and case.fault in ("nan", "lr_spike"):
                cap.wait_staged()  # a change outside optimizer.step(): let the lazy copies finish (docs/capture.md)
                x = x.clone().float() if x.dtype.is_floating_point else x
                if x.dtype.is_floating_point:
                    x[0].view(-1)[0] = float("nan")
                else:  # token ids: poison the embedding's output instead
                    model.emb.weight.data[int(x[0, 0])] = float("nan")
            elif case.at == step and case.fault == "loss_spike":
                if case.model == "mlp":  # a batch of outliers
                    y = y + 20.0
                elif x.dtype.is_floating_point:
                    x = x * 30.0
                else:
                    y = torch.randint(0, 256, y.shape, generator=torch.Generator().manual_seed(step))
            elif case.at == step and case.fault == "bad_batch":
                y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(step))]
                x = x + 3.0 * torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
            opt.step()
            extra: dict[str, Any] = {"loss": loss.item(), "iter_num": step}
            if case.grad_norm:
                extra["grad_norm"] = gn
            cap.snapshot(step, model=model, optimizer=opt, extra=extra)
            if case.flight:  # the README's flight-recorder loop: an incident on a spike stores what led to it
                if not math.isfinite(extra["loss"]) or (len(losses) >= 4 and extra["loss"] > 1.5 * sorted(losses)[len(losses) // 2]):
                    cap.incident("loss spike")
                losses = (losses + [extra["loss"]])[-8:]


# ----------------------------------------------------------------------------- scoring

def first_detection(store: Path) -> int | None:
    """``dstt find STORE --json``'s first step (None: nothing found)."""
    code = "import sys; from dstt.cli.main import main; sys.argv = ['dstt'] + sys.argv[1:]; main()"
    out = subprocess.run([sys.executable, "-P", "-c", code, "find", str(store), "--json"], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"find failed on {store}: {out.stderr[-2000:]}")
    doc = json.loads(out.stdout)
    step = doc.get("first_step")
    return None if step is None else int(step)


def first_stored(store: Path, at: int) -> int | None:
    """The first stored step at or after ``at`` (the flight recorder may keep
    the fault's own step in memory only: then the next stored one is right)."""
    import dstt

    run = dstt.open(str(store))
    return min((s for b in run.branches() for s in run.steps(b) if s >= at), default=None)


def score(root: Path) -> dict[str, Any]:
    rows = []
    for case in CASES:
        got = first_detection(root / case.name)
        want = None if case.at is None else first_stored(root / case.name, case.at)
        right = got is None if case.fault is None else got == want
        rows.append({"case": case.name, "fault": case.fault, "at": case.at, "want": want, "found": got, "right": right})
        print(f"{case.name:28s} fault={str(case.fault):10s} at={str(case.at):5s} want={str(want):5s} found={str(got):5s} "
              f"{'RIGHT' if right else 'wrong'}", flush=True)
    blow = [r for r in rows if r["fault"] is not None]
    clean = [r for r in rows if r["fault"] is None]
    summary = {"blowups_right": sum(r["right"] for r in blow), "blowups": len(blow),
               "clean_right": sum(r["right"] for r in clean), "clean": len(clean), "rows": rows}
    print(f"blow-ups placed at the right step: {summary['blowups_right']}/{len(blow)}; "
          f"clean runs left alone: {summary['clean_right']}/{len(clean)}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, help="Build the stores under this directory.")
    ap.add_argument("--score", type=Path, help="Score `dstt find` on the stores under this directory.")
    ap.add_argument("--only", default="", help="Only cases whose name contains this.")
    ap.add_argument("--json", type=Path, help="Write the score here.")
    a = ap.parse_args()
    if a.only:
        CASES[:] = [c for c in CASES if a.only in c.name]
    if a.build:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for case in CASES:
            store = a.build / case.name
            if not store.exists():
                train(case, store)
                print(f"built {store}", flush=True)
    if a.score:
        summary = score(a.score)
        if a.json:
            a.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
