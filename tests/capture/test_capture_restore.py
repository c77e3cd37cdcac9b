"""``Capture.restore``: the restarted job's resume -- a step restored into
the live objects (from the store here; from the rebuilt memory after a
node loss: tests/system/test_node_loss.py), capturing going on on the
same branch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import StepNotFoundError


def test_restore_the_newest_step_and_go_on_on_the_same_branch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    path = tmp_path / "run"
    with dstt.Capture(path, helper=False) as cap:
        for step in range(2):
            m(torch.randn(4, 3)).sum().backward()
            opt.step()
            cap.snapshot(step, model=m, optimizer=opt, extra={"pos": step})
    want = {k: v.clone() for k, v in m.state_dict().items()}
    m2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(m2.parameters())
    with dstt.Capture(path, helper=False) as cap:
        assert cap.restore(model=m2, optimizer=opt2) == {"pos": 1}  # (the newest step by default)
        assert all(torch.equal(want[k], v) for k, v in m2.state_dict().items())
        assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
        with pytest.raises(StepNotFoundError):
            cap.restore(5, model=m2)
        assert all(torch.equal(want[k], v) for k, v in m2.state_dict().items())  # (a refused restore: unchanged)
        cap.snapshot(2, model=m2, optimizer=opt2)
    assert dstt.open(path).steps() == [0, 1, 2]
