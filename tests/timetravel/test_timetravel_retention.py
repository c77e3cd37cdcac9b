"""Branches, export, prune and gc (library and CLI)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dstt
from dstt.api import gc
from dstt.cli.main import app
from dstt.format.gc import prune
from dstt.format.writeoptions import WriteOptions
from tests.conftest import bits_equal

cli = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    res = cli.invoke(app, list(args))
    return res.exit_code, res.output


def state(step: int) -> dict:
    """A frozen embedding (same every step) and a layer that changes."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"emb": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
                      "w": torch.randn(32, 32, generator=g).to(torch.bfloat16)},
            "extra": {"step": step}}


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_branch_shares_parent_data(store: Path) -> None:
    for s in range(3):
        dstt.save(store, s, state(s))
    code, out = invoke("branch", str(store), "exp", "--from", "main:1", "--json")
    assert code == 0, out
    assert json.loads(out) == {"branch": "exp", "parent": {"branch": "main", "step": 1}}
    assert not (store / "meta/steps/exp").exists()  # no data copied
    restored = dstt.open(f"{store}@main:1").state_dict()
    info = dstt.save(store, 2, restored, branch="exp", parent=("main", 1))
    assert info.bytes_written == 0  # an unchanged first step only references the parent's chunks
    info = dstt.save(store, 3, {**restored, "model": {**restored["model"], "w": restored["model"]["w"] + 1}},
                     branch="exp")
    assert 0 < info.bytes_written < 64 * 64 * 4  # only the changed tensor
    run = dstt.open(store)
    assert run.steps("main") == [0, 1, 2] and run.steps("exp") == [2, 3]
    assert bits_equal(run.read("model/w", 2, branch="exp"), run.read("model/w", 1, branch="main"))
    # Writer/Capture with parent= creates the branch too; errors are one line with exit codes.
    dstt.save(store, 5, state(5), branch="exp2", parent=("main", 2))
    assert dstt.open(store).branch_info("exp2").parent == ("main", 2)
    assert invoke("branch", str(store), "exp", "--from", ":0")[0] == 1
    code, out = invoke("branch", str(store), "bad name", "--from", ":0")
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert invoke("branch", str(store), "x", "--from", "main:99")[0] == 1


