"""The encode rate of predictive coding (issue 27): noise chunks in the
cheaper Blosc container every reader decodes, and Blosc in the capture
helper on its calling thread only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import zarr
from numcodecs import blosc

import dstt
from tests.conftest import bits_equal
from tests.format.test_predchain import check_reads, train


def _complib(chunk: Path) -> str:
    """The compressor a stored chunk's Blosc header names (the CRC-32C trailer stripped)."""
    return str(blosc.cbuffer_complib(chunk.read_bytes()[:-4]))


def test_noise_chunks_are_lz4_containers_every_blosc_reader_decodes(tmp_path: Path) -> None:
    """Keyframes and ``exp_avg``'s residuals (mantissa and gradient noise)
    are coded in bit-shuffle + lz4; the residuals of parameters and
    ``exp_avg_sq`` (mostly zeros) keep shuffle + zstd. Both decode
    bit-exact through dstt and through plain zarr-python reading the array
    dstt described with its usual codec."""
    path = tmp_path / "run"
    states = train(path, "adamw", steps=4, keyframe_every=4, pack_chunk_bytes=0, shapes=((64, 128), (128, 16)))
    check_reads(path, states)
    libs: dict[str, set[tuple[str, bool]]] = {}
    for chunk in (path / "tensors").rglob("c.*"):
        role = chunk.parts[-3] if chunk.parts[-4] == "optim" or "optim" in chunk.parts else "param"
        libs.setdefault(role, set()).add((_complib(chunk), chunk.parent.name.endswith(".delta")))
    assert {lib for lib, _ in libs["exp_avg"]} == {"LZ4"}, libs
    for role in ("exp_avg_sq", "param"):  # keyframes lz4, residuals (mostly zeros) zstd
        assert libs[role] == {("LZ4", False), ("Zstd", True)}, libs
    run = dstt.open(path)
    e = run.entry("optim/m.0.weight/exp_avg", 0)
    arr = zarr.open_array(str(path / e.array), mode="r")  # the keyframe array of step 0
    assert _complib(next((path / e.array).glob("c.*"))) == "LZ4"
    want = states[0]["optim/m.0.weight/exp_avg"]
    assert bits_equal(torch.from_numpy(np.asarray(arr[e.slots[0]])), want)


_THREADS = """
import os, sys
import numpy as np
from numcodecs import blosc
blosc.set_nthreads(4)  # a host with cores to spare: numcodecs' default pool
if sys.argv[1] == "helper":
    from dstt.capture.helpercpu import single_threaded_codecs
    single_threaded_codecs()
before = len(os.listdir("/proc/self/task"))
data = np.random.default_rng(0).integers(0, 255, 32 << 20, dtype=np.uint8)
blob = blosc.compress(data, b"zstd", 1, blosc.SHUFFLE, 1 << 20, typesize=4)
out = np.empty_like(data)
blosc.decompress(blob, out)
assert np.array_equal(out, data)
print(len(os.listdir("/proc/self/task")) - before)
"""


def test_blosc_in_the_helpers_process_starts_no_threads_of_its_own(tmp_path: Path) -> None:
    """On a process's main thread numcodecs runs Blosc's own thread pool;
    the helper's process turns it off (its coding threads are the
    parallelism), and the trainer's process is left as it was."""
    def extra_threads(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _THREADS, mode], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path, check=True)
        return int(out.stdout.split()[-1])

    assert extra_threads("default") > 0  # (the test can fail: the pool is there by default)
    assert extra_threads("helper") == 0



def test_a_noise_residual_that_does_not_pay_is_not_tried_every_step(tmp_path: Path, monkeypatch) -> None:
    """``exp_avg``'s chained delta rarely beats its keyframe (beta1 0.9:
    ~0.83 vs ~0.81 of raw): once a chunk's residual was not kept, the next
    NOISE_RETRY_STEPS coded steps store it whole without computing and
    compressing a residual first; the other roles are coded every step, and
    everything reads back bit-exact."""
    from dstt.format.codecs import predictive, stepcoder

    tried: dict[tuple[str, str], int] = {}
    real = predictive.residual

    def counting(coding, actual, inputs, where="chunk", out=None):  # type: ignore[no-untyped-def]
        if where != "chunk":  # (the coder's calls name the tensor; pick's samples do not)
            tried[coding.role, where] = tried.get((coding.role, where), 0) + 1
        return real(coding, actual, inputs, where, out)

    monkeypatch.setattr(stepcoder.predictive, "residual", counting)
    path = tmp_path / "run"
    states = train(path, "adamw", steps=8, keyframe_every=16, pack_chunk_bytes=0)
    check_reads(path, states)
    run = dstt.open(path)
    noise = [n for n in states[0] if n.endswith("/exp_avg")]
    rejected = [n for n in noise if run.entry(n, 1).pred is None]  # its residual at step 1 did not pay
    assert rejected and stepcoder.NOISE_RETRY_STEPS >= 6
    assert all(tried["exp_avg", n] == 1 for n in rejected), tried  # not tried at steps 2..7
    assert all(run.entry(n, s).pred is None for n in rejected for s in range(8))
    second = [n.replace("/exp_avg", "/exp_avg_sq") for n in noise]
    assert all(tried["exp_avg_sq", n] == 7 for n in second), tried  # every coded step
