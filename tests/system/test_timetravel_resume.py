"""Bit-exact resume after SIGKILL, in real processes, continuing on a new branch."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

import dstt
from tests.conftest import bits_equal, kill_when_committed, start_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/resume_train.py"
K = 6  # crash point; the run is 2K steps and crosses an epoch (5 batches) on each side


def train(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def train_here(*args: str) -> None:
    """The same script in this process (no interpreter start-up); only the
    crashed and the resumed runs need to be separate processes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("resume_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        mod.main(list(args))
    finally:
        torch.use_deterministic_algorithms(was)


def kill_after(store: Path, step: int) -> None:
    """Train 'forever', SIGKILL the process once ``step`` is committed."""
    kill_when_committed(start_script(SCRIPT, str(store), "--steps", "1000000", stderr=subprocess.DEVNULL), step)
    # Its capture helper commits the steps already sealed, then frees the branch.
    from dstt.format.lock import lock_holder

    deadline = time.monotonic() + 60
    while lock_holder(store, "main") is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def final(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def same_training_state(a: dict, b: dict) -> bool:
    if a["sched"] != b["sched"] or a["optim"]["param_groups"] != b["optim"]["param_groups"]:
        return False
    if any(not bits_equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    return sa.keys() == sb.keys() and all(bits_equal(v, sb[i][k]) for i in sa for k, v in sa[i].items())


def test_sigkill_then_resume_is_bit_exact(tmp_path: Path) -> None:
    ref_store, crash_store = tmp_path / "ref", tmp_path / "crash"
    train_here(str(ref_store), "--steps", str(2 * K), "--out", str(tmp_path / "ref.pt"))
    kill_after(crash_store, K)

    run = dstt.open(crash_store)
    killed_steps = run.steps()
    assert killed_steps[:K] == list(range(1, K + 1))  # durable up to (at least) the kill point
    train(str(crash_store), "--resume", f"{crash_store}@main:{K}", "--branch", "resumed",
          "--steps", str(2 * K), "--out", str(tmp_path / "resumed.pt"))
    assert same_training_state(final(tmp_path / "ref.pt"), final(tmp_path / "resumed.pt"))

    # The resumed branch forks at step K; the crashed branch is untouched.
    run = dstt.open(crash_store)
    assert run.branch_info("resumed").parent == ("main", K)
    assert run.steps("resumed") == list(range(K + 1, 2 * K + 1))
    assert run.steps("main") == killed_steps
    ref = dstt.open(ref_store)
    for name in [t.name for t in ref.tensors(2 * K)]:
        if not name.startswith("rng/"):
            assert bits_equal(run.read(name, 2 * K, branch="resumed"), ref.read(name, 2 * K)), name

    # Control: the same resume without the RNG states diverges (dropout, shuffling, noise).
    train_here(str(crash_store), "--resume", f"{crash_store}@main:{K}", "--branch", "no-rng", "--no-rng",
          "--steps", str(K + 2), "--out", str(tmp_path / "no_rng.pt"))
    ref_mid = dstt.open(ref_store).state_dict(K + 2, prefix="model")
    no_rng = final(tmp_path / "no_rng.pt")["model"]
    assert not all(bits_equal(no_rng[k], ref_mid[k]) for k in ref_mid)
