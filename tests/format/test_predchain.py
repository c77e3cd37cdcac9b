"""Predictive chunks in a store (issue 27): the Writer codes parameters and
optimizer state against the previous step, every read path decodes them
through their chain, bit-exact; verify walks chains and names the broken
link; prune keeps what kept steps' chains need and says what it frees; a
step coded against a step that failed is stored whole."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import blosc

import dstt
from dstt.api import gc
from dstt.errors import CaptureError, CaptureWarning, CorruptStoreError
from dstt.format import layout as L
from dstt.format.codecs import stepcoder
from dstt.format.gc import prune
from dstt.format.verify import verify
from dstt.format.writeoptions import WriteOptions
from dstt.store.state import state_of
from dstt.store.writer import Writer
from tests.conftest import bits_equal

OPTIMIZERS: dict[str, Callable[[list[Any]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam-amsgrad-maximize": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, maximize=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adam-tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3), foreach=False),  # lr a tensor: deltas
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),  # no predictor: chained deltas
}


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the captured state by its store name, cloned."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: Any) -> None:
        if torch.is_tensor(v):
            out[prefix] = v.detach().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)

    walk("", state_of(model, opt, rng=False))
    return {k[1:]: v for k, v in out.items()}


def train(path: Path, opt_name: str, *, steps: int = 6, dtype: torch.dtype = torch.float32,
          shapes: tuple[tuple[int, int], ...] = ((32, 64), (64, 16)), keyframe_every: int = 4,
          compression: str = "predictive", specials: bool = False, zero_grad_every: int = 0,
          add_group_at: int | None = None, schedule: bool = False, pack_chunk_bytes: int | None = None,
          max_chunk_bytes: int | None = None, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A small training run captured every step with ``Writer``; the
    states written, by step."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # the same initial weights for the same seed
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(a, b).to(dtype) for a, b in shapes]
        extra = torch.nn.Linear(shapes[-1][1], 3).to(dtype)
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters()) if add_group_at is not None else list(model.parameters()) + list(extra.parameters())
    opt = OPTIMIZERS[opt_name](params)
    holder = torch.nn.ModuleDict({"m": model, "x": extra})
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if schedule else None
    if specials:  # values the codec must carry bit-exact: -0.0, a subnormal; NaN and Inf in a buffer
        with torch.no_grad():
            w = layers[0].weight.view(-1)
            w[0] = -0.0
            w[-1] = torch.finfo(dtype).tiny / 4
        model.register_buffer("odd", torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0] * 8,
                                                  dtype=dtype))
    kw: dict[str, Any] = {}
    if pack_chunk_bytes is not None:
        kw["pack_chunk_bytes"] = pack_chunk_bytes
    if max_chunk_bytes is not None:
        kw["max_chunk_bytes"] = max_chunk_bytes
    states = []
    with Writer(path, WriteOptions(compression=compression, keyframe_every=keyframe_every, **kw)) as w:
        for step in range(steps):
            if add_group_at is not None and step == add_group_at:
                opt.add_param_group({"params": list(extra.parameters())})
            x = torch.randn(4, shapes[0][0], generator=g).to(dtype)
            loss = extra(model(x)).float().pow(2).mean()
            if not (zero_grad_every and step % zero_grad_every == zero_grad_every - 1):
                loss.backward()
            if specials and step == 2:
                layers[-1].bias.grad = None  # a parameter without a gradient this step
            opt.step()
            opt.zero_grad()
            if specials:
                with torch.no_grad():
                    model.odd.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[step % 32] ^= 1  # NaN payloads
            if sched is not None:
                sched.step()
            states.append(snapshot(holder, opt))
            w.write(step, state_of(holder, opt, rng=False))
    return states


def check_reads(path: Path, states: list[dict[str, torch.Tensor]]) -> dstt.Run:
    run = dstt.open(path)
    for step, state in enumerate(states):
        for name, value in state.items():
            got = run.read(name, step)
            assert bits_equal(got, value), (step, name)
    return run


def small_adamw(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
    """Two Linear layers trained with AdamW, built from ``seed`` without
    touching the global RNG, and a generator for their batches."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.Generator().manual_seed(seed)


def entries(path: Path, step: int) -> list[dict[str, Any]]:
    doc = json.loads((path / L.step_dir("main", step) / "index.json").read_text())
    return [t for t in doc["tensors"] if isinstance(t, dict)]


