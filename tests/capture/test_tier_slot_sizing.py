"""The in-process memory tier's slot holds everything the stager puts in
it (issue 25): small tasks are staged in groups, and a group of 64 KiB or
more goes on a page boundary like a large block. ``slot_bytes_for`` counted
64-byte alignment only, so a state of 150 tasks of 64,000 bytes (50
parameters + Adam) waited forever for its last block (``background_timeout_s``
then gave up: "gave up waiting for 64000 bytes of staging pool")."""

from __future__ import annotations

from pathlib import Path

import torch

import dstt


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16000)) for _ in range(50)])  # 64,000 bytes each
    return m, torch.optim.Adam(m.parameters())


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    sum(p.square().sum() for p in m.parameters()).backward()  # type: ignore[arg-type]
    opt.step()
    opt.zero_grad()


def test_a_state_of_small_tensors_fits_its_slot(tmp_path: Path) -> None:
    m, opt = _model()
    path = str(tmp_path / "run")
    ref = {}
    with dstt.Capture(path, memory_steps=1, persist="all", helper=False, background_timeout_s=5) as cap:
        for s in range(2):
            _train(m, opt)
            cap.snapshot(s, model=m, optimizer=opt)
            ref[s] = {k: v.clone() for k, v in m.state_dict().items()}
    run = dstt.open(path)
    assert run.steps() == [0, 1]
    for s in (0, 1):
        for k, v in ref[s].items():
            assert torch.equal(run.read("model/" + k, s), v)

