"""PyTorch Lightning integration: capture every optimizer step, resume from any.

``DsttCallback`` captures in ``on_train_batch_end`` -- which Lightning calls
after the optimizer step and after step-interval schedulers stepped -- once
per optimizer step: a batch whose ``trainer.global_step`` did not move (a
gradient-accumulation batch) is not captured. Automatic and manual
optimization alike; the dstt step number is ``trainer.global_step`` (in
manual optimization Lightning counts every ``optimizer.step()`` call).

What is captured: the LightningModule's ``state_dict`` (``model/...``), the
first optimizer keyed by parameter name (``optim/...``, copied lazily: only
its next ``step()`` waits), the first scheduler, every RNG, and in
``extra``:

* ``extra/lightning/``: ``global_step``, ``epoch``, ``batch_idx`` and
  ``loops`` -- the fit loop's progress counters as Lightning checkpoints
  them (with the state of stateful dataloaders, when yours are);
* ``extra/optimizers/<i>``, ``extra/schedulers/<i>``: further optimizers
  (by parameter name) and schedulers (manual optimization with several);
* ``extra/metrics/``: the numbers in ``trainer.callback_metrics`` (what you
  ``self.log``).

Resuming: ``trainer.fit(module, ckpt_path=cb.resume(REF))``. ``resume``
writes the captured step as a Lightning checkpoint file (temporary, removed
when fitting ends) and the callback sets the captured RNG states back at
``on_fit_start``, before the fit loop builds its data iterator; Lightning restores
the rest as from its own checkpoints. The data position: resuming mid-epoch,
the callback makes the train dataloaders skip the batches the epoch had
already consumed (indices only, in the epoch's order; Lightning alone would
restart a plain ``DataLoader``'s epoch) and sets the RNG states again after
that; resumable dataloaders (``state_dict``) are left to Lightning. The
shuffled order must not depend on the global RNG at the epoch's start (a
sampler seeded per epoch, e.g. ``DistributedSampler`` or any ``set_epoch``
sampler): see docs/integrations.md.

>>> from dstt.integrations.lightning import DsttCallback
>>> DsttCallback("runs/pl", every=5).settings.every
5
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import lightning
import lightning.pytorch as pl
import torch

from dstt.capture import Capture
from dstt.errors import RestoreMismatchError
from dstt.integrations import (
    CallbackSettings,
    numbers_only,
    optimizer_state_dict,
    plain_values,
)
from dstt.store.state import optimizer_state, set_rng_state


class DsttCallback(pl.Callback):
    """Capture a Lightning ``Trainer.fit`` run into a dstt store.

    ``store``: path or URL; ``every``: capture when ``global_step % every ==
    0``; ``branch``: branch to capture on (default ``main``, or the resumed
    one); ``rng``: capture RNG states; ``capture_options``: passed to
    :class:`dstt.Capture`.
    """

    def __init__(self, store: Any, *, every: int = 1, branch: str | None = None, rng: bool = True,
                 **capture_options: Any) -> None:
        self.settings = CallbackSettings(store, every=every, branch=branch, rng=rng, capture_options=capture_options)
        self._last_step = -1
        self._resume_rng: Any = None
        self._resume_at: dict[str, Any] | None = None  # extra/lightning of the step resumed from

    @property
    def capture(self) -> Capture | None:
        """The Capture (None before training starts and after it ends)."""
        return self.settings.capture

    def close(self) -> None:
        """Wait until every captured step is committed, release the capture,
        remove the temporary resume directory. Idempotent."""
        self.settings.close()

    # ------------------------------------------------------------------ resume

    def resume(self, ref: str, directory: str | None = None) -> str:
        """Write step ``ref`` (``STORE[@BRANCH][:STEP]``) as a Lightning
        checkpoint and return its path for ``trainer.fit(..., ckpt_path=)``.
        Capture continues on the same branch when ``ref`` is its latest step,
        else on this callback's ``branch=`` (a new branch forked at ``ref``)."""
        directory = self.settings.resume_from(ref, directory, "dstt-pl-resume-")
        path, self._resume_rng, self._resume_at = to_checkpoint(ref, os.path.join(directory, "dstt-resume.ckpt"))
        return path

    # ------------------------------------------------------------------ trainer events

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resume_rng is not None:
            # Lightning checkpoints no global RNG state: the captured one is
            # set here, before the fit loop builds its data iterator (a
            # DataLoader's iter() draws its base seed from the global RNG, as
            # the next epoch's iter() did in the captured run).
            set_rng_state(_this_rank(self._resume_rng))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        if self._resume_at is not None:
            at, rng, self._resume_at, self._resume_rng = self._resume_at, self._resume_rng, None, None
            consumed = int(at["batch_idx"]) + 1
            if consumed < trainer.num_training_batches and _skip_consumed(trainer, int(at["epoch"]), consumed):
                set_rng_state(_this_rank(rng))  # the iterator rebuilt above drew a base seed
        self.settings.open()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step == self._last_step:  # no optimizer step in this batch (accumulating)
            return
        self._last_step = step
        if not self.settings.due(step):
            return
        if self.settings.capture is None:
            self.on_train_start(trainer, pl_module)
        optimizers = list(trainer.optimizers)
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        extra: dict[str, Any] = {
            "lightning": {"global_step": step, "epoch": int(trainer.current_epoch), "batch_idx": int(batch_idx),
                          "loops": _loops_state(trainer)},
            "metrics": numbers_only({k: _number(v) for k, v in trainer.callback_metrics.items()}),
        }
        if len(optimizers) > 1:
            extra["optimizers"] = {str(i): optimizer_state(o, pl_module) for i, o in enumerate(optimizers) if i}
        if len(schedulers) > 1:
            extra["schedulers"] = {str(i): s.state_dict() for i, s in enumerate(schedulers) if i}
        self.settings.open().snapshot(step, model=pl_module, optimizer=optimizers[0] if optimizers else None,
                                      scheduler=schedulers[0] if schedulers else None, rng=self.settings.rng,
                                      extra=extra)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()


