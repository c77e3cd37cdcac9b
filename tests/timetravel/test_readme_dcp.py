"""The README's "DCP checkpoints" examples, run as written (issue 29): its
shell block against a real directory of DCP checkpoints a trainer wrote
without dstt, then its Python block loading the exported checkpoint into a
fresh model + optimizer + scheduler that continues bit-exactly."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from typer.testing import CliRunner

from dstt.cli.main import app
from tests.timetravel.test_dcp import build, same_bits, train

runner = CliRunner()
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(title: str) -> tuple[str, str]:
    """(the bash block, the python block) of the README section ``title``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"### {title}")
    section = text[start: text.index("\n## ", start)]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and python, f"README section {title!r} lost its examples"
    return bash.group(1), python.group(1)


def test_readme_dcp_examples_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the README's relative paths
    model, opt, sched = build(0)
    for step in range(1, 7):  # a DCP trainer's own checkpoints: outputs/checkpoint/step-3, step-6
        train(model, opt, sched, range(step - 1, step))
        if step % 3 == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": optim_sd, "lr_scheduler": sched.state_dict()},
                     checkpoint_id=str(Path("outputs/checkpoint") / f"step-{step}"))
    bash, python = _blocks("DCP checkpoints")
    for line in bash.splitlines():
        argv = shlex.split(line.split("#", 1)[0])
        if not argv:
            continue
        assert argv[0] == "dstt", line
        r = runner.invoke(app, argv[1:])
        assert r.exit_code == 0, (line, r.output)
    assert Path("ckpt/step-6/.metadata").is_file()  # (its parent made, as dcp.save makes it)
    r = runner.invoke(app, ["export", "runs/titan:99", "--format", "dcp", "other/step-99"])
    assert r.exit_code == 1 and not Path("other").exists()  # a step that is not there makes no directory
    train(model, opt, sched, range(6, 8))  # the original run goes on
    fresh, fopt, fsched = build(1)
    exec(compile(python, "README.md", "exec"), {"model": fresh, "opt": fopt, "sched": fsched})
    train(fresh, fopt, fsched, range(6, 8))  # the loaded one continues from step 6
    assert same_bits(fresh, model)
    assert torch.equal(fopt.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
