"""Capture, save, restore and rewind of CUDA-resident state (skipped where
no CUDA GPU is present; run on a GPU machine before a release).

Every test compares the stored bytes with a CPU clone taken at the moment
of the snapshot, so a copy that raced the trainer (the copy stream not
ordered after the compute stream, a lazy copy after ``optimizer.step()``)
fails bit-exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bits_equal

import dstt
from dstt.format import layout as L
from tests.capture.test_capture import assert_same, clone_state, deadline, stored

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def cuda_model(seed: int = 0, width: int = 256) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 8)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step_on_gpu(model: torch.nn.Module, opt: torch.optim.Optimizer, heavy: bool = False) -> None:
    x = torch.randn(32, 64, device="cuda")
    if heavy:  # keep the compute stream busy so an unordered copy would read stale values
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(8):
            a = a @ a / 64
        x = x + a[:32, :64] * 0
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_lazy_capture_is_ordered_after_compute_and_before_the_next_step(tmp_path: Path) -> None:
    """snapshot() right after a step whose kernels are still queued, then the
    next step's optimizer.step() and a forward that updates BN buffers:
    every stored step equals the state at its snapshot."""
    model, opt = cuda_model()
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run") as cap:
        for step in range(6):
            step_on_gpu(model, opt, heavy=True)  # still queued: the snapshot must see its values
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            # the state at the snapshot (the clone runs on the compute stream, before any change)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            model(torch.randn(32, 64, device="cuda"))  # BN buffers change right away, before any copy
        cap.wait()
        assert cap.pool is not None and cap.pool.pinned
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")


def test_a_step_larger_than_the_pool_is_staged_in_parts(tmp_path: Path) -> None:
    model, opt = cuda_model(width=1024)  # ~1.6 MB of state per copy, with Adam's ~4.8 MB
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run", host_buffer_bytes=1 << 20, max_chunk_bytes=256 << 10) as cap:
        for step in range(3):
            step_on_gpu(model, opt)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
        cap.wait()
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")


def test_dtypes_views_and_mixed_devices_round_trip_bit_exact(tmp_path: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64, 48, device="cuda", generator=g)
    state: dict[str, Any] = {
        "bf16": base.bfloat16(), "fp16": base.half(), "f64": base.double(),
        "f8": base.to(torch.float8_e4m3fn), "i8": (base * 50).to(torch.int8), "i64": torch.arange(1000, device="cuda"),
        "bool": base > 0, "c64": torch.complex(base, -base), "conj": torch.complex(base, base).conj(),
        "t": base.t(), "slice": base[5:40:3, 7:], "zero_d": base[3, 4], "empty": base[:0],
        "nan": torch.tensor([float("nan"), -0.0, float("inf")], device="cuda"),
        "cpu": torch.randn(17), "nested": {"a": [base[0], base[1].cpu()]},
    }
    ref = clone_state(state)
    dstt.save(tmp_path / "run", 0, state)
    assert_same(ref, dstt.open(tmp_path / "run").state_dict(0))
    with deadline(120), dstt.Capture(tmp_path / "cap") as cap:
        cap.snapshot(0, extra=state, rng=False)
    assert_same(ref, stored(tmp_path / "cap", 0)["extra"])


def test_restore_puts_state_back_on_the_gpu_bit_exact(tmp_path: Path) -> None:
    model, opt = cuda_model()
    with deadline(120), dstt.Capture(tmp_path / "run") as cap:
        for step in range(3):
            step_on_gpu(model, opt)
            cap.snapshot(step, model=model, optimizer=opt)
    want = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
    model2, opt2 = cuda_model(seed=1)
    step_on_gpu(model2, opt2)
    dstt.restore(f"{tmp_path / 'run'}:2", model=model2, optimizer=opt2)
    assert all(p.is_cuda for p in model2.parameters())
    assert all(v.is_cuda for s in opt2.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v))
    assert_same(want, clone_state(dstt.state_of(model=model2, optimizer=opt2, rng=False)))
    # training goes on from the restored state as from the original one
    torch.manual_seed(5)
    step_on_gpu(model, opt)
    torch.manual_seed(5)
    step_on_gpu(model2, opt2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert bits_equal(a.detach().cpu(), b.detach().cpu())


def test_delta_coding_of_gpu_state_round_trips(tmp_path: Path) -> None:
    model, opt = cuda_model()
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run", compression="delta", keyframe_every=3) as cap:
        for step in range(7):
            step_on_gpu(model, opt)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")
    assert dstt.verify(tmp_path / "run").ok


@pytest.mark.parametrize("helper", [True, False], ids=["tier-in-helper", "in-process"])
def test_flight_recorder_rewinds_gpu_state_from_memory(tmp_path: Path, helper: bool) -> None:
    model, opt = cuda_model()
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run", helper=helper, memory_steps=4) as cap:
        for step in range(8):
            step_on_gpu(model, opt)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
        extra = cap.rewind(6, model=model, optimizer=opt, rng=False, branch="gpu-rewind")
        assert extra == {}
        assert all(p.is_cuda for p in model.parameters())
        assert_same(refs[6], clone_state(dstt.state_of(model=model, optimizer=opt, rng=False)))
        step_on_gpu(model, opt)
        cap.snapshot(7, model=model, optimizer=opt, rng=False)
    run = dstt.open(f"{tmp_path / 'run'}@gpu-rewind")
    assert 7 in run.steps()


@pytest.mark.parametrize("variant", ["foreach", "fused"])
def test_default_capture_codes_cuda_adamw_predictively_and_bit_exact(tmp_path: Path, variant: str) -> None:
    """CUDA AdamW (foreach and fused kernels) under Capture's defaults: the
    optimizer-aware predictor codes the steps (a CUDA kernel's rounding may
    differ from the predictor's, which costs bytes, never correctness), and
    every step reads back bit-exact."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    kw: dict[str, Any] = {"fused": True} if variant == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)
    refs = {}
    with deadline(240), dstt.Capture(tmp_path / "run") as cap:
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(32, 256, device="cuda")).square().mean().backward()
            opt.step()
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
            cap.wait()  # (a helper that keeps up codes every step; one behind stores it fast)
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")
    used = set()
    for step in range(6):
        doc = json.loads((tmp_path / "run" / L.step_dir("main", step) / "index.json").read_text())
        used |= {c["predictor"] for t in doc["tensors"] if isinstance(t, dict) and "pred" in t
                 for c in t["pred"]["codings"]}
    assert "adam" in used, used
    assert dstt.verify(tmp_path / "run").ok


