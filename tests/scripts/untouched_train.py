"""Train a model in a fresh process with or without dstt and report the
process's global settings along the way (tests/system/test_untouched.py, issue 23).

    python tests/scripts/untouched_train.py MODE STORE OUT.json

MODE: ``none`` (no dstt: the reference), ``capture`` (``dstt.Capture()``
with its defaults), ``nohelper`` (``helper=False``), ``flight``
(``memory_steps=4, persist="newest"``), ``save`` (``dstt.save`` in the
loop) -- each with ``-t3``: the trainer calls ``torch.set_num_threads(3)``
first (which did not protect it either: a thread adopts the process-wide
count at its first operation); ``hf-none``/``hf`` (a tiny GPT-2 under transformers.Trainer without /
with ``dstt.integrations.transformers.DsttCallback``), ``pl-none``/``pl``
(Lightning, without / with its DsttCallback).

The parent runs it with the machine's default thread settings (no
OMP_NUM_THREADS). The reference modes never import dstt. Where the plain
modes create a Capture, they do so before the model exists: the main thread
has run no torch operation yet, so it would adopt a changed default thread
count (issue 23's nanoGPT case). OUT.json holds the settings at several
points -- read on the main thread, in a new thread at each point, and in a
thread the trainer started after creating the Capture -- and a sha256 of
every tensor of the final model and optimizer state.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import queue
import random
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

STEPS = 24
PROBE_AT = (1, 8, 16)  # steps after which the settings are read (and at the start and the end)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _flushes_denormals() -> bool:
    """Whether this thread's FPU flushes denormals (torch.set_flush_denormal
    sets the calling thread's MXCSR); read with numpy, not torch, so that the
    main thread runs no torch operation before the trainer's first one."""
    tiny = np.array([1e-39], dtype=np.float32)  # a float32 denormal
    return bool((tiny * np.float32(1.0))[0] == 0)


