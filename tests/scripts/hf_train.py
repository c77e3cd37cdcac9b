"""A tiny GPT-2 trained by transformers.Trainer with dstt.integrations.transformers.

    python tests/scripts/hf_train.py STORE --steps N [--hold-at K] [--resume REF] [--out FINAL.pt] [--next ...]

Everything is built in code (config, data): nothing is downloaded. Dropout
is on, so the RNG matters; gradient accumulation is 2, so one optimizer step
is two batches; 3 optimizer steps per epoch, so a run of 7 steps crosses two
epoch boundaries. ``--hold-at K`` prints ``committed K`` once step K is
durable and then sleeps (the test SIGKILLs it there, mid-training).
``--next`` starts the arguments of another run, trained after this one in
the same process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from dstt.integrations.transformers import DsttCallback

hf_logging.set_verbosity_error()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, length: int = 8, vocab: int = 32) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Hold(TrainerCallback):
    """After step K: wait until dstt committed it, say so, then sleep (to be killed)."""

    def __init__(self, cb: DsttCallback, k: int) -> None:
        self.cb, self.k = cb, k

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.k:
            assert self.cb.capture is not None
            self.cb.capture.wait()
            print(f"committed {self.k}", flush=True)
            time.sleep(120)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--hold-at", type=int)
    p.add_argument("--resume")
    p.add_argument("--branch")
    p.add_argument("--drop-rng", action="store_true", help="control: resume without the captured RNG states")
    p.add_argument("--out")
    a = p.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(a.store + "-hf"), max_steps=a.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    cb = DsttCallback(a.store, every=1, branch=a.branch)
    callbacks: list = [cb]
    if a.hold_at is not None:
        callbacks.append(Hold(cb, a.hold_at))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    ckpt = cb.resume(a.resume) if a.resume else None
    if ckpt and a.drop_rng:
        os.remove(os.path.join(ckpt, "rng_state.pth"))
    trainer.train(resume_from_checkpoint=ckpt)
    if a.out:
        opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                    "sched": trainer.lr_scheduler.state_dict()}, a.out)


if __name__ == "__main__":
    from nextruns import runs  # (beside this script: sys.path[0])

    for one in runs(sys.argv[1:]):
        main(one)
