"""After ``Capture.rewind(k)`` the next snapshot() is of step k + 1 (issue 29
item 5): a loop whose step counter ran on used to label the new branch's
steps wrongly, and the gap was accepted silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import StepOrderError


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    m(torch.ones(2, 3)).sum().backward()
    opt.step()


@pytest.mark.parametrize("helper", [True, False], ids=["tier-in-helper", "in-process-tier"])
def test_the_step_after_a_rewind_follows_it(tmp_path: Path, helper: bool, memory_steps: int = 4) -> None:
    """With the memory tier (the README's flight-recorder loop), in the
    capture helper (the default) and in process; the check is the same in
    every mode (Capture.snapshot). Steps 3 and 4 are never persisted before
    the rewinds (persist="newest"; the helper had not even started): both
    are read from the tier. Two rewinds in a row: the second once raised
    RuntimeError (a Job compared by value, tensors and all); with the tier
    in the helper the first raised StepNotFoundError (its ``hold`` reached
    the helper before the step's ``tier``)."""
    path = str(tmp_path / "run")
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with dstt.Capture(path, memory_steps=memory_steps, helper=helper) as cap:
        for s in range(6):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
        cap.rewind(3, model=m, optimizer=opt, branch="retry")
        _train(m, opt)
        with pytest.raises(StepOrderError, match=r"snapshot\(6\) skips steps 4..5: branch 'retry' continues "
                                                 r"from step 3 .* its next step is 4"):
            cap.snapshot(6, model=m, optimizer=opt)  # the README's old loop: the counter ran on
        with pytest.raises(StepOrderError, match=r"snapshot\(3\) goes backwards"):
            cap.snapshot(3, model=m, optimizer=opt)
        assert cap.snapshot(4, model=m, optimizer=opt)  # refused calls changed nothing
        cap.snapshot(5, model=m, optimizer=opt)
        cap.rewind(4, model=m, optimizer=opt, branch="retry2", check_steps=False)  # told otherwise
        _train(m, opt)
        cap.snapshot(9, model=m, optimizer=opt)
    run = dstt.open(path)
    assert run.steps("retry") == [4, 5] and run.branch_info("retry").parent == dstt.StepRef("main", 3)
    assert run.steps("retry2") == [9]
    assert dstt.verify(path).ok
