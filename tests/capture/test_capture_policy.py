"""Capture's pure decisions (dstt.capture.policy) and its options, unit by unit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dstt.capture import policy
from dstt.capture.config import CaptureConfig, make_config
from dstt.capture.guard import VersionGuard
from dstt.errors import ConfigError


def test_pool_is_two_steps_rounded_and_bounded() -> None:
    mib = 1 << 20
    assert policy.pool_bytes(need_bytes=0, biggest_bytes=0, limit_bytes=None) == mib
    assert policy.pool_bytes(need_bytes=16 * mib + 1, biggest_bytes=1, limit_bytes=None) == 33 * mib
    assert policy.pool_bytes(need_bytes=mib // 8, biggest_bytes=5 * mib, limit_bytes=None) == 5 * mib
    # small steps: up to SMALL_STEPS of them (group commit), within SMALL_POOL_BYTES
    assert policy.pool_bytes(need_bytes=mib + 1, biggest_bytes=1, limit_bytes=None) == 17 * mib
    assert policy.pool_bytes(need_bytes=8 * mib, biggest_bytes=1, limit_bytes=None) == 32 * mib
    assert policy.pool_bytes(need_bytes=10 * mib, biggest_bytes=mib, limit_bytes=7 * mib + 3) == 7 * mib + 3


def test_pool_grows_only_when_a_step_no_longer_fits_and_the_limit_allows() -> None:
    assert not policy.should_grow(need_bytes=10, capacity_bytes=10, limit_bytes=None)
    assert policy.should_grow(need_bytes=11, capacity_bytes=10, limit_bytes=None)
    assert policy.should_grow(need_bytes=11, capacity_bytes=10, limit_bytes=20)
    assert not policy.should_grow(need_bytes=30, capacity_bytes=20, limit_bytes=20)


def test_skip_only_when_waiting_could_help() -> None:
    # nothing in flight: never skip (a step larger than the pool is staged in parts)
    assert policy.skip_reason(capacity_bytes=100, outstanding_bytes=0, need_bytes=10**9) is None
    assert policy.skip_reason(capacity_bytes=100, outstanding_bytes=50, need_bytes=50) is None
    assert "51 of 100" in (policy.skip_reason(capacity_bytes=100, outstanding_bytes=51, need_bytes=50) or "")
    # a step larger than the pool needs the whole pool free
    assert policy.skip_reason(capacity_bytes=100, outstanding_bytes=1, need_bytes=500) is not None
    assert policy.step_need_bytes([4096, 64, 64]) == 4096 * 2 + 128


def test_shm_decision_falls_back_with_the_size_needed() -> None:
    assert policy.shm_decision(pool_bytes=100 << 20, shm_free_bytes=1 << 30).where == "shm"
    d = policy.shm_decision(pool_bytes=100 << 20, shm_free_bytes=64 << 20)
    assert d.where == "process" and str(100 << 20) in (d.warning or "") and "shm-size" in (d.warning or "")
    assert policy.shm_decision(pool_bytes=1, shm_free_bytes=None).where == "process"


def test_every() -> None:
    assert [s for s in range(10) if policy.is_due(s, 4)] == [0, 4, 8]


def test_options_are_listed_once() -> None:
    base = CaptureConfig(every=3, on_full="skip")
    cfg = make_config(base, {"branch": "b2"})
    assert (cfg.every, cfg.on_full, cfg.branch) == (3, "skip", "b2") and base.branch == "main"
    with pytest.raises(ConfigError, match="unknown Capture option 'flush_thread'"):
        make_config(None, {"flush_thread": 2})
    with pytest.raises(ConfigError, match="every"):
        make_config(base, {"every": 0})  # overrides are validated like the rest
    with pytest.raises(ConfigError, match="CaptureConfig"):
        make_config({"every": 2}, {})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="exit_drain_s"):
        CaptureConfig(exit_drain_s=-1)


def test_version_guard_names_the_tensor() -> None:
    import torch

    a, b = torch.zeros(4), torch.zeros(4)
    g = VersionGuard([a, b[:2]], ["model/a", "model/b"])
    assert g.copied(0) is None
    a.add_(1)  # after its copy: fine
    assert g.scan() is None
    b.mul_(2)  # a view's base changed before the view's copy
    msg = g.scan()
    assert msg is not None and "model/b" in msg and "wait_staged()" in msg
    assert g.copied(1) == msg


def test_gpu_benchmark_parses_and_skips_cleanly_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_capture_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_capture_gpu", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--check", "--size-gb", "0.1"]) == 0
    with pytest.raises(SystemExit):
        bench.main(["--iters", "1"])  # a usage error, not a crash
    if not torch.cuda.is_available():
        assert bench.main(["--size-gb", "0.1"]) == 0
        assert "no CUDA GPU" in capsys.readouterr().out


def test_ring_sweep_removes_only_rings_nobody_can_commit(tmp_path: Path) -> None:
    """Rings whose owner is proven gone (a process that exited without
    closing them: its lock went with it) are removed when they hold no seal
    or their local store is gone; a sealed one waits for its branch's next
    Capture; a live owner's, a released one's owner aside, and one whose
    owner cannot be proven gone (no lock file: an older dstt's) stay."""
    import json
    import subprocess
    import sys

    from dstt.capture.ring import Ring, sweep

    store = tmp_path / "store"
    store.mkdir()
    base = tmp_path / "shm"
    script = (
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from dstt.capture.ring import Ring\n"
        "out = []\n"
        "for name, store, seals in json.loads(sys.argv[2]):\n"
        "    r = Ring({'store': store, 'branch': name, 'branch_id': 0, 'branch_created': 0.0}, base=Path(sys.argv[1]))\n"
        "    if seals:\n"
        "        (r.dir / 'seal-00000000000000000003.json').write_text('{}')\n"
        "    out.append(str(r.dir))\n"
        "print(json.dumps(out))\n"
        "os._exit(0)  # dead, its rings not closed\n")
    specs = [("a", str(store), False), ("b", str(store), True), ("c", str(tmp_path / "gone"), True),
             ("e", str(store), False)]
    proc = subprocess.run([sys.executable, "-c", script, str(base), json.dumps(specs)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 0, proc.stderr
    empty_dead, sealed_dead, store_gone, legacy = map(Path, json.loads(proc.stdout))
    (legacy / "owner.lock").unlink()  # as an older dstt left it: pid only, nothing proves its owner gone
    released = Ring({"store": str(store), "branch": "f", "branch_id": 0, "branch_created": 0.0}, base=base)
    released.release()  # (its helper died: left for the next Capture, although this process lives)
    alive = Ring({"store": str(store), "branch": "d", "branch_id": 0, "branch_created": 0.0}, base=base)
    try:  # (building a Ring sweeps too)
        assert not empty_dead.exists() and not store_gone.exists() and not released.dir.exists()
        assert sealed_dead.exists() and alive.dir.exists() and legacy.exists()
        assert sweep(base) == 0
    finally:
        alive.close()
