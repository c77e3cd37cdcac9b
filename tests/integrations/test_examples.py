"""Every example in examples/ runs as it is (real subprocesses) and ends
with the dstt commands to run next; the ones that resume do so bit-exactly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import dstt

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                 "TMPDIR": str(cwd)})  # (an example's own temporary store stays in tmp_path)


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "what a user would run next" in out
    return out


def test_plain_loop_and_next_batch_recipe(tmp_path: Path) -> None:
    store = tmp_path / "plain"
    plain = start([sys.executable, str(EX / "plain_loop.py"), "--store", str(store), "--steps", "12"], tmp_path)
    recipe = start([sys.executable, str(EX / "next_batch_first.py")], tmp_path)
    finish(plain)
    out = finish(recipe)
    assert "from extra: bit-exact" in out and "a batch was skipped" in out
    assert dstt.open(store).steps() == list(range(12))
    resumed = start([sys.executable, str(EX / "plain_loop.py"), "--store", str(store), "--steps", "12",
                     "--resume", f"{store}:5", "--branch", "retry"], tmp_path)
    finish(resumed)
    rows = dstt.open(store).diff(11, f"{store}@retry:11")
    assert rows and all(r["status"] == "unchanged" for r in rows)  # travelled back and went on, bit for bit


@pytest.mark.slow  # ~15 s: torchrun start-up; the FSDP2 capture itself is covered by test_capture_dist.py
@pytest.mark.distributed
def test_fsdp2_torchrun_example(tmp_path: Path) -> None:
    store = tmp_path / "fsdp"
    proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  str(EX / "fsdp2_torchrun.py"), "--store", str(store), "--steps", "3"], tmp_path)
    finish(proc)
    run = dstt.open(store)
    assert run.steps() == [0, 1, 2]
    assert [t.shape for t in run.tensors(2) if t.name == "model/0.weight"] == [(10, 16)]  # shards reassembled


@pytest.mark.slow  # ~25 s each; the callbacks' resume is tested in tests/test_integrations_*.py
@pytest.mark.parametrize("name, extra", [("hf_trainer.py", "transformers"), ("lightning_fit.py", "lightning")])
def test_trainer_examples(tmp_path: Path, name: str, extra: str) -> None:
    if importlib.util.find_spec(extra) is None:
        pytest.skip(f"{extra} is not installed")
    store = tmp_path / "run"
    finish(start([sys.executable, str(EX / name), "--store", str(store), "--steps", "6"], tmp_path))
    finish(start([sys.executable, str(EX / name), "--store", str(store), "--steps", "6", "--resume",
                  f"{store}:3", "--branch", "again"], tmp_path))
    run = dstt.open(store)
    assert run.steps() == list(range(1, 7)) and run.steps("again") == [4, 5, 6]


def test_flight_recorder_example(tmp_path: Path) -> None:
    store = tmp_path / "flight"
    out = finish(start([sys.executable, str(EX / "flight_recorder.py"), "--store", str(store)], tmp_path))
    assert "loss spike" in out and "rewound to step" in out
    run = dstt.open(store)
    parent = run.branch_info("after-spike").parent
    assert parent is not None and parent.branch == "main"
    assert parent.step in run.steps("main") and run.steps("after-spike")
    assert [i.source for i in run.incidents("main")].count("trainer") == 1
    spans, persisted = run.captured("main")
    assert spans[0][0] == 0 and set(persisted) <= set(range(spans[-1][1] + 1))