def test_export_pt_and_safetensors(store: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    m = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    st = dstt.state_of(model=m, optimizer=opt, rng=True, extra={"pos": 3})
    st["model"]["f8"] = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    st["model"]["mask"] = torch.tensor([True, False])
    st["model"]["ids"] = torch.arange(5, dtype=torch.int32)
    dstt.save(store, 4, st)

    pt = tmp_path / "all.pt"
    code, out = invoke("restore", f"{store}:4", "--out", str(pt), "--quiet")
    assert code == 0, out
    back = torch.load(pt, weights_only=True)
    assert back["extra"] == {"pos": 3}
    assert isinstance(back["rng"]["numpy"][1], torch.Tensor)  # numpy array → tensor, weights_only-safe
    for k, v in st["model"].items():
        assert bits_equal(back["model"][k], v), k
    assert bits_equal(back["optim"]["state"][0]["exp_avg"], opt.state[m.weight]["exp_avg"])  # state_dict form

    sf = tmp_path / "model.safetensors"
    code, out = invoke("restore", f"{store}:4", "-o", str(sf), "--only", "model", "--json")
    assert code == 0, out
    assert json.loads(out)["n_tensors"] == 5
    flat = load_file(sf)
    assert set(flat) == set(st["model"])
    for k, v in st["model"].items():
        assert bits_equal(flat[k], v), k
    with safe_open(sf, "pt") as f:
        assert f.metadata()["dstt_step"] == "4"
    info = dstt.export(f"{store}:4", tmp_path / "all.safetensors")
    assert "optim/weight/exp_avg" in load_file(tmp_path / "all.safetensors")
    assert info.notes and "non-tensor" in info.notes[0]
    # Bad input: one line, non-zero exit, nothing written.
    assert invoke("restore", f"{store}:4", "--out", str(tmp_path / "x.txt"))[0] == 2
    code, out = invoke("restore", f"{store}:4", "--out", str(tmp_path / "x.pt"), "--only", "nope")
    assert code == 1 and "no subtree 'nope'" in out and not (tmp_path / "x.pt").exists()


def test_prune_and_gc_keep_everything_referenced(store: Path) -> None:
    for s in range(10):
        dstt.save(store, s, state(s))
    dstt.save(store, 20, state(20), branch="side", parent=("main", 3))
    dstt.save(store, 21, state(21), branch="side")
    # A crashed step: a step directory without commit.json, and its chunk.
    partial = store / "meta/steps/main/00000000000000000099"
    partial.mkdir()
    (partial / "index.json").write_bytes(b"{}")
    run = dstt.open(store)
    expected = {(b, s): run.state_dict(s, branch=b) for b in ("main", "side") for s in run.steps(b)}
    before = disk_bytes(store)

    code, out = invoke("prune", str(store), "--keep-last", "2", "--keep-every", "4", "--dry-run", "--json")
    assert code == 0, out
    assert {(r["branch"], r["step"]) for r in json.loads(out)["removed"]} == {("main", s) for s in (1, 2, 5, 6, 7)}
    code, out = invoke("gc", str(store), "--dry-run", "--json")
    assert code == 0 and json.loads(out)["chunks_removed"] == 0  # every chunk is still referenced
    assert disk_bytes(store) == before  # dry runs change nothing

    report = prune(store, keep_last=2, keep_every=4)
    kept = {"main": [0, 3, 4, 8, 9], "side": [20, 21]}  # 3 is the side branch's parent
    assert report.kept == kept
    code, out = invoke("gc", str(store), "--json")
    assert code == 0, out
    g = json.loads(out)
    assert g["chunks_removed"] == 5 and g["partial_steps_removed"] == [{"branch": "main", "dir": partial.name}]
    assert disk_bytes(store) < before - 5 * 32 * 32 * 2
    run = dstt.open(store)
    for b, steps in kept.items():
        assert run.steps(b) == steps
        for s in steps:
            got = run.state_dict(s, branch=b, verify=True)
            assert got["extra"] == expected[(b, s)]["extra"]
            for k, v in expected[(b, s)]["model"].items():
                assert bits_equal(got["model"][k], v), (b, s, k)
    assert gc(store).chunks_removed == 0  # idempotent
    # The frozen embedding written once at step 0 is still shared by every kept step.
    assert {tuple(run.record(s, branch="main").by_name["model/emb"].slots) for s in kept["main"]} == \
        {tuple(run.record(0, branch="main").by_name["model/emb"].slots)}


def test_prune_and_gc_refuse_beside_a_live_writer(store: Path) -> None:
    for s in range(3):
        dstt.save(store, s, state(s))
    with dstt.Writer(store, WriteOptions(branch="main")) as w:
        w.write(3, state(3))
        code, out = invoke("gc", str(store))
        assert code == 1 and "being written" in out
        with pytest.raises(dstt.StoreLockedError):
            prune(store, keep_last=1)
    assert dstt.open(store).steps() == [0, 1, 2, 3]
    code, out = invoke("prune", str(store))
    assert code == 2 and "--keep-last" in out
    assert invoke("prune", str(store), "--keep-last", "0")[0] == 2
    assert invoke("prune", str(store), "--keep-last", "1", "--branch", "nope")[0] == 1
    assert prune(store, keep_last=1, branch="main").removed == [("main", 0), ("main", 1), ("main", 2)]
    assert os.listdir(store / "meta/steps/main") == ["00000000000000000003"]


def test_export_refuses_a_missing_or_unwritable_directory(store: Path, tmp_path: Path) -> None:
    dstt.save(store, 0, {"w": torch.ones(2)})
    with pytest.raises(dstt.ConfigError, match="not a writable directory"):
        dstt.export(f"{store}:0", tmp_path / "nowhere" / "x.pt")
    assert not (tmp_path / "nowhere").exists()
