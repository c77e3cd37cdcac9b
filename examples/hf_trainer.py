"""A Hugging Face Trainer run captured with dstt, then resumed from a dstt step.

    pip install 'dstt[transformers]'
    python examples/hf_trainer.py                                   # 12 optimizer steps into runs/hf
    python examples/hf_trainer.py --resume runs/hf:6 --branch again # resume from step 6 on a new branch

A tiny Llama built from a config (nothing is downloaded), made-up token
data, gradient accumulation 2: dstt captures once per optimizer step (model,
optimizer, scheduler, RNG and the Trainer's counters). The Trainer's own
``save_steps`` checkpointing is untouched (off here).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from dstt.integrations.transformers import DsttCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 48, length: int = 16, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="runs/hf")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resume", help="STORE[@BRANCH]:STEP to resume from")
    p.add_argument("--branch", help="branch for the resumed run (needed unless resuming from the latest step)")
    a = p.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=a.store + "-trainer", max_steps=a.steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=2, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    dstt_cb = DsttCallback(a.store, every=1, branch=a.branch)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[dstt_cb])
    trainer.train(resume_from_checkpoint=dstt_cb.resume(a.resume) if a.resume else None)
    print(f"""
captured into {a.store}; what a user would run next:
  dstt ls {a.store}                                    # one step per optimizer step
  dstt history {a.store} extra/log/loss optim/param_groups/0/lr   # loss and learning rate
  dstt show {a.store}:latest extra/trainer              # the Trainer's counters at a step
  dstt diff {a.store}:1 :latest --top 10                 # which weights moved most
  dstt find {a.store}                                    # first NaN/Inf or norm jump
  python examples/hf_trainer.py --store {a.store} --resume {a.store}:6 --branch again""")


if __name__ == "__main__":
    main()
