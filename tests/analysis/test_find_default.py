"""``dstt find`` with no flags (issue 29 item 1): the default scope (model
tensors and float values; never RNG states, optimizer state, counters or
data offsets), values judged (an lr x100, a NaN loss, a loss spike), jumps
judged across gaps, detections grouped by step. Real training loops of a
small model, stored with ``dstt.save``; ``find`` run through the CLI as a
user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

runner = CliRunner()


def _find(*args: str) -> dict[str, Any]:
    res = runner.invoke(app, ["find", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _train(path: Path, steps: int = 30, *, lr_spike_at: int | None = None, spike_at: int | None = None,
           nan_at: int | None = None, keep: list[int] | None = None) -> None:
    """A small MLP regressor trained with AdamW, the loss and a data offset in
    ``extra``; faults injected as a user's loop would meet them."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(8, 1, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        if step == lr_spike_at:
            opt.param_groups[0]["lr"] *= 100
        x = torch.randn(32, 8, generator=g)
        y = x @ w_true
        if step == spike_at:
            y = y + 20.0  # a batch of outliers
        if step == nan_at:
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if keep is None or step in keep:
            dstt.save(path, step, dstt.state_of(model=model, optimizer=opt,
                                               extra={"loss": loss.item(), "next_ix": step * 4096}))


def test_find_with_no_flags_names_an_lr_blow_up_at_its_step(store: Path) -> None:
    """An lr x100 at step 25: plain ``find`` gives step 25 and says the
    learning rate jumped; the detection is one per step, values first."""
    _train(store, lr_spike_at=25)
    doc = _find(str(store))
    assert doc["first_step"] == 25
    (det,) = doc["detections"]
    assert det["step"] == 25 and det["names"][0] == "optim/param_groups/0/lr"
    assert det["reasons"].get("value_jump") == 1
    (ev,) = [e for e in doc["events"] if e["tensor"] == "optim/param_groups/0/lr"]
    assert ev["previous"] == pytest.approx(1e-2) and ev["value"] == pytest.approx(1.0)
    human = runner.invoke(app, ["find", str(store)])
    assert human.exit_code == 0 and "value_jump: optim/param_groups/0/lr" in human.stdout
    assert "first problem at step 25" in human.stdout


def test_find_with_no_flags_names_a_loss_spike_and_a_nan_loss(store: Path) -> None:
    """A batch of outliers at step 16, a NaN batch at step 24: plain ``find``
    gives 16 (the loss above its recent high); ``--all`` also step 24,
    where the loss and the weights are NaN."""
    _train(store, spike_at=16, nan_at=24)
    doc = _find(str(store))
    assert doc["first_step"] == 16
    (ev,) = [e for e in doc["events"] if e["tensor"] == "extra/loss"]
    assert ev["reason"] == "spike" and ev["value"] > 2 * ev["previous"]
    nan = [d for d in _find(str(store), "--all")["detections"] if d["step"] == 24]
    assert nan and "extra/loss" in nan[0]["names"] and nan[0]["reasons"]["nonfinite"] >= 2


def test_find_leaves_a_clean_run_counters_offsets_and_rng_alone(store: Path) -> None:
    """A clean run: nothing, although the data offset grows 4096 per step (a
    norm jump of 2x-inf from step 0), the optimizer's step counters grow
    and RNG states change every step; naming the offset looks at it."""
    _train(store)
    assert _find(str(store))["first_step"] is None
    doc = _find(str(store), "extra/next_ix")  # told to: a value from 0 is not judged, then 2x, 1.5x ...
    assert doc["first_step"] is None
    assert _find(str(store), "extra/next_ix", "--jump", "1.4")["first_step"] == 2  # 8192 / 4096
    assert _find(str(store), "optim/*", "--jump", "1.5")["first_step"] is not None  # optimizer state when asked


def test_find_does_not_call_a_gap_a_jump(store: Path) -> None:
    """Stored steps 0-5, then 22 (the flight recorder's memory-only steps in
    between): a tensor that grows 15x across the 17-step gap is not a spike
    (a ramp over 17 steps); the same growth between neighbours is."""
    for s, v in [(0, 1.0), (1, 1.1), (2, 1.2), (3, 1.3), (4, 1.4), (5, 1.5), (22, 22.5), (23, 22.6)]:
        dstt.save(store, s, {"model": {"w": torch.full((4,), v / 2)}})
    assert _find(str(store))["first_step"] is None
    dstt.save(store, 24, {"model": {"w": torch.full((4,), 400.0)}})  # 17.7x in one step
    doc = _find(str(store))
    assert doc["first_step"] == 24 and doc["events"][0]["gap"] == 1


def test_find_does_not_flag_a_bias_crossing_zero(store: Path) -> None:
    """A one-element bias whose norm passes near 0 (0.2 -> 0.002 -> 0.03):
    neither the fall (a tensor of a few elements) nor the 15x rise from a
    norm under 1/10 of its peak means anything; a 20-element weight falling
    100x does."""
    for s, b in enumerate([0.5, 0.4, 0.2, 0.002, 0.03, 0.1]):
        dstt.save(store, s, {"model": {"w": torch.ones(3), "b": torch.tensor([b])}})
    assert _find(str(store))["first_step"] is None
    dstt.save(store, 6, {"model": {"w": torch.ones(20) / 100, "b": torch.tensor([0.1])}})
    assert _find(str(store))["first_step"] == 6
