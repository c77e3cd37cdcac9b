"""Hugging Face ``Trainer`` integration: capture every optimizer step, resume from any.

``DsttCallback`` captures, right after each optimizer step (``on_step_end``,
which the Trainer calls after ``optimizer.step()``, ``lr_scheduler.step()``
and ``zero_grad``, once per optimizer step whatever the gradient
accumulation), the model, the optimizer (keyed by parameter name), the
scheduler, every RNG, and the trainer's own counters in ``extra``:

* ``extra/trainer/...``: the ``TrainerState`` fields (``global_step``,
  ``epoch``, ``num_input_tokens_seen``, ``total_flos``, ...; not the ever
  growing ``log_history``). The Trainer locates its data position from
  ``global_step`` (whole epochs, then batches into the epoch, with a seeded
  sampler), exactly as its own checkpoints do;
* ``extra/log/...``: the latest numbers the Trainer logged (``loss``,
  ``grad_norm``, ``learning_rate``).

The dstt step number is ``state.global_step`` (the first optimizer step is
step 1). Capture is lazy (docs/capture.md): the copy overlaps the next
forward and backward; only the next ``optimizer.step()`` waits, if needed.
The Trainer's own ``save_steps`` checkpointing is left as it is.

Resuming: ``cb.resume(REF)`` writes the captured step as a standard Trainer
checkpoint directory (weights, optimizer, scheduler, RNG states,
``trainer_state.json``) into a temporary directory and returns its path, for
``trainer.train(resume_from_checkpoint=...)``. The Trainer then does what it
does with its own checkpoints (skips the batches already trained on, restores
RNG after skipping) and the callback goes on capturing on the same branch
(resuming from a branch's latest step) or on a new ``branch=`` forked at the
step. With deterministic ops the resumed run equals the uninterrupted one bit
for bit (tests/integrations/test_integrations_transformers.py kills a run with SIGKILL).

>>> from dstt.integrations.transformers import DsttCallback
>>> cb = DsttCallback("runs/hf", every=10)   # Trainer(..., callbacks=[cb])
>>> cb.settings.every
10
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from transformers import TrainerCallback

from dstt.capture import Capture
from dstt.errors import RestoreMismatchError
from dstt.integrations import (
    CallbackSettings,
    dumps,
    numbers_only,
    optimizer_state_dict,
    plain_values,
)

#: TrainerState fields not captured: grows with every log call.
_SKIPPED_STATE = ("log_history",)


class DsttCallback(TrainerCallback):
    """Capture a ``transformers.Trainer`` run into a dstt store.

    ``store``: path or URL; ``every``: capture when ``global_step % every ==
    0``; ``branch``: branch to capture on (default ``main``, or the resumed
    branch); ``rng``: capture RNG states (needed for a bit-exact resume);
    ``capture_options``: passed to :class:`dstt.Capture`
    (``host_buffer_bytes``, ``compression``, ``on_full``, ...).

    >>> cb = DsttCallback("runs/hf", every=1, compression="zstd")
    >>> cb.settings.capture_options
    {'compression': 'zstd'}
    """

    def __init__(self, store: Any, *, every: int = 1, branch: str | None = None, rng: bool = True,
                 **capture_options: Any) -> None:
        self.settings = CallbackSettings(store, every=every, branch=branch, rng=rng, capture_options=capture_options)
        self._logs: dict[str, float | int] = {}

    @property
    def capture(self) -> Capture | None:
        """The Capture (None before training begins and after it ends)."""
        return self.settings.capture

    def close(self) -> None:
        """Wait until every captured step is committed, release the capture,
        remove the temporary resume directory. Idempotent."""
        self.settings.close()

    # ------------------------------------------------------------------ resume

    def resume(self, ref: str, directory: str | None = None) -> str:
        """Prepare resuming from ``ref`` (``STORE[@BRANCH][:STEP]``): write it
        as a Trainer checkpoint (into ``directory``, or a temporary directory
        removed when training ends) and return the path for
        ``trainer.train(resume_from_checkpoint=...)``.

        Capture continues on the same branch when ``ref`` is its latest step,
        else on this callback's ``branch=`` (a new branch forked at ``ref``).
        """
        directory = self.settings.resume_from(ref, directory, "dstt-hf-resume-")
        to_checkpoint(ref, directory)
        return directory

    # ------------------------------------------------------------------ trainer events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.settings.open()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._logs = numbers_only(logs)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        if not self.settings.due(step):
            return
        # (opened here too for a trainer that skipped on_train_begin)
        self.settings.open().snapshot(step, model=model, optimizer=torch_optimizer(optimizer),
                                      scheduler=lr_scheduler, rng=self.settings.rng, extra=self._extra(args, state))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def _extra(self, args: Any, state: Any) -> dict[str, Any]:
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name not in _SKIPPED_STATE}
        return {
            "trainer": plain_values(fields),
            "log": dict(self._logs),
            "args": {"gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "per_device_train_batch_size": args.per_device_train_batch_size,
                     "seed": args.seed, "world_size": args.world_size},
        }


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` inside accelerate's wrapper (its step
    pre-hooks are what dstt's capture fence needs)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


# ----------------------------------------------------------------------------- checkpoint files


def to_checkpoint(ref: str, directory: str) -> str:
    """Write step ``ref`` as a ``transformers.Trainer`` checkpoint directory:
    ``pytorch_model.bin``, ``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth`` (``rng_state_<rank>.pth`` per rank of a distributed
    capture) and ``trainer_state.json``. Returns ``directory``."""
    import dstt

    run = dstt.open(ref)
    branch, step = run.resolve()
    state = run.state_dict(step, branch=branch)
    if not isinstance(state, dict) or "model" not in state:
        raise RestoreMismatchError(f"step {step} of branch {branch!r} holds no model state")
    os.makedirs(directory, exist_ok=True)
    torch.save(state["model"], os.path.join(directory, "pytorch_model.bin"))
    if "optim" in state:
        torch.save(optimizer_state_dict(state["optim"]), os.path.join(directory, "optimizer.pt"))
    if "scheduler" in state:
        torch.save(state["scheduler"], os.path.join(directory, "scheduler.pt"))
    _write_rng(state.get("rng"), directory)
    extra = state.get("extra")
    if not isinstance(extra, dict):
        extra = {}
    trainer = dict(extra.get("trainer") or {"global_step": step})
    trainer["log_history"] = []
    with open(os.path.join(directory, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(dumps(trainer) + "\n")
    return directory


def _write_rng(rng: Any, directory: str) -> None:
    if not isinstance(rng, dict):
        return
    per_rank = {k: v for k, v in rng.items() if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()}
    if per_rank:
        for k, v in per_rank.items():
            torch.save(_hf_rng(v, distributed=True), os.path.join(directory, f"rng_state_{int(k[4:])}.pth"))
    else:
        torch.save(_hf_rng(rng, distributed=False), os.path.join(directory, "rng_state.pth"))


def _hf_rng(rng: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """dstt's RNG record in the Trainer's ``rng_state.pth`` layout."""
    out: dict[str, Any] = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    if "cuda" in rng:
        out["cuda"] = rng["cuda"] if distributed else rng["cuda"][0]
    return out


__all__ = ["DsttCallback", "to_checkpoint", "torch_optimizer"]
