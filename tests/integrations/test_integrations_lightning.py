"""dstt.integrations.lightning: real Lightning fits (automatic optimization
with gradient accumulation, and manual optimization), captured every
optimizer step, SIGKILLed in real subprocesses and resumed from dstt bit for
bit."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import dstt
from tests.conftest import bits_equal, finish, kill_when_committed, start_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/scripts/pl_train.py"


def start(*args: str) -> subprocess.Popen:
    return start_script(SCRIPT, *args)


def together(runs: Iterable[list[str]]) -> list[str]:
    """The arguments of several runs made by one process, one after another."""
    out: list[str] = []
    for args in runs:
        out += ["--next", *args] if out else args
    return out


def same_training_state(a: dict, b: dict) -> bool:
    if a["sched"] != b["sched"] or a["optim"]["param_groups"] != b["optim"]["param_groups"]:
        return False
    if any(not bits_equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    return sa.keys() == sb.keys() and all(bits_equal(v, sb[i][k]) for i in sa for k, v in sa[i].items())


def test_fit_killed_and_resumed_from_dstt_is_bit_exact(tmp_path: Path) -> None:
    # automatic: 6 batches per epoch, accumulation 2 -> 3 optimizer steps per epoch, killed
    # mid-epoch (step 4: the resumed run skips the epoch's first 4 batches, as the HF Trainer does);
    # manual: one optimizer step per batch -> 6 per epoch, killed at an epoch's end.
    cases = {"auto": (7, 4, []), "manual": (9, 6, ["--manual"])}
    # The two references in one process, one fit after the other, and the two
    # resumed runs in another: each fit stands alone (seeded, deterministic),
    # and a fit that left anything behind for the next would fail the check.
    ref = start(*together([str(tmp_path / f"{name}-ref"), "--steps", str(n), *flags, "--out",
                           str(tmp_path / f"{name}-ref.pt")] for name, (n, k, flags) in cases.items()))
    victims = {name: start(str(tmp_path / name), "--steps", str(n), *flags, "--hold-at", str(k))
               for name, (n, k, flags) in cases.items()}
    for name, victim in victims.items():
        kill_when_committed(victim, cases[name][1])
    finish(ref)
    finish(start(*together([str(tmp_path / name), "--steps", str(n), *flags, "--resume", f"{tmp_path / name}:latest",
                            "--out", str(tmp_path / f"{name}-res.pt")] for name, (n, k, flags) in cases.items())))

    for name, (n, _k, _flags) in cases.items():
        a = torch.load(tmp_path / f"{name}-ref.pt", weights_only=True)
        b = torch.load(tmp_path / f"{name}-res.pt", weights_only=True)
        assert same_training_state(a, b), name
        run = dstt.open(tmp_path / name)
        assert run.steps() == list(range(1, n + 1)), name  # one capture per optimizer step, same branch
        last = run.state_dict(n)
        assert all(bits_equal(last["model"][key], a["model"][key]) for key in a["model"]), name
        assert last["extra"]["lightning"]["global_step"] == n
        assert last["scheduler"]["last_epoch"] == n  # the step-interval scheduler stepped before the capture
        assert "train_loss" in last["extra"]["metrics"]
        ref_run = dstt.open(tmp_path / f"{name}-ref")
        # Every captured step of the resumed run equals the uninterrupted run's.
        assert all(r["status"] == "unchanged" for r in ref_run.diff(n, f"{tmp_path / name}:{n}", ["model/*", "optim/*"]))


def test_resume_needs_a_lightning_capture(tmp_path: Path) -> None:
    from dstt.errors import RestoreMismatchError
    from dstt.integrations.lightning import DsttCallback

    store = tmp_path / "run"
    dstt.save(store, 1, dstt.state_of(model=torch.nn.Linear(2, 2), rng=False))
    with pytest.raises(RestoreMismatchError, match="extra/lightning"):
        DsttCallback(store).resume(f"{store}:latest")
