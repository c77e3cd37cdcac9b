"""Worker for tests/system/test_capture_dist.py, run under torchrun (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node N capture_fsdp.py OUT MODE[,MODE]

Each mode runs in OUT/MODE, one after the other in the same process group.
MODE ``ok``: FSDP2 model with uneven shards, captured at every step while
training; rank 0 saves the unsharded expected state of every step to
OUT/expected.pt. MODE ``fail``: rank 1's chunk writes fail from step 1 on;
every rank records the CaptureError it saw in OUT/error<rank>.txt.
MODE ``pred``: predictive coding of every rank's shards (:func:`run_pred`);
MODE ``default``: the same run with Capture's default compression.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dstt
from dstt.errors import CaptureError
from dstt.format.backends import LocalBackend


class FailingBackend(LocalBackend):
    """Fails every chunk write once ``armed`` (chunk files and packs of small chunks)."""

    armed = False

    def put(self, key: str, data: Any) -> None:
        if self.armed and (key.startswith("tensors/") and "/c." in key or key.startswith("packs/p.")):
            raise OSError(errno.ENOSPC, "No space left on device")
        super().put(key, data)


def full(state: Any) -> Any:
    """The unsharded value of every tensor (collective for DTensors)."""
    if isinstance(state, dict):
        return {k: full(v) for k, v in state.items()}
    if isinstance(state, list):
        return [full(v) for v in state]
    if hasattr(state, "full_tensor"):
        return state.full_tensor().detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    # 10, 7 and 2 output rows: uneven over 2 and 3 ranks, and empty on some rank.
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 2))
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # An explicit CPU mesh: without one, fully_shard picks CUDA whenever a GPU
    # is present and puts rank r on cuda:r, which a machine with fewer GPUs
    # than ranks does not have ("invalid device ordinal"). gloo, CPU tensors.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def run_pred(out: Path, default: bool = False) -> None:
    """MODE ``pred``: compression="predictive" under FSDP2 (AdamW, 8 steps,
    a keyframe every 4): each rank codes its own shards; rank 0 saves the
    unsharded expected state of every step and the raw bytes of them all.
    MODE ``default`` (``default=True``): the same run with Capture's default
    options (no compression given), waiting for each step, so no step is
    planned while another is still being written (compression "auto" stores
    such a step fast: that fallback is timing, not what this mode checks)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 61))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    torch.manual_seed(100 + rank)
    expected: dict[int, Any] = {}
    cap = dstt.Capture(out / "run") if default else dstt.Capture(out / "run", compression="predictive",
                                                                   keyframe_every=4)
    (out / f"helper{rank}.txt").write_text(str(cap.parts.helper is not None))
    try:
        for step in range(8):
            opt.zero_grad()
            model(torch.randn(5, 32)).square().mean().backward()
            opt.step()
            cap.snapshot(step, model=model, optimizer=opt)
            expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
            if default:
                cap.wait()
        cap.wait()
    finally:
        cap.close()
    if rank == 0:
        torch.save(expected, out / "expected.pt")


def main(out: Path, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    for mode in modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        if mode in ("pred", "default"):
            run_pred(out / mode, default=mode == "default")
        else:
            run_mode(out / mode, mode)
    dist.destroy_process_group()


def run_mode(out: Path, mode: str) -> None:
    rank = dist.get_rank()
    model, reference = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    store: Any = out / "run"
    if mode == "fail" and rank == 1:
        store = FailingBackend(out / "run", create=True)
    expected: dict[int, Any] = {}
    extra = {"shared": torch.arange(12.0).reshape(3, 4)}  # replicated: written once, by some rank
    torch.manual_seed(100 + rank)
    if mode == "delta":  # every chunk after the first step a delta, however large
        from dstt.format.codecs import keyframes

        keyframes.DELTA_MAX_RATIO = float("inf")
        # ... in the capture helpers too (exec'ed interpreters: a sitecustomize).
        hook = out / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(
            "from dstt.format.codecs import keyframes\nkeyframes.DELTA_MAX_RATIO = float('inf')\n")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
        os.environ["DSTT_PACK_CHUNK_BYTES"] = "0"  # chunks this small would be packed: never delta coded
    cap = dstt.Capture(store, max_chunk_bytes=64, compression="delta" if mode == "delta" else "none")
    # A store given by path: a capture helper per rank (ranks.py); a Backend object (mode fail): none.
    (out / f"helper{rank}.txt").write_text(str(cap.parts.helper is not None))
    errors: list[str] = []
    try:
        cap.snapshot(0, model=model, optimizer=opt, extra=extra)
        expected[0] = {"model": reference}
        for step in range(1, 4):
            if mode == "fail" and step == 2:
                cap.wait()
                if rank == 1:
                    store.armed = True
            opt.zero_grad()
            model(torch.randn(5, 6)).square().mean().backward()
            opt.step()
            cap.snapshot(step, model=model, optimizer=opt, extra=extra)
            if mode in ("ok", "delta"):
                expected[step] = full(dstt.state_of(model=model, optimizer=opt, rng=False))
        cap.wait()
    except CaptureError as e:
        errors.append(str(e))
    finally:
        try:
            cap.close()
        except CaptureError as e:  # a failure not reported yet (timing decides which call sees it)
            errors.append(str(e))
    # close() lets go of dstt's gloo groups even though the Capture object may
    # live on (a cycle, a traceback): freed at interpreter exit, a group can
    # abort the process ("terminate called without an active exception").
    assert all(c.group is None for c in cap.parts.coordinators)
    if errors:
        (out / f"error{rank}.txt").write_text("\n".join(errors))
    if rank == 0 and mode in ("ok", "delta"):
        torch.save(expected, out / "expected.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