def predictors(path: Path, steps: range) -> set[str]:
    return {c["predictor"] for s in steps for t in entries(path, s) if "pred" in t for c in t["pred"]["codings"]}


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_every_optimizer_round_trips_bit_exact(tmp_path: Path, opt_name: str) -> None:
    """Parameters and optimizer state of every optimizer/variant, written
    predictively and read back bit-exact at every step; verify is clean."""
    path = tmp_path / "run"
    states = train(path, opt_name, steps=6, specials=True, schedule=True)
    check_reads(path, states)
    used = predictors(path, range(6))
    want = "sgd" if opt_name.startswith("sgd") else "delta" if opt_name in ("rmsprop", "adam-tensor-lr") else "adam"
    assert want in used, used  # the optimizer's own predictor coded something
    report = verify(path)
    assert report.ok, report.problems


@settings(max_examples=int(os.environ.get("DSTT_PRED_EXAMPLES", "6")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(opt_name=st.sampled_from(["adamw", "adam-amsgrad-maximize", "adamw-fused", "sgd-nesterov"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       widths=st.lists(st.integers(1, 24), min_size=2, max_size=4),
       keyframe_every=st.integers(1, 5), zero_grad_every=st.integers(0, 3), add_group=st.booleans(),
       packed=st.booleans(), split=st.booleans(), seed=st.integers(0, 1000))
def test_hypothesis_round_trips(tmp_path_factory: pytest.TempPathFactory, opt_name: str, dtype: torch.dtype,
                                widths: list[int], keyframe_every: int, zero_grad_every: int,
                                add_group: bool, packed: bool, split: bool, seed: int) -> None:
    """Shapes, dtypes, NaN/Inf, -0.0, subnormals, lr schedules, steps with
    zero gradients, a param group added mid-run, packed or chunk files,
    tensors split in several chunks: every step reads back bit-exact."""
    chained = tuple(zip(widths[:-1], widths[1:]))  # each layer feeds the next
    path = tmp_path_factory.mktemp("h") / "run"
    states = train(path, opt_name, steps=5, dtype=dtype, shapes=chained, keyframe_every=keyframe_every,
                   specials=True, zero_grad_every=zero_grad_every, add_group_at=2 if add_group else None,
                   schedule=True, pack_chunk_bytes=None if packed else 0,
                   max_chunk_bytes=64 if split else None, seed=seed)
    check_reads(path, states)
    assert verify(path).ok


def test_chains_are_at_most_k_minus_1_steps_and_read_each_chunk_once(tmp_path: Path) -> None:
    """A keyframe every K steps, at the same steps for every role of a
    parameter; reading every step in order decodes each chunk once."""
    path = tmp_path / "run"
    k = 3
    states = train(path, "adamw", steps=8, keyframe_every=k)
    for s in range(8):
        for t in entries(path, s):
            for c in (t.get("pred") or {}).get("chunks", [None]):
                depth, step, cur = 0, s, c
                while cur is not None:  # walk back to the keyframe
                    depth += 1
                    step = cur[2]
                    (prev,) = [e for e in entries(path, step) if e["name"] == t["name"]]
                    cur = (prev.get("pred") or {}).get("chunks", [None])[0]
                assert depth <= k - 1, (s, t["name"], depth)
    keyframe_steps = {s for s in range(8) if not any("pred" in t for t in entries(path, s)
                                                     if t["name"].startswith(("model/", "optim/m.0.weight")))}
    assert keyframe_steps == {0, 3, 6}
    run = check_reads(path, states)
    coded = sum(1 for s in range(8) for t in entries(path, s) for c in (t.get("pred") or {}).get("chunks", [])
                if c is not None)
    assert run.chains.decoded == coded  # each predictive chunk decoded exactly once


def test_reading_one_step_decodes_each_link_once_with_a_cache_smaller_than_the_chain(tmp_path: Path) -> None:
    """Every tensor of a late step read in the store's order (parameters,
    then optimizer state, as state_dict and restore read them) with a
    decoded-link cache of two steps' chunks and chains eight times longer:
    each link is decoded once (the chains' own older links leave the cache
    first, the requested step's stay), every value bit-exact."""
    path = tmp_path / "run"
    states = train(path, "adamw", steps=8, keyframe_every=8, shapes=((256, 256), (256, 256)))
    run = dstt.open(path)
    step_bytes = sum(v.numel() * v.element_size() for v in states[7].values())
    run.chains.cache_bytes = 2 * step_bytes
    for name in sorted(states[7]):
        assert bits_equal(run.read(name, 7), states[7][name]), name
    coded = sum(1 for s in range(8) for t in entries(path, s) for c in (t.get("pred") or {}).get("chunks", [])
                if c is not None)
    assert run.chains.decoded == coded


def test_a_forged_misprediction_costs_bytes_not_correctness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Codings with wrong constants (a forged lr) predict badly: the chunks
    are larger, and still decode bit-exact."""
    base = train(tmp_path / "good", "adamw", steps=5)
    real = stepcoder.param_codings

    def forged(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        return {r: (c if c is None or "c" not in c.params else
                    type(c)(c.predictor, c.version, c.role, c.dtype,
                            {**c.params, "c": {k: float(np.float32(v * 3.0)) for k, v in c.params["c"].items()}}))
                for r, c in out.items()}

    monkeypatch.setattr(stepcoder, "param_codings", forged)
    monkeypatch.setattr(stepcoder, "DELTA_MAX_RATIO", math.inf)  # keep every residual, however large
    states = train(tmp_path / "bad", "adamw", steps=5)
    assert all(bits_equal(a[n], b[n]) for a, b in zip(base, states) for n in a)
    check_reads(tmp_path / "bad", states)
    size = {p: sum(dstt.open(tmp_path / p).commit_info(s)["bytes_written"] for s in range(5)) for p in ("good", "bad")}
    assert size["bad"] > size["good"]
    assert verify(tmp_path / "bad").ok


def _residual_key(path: Path, step: int, name: str) -> Path:
    (t,) = [t for t in entries(path, step) if t["name"] == name]
    assert t["pred"]["chunks"][0] is not None and t.get("pack") is None
    return path / f"{t['pred']['array']}/c.{t['slots'][0]}.0.0"


def test_verify_finds_a_damaged_chunk_in_the_middle_of_a_chain(tmp_path: Path) -> None:
    """One residual damaged at step 2 of a chain 0..5: verify reports it at
    step 2 and names it as the broken link of every later step that
    decodes through it; a read of step 4 fails naming step 2."""
    path = tmp_path / "run"
    train(path, "adamw", steps=6, keyframe_every=8, pack_chunk_bytes=0)
    name = "model/m.0.weight"
    key = _residual_key(path, 2, name)
    data = bytearray(key.read_bytes())
    data[len(data) // 2] ^= 0x40
    key.write_bytes(bytes(data))
    report = verify(path)
    assert not report.ok
    at = {(p.step, p.tensor) for p in report.problems}
    assert (2, name) in at
    later = [p for p in report.problems if p.step is not None and p.step > 2]
    assert later and all(f"step 2 {name}" in p.message for p in later), later
    with pytest.raises(CorruptStoreError, match=f"step 2 {name}"):
        dstt.open(path).read("model/m.0.weight", 4)
    assert dstt.open(path).read("model/m.0.weight", 1) is not None  # before the damage: fine


def test_prune_keeps_what_chains_need_and_dry_run_says_what_gc_frees(tmp_path: Path) -> None:
    """keep_every=5 over steps 0..9 with a keyframe every 4: steps 5 and 9
    are predicted from 4 and 8, which are kept (and reported); the dry run's
    bytes are what prune + gc free; every kept step reads back bit-exact."""
    path = tmp_path / "run"
    states = train(path, "adamw", steps=10, keyframe_every=4)
    gc(path)  # (the .delta array documents of tensors never coded so: not the prune's bytes)
    dry = prune(path, keep_every=5, dry_run=True)
    assert dry.chained == {"main": [4, 8]}
    assert sorted(s for _, s in dry.removed) == [1, 2, 3, 6, 7]

    def size() -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    before = size()
    report = prune(path, keep_every=5)
    assert report.removed == dry.removed
    gc(path)
    assert before - size() == dry.bytes_freed
    run = dstt.open(path)
    assert run.steps() == [0, 4, 5, 8, 9]
    for s in run.steps():
        for name, value in states[s].items():
            assert bits_equal(run.read(name, s), value), (s, name)
    assert verify(path).ok


def test_prune_cli_says_which_steps_it_keeps_for_chains(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dstt.cli.main import app

    path = tmp_path / "run"
    train(path, "adamw", steps=10, keyframe_every=4)
    r = CliRunner().invoke(app, ["prune", str(path), "--keep-every", "5", "--dry-run"])
    assert r.exit_code == 0, r.stdout
    assert "kept 2 step(s) of main that kept steps' predictive chunks are decoded from (steps 4, 8)" in r.stdout
    r = CliRunner().invoke(app, ["prune", str(path), "--keep-every", "5", "--dry-run", "--json"])
    assert json.loads(r.stdout)["chained"] == {"main": [4, 8]}


def test_a_step_coded_against_a_failed_step_is_stored_whole(tmp_path: Path) -> None:
    """Step 2 is coded and flushed, then fails to commit; step 3 was coded
    against it: it is stored whole, so no committed step depends on a
    missing one (before the fix step 3 committed and could not be read)."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = tmp_path / "run"
    states = {}
    with Writer(path, WriteOptions(compression="predictive", pack_chunk_bytes=0)) as w:
        for step in range(4):
            model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = state_of(model, opt, rng=False)
            if step != 2:
                states[step] = snapshot(model, opt)
                w.write(step, state)
                continue
            plan = w.plan(step, state)
            w.ensure_arrays(plan)
            w.prepare_pred(plan)
            results = [w.flush_chunk(plan, t) for t in plan.tasks]
            with pytest.raises(CaptureError):
                w.commit(plan, results, RuntimeError("disk full (injected)"))
    run = dstt.open(path)
    assert run.steps() == [0, 1, 3]
    for s, state in states.items():
        for name, value in state.items():
            assert bits_equal(run.read(name, s), value), (s, name)
    assert all((t.get("pred") or {"chunks": [None]})["chunks"][0] is None for t in entries(path, 3))
    assert verify(path).ok


def test_stores_of_earlier_versions_still_read_and_append(tmp_path: Path) -> None:
    """A format-2 delta store appended with predictive steps: the root is
    raised to 5, every step (star deltas and predictive chunks) reads back."""
    path = tmp_path / "run"
    first = train(path, "adamw", steps=3, compression="delta")
    assert json.loads((path / "zarr.json").read_text())["attributes"]["dstt"]["format_version"] == 2
    # the same trajectory continued by a predictive writer on the same branch
    g = torch.Generator().manual_seed(0)
    run = dstt.open(path)
    assert run.steps() == [0, 1, 2]
    later = [{"w": torch.randn(4096, generator=g)}]
    for _ in range(2):
        later.append({"w": later[-1]["w"] + 1e-4 * torch.randn(4096, generator=g)})
    with Writer(path, WriteOptions(compression="predictive")) as w:
        for step, state in enumerate(later, start=3):
            w.write(step, state)
    assert json.loads((path / "zarr.json").read_text())["attributes"]["dstt"]["format_version"] == 5
    check_reads(path, first)
    run = dstt.open(path)
    assert run.entry("w", 5).pred is not None
    assert all(bits_equal(run.read("w", s), state["w"]) for s, state in enumerate(later, start=3))
    assert verify(path).ok


_WORKER = r"""
import sys, torch
from dstt.store.writer import Writer
from dstt.store.state import state_of
from dstt.format.writeoptions import WriteOptions
g = torch.Generator().manual_seed(7)
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
with Writer(sys.argv[1], WriteOptions(compression="predictive", keyframe_every=4, pack_chunk_bytes=0)) as w:
    for step in range(10_000):
        model(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        w.write(step, state_of(model, opt, rng=False))
        print(step, flush=True)
"""


def test_sigkill_mid_encode_leaves_every_committed_step_readable(tmp_path: Path) -> None:
    """A writer killed (SIGKILL) while it codes and writes steps: every
    committed step reads back bit-exact (compared with the same trajectory
    recomputed here), verify is clean, and gc removes the leftovers."""
    path = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if int(line) >= 9:  # several chains in, in the middle of the next step
                time.sleep(0.05)
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    g = torch.Generator().manual_seed(7)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = dstt.open(path)
    steps = run.steps()
    assert len(steps) >= 10 and steps == list(range(len(steps)))
    # (exp_avg's chained deltas rarely beat 0.95 of its lz4 keyframe: "adam" chains)
    assert "adam" in predictors(path, range(len(steps)))
    for step in range(len(steps)):
        model(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for name, value in snapshot(model, opt).items():
            assert bits_equal(run.read(name, step), value), (step, name)
    assert verify(path).ok
    gc(path)
    assert verify(path).ok and verify(path).orphans == {"chunks": 0, "arrays": 0, "bytes": 0}


@pytest.mark.parametrize("helper", [True, False])
def test_capture_codes_predictively_in_its_helper(tmp_path: Path, helper: bool) -> None:
    """Capture(compression="predictive"): the capture helper codes each step
    against the previous one (off the trainer's process); every step reads
    back bit-exact. Without a helper the steps are stored whole (coding in
    the trainer's process would share its CPU and GIL), and a warning says so."""
    threads_before = blosc.use_threads
    model, opt, g = small_adamw(5)
    path = tmp_path / "run"
    states = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cap = dstt.Capture(path, compression="predictive", helper=helper, keyframe_every=4)
    assert any(issubclass(w.category, CaptureWarning) and "stored whole" in str(w.message) for w in said) != helper
    try:
        for step in range(6):
            model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            states.append(snapshot(model, opt))
    finally:
        cap.close()
    check_reads(path, states)
    used = predictors(path, range(6))
    assert ("adam" in used) == helper, used
    assert blosc.use_threads is threads_before  # (set in the helper's process only: helpercpu.py)
    assert verify(path).ok


def test_dstt_save_codes_each_call_against_the_stored_previous_step(tmp_path: Path) -> None:
    """dstt.save (a new writer per call) reads the latest step back and codes
    against it, keyframes every K steps still; a new branch's first step is
    predicted from its fork step; every step reads back bit-exact."""
    model, opt, g = small_adamw(9)
    path = tmp_path / "run"
    states = []
    for step in range(7):
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        dstt.save(path, step, state_of(model, opt, rng=False), compression="predictive", keyframe_every=3)
        states.append(snapshot(model, opt))
    check_reads(path, states)
    chunks = {s: [t["pred"]["chunks"][0] if "pred" in t else None for t in entries(path, s)
                  if t["name"] == "model/0.weight"][0] for s in range(7)}
    assert chunks == {0: None, 1: [0, 1, 0], 2: [0, 2, 1], 3: None, 4: [0, 4, 3], 5: [0, 5, 4], 6: None}
    assert "adam" in predictors(path, range(7))
    side = snapshot(model, opt)
    dstt.save(path, 9, state_of(model, opt, rng=False), compression="predictive", branch="side", parent=("main", 5))
    doc = json.loads((path / L.step_dir("side", 9) / "index.json").read_text())
    (w,) = [t for t in doc["tensors"] if isinstance(t, dict) and t["name"] == "model/0.weight"]
    assert w["pred"]["chunks"] == [[0, 9, 5]]  # predicted from main's step 5
    run = dstt.open(f"{path}@side")
    assert all(bits_equal(run.read(n, 9), v) for n, v in side.items())
    assert verify(path).ok


def test_the_coders_memory_is_bounded(tmp_path: Path) -> None:
    """A writer whose coder may remember fewer bytes than a step holds codes
    only what it remembered: the rest is stored whole, every step reads back."""
    g = torch.Generator().manual_seed(4)
    big, small = torch.randn(4096, generator=g), torch.randn(256, generator=g)
    states = []
    with Writer(tmp_path / "run", WriteOptions(compression="predictive", pack_chunk_bytes=0)) as w:
        assert w.coder is not None
        w.coder.memory_limit = 4096  # the small tensor (1 KiB) fits, the big one (16 KiB) does not
        for step in range(3):
            state = {"big": big + step * 1e-6, "small": small + step * 1e-6}
            w.write(step, state)
            states.append(state)
        assert w.coder.held <= 4096
    run = dstt.open(tmp_path / "run")
    assert run.entry("small", 2).pred is not None and run.entry("big", 2).pred is None
    assert all(bits_equal(run.read(n, s), v) for s, st in enumerate(states) for n, v in st.items())


def test_a_group_commit_of_predicted_steps_publishes_its_markers_in_order(tmp_path: Path) -> None:
    """Steps committed as a group (the capture helper behind) where a step
    is predicted from the one before: each marker is made durable before
    the next is renamed into place, so a crash leaves a prefix committed,
    never a step without the step it is predicted from."""
    from dstt.format import groupcommit

    events: list[str] = []
    g = torch.Generator().manual_seed(2)
    w0 = torch.randn(4096, generator=g)
    with Writer(tmp_path / "run", WriteOptions(compression="predictive")) as w:
        if not groupcommit.can_group(w.commits):
            pytest.skip("this backend cannot sync a group at once: steps are committed one by one")
        w.write(0, {"w": w0})
        items = []
        for step in (1, 2, 3):
            plan = w.plan(step, {"w": w0 + step * 1e-6})
            w.ensure_arrays(plan)
            w.prepare_pred(plan)
            items.append((plan, [w.flush_chunk(plan, t) for t in plan.tasks]))
        backend = w.backend
        rename, sync = backend.rename, backend.sync  # type: ignore[attr-defined]

        def watched_rename(src: str, dst: str) -> None:
            events.append("rename")
            rename(src, dst)

        def watched_sync() -> None:
            events.append("sync")
            sync()

        backend.rename, backend.sync = watched_rename, watched_sync  # type: ignore[method-assign, attr-defined]
        infos = w.commit_group(items)
        assert [i.step for i in infos] == [1, 2, 3]
    renames = [i for i, e in enumerate(events) if e == "rename"]
    assert len(renames) == 3 and all(events[i + 1] == "sync" for i in renames), events
    run = dstt.open(tmp_path / "run")
    assert [run.entry("w", s).pred.chunks[0][1:] for s in (1, 2, 3)] == [(1, 0), (2, 1), (3, 2)]


@pytest.mark.parametrize("helper", [True, False])
def test_the_memory_tiers_persisted_steps_are_coded_predictively(tmp_path: Path, helper: bool) -> None:
    """Capture(memory_steps=, persist="all", compression="predictive"): the
    steps the flight recorder persists go through the same codec (each
    predicted from the previous persisted step) and read back bit-exact,
    with the tier in the capture helper (the default) and in the trainer's
    process (helper=False)."""
    model, opt, g = small_adamw(6)
    path = tmp_path / "run"
    states = []
    cap = dstt.Capture(path, compression="predictive", memory_steps=4, persist="all", keyframe_every=4,
                       helper=helper)
    try:
        for step in range(6):
            model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            states.append(snapshot(model, opt))
    finally:
        cap.close()
    run = dstt.open(path)
    assert run.steps() == list(range(6))
    check_reads(path, states)
    assert "adam" in predictors(path, range(6))
    assert verify(path).ok


def test_the_tier_in_the_helper_codes_against_a_step_whose_slot_was_reused(tmp_path: Path) -> None:
    """persist=N with the tier in the capture helper: the previous persisted
    step left the tier (its ring slot given back, then reused by the
    trainer) before the next persisted step is coded against it. The coder
    remembers ring views only while the tier holds the step; they are copied
    before the slot goes back, so every persisted step reads back bit-exact."""
    with torch.random.fork_rng():
        torch.manual_seed(8)
        model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 512))  # 4.7 MB a step
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(8)
    path = tmp_path / "run"
    states = {}
    cap = dstt.Capture(path, compression="predictive", memory_steps=1, persist=6, keyframe_every=8)
    try:
        for step in range(13):
            model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            states[step] = snapshot(model, opt)
    finally:
        cap.close()
    run = dstt.open(path)
    assert run.steps() == [0, 6, 12]
    # step 6 coded against step 0, whose ring bytes the trainer overwrote meanwhile (the ring holds 5 steps)
    assert run.entry("model/1.weight", 6).pred is not None
    for step in run.steps():
        assert all(bits_equal(run.read(n, step), v) for n, v in states[step].items()), step
    assert verify(path).ok


def run_chunk_recipe(store: Path, branch: str, step: int, name: str, i: int) -> tuple[np.ndarray, tuple[slice, ...]]:
    """docs/format.md "Reading a predictive chunk without dstt", run as
    written after "Predictive chunks"'s prediction block (its ``decode``)."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text()
    predict = re.search(r"```python\n(.*?)```", doc.split("**The prediction**", 1)[1], re.S)
    recipe = re.search(r"```python\n(.*?)```", doc.split("### Reading a predictive chunk without dstt", 1)[1], re.S)
    assert predict is not None and recipe is not None
    first = "store, branch, step, name, i = "
    code = recipe.group(1)
    assert code.count(first) == 1
    lines = [f"{first}{str(store)!r}, {branch!r}, {step}, {name!r}, {i}" if line.startswith(first) else line
             for line in code.splitlines()]
    scope: dict[str, Any] = {}
    exec(predict.group(1), scope)  # noqa: S102 - the documented recipe itself
    exec("\n".join(lines), scope)  # noqa: S102
    return scope["bits"], scope["box"]


@pytest.mark.parametrize("packs", [False, True])
def test_docs_predictive_chunk_recipe_reads_every_chunk_verbatim(tmp_path: Path, packs: bool) -> None:
    """The document's numpy + zarr-python recipe for a predictive chunk
    (find its pred record, walk the chain to the keyframes, add the
    residuals) gives dstt's bits for every chunk of every tensor of a
    mid-chain step, edge chunks included: chunks in chunk files, and
    chunks in packs (their range of a pack holds the keyframe or the
    residual)."""
    path = tmp_path / "run"
    states = train(path, "adamw", steps=4, keyframe_every=8, shapes=((40, 24), (24, 8)),
                   pack_chunk_bytes=1 << 20 if packs else 0, max_chunk_bytes=1024)
    run = dstt.open(path)
    assert run.entry("model/m.0.weight", 3).pred is not None and run.entry("model/m.0.weight", 3).nchunks > 2
    packed = [all(e.pack(i) is not None for i in range(e.nchunks))
              for e in (run.entry(n, s) for n in states[3] for s in range(4))]
    assert all(packed) if packs else not any(packed)
    seen = 0
    for name, value in states[3].items():
        e = run.entry(name, 3)
        if e.pred is None:
            continue
        ints = value.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            value.element_size()])
        for i in range(e.nchunks):
            bits, box = run_chunk_recipe(path, "main", 3, name, i)
            assert np.array_equal(bits.view(ints.numpy().dtype), ints[box].reshape(-1).numpy()), (name, i)
            seen += 1
    assert seen > 6


@pytest.mark.parametrize("damage", [
    lambda p: p["chunks"][0].__setitem__(2, p["chunks"][0][1]),  # prev not before cur
    lambda p: p["chunks"][0].__setitem__(0, 5),  # coding out of range
    lambda p: p.__setitem__("array", "tensors/other/@x.delta"),  # not the entry's sibling
    lambda p: p["inputs"].pop("param"),  # its own role missing
    lambda p: p["codings"][0].__setitem__("predictor", "adam9"),  # unknown predictor
    lambda p: p["codings"][0].__setitem__("dtype", "float16"),  # another dtype
    lambda p: p.__setitem__("extra", 1),
])
def test_a_hostile_pred_record_is_refused(tmp_path: Path, damage: Callable[[dict[str, Any]], None]) -> None:
    """A pred record that does not check out (untrusted index) is refused
    with a dstt error when the entry is parsed, never decoded."""
    from dstt.errors import DsttError
    from dstt.format.entries import parse_entry

    path = tmp_path / "run"
    train(path, "adamw", steps=3, pack_chunk_bytes=0)
    (t,) = [t for t in entries(path, 2) if t["name"] == "model/m.0.weight"]
    parse_entry(json.loads(json.dumps(t)), "index")  # as written: accepted
    bad = json.loads(json.dumps(t))
    damage(bad["pred"])
    with pytest.raises(DsttError):
        parse_entry(bad, "index")


def test_the_helper_tiers_backfills_are_coded_against_the_previous_step(tmp_path: Path) -> None:
    """An incident persists the steps the tier in the capture helper had
    passed over; those older than the head (backfills) are coded too, each
    against the previous captured step where it is stored -- the first
    against the stored step before it (read back, its chain counted), the
    next against the backfill just stored -- bit-exact and verified."""
    model, opt, g = small_adamw(8)
    path = tmp_path / "run"
    states = []
    cap = dstt.Capture(path, compression="predictive", memory_steps=8, persist=4, keyframe_every=8, helper=True)
    try:
        for step in range(8):
            model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cap.snapshot(step, model=model, optimizer=opt)
            states.append(snapshot(model, opt))
        cap.wait()
        assert dstt.open(path).steps() == [0, 4]
        cap.incident("bad batch")  # 1..3 are older than the head (4): backfills; 5..7 newer
        cap.wait()
    finally:
        cap.close()
    run = dstt.open(path)
    assert run.steps() == list(range(8))
    check_reads(path, states)
    for step in (1, 2, 3):
        e = run.entry("model/0.weight", step)
        assert e.pred is not None and {c[2] for c in e.pred.chunks} == {step - 1}, (step, e.pred)
        assert run.entry("optim/0.weight/exp_avg_sq", step).pred is not None
    assert verify(path).ok