def _thread_probe() -> dict[str, Any]:
    """What a thread started now gets: its first torch operation adopts the
    process's default thread count."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["new_thread_threads"] = torch.get_num_threads()
        out["new_thread_interop"] = torch.get_num_interop_threads()
        out["new_thread_flush_denormal"] = _flushes_denormals()
        out["new_thread_grad"] = torch.is_grad_enabled()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


class Worker:
    """A thread of the trainer, started after dstt's Capture exists, that runs
    a parallel torch operation whenever asked and reports its thread count."""

    def __init__(self) -> None:
        self.asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.answers: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.asks.get():
            torch.ones(1 << 18).mul(2).sum()  # large enough for an OpenMP team
            self.answers.put(torch.get_num_threads())

    def threads(self) -> int:
        self.asks.put(True)
        return self.answers.get(timeout=60)

    def stop(self) -> None:
        self.asks.put(False)
        self.thread.join(60)


def settings(main_threads: bool, worker: Worker | None) -> dict[str, Any]:
    """Every process-wide (and main-thread) setting dstt must leave alone."""
    tid = threading.get_native_id()
    s: dict[str, Any] = {
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "deterministic_debug_mode": torch.get_deterministic_debug_mode(),
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "cudnn": [torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                  torch.backends.cudnn.allow_tf32],
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cuda_initialized": torch.cuda.is_initialized(),
        "rng_torch": _digest(torch.get_rng_state().numpy().tobytes()),
        "initial_seed": torch.initial_seed(),
        "rng_numpy": _digest(repr(np.random.get_state()).encode()),
        "rng_python": _digest(repr(random.getstate()).encode()),
        "flush_denormal": _flushes_denormals(),
        "numpy_err": np.geterr(),
        "nice": os.getpriority(os.PRIO_PROCESS, tid),
        "sched_policy": os.sched_getscheduler(0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "gc_threshold": list(gc.get_threshold()),
        "print_options": repr(torch._tensor_str.PRINT_OPTS.__dict__),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["rng_cuda"] = [_digest(t.numpy().tobytes()) for t in torch.cuda.get_rng_state_all()]
    s.update(_thread_probe())
    if main_threads:  # (reading it runs torch's per-thread initialisation: only once the trainer may have)
        s["main_threads"] = torch.get_num_threads()
        s["main_interop"] = torch.get_num_interop_threads()
    if worker is not None:
        s["worker_threads"] = worker.threads()
    return s


def weights(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: _digest(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()) if v.numel() else "empty"
            for k, v in tensors.items()}


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


# ---------------------------------------------------------------- plain torch


def plain(mode: str, store: str, report: dict[str, Any]) -> None:
    mode, _, threads = mode.partition("-t")
    if threads:
        torch.set_num_threads(int(threads))
    report["points"]["start"] = settings(False, None)
    cap = None
    if mode != "none":
        import dstt

        options: dict[str, Any] = {"capture": {}, "nohelper": {"helper": False},
                                   "flight": {"memory_steps": 4, "persist": "newest"}}.get(mode, {})
        if mode != "save":
            cap = dstt.Capture(store, **options)
            time.sleep(0.5)  # dstt's threads are up and running
    worker = Worker()
    report["points"]["created"] = settings(True, worker)  # before the trainer's first torch operation
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(512, 256), torch.nn.LayerNorm(256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(128, 256, generator=g)
        loss = model(x).pow(2).mean().sqrt()  # the whole-tensor mean's summation order reaches the gradients
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cap is not None:
            cap.snapshot(step, model=model, optimizer=opt)
        elif mode == "save" and step % 6 == 0:
            import dstt

            dstt.save(store, step, dstt.state_of(model=model, optimizer=opt))
        if step in PROBE_AT:
            report["points"][f"step{step}"] = settings(True, worker)
    if cap is not None:
        cap.close()
    report["points"]["end"] = settings(True, worker)
    worker.stop()
    report["weights"] = weights(flat_state(model, opt))


# ---------------------------------------------------------------- transformers


def hf(mode: str, store: str, report: dict[str, Any]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.ids = torch.randint(0, 32, (48, 8), generator=torch.Generator().manual_seed(1234))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Probe(TrainerCallback):  # type: ignore[misc]
        worker: Worker | None = None

        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self.worker = Worker()  # (after the dstt callback's on_train_begin: the Capture exists)
            report["points"]["begin"] = settings(True, self.worker)

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step in PROBE_AT:
                report["points"][f"step{state.global_step}"] = settings(True, self.worker)

    report["points"]["start"] = settings(False, None)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=store + "-hf", max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3,
        warmup_steps=2, logging_steps=STEPS, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    callbacks: list[Any] = []
    if mode == "hf":
        from dstt.integrations.transformers import DsttCallback

        callbacks.append(DsttCallback(store, every=1))
    probe = Probe()
    callbacks.append(probe)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    report["points"]["end"] = settings(True, probe.worker)
    assert probe.worker is not None
    probe.worker.stop()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    report["weights"] = weights(flat_state(model, opt))


# ---------------------------------------------------------------- lightning


def pl(mode: str, store: str, report: dict[str, Any]) -> None:
    import warnings

    import lightning.pytorch as lp

    warnings.filterwarnings("ignore")

    class Net(lp.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                           torch.nn.Linear(256, 1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Probe(lp.Callback):  # type: ignore[misc]
        worker: Worker | None = None

        def on_train_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
            self.worker = Worker()  # (after the dstt callback's on_train_start: the Capture exists)
            report["points"]["begin"] = settings(True, self.worker)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step in PROBE_AT and f"step{trainer.global_step}" not in report["points"]:
                report["points"][f"step{trainer.global_step}"] = settings(True, self.worker)

    report["points"]["start"] = settings(False, None)
    lp.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(96, 64, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(7))
    model = Net()
    callbacks: list[Any] = []
    if mode == "pl":
        from dstt.integrations.lightning import DsttCallback

        callbacks.append(DsttCallback(store, every=1))
    probe = Probe()
    callbacks.append(probe)
    trainer = lp.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, loader)
    report["points"]["end"] = settings(True, probe.worker)
    assert probe.worker is not None
    probe.worker.stop()
    report["weights"] = weights(flat_state(model, trainer.optimizers[0]))


def main(argv: list[str]) -> None:
    mode, store, out = argv
    report: dict[str, Any] = {"mode": mode, "points": {}}
    torch.manual_seed(12345)  # (the process starts from random states: the same ones in every mode)
    np.random.seed(12345)
    random.seed(12345)
    if mode.startswith("hf"):
        hf(mode, store, report)
    elif mode.startswith("pl"):
        pl(mode, store, report)
    else:
        plain(mode, store, report)
    try:  # possible only while no inter-op work has started: dstt must not have started any
        torch.set_num_interop_threads(3)
        report["interop_settable"] = True
    except RuntimeError:
        report["interop_settable"] = False
    report["gc_enabled"] = gc.isenabled()
    with open(out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
