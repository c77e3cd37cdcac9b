"""``dstt ls --follow`` / ``history --follow`` (issue 29 item 5): a real
``dstt`` process watching a store while another process commits steps; it
shows each new step, and Ctrl-C (SIGINT) ends it with status 0."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import dstt

CLI = [sys.executable, "-c", "from dstt.cli.main import main; main()"]


def _reader(proc: subprocess.Popen) -> "queue.Queue[str]":
    """A thread reading ``proc``'s stdout lines into a queue (a test never
    blocks on a pipe)."""
    q: queue.Queue[str] = queue.Queue()

    def run() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line)

    threading.Thread(target=run, daemon=True).start()
    return q


def _wait_for(q: "queue.Queue[str]", text: str, timeout_s: float = 60.0) -> str:
    """Lines from ``q`` up to one containing ``text``."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no {text!r} within {timeout_s} s: {''.join(seen)[-2000:]}")


def test_ls_and_history_follow_a_growing_store(tmp_path: Path) -> None:
    store = tmp_path / "run"
    dstt.save(store, 0, {"model": {"w": torch.ones(4)}, "extra": {"loss": 1.0}})
    env = {**os.environ, "COLUMNS": "200"}
    ls = subprocess.Popen([*CLI, "ls", str(store), "--follow", "--interval", "0.2"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
    hist = subprocess.Popen([*CLI, "history", str(store), "extra/loss", "--follow", "--interval", "0.2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lq, hq = _reader(ls), _reader(hist)
    try:
        _wait_for(lq, "main")
        for s in (1, 2, 3):
            dstt.save(store, s, {"model": {"w": torch.ones(4) * s}, "extra": {"loss": 1.0 / (s + 1)}})
        out = _wait_for(lq, "(0..3)")  # the store listing, redrawn
        assert "---" in out  # piped: each new output after a separator line
        got = ""
        while '"step": 3' not in got:  # one JSON document per change
            got += _wait_for(hq, "}")
    finally:
        for p in (ls, hist):
            p.send_signal(signal.SIGINT)
        codes = [p.wait(timeout=60) for p in (ls, hist)]
        errs = [p.stderr.read() if p.stderr else "" for p in (ls, hist)]
        for p in (ls, hist):
            p.stderr.close()  # type: ignore[union-attr]
    assert codes == [0, 0], errs
    assert "stopped following" in errs[0] and "Traceback" not in errs[0] + errs[1]
