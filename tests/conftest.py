from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# compression="auto" in a capture helper stores steps fast while the host has
# no idle core (capture/helpercpu.py): off for the suite, whose machines are
# shared and loaded, so the tests of the default coding do not depend on it;
# tests/capture/test_auto_cpu.py turns it on.
os.environ.setdefault("DSTT_AUTO_SPARE_CORES", "0")
torch.set_num_threads(1)


# ----------------------------------------------------------------------------- nothing left behind (issue 29 item 7)
#
# The run's temporary files (TMPDIR: tempfile, subprocesses) and staging
# rings (DSTT_SHM_DIR) go into two directories of its own, made here at
# import, before any test module builds a subprocess environment; a second
# import of this module (``import conftest`` in a test module, a subprocess)
# reuses them. pytest's own tmp_path tree stays where it was
# (PYTEST_DEBUG_TEMPROOT; the trees of passed tests are removed at the end:
# tmp_path_retention_policy in pyproject.toml). At the end of the run
# (pytest_sessionfinish) whatever is left in the two directories is a leak:
# the run fails, naming it. Both are then removed.

_ORIG_TMP = os.environ.get("DSTT_SUITE_ORIG_TMP") or tempfile.gettempdir()
os.environ["DSTT_SUITE_ORIG_TMP"] = _ORIG_TMP
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _ORIG_TMP)
_MADE_HERE: list[Path] = []


def _own_dir(parent: str, var: str) -> Path | None:
    have = os.environ.get(var)
    if have and os.path.isdir(have):
        return Path(have)  # the run's, made by an earlier import or the parent process
    if not os.path.isdir(parent) or os.environ.get("DSTT_SUITE_OWN_DIRS") == "0":
        return None
    made = Path(tempfile.mkdtemp(prefix=f"dstt-suite-{os.getpid()}-", dir=parent))
    os.environ[var] = str(made)
    _MADE_HERE.append(made)
    return made


SUITE_TMP = _own_dir(_ORIG_TMP, "DSTT_SUITE_TMP")
SUITE_SHM = _own_dir("/dev/shm", "DSTT_SUITE_SHM")
if SUITE_TMP is not None:
    os.environ["TMPDIR"] = str(SUITE_TMP)
    tempfile.tempdir = str(SUITE_TMP)
if SUITE_SHM is not None:
    os.environ["DSTT_SHM_DIR"] = str(SUITE_SHM)


def left_behind(root: Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Files (and non-empty directories' files) under ``root``, skipping the
    top-level entries named in ``keep``; empty directories do not count (a
    ring's per-user directory outlives its rings by design)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in keep]
            filenames = [f for f in filenames if f not in keep]
        out.extend(str(Path(dirpath, f).relative_to(root)) for f in filenames)
    return sorted(out)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left files in its temporary or ring directory."""
    import shutil

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    mine = [d for d in (SUITE_SHM, SUITE_TMP) if d is not None and d in _MADE_HERE]
    leaks = [f"{root}/{f}" for root in mine if root.exists() for f in left_behind(root)]
    for root in mine:
        shutil.rmtree(root, ignore_errors=True)
    if leaks:
        shown = "\n  ".join(leaks[:30]) + (f"\n  ... and {len(leaks) - 30} more" if len(leaks) > 30 else "")
        print(f"\nthe test run left {len(leaks)} file(s) behind in /dev/shm or /tmp (removed now):\n  {shown}",
              file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a leak fails the run


#: Packs (issue 16, dstt/format/packs.py) are on by default. Most test
#: modules predate them and inspect, damage or read with plain zarr-python
#: the chunk files of small tensors: the suite runs with packing off, set
#: here at import (modules build subprocess environments at import time;
#: the variable reaches subprocesses and capture helpers too).
os.environ["DSTT_PACK_CHUNK_BYTES"] = "0"


@pytest.fixture(autouse=True)
def _packing_per_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that sets ``DSTT_PACKING = True`` runs with the default
    (packing on). Set by hand, not with monkeypatch: tests call
    monkeypatch.undo() themselves."""
    if not getattr(request.module, "DSTT_PACKING", False):
        yield
        return
    before = os.environ.pop("DSTT_PACK_CHUNK_BYTES", None)
    try:
        yield
    finally:
        if before is not None:
            os.environ["DSTT_PACK_CHUNK_BYTES"] = before


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


ROOT = Path(__file__).resolve().parents[1]


def start_script(script: Path, *args: str, stderr: int | None = subprocess.PIPE) -> subprocess.Popen:
    """``python SCRIPT ARGS...`` from the repository root, stdout read by the test."""
    return subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


def finish(proc: subprocess.Popen) -> None:
    """Wait for ``proc`` (at most 180 s) and require exit status 0."""
    _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, (err or "")[-3000:]


def kill_when_committed(proc: subprocess.Popen, step: int, timeout_s: float = 300.0) -> None:
    """SIGKILL ``proc`` once it prints ``committed S`` for S >= ``step``
    (steps commit in order); fail if it exits first or has not within
    ``timeout_s`` (a watchdog kills it: a test never hangs on a trainer)."""
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, _, num = line.strip().partition(" ")
            if word == "committed" and num.isdigit() and int(num) >= step:
                os.kill(proc.pid, signal.SIGKILL)
                break
        else:
            err = proc.stderr.read()[-2000:] if proc.stderr is not None else ""
            pytest.fail(f"training exited ({proc.wait()}) before committing step {step}: {err}")
    finally:
        watchdog.cancel()
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

def small_state(n: int, seed: int | None = None, *, wide: bool = False) -> dict[str, Any]:
    """``n`` small tensors of mixed dtypes in groups of ten (0-d and empty
    included); ``wide``: also float64 matrices and one 1.2 MB tensor (a zarr
    array, above the packing threshold). Seeded by ``seed`` (default ``n``)."""
    g = torch.Generator().manual_seed(n if seed is None else seed)
    makers = [
        lambda: torch.randn(16, generator=g).to(torch.bfloat16),
        lambda: torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        lambda: torch.rand(5, generator=g) > 0.5,
        lambda: torch.randn((), generator=g),
        lambda: torch.empty(0, 3),
        lambda: torch.randint(-9, 9, (3, 2), generator=g, dtype=torch.int64),
    ]
    if wide:
        makers.append(lambda: torch.randn(40, 7, generator=g, dtype=torch.float64))
    out: dict[str, Any] = {f"layer{i0 // 10}": {f"p{i}": makers[i % len(makers)]() for i in range(i0, i0 + 10)}
                           for i0 in range(0, n, 10)}
    if wide:
        out["big"] = torch.randn(600, 500, generator=g)
    return out
