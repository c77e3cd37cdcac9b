"""Time the dstt callbacks add per optimizer step (issue 15).

    python benchmarks/bench_integrations.py [--steps 40] [--rounds 3] [--only hf|pl]

The same tiny model and trainer run with and without ``DsttCallback(every=1)``
(alternating, ``--rounds`` times each, in this process); a probe callback
records the time at every optimizer step's end, and the per-step time is the
median of the intervals after the first 5 steps (warm-up: the staging pool
is allocated at the first capture). The capture's drain at the end of
training (waiting for the last steps to be durable) is reported apart.
CPU; on a GPU machine the HF run uses it (``use_cpu=False``) when
``--gpu`` is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import machine  # noqa: E402

WARMUP = 5


def _median_interval(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1:])]
    return statistics.median(gaps)


def bench_hf(steps: int, store: str | None, gpu: bool) -> tuple[float, float, int]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from dstt.integrations.transformers import DsttCallback

    hf_logging.set_verbosity_error()

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter())

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 512, (4096, 64), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = tempfile.mkdtemp(prefix="bench-hf-")
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-4,
                             save_strategy="no", report_to=[], use_cpu=not gpu, disable_tqdm=True, logging_steps=10**9)
    probe = Probe()
    cbs: list[Any] = [probe]
    if store:
        cbs.insert(0, DsttCallback(store, every=1))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=cbs)
    t0 = time.perf_counter()
    trainer.train()
    drain = time.perf_counter() - probe.times[-1]
    del t0
    shutil.rmtree(out, ignore_errors=True)
    return _median_interval(probe.times), drain, nbytes


def bench_pl(steps: int, store: str | None) -> tuple[float, float, int]:
    import warnings

    import lightning.pytorch as pl

    from dstt.integrations.lightning import DsttCallback

    warnings.filterwarnings("ignore")

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter())

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                           torch.nn.GELU(), torch.nn.Linear(1024, 256))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    module = Net()
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    data = torch.utils.data.TensorDataset(torch.randn(64 * (steps + 1), 256))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    probe = Probe()
    cbs: list[Any] = [probe]
    if store:
        cbs.insert(0, DsttCallback(store, every=1))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
    trainer.fit(module, loader)
    drain = time.perf_counter() - probe.times[-1]
    return _median_interval(probe.times), drain, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=["hf", "pl"])
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    print(machine())
    base = a.dir or tempfile.mkdtemp(prefix="bench-integrations-")
    for kind in ("hf", "pl"):
        if a.only and kind != a.only:
            continue
        plain, dstt_, drains = [], [], []
        nbytes = 0
        for r in range(a.rounds):
            store = os.path.join(base, f"{kind}-{r}")
            shutil.rmtree(store, ignore_errors=True)
            run = (lambda s: bench_hf(a.steps, s, a.gpu)) if kind == "hf" else (lambda s: bench_pl(a.steps, s))
            t, _d, nbytes = run(None)
            plain.append(t)
            t, d, nbytes = run(store)
            dstt_.append(t)
            drains.append(d)
            shutil.rmtree(store, ignore_errors=True)
        tp, td = statistics.median(plain), statistics.median(dstt_)
        print(f"{kind}: params {nbytes / 2**20:.1f} MiB (state with Adam ~{3 * nbytes / 2**20:.1f} MiB); "
              f"per optimizer step: without {tp * 1e3:.1f} ms, with DsttCallback(every=1) {td * 1e3:.1f} ms "
              f"(+{(td - tp) * 1e3:.1f} ms, x{td / tp:.2f}); drain at the end {statistics.median(drains) * 1e3:.0f} ms; "
              f"rounds: without {[round(x * 1e3, 1) for x in plain]}, with {[round(x * 1e3, 1) for x in dstt_]}")


if __name__ == "__main__":
    main()
