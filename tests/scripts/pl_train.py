"""A tiny model trained by lightning.pytorch.Trainer with dstt.integrations.lightning.

    python tests/scripts/pl_train.py STORE --steps N [--hold-at K] [--resume REF] [--manual] [--out FINAL.pt] [--next ...]

Dropout is on (the RNG matters), gradient accumulation is 2 (automatic
optimization), 3 optimizer steps per epoch, a StepLR stepped every
optimizer step. The shuffled order is seeded per epoch (the sampler has
``set_epoch``, which Lightning calls), never drawn from the global RNG.
``--hold-at K`` prints ``committed K`` once step K is durable and then sleeps.
``--next`` starts the arguments of another run, trained after this one in
the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import lightning.pytorch as pl

from dstt.integrations.lightning import DsttCallback

warnings.filterwarnings("ignore")
BATCHES_PER_EPOCH = 6


class EpochShuffle(torch.utils.data.Sampler):
    def __init__(self, n: int, seed: int = 7) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


class Net(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))
        self.automatic_optimization = not manual

    def loss(self, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return None

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--hold-at", type=int)
    p.add_argument("--resume")
    p.add_argument("--manual", action="store_true")
    p.add_argument("--out")
    a = p.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(24, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=24 // BATCHES_PER_EPOCH, sampler=EpochShuffle(24))
    model = Net(manual=a.manual)
    cb = DsttCallback(a.store, every=1)
    callbacks: list = [cb]
    if a.hold_at is not None:
        callbacks.append(_HoldAt(cb, a.hold_at))
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                         accumulate_grad_batches=1 if a.manual else 2, callbacks=callbacks)
    trainer.fit(model, loader, ckpt_path=cb.resume(a.resume) if a.resume else None)
    if a.out:
        opt = trainer.optimizers[0]
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                    "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict()}, a.out)


class _HoldAt(pl.Callback):
    """After step K (captured by the dstt callback, which runs first): wait
    until it is durable, say so, then sleep (to be killed)."""

    def __init__(self, cb: DsttCallback, k: int) -> None:
        self.cb, self.k = cb, k

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if trainer.global_step == self.k:
            assert self.cb.capture is not None
            self.cb.capture.wait()
            print(f"committed {self.k}", flush=True)
            time.sleep(120)


if __name__ == "__main__":
    from nextruns import runs  # (beside this script: sys.path[0])

    for one in runs(sys.argv[1:]):
        main(one)
