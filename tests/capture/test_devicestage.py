"""Device staging (dstt/capture/devicestage.py) where it can be checked
without a GPU: the flat copies are copies (never the live tensor), equal
bit for bit, shaped as their sources; CPU-only steps take the usual path;
the knob. The GPU path itself: tests/system/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from dstt import knobs
from dstt.capture.devicestage import DeviceStaging, EarlyCopies, StagingLayout, copy_flat
from dstt.capture.pipeline import Job
from dstt.errors import ConfigError
from dstt.store.plan import ChunkTask, StepPlan


def _job(sources: list[torch.Tensor]) -> Job:
    tasks = [ChunkTask(None, (i,), (0,), (0,), tuple(s.shape), s) for i, s in enumerate(sources)]  # type: ignore[arg-type]
    return Job(plan=StepPlan.__new__(StepPlan), lazy=tasks)


def test_flat_copies_are_copies_equal_and_shaped_as_their_sources() -> None:
    base = torch.randn(6, 5)
    sources = [base, base.t(), base[1:5:2, 1:], base[2, 3], torch.arange(7, dtype=torch.int64),
               torch.randn(3).double(), torch.tensor([float("nan"), -0.0])]
    job = _job(sources)
    layout = StagingLayout.of(job.lazy)
    early = EarlyCopies(layout, copy_flat(job.lazy, layout))
    assert len(layout.groups) == 3 and layout.unfit == "no source on a GPU"
    assert len(early) == len(sources)
    for s, e in zip(sources, early):
        assert e.shape == s.shape and e.dtype == s.dtype
        assert torch.equal(_bits(s), _bits(e))
    snapshot = [e.clone() for e in early]
    for s in sources:
        s.add_(1)  # the state moves on after snapshot()
    for e, was in zip(early, snapshot):
        assert torch.equal(_bits(e), _bits(was))  # never a view of the live tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_a_lone_tensor_of_its_dtype_is_copied_not_aliased() -> None:
    """(flatten_dense_tensors returns a lone contiguous tensor itself.)"""
    x = torch.arange(4.0)
    job = _job([x])
    layout = StagingLayout.of(job.lazy)
    early = EarlyCopies(layout, copy_flat(job.lazy, layout))
    x.mul_(10)
    assert early[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_layout_is_computed_once_for_the_same_tasks() -> None:
    job = _job([torch.randn(4), torch.randn(3)])
    staging = DeviceStaging(lambda devices: {})
    first = staging.layout(job.lazy)
    assert staging.layout(list(job.lazy)) is first  # (the plan memo hands the same task objects back)
    assert staging.layout(_job([torch.randn(4), torch.randn(3)]).lazy) is not first


def test_a_step_in_host_memory_takes_the_usual_path() -> None:
    job = _job([torch.randn(4), torch.randn(3)])
    staging = DeviceStaging(lambda devices: {})
    assert staging.take(job) is False
    assert job.early is None and not job.device_staged and not job.issued.is_set() and staging.steps == 0


def test_the_knob() -> None:
    assert knobs.device_staging() in ("auto", "off")
    with knobs.override(DSTT_DEVICE_STAGING="off"):
        assert knobs.device_staging() == "off" and not DeviceStaging.enabled()
    with knobs.override(DSTT_DEVICE_STAGING="sometimes"), pytest.raises(ConfigError, match="auto or off"):
        knobs.device_staging()
