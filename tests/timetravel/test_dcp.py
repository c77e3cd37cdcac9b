"""DCP in and out, and the ``.pt`` export's optimizer state (issue 29,
item 4): a step exported as a torch.distributed.checkpoint directory, or a
``.pt`` file, is loaded into a freshly built model + optimizer + scheduler
the way a DCP trainer (or a plain one) loads its own checkpoints, and
training continues bit-exactly; DCP checkpoints a trainer wrote without
dstt are imported and read back bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from typer.testing import CliRunner

import dstt
from dstt.cli.main import app

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


X = torch.linspace(-1, 1, 64 * 8).reshape(64, 8)
Y = torch.stack([X[:, 0].sin(), X[:, 1] * X[:, 2]], dim=1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range,
          store: Path | None = None) -> None:
    for step in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        sched.step()
        if store is not None:
            dstt.save(store, step, dstt.state_of(model=model, optimizer=opt, scheduler=sched, rng=False,
                                                  extra={"step": step}))


def same_bits(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32))
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A store of steps 0..5 and the model after step 7 (the run went on)."""
    store = tmp_path_factory.mktemp("dcp") / "run"
    model, opt, sched = build(0)
    train(model, opt, sched, range(6), store)
    train(model, opt, sched, range(6, 8))
    return store, model


def test_dcp_export_resumes_a_fresh_trainer_bit_exactly(run: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    store, final = run
    out = tmp_path / "ckpt"
    r = runner.invoke(app, ["export", f"{store}:5", "--format", "dcp", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["format"] == "dcp" and (out / ".metadata").is_file()
    model, opt, sched = build(1)  # another init: everything must come from the checkpoint
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched.state_dict()}
    dcp.load(state, checkpoint_id=str(out))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    sched.load_state_dict(state["lr_scheduler"])
    train(model, opt, sched, range(6, 8))
    assert same_bits(model, final)
    r = runner.invoke(app, ["export", f"{store}:5", "--format", "dcp", str(out)])
    assert r.exit_code == 2 and "exists" in r.output  # never over a checkpoint


def test_pt_export_loads_with_optimizer_load_state_dict(run: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    store, final = run
    r = runner.invoke(app, ["export", f"{store}:5", str(tmp_path / "s5.pt"), "-q"])
    assert r.exit_code == 0, r.output
    saved = torch.load(tmp_path / "s5.pt", weights_only=True)
    model, opt, sched = build(1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["scheduler"])
    train(model, opt, sched, range(6, 8))
    assert same_bits(model, final)
    dstt.export(f"{store}:5", tmp_path / "opt.pt", only="optim")  # the optimizer alone, too
    model2, opt2, _ = build(1)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    stored = dstt.open(store).state_dict(5)["optim"]
    assert torch.equal(opt2.state[model2[2].weight]["exp_avg_sq"], stored["2.weight"]["exp_avg_sq"])  # order kept


def test_import_dcp_of_a_trainer_that_never_used_dstt(tmp_path: Path) -> None:
    model, opt, sched = build(0)
    ckpts = tmp_path / "ckpts"
    kept: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, 7):
        train(model, opt, sched, range(step - 1, step))
        if step % 3 == 0:  # a DCP trainer's own checkpoints: step-3/, step-6/
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched.state_dict(),
                      "train_state": {"step": step}}, checkpoint_id=str(ckpts / f"step-{step}"))
            kept[step] = {k: v.clone() for k, v in model.state_dict().items()}
    store = tmp_path / "imported"
    r = runner.invoke(app, ["import-dcp", str(ckpts), f"{store}@main", "--json"])
    assert r.exit_code == 0, r.output
    assert [(x["branch"], x["step"]) for x in json.loads(r.stdout)["imported"]] == [("main", 3), ("main", 6)]
    run = dstt.open(store)
    assert run.steps() == [3, 6]
    for step, want in kept.items():
        got = run.state_dict(step)
        assert all(torch.equal(got["model"][k], v) for k, v in want.items())
        assert got["train_state"] == {"step": step} and got["scheduler"]["last_epoch"] == step
    assert torch.equal(run.state_dict(6)["optim"]["0.weight"]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    r = runner.invoke(app, ["diff", f"{store}:3", ":6", "--json"])  # the everyday commands work on it
    assert r.exit_code == 0 and any(t["name"] == "model/0.weight" for t in json.loads(r.stdout)["tensors"])
    r = runner.invoke(app, ["restore", f"{store}:6", "--format", "dcp", str(tmp_path / "again")])
    assert r.exit_code == 0, r.output  # and round-trips out again
    r = runner.invoke(app, ["import-dcp", str(tmp_path / "again"), f"{store}@side"])
    assert r.exit_code == 2 and "STORE:STEP" in r.output  # "again" ends in no number: the step is asked for
    r = runner.invoke(app, ["import-dcp", str(tmp_path / "again"), f"{store}@side:7"])
    assert r.exit_code == 0, r.output
    back = dstt.open(store).state_dict(7, branch="side")
    assert all(torch.equal(back["model"][k], v) for k, v in kept[6].items())
    assert torch.equal(back["optim"]["0.weight"]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
