"""A plain PyTorch loop captured every step with dstt.Capture, and resumed.

    python examples/plain_loop.py                       # trains 40 steps into runs/plain
    python examples/plain_loop.py --resume runs/plain:20 --branch retry   # continues from step 20

A tiny transformer-ish model (embedding, attention, MLP) learns to predict
the next token of made-up sequences; Adam, a cosine schedule, dropout. The
data position (epoch, batch index) goes into ``extra`` so a resumed run
continues exactly where the captured step left off.
"""

from __future__ import annotations

import argparse
import math

import torch

import dstt

VOCAB, LENGTH, BATCH, BATCHES_PER_EPOCH = 64, 16, 8, 10


class TinyLM(torch.nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.attn = torch.nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return self.head(x + self.mlp(x))


def batches(epoch: int) -> torch.Tensor:
    """The epoch's batches, shuffled by (seed, epoch): reproducible from the data position alone."""
    g = torch.Generator().manual_seed(1000 + epoch)
    return torch.randint(0, VOCAB, (BATCHES_PER_EPOCH, BATCH, LENGTH), generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="runs/plain")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--resume", help="a reference STORE[@BRANCH]:STEP to continue from")
    p.add_argument("--branch", help="branch to capture on when resuming from an earlier step")
    a = p.parse_args()

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    start, parent, branch = 0, None, a.branch or "main"
    if a.resume:
        extra = dstt.restore(a.resume, model=model, optimizer=opt, scheduler=sched)  # + RNG states
        start = extra["step"] + 1
        if a.branch:  # an earlier step: continue on a new branch forked there
            parent = tuple(dstt.open(a.resume).resolve())
        print(f"resumed from {a.resume}: step {extra['step']}, epoch {extra['epoch']}, batch {extra['batch']}")

    with dstt.Capture(a.store, every=1, branch=branch, parent=parent) as cap:
        for step in range(start, a.steps):
            epoch, batch = divmod(step, BATCHES_PER_EPOCH)
            tokens = batches(epoch)[batch]
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            # right after the optimizer step: the copy overlaps the next forward/backward
            cap.snapshot(step, model=model, optimizer=opt, scheduler=sched,
                         extra={"step": step, "epoch": epoch, "batch": batch, "loss": loss.item()})
    print(f"captured steps {start}..{a.steps - 1} of {a.store}@{branch}")
    print(NEXT.format(store=a.store, last=a.steps - 1))


NEXT = """
what a user would run next:
  dstt ls {store}                                        # branches and steps
  dstt ls {store}:latest                                 # tensors of the last step, with stats
  dstt history {store} extra/loss optim/param_groups/0/lr   # the loss and the learning rate over the steps
  dstt history {store} 'model/*' --stat norm             # weight norms over the steps
  dstt diff {store}:0 :latest --top 10                   # what changed the most
  dstt find {store}                                      # the first NaN/Inf or norm jump, on every branch
  dstt show {store}:latest optim/param_groups/0          # the hyperparameters at a step
  python examples/plain_loop.py --store {store} --resume {store}:20 --branch retry   # travel back and go on
"""

if __name__ == "__main__":
    main()
