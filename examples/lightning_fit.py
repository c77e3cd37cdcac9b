"""A Lightning fit captured with dstt, then resumed from a dstt step.

    pip install 'dstt[lightning]'
    python examples/lightning_fit.py                                 # 12 optimizer steps into runs/pl
    python examples/lightning_fit.py --resume runs/pl:6 --branch again

dstt captures in on_train_batch_end, once per optimizer step (gradient
accumulation 2 here). The shuffled order is seeded per epoch (a sampler with
set_epoch, which Lightning calls), so it does not depend on the global RNG
at an epoch's start; resuming from any step, mid-epoch included, continues
the captured run (see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
import torch

from dstt.integrations.lightning import DsttCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class EpochShuffle(torch.utils.data.Sampler):
    def __init__(self, n: int, seed: int = 7) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="runs/pl")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resume")
    p.add_argument("--branch")
    a = p.parse_args()

    pl.seed_everything(0, verbose=False)
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=EpochShuffle(48))
    cb = DsttCallback(a.store, every=1, branch=a.branch)
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb])
    trainer.fit(Regressor(), loader, ckpt_path=cb.resume(a.resume) if a.resume else None)
    print(f"""
captured into {a.store}; what a user would run next:
  dstt ls {a.store}
  dstt history {a.store} extra/metrics/train_loss optim/param_groups/0/lr
  dstt show {a.store}:latest extra/lightning          # global step, epoch, batch, loop counters
  dstt diff {a.store}:1 :latest
  python examples/lightning_fit.py --store {a.store} --resume {a.store}:6 --branch again""")


if __name__ == "__main__":
    main()
