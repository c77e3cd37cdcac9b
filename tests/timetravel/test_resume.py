"""``dstt.resume`` for plain loops (issue 29 item 5): restore, give back
``extra``, continue capturing on the right branch -- and the resumed run is
bit-exact with the one that never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import BranchExistsError, ConfigError


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, pos: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(pos))
    loss = (m(x) - x.sum(1, keepdim=True)).pow(2).mean() + 1e-3 * torch.randn(())  # draws from the global RNG
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()  # type: ignore[attr-defined]


def test_resume_continues_a_plain_loop_bit_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "run")
    m, opt, sched = _objects()
    ref = {}
    with dstt.Capture(path) as cap:
        for step in range(6):
            _step(m, opt, sched, pos=step)
            cap.snapshot(step, model=m, optimizer=opt, scheduler=sched, extra={"pos": step})
            ref[step] = {k: v.clone() for k, v in m.state_dict().items()}
    m2, opt2, sched2 = _objects()
    with pytest.raises(ConfigError, match="not the latest step"):
        dstt.resume(f"{path}:2", model=m2, optimizer=opt2, scheduler=sched2)
    dstt.branch(f"{path}@main:1", "taken")
    with pytest.raises(BranchExistsError, match="'taken' already exists"):
        dstt.resume(f"{path}:2", model=m2, optimizer=opt2, scheduler=sched2, branch="taken")
    assert all(torch.equal(v, _objects()[0].state_dict()[k]) for k, v in m2.state_dict().items())  # untouched
    r = dstt.resume(f"{path}:2", model=m2, optimizer=opt2, scheduler=sched2, branch="again")
    assert (r.extra, r.step, r.next_step) == ({"pos": 2}, 2, 3)
    with r.capture as cap:
        for step in range(r.next_step, 6):
            _step(m2, opt2, sched2, pos=step)
            cap.snapshot(step, model=m2, optimizer=opt2, scheduler=sched2, extra={"pos": step})
            for k, v in m2.state_dict().items():
                assert torch.equal(v, ref[step][k]), (step, k)  # the RNG, the scheduler, Adam's moments: all back
    run = dstt.open(path)
    assert run.steps("again") == [3, 4, 5] and run.branch_info("again").parent == dstt.StepRef("main", 2)
    latest = dstt.resume(path, model=m2, optimizer=opt2, scheduler=sched2)  # the latest step: main goes on
    assert latest.step == 5
    with latest.capture as cap:
        _step(m2, opt2, sched2, pos=6)
        cap.snapshot(latest.next_step, model=m2, optimizer=opt2, scheduler=sched2)
    assert dstt.open(path).steps() == [0, 1, 2, 3, 4, 5, 6]
