"""No capture helper outlives its trainer (issue 25): a trainer SIGKILLed
while a process it left behind still holds the write end of the helper's
command pipe (a child made without Python's fork hooks: no end of file
ever comes) -- the helper sees its parent gone, stores its tier's steps
as a crash incident, bit-exact, and exits within a bound; no process
left. And dstt's own collectives (its gloo group) time out: a rank that
never joins fails the others' call with a dstt error instead of torch's
30 minutes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import dstt
from dstt.capture.waits import exists

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm for the staging ring")]

TRAINER = textwrap.dedent("""
    import ctypes, os, sys, time, torch, dstt
    path, ref = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(m.parameters())
    cap = dstt.Capture(path, memory_steps=4, persist=100, background_timeout_s=60)
    states = {}
    for s in range(9):
        m(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        cap.snapshot(s, model=m, optimizer=opt)
        states[s] = {k: v.clone() for k, v in m.state_dict().items()}
    cap.wait_staged()
    torch.save(states, ref)
    # a child made by libc's fork (no Python fork hooks: it keeps every
    # descriptor, the helper's command pipe included), living on
    child = ctypes.PyDLL(None).fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(cap.parts.helper.pid, child, flush=True)
    time.sleep(600)
""")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dstt.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))


def test_a_sigkilled_trainers_helper_exits_though_its_pipe_stays_open(tmp_path: Path) -> None:
    path, ref = str(tmp_path / "run"), str(tmp_path / "ref.pt")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), path, ref], stdout=subprocess.PIPE, env=_env(), text=True)
    helper = child = 0
    try:
        assert proc.stdout is not None
        helper, child = map(int, proc.stdout.readline().split())
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t0 = time.monotonic()
        while exists(helper) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        gone_after = time.monotonic() - t0
        assert not exists(helper), f"the helper (pid {helper}) still runs {gone_after:.0f} s after its trainer died"
        assert exists(child)  # (the pipe's write end was open all along: no end of file told it)
    finally:
        for pid in (proc.pid, child, helper):
            if pid:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(child, os.WNOHANG)
    run = dstt.open(path)
    assert [i.source for i in run.incidents()] == ["crash"]
    states = torch.load(ref)
    stored = run.steps()
    assert {5, 6, 7, 8} <= set(stored)
    for s in stored:
        for k, v in states[s].items():
            assert torch.equal(run.read("model/" + k, s).view(torch.uint8), v.view(torch.uint8)), (s, k)
    with dstt.Capture(path, memory_steps=2) as cap:  # nothing left sealed
        assert cap.recovered == []


RANKS = textwrap.dedent("""
    import json, os, sys, time, torch.distributed as dist
    from dstt.store.coord import DistCoordinator
    from dstt.errors import DsttError
    dist.init_process_group("gloo")
    coord = DistCoordinator()
    if dist.get_rank() == 1:
        time.sleep(60)  # never joins
        os._exit(0)
    t0 = time.monotonic()
    try:
        coord.all_gather(0)
        print(json.dumps({"error": "", "after_s": time.monotonic() - t0}), flush=True)
    except DsttError as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "after_s": time.monotonic() - t0}), flush=True)
    os._exit(0)
""")


def test_dstts_collectives_time_out_when_a_rank_never_joins(tmp_path: Path) -> None:
    import json
    import socket

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "DSTT_COLLECTIVE_TIMEOUT_S": "3", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        out, _ = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["error"].startswith("CaptureError: dstt's all_gather across 2 ranks failed on rank 0"), seen
    assert seen["after_s"] < 3 * 3, seen
