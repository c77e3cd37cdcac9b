"""The suite's leak check (issue 29 item 7, tests/conftest.py): a run that
leaves a file in its temporary directory fails, naming the file, even when
every test passed -- a real pytest run in a subprocess, with this conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_run_that_leaves_a_file_in_tmp_fails(tmp_path: Path) -> None:
    (tmp_path / "test_leaky.py").write_text(
        "import os, tempfile\n"
        "def test_clean(tmp_path):\n"
        "    (tmp_path / 'fine.txt').write_text('x')\n"
        "def test_leaky():\n"
        "    open(os.path.join(tempfile.gettempdir(), 'leaked-by-a-test.txt'), 'w').close()\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DSTT_SUITE") and k not in ("TMPDIR", "PYTEST_DEBUG_TEMPROOT", "PYTEST_ADDOPTS")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_leaky.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = p.stdout + p.stderr
    assert "2 passed" in out, out
    assert p.returncode == 1 and "leaked-by-a-test.txt" in out and "left 1 file(s) behind" in out, out
    assert not [f for f in tmp_path.rglob("leaked-by-a-test.txt")]  # removed with the run's directory