TRAINER = textwrap.dedent("""
    import os, signal, sys, torch, dstt
    store = sys.argv[1]
    state = {f"w{i}": torch.full((256, 256), float(i), device="cuda") for i in range(6)}
    cap = dstt.Capture(store, helper=True, shm=True)
    for step in range(5):
        for i, t in enumerate(state.values()):
            t.fill_(step * 100 + i)
        cap.snapshot(step, extra=state, rng=False)
        cap.wait_staged()
    print(cap.parts.helper.pid if cap.parts.helper is not None else 0, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkilled_gpu_trainer_loses_no_sealed_step(tmp_path: Path) -> None:
    """The trainer dies right after its last step is staged: the helper
    process commits every sealed step, bit-exact."""
    store = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", TRAINER, str(store)], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    helper = int(proc.stdout.split()[-1])
    assert helper > 0, "the capture helper did not run"
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        if dstt.open(store).steps() == list(range(5)):
            break
        time.sleep(0.2)
    if dstt.open(store).steps() != list(range(5)):
        dstt.Capture(store).close()  # commits whatever the helper left sealed
    run = dstt.open(store)
    assert run.steps() == list(range(5))
    for step in range(5):
        got = run.state_dict(step)["extra"]
        for i in range(6):
            assert torch.equal(got[f"w{i}"], torch.full((256, 256), float(step * 100 + i))), (step, i)


def test_a_pool_registered_in_pieces_copies_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The /dev/shm pool is page-locked piece by piece (so the trainer's CUDA
    calls never wait behind one long cudaHostRegister); blocks that straddle
    two pieces are copied bit-exact, before and after registration ends."""
    from dstt.capture import hostpool

    monkeypatch.setattr(hostpool, "REGISTER_PIECE_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {f"w{i}": torch.randn(70_001 + i, device="cuda", generator=g) for i in range(12)}  # ~280 KB, odd sizes
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run", shm=True, max_chunk_bytes=96 << 10) as cap:
        for step in range(6):
            for t in state.values():
                t.mul_(1.5).add_(step)
            cap.snapshot(step, extra=state, rng=False)
            refs[step] = clone_state(state)
            if step == 0:
                assert cap.pool is not None
                cap.pool.registered.wait(60)
                assert cap.pool.pinned and len(cap.pool._pieces) > 1
        cap.wait()
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step)["extra"], f"step {step}")


@pytest.mark.parametrize("staging", ["auto", "off", "no-room"])
def test_device_staging_stores_the_state_at_snapshot_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               staging: str) -> None:
    """A step's GPU sources copied on the GPU inside snapshot()
    (capture/devicestage.py), the host copies later: every stored step is
    the state at its snapshot, although the optimizer hook waits for
    nothing and the next update runs at once. ``off`` and a device without
    room take the usual path."""
    from dstt.capture import devicestage

    monkeypatch.setenv("DSTT_DEVICE_STAGING", "off" if staging == "off" else "auto")
    if staging == "no-room":
        monkeypatch.setattr(devicestage, "MARGIN_MIN_BYTES", 1 << 60)
    model, opt = cuda_model(width=1024)
    refs = {}
    with deadline(180), dstt.Capture(tmp_path / "run") as cap:
        for step in range(6):
            step_on_gpu(model, opt, heavy=True)  # still queued: the copies must see its values
            cap.snapshot(step, model=model, optimizer=opt, rng=False)
            refs[step] = clone_state(dstt.state_of(model=model, optimizer=opt, rng=False))
        cap.wait()
        taken = cap.stager.device_staging.steps
    assert (taken >= 3) if staging == "auto" else (taken == 0)
    for step, ref in refs.items():
        assert_same(ref, stored(tmp_path / "run", step), f"step {step}")