class _SkipOnce(torch.utils.data.Sampler[list[int]]):
    """A batch sampler that drops its first ``n`` batches once (indices only:
    no data is loaded for them) and is its inner sampler otherwise."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __iter__(self) -> Iterator[list[int]]:
        it: Iterator[list[int]] = iter(self.inner)
        n = self.n
        self.n = 0
        for _ in range(n):
            next(it, None)
        return it

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, drop_last, set_epoch ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _skip_consumed(trainer: pl.Trainer, epoch: int, consumed: int) -> bool:
    """Resuming mid-epoch: make the train dataloaders yield the epoch's
    batches after the ``consumed`` ones, in the epoch's order, as the HF
    Trainer does (Lightning itself restarts a plain DataLoader's epoch).
    Needs a map-style DataLoader with a batch sampler; loaders that are
    resumable (``state_dict``) are left to Lightning. False: not done."""
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.fabric.utilities.types import _Stateful

    fit_loop = trainer.fit_loop
    combined = getattr(fit_loop, "_combined_loader", None)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    loaders = list(getattr(combined, "flattened", []) or [])
    if combined is None or fetcher is None or not loaders:
        return False
    if any(isinstance(dl, _Stateful) or not isinstance(dl, torch.utils.data.DataLoader)
           or getattr(dl, "batch_sampler", None) is None for dl in loaders):
        return False
    for dl in loaders:
        _set_sampler_epoch(dl, epoch)
        object.__setattr__(dl, "batch_sampler", _SkipOnce(dl.batch_sampler, consumed))  # set once, after init
    iter(fetcher)  # a fresh iterator over the rest of the epoch
    return True


def _number(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return v


def _loops_state(trainer: pl.Trainer) -> Any:
    """The fit loop's state as Lightning checkpoints it, tensors and all
    (a stateful dataloader's state may hold a generator state)."""
    return {"fit_loop": _storable(trainer.fit_loop.state_dict())}


def _storable(obj: Any) -> Any:
    """Tensors and plain values kept, anything else dropped."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _storable(v) for k, v in obj.items() if isinstance(k, str) and not k.startswith("$")}
    if isinstance(obj, (list, tuple)):
        return [_storable(v) for v in obj]
    v = plain_values(obj)
    return v


def _this_rank(rng: Any) -> Any:
    if isinstance(rng, dict) and any(isinstance(k, str) and k.startswith("rank") for k in rng):
        from dstt.store.state import _rank

        return rng.get(f"rank{_rank()[0]}", {})
    return rng


def to_checkpoint(ref: str, path: str) -> tuple[str, Any, dict[str, Any]]:
    """Write step ``ref`` as a Lightning checkpoint file at ``path``; return
    ``(path, the step's RNG states, its extra/lightning)`` (Lightning
    checkpoints hold no global RNG state: :class:`DsttCallback` sets these)."""
    import dstt

    run = dstt.open(ref)
    branch, step = run.resolve()
    state = run.state_dict(step, branch=branch)
    if not isinstance(state, dict) or "model" not in state:
        raise RestoreMismatchError(f"step {step} of branch {branch!r} holds no model state")
    extra = state.get("extra")
    if not isinstance(extra, dict):
        extra = {}
    info = extra.get("lightning")
    if not isinstance(info, dict):
        raise RestoreMismatchError(
            f"step {step} of branch {branch!r} was not captured by dstt.integrations.lightning (no extra/lightning)")
    optimizers = []
    if "optim" in state:
        optimizers.append(optimizer_state_dict(state["optim"]))
    for _i, o in sorted((extra.get("optimizers") or {}).items(), key=lambda kv: int(kv[0])):
        optimizers.append(optimizer_state_dict(o))
    schedulers = [state["scheduler"]] if "scheduler" in state else []
    schedulers += [s for _i, s in sorted((extra.get("schedulers") or {}).items(), key=lambda kv: int(kv[0]))]
    ckpt = {
        "epoch": info["epoch"],
        "global_step": info["global_step"],
        "pytorch-lightning_version": lightning.__version__,  # what lightning.pytorch reports
        "state_dict": state["model"],
        "loops": info["loops"],
        "callbacks": {},
        "optimizer_states": optimizers,
        "lr_schedulers": schedulers,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(ckpt, path)
    return path, state.get("rng"), info


__all__ = ["DsttCallback", "to_checkpoint"]
