"""Recipe: a loop that draws the next batch before optimizer.step() (nanoGPT does).

nanoGPT fetches batch k+1 while batch k's forward/backward are in flight::

    X, Y = get_batch("train")                 # batch 0
    for it in range(max_iters):
        loss = model(X, Y)
        X, Y = get_batch("train")             # batch it+1, drawn from the global RNG...
        loss.backward(); optimizer.step()     # ...before step it's update
        cap.snapshot(it, ...)                 # the captured RNG is already past batch it+1

The RNG state captured at step ``it`` has already produced batch ``it+1``.
Restoring it and drawing "the next batch" would draw batch ``it+2``: the
resumed run silently skips a batch and is no longer the same run. The fix:
store what the loop already holds -- the drawn batch, or the data position
that reproduces it (here the sampled offsets ``ix``) -- in ``extra``, and on
resume use it instead of drawing::

    cap.snapshot(it, model=model, optimizer=opt, extra={"next_ix": ix})
    ...
    extra = dstt.restore(ref, model=model, optimizer=opt)   # RNG: already past batch it+1
    X, Y = batch_at(extra["next_ix"])                       # batch it+1, not a new draw

    python examples/next_batch_first.py   # shows both, in seconds

``--check`` trains 12 iterations uninterrupted, then 6 + resume with the
recipe (equal bit for bit), then 6 + resume the naive way (differs).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import dstt

DATA = torch.randint(0, 50, (4096,), generator=torch.Generator().manual_seed(0))
BLOCK, BATCH = 8, 4


def get_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: random offsets from the global RNG."""
    ix = torch.randint(len(DATA) - BLOCK - 1, (BATCH,))
    return (*batch_at(ix), ix)


def batch_at(ix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.stack([DATA[i:i + BLOCK] for i in ix.tolist()])
    y = torch.stack([DATA[i + 1:i + 1 + BLOCK] for i in ix.tolist()])
    return x, y


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 50))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(store: str, iters: int, resume: str | None = None, recipe: bool = True, branch: str = "main") -> dict:
    model, opt = build()
    start, parent = 0, None
    if resume is None:
        X, Y, ix = get_batch()
    else:
        extra = dstt.restore(resume, model=model, optimizer=opt)
        start, parent = extra["it"] + 1, tuple(dstt.open(resume).resolve())
        if recipe:
            ix = extra["next_ix"]  # the batch the captured run had already drawn
            X, Y = batch_at(ix)
        else:
            X, Y, ix = get_batch()  # naive: a fresh draw skips that batch
    with dstt.Capture(store, branch=branch, parent=parent if branch != "main" else None) as cap:
        for it in range(start, iters):
            logits = model(X)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, 50), Y.view(-1))
            X, Y, ix = get_batch()  # prefetch the next batch before the update, as nanoGPT does
            opt.zero_grad()
            loss.backward()
            opt.step()
            cap.snapshot(it, model=model, optimizer=opt, extra={"it": it, "next_ix": ix, "loss": loss.item()})
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="run the demonstration (the default)")
    p.parse_args()
    torch.use_deterministic_algorithms(True)
    store = tempfile.mkdtemp(prefix="dstt-nanogpt-") + "/run"
    whole = train(store, 12)
    half = store + "-half"
    train(half, 6)
    resumed = train(half, 12, resume=f"{half}:5", recipe=True, branch="recipe")
    naive = train(half, 12, resume=f"{half}:5", recipe=False, branch="naive")
    print(f"resumed with the batch position from extra: {'bit-exact' if same(whole, resumed) else 'DIFFERENT'}")
    print(f"resumed by drawing the next batch again:    {'bit-exact' if same(whole, naive) else 'different (a batch was skipped)'}")
    if not same(whole, resumed) or same(whole, naive):
        raise SystemExit(1)
    print(f"""
what a user would run next:
  dstt ls {half}                                   # main (6 steps) and the two resumed branches
  dstt diff {store}:11 {half}@recipe:11            # identical
  dstt diff {store}:11 {half}@naive:11 --top 5     # not
  dstt history {half} extra/loss -b recipe -b naive""")


if __name__ == "__main__":
    main()
