from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A not-yet-existing store path inside a fresh temporary directory."""
    return tmp_path / "run"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a = a.detach().contiguous().reshape(-1)
    b = b.detach().contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
