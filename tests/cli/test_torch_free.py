"""Read-only commands answer without importing torch (issue 29, item 3):
``show`` of any tensor (bfloat16 and float8 decoded with numpy bit
operations), ``branch``, ``gc``, ``verify``, ``export`` to safetensors/npz
-- each a real ``dstt`` subprocess whose imported modules are checked, its
output compared with what the torch reader gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.format.dtypes import BITS_STORAGE, decode, info_for_name
from dstt.store.torch_dtypes import torch_dtype

ROOT = Path(dstt.__file__).resolve().parent.parent

#: Runs several ``dstt`` command lines in one fresh interpreter (one start
#: for many commands: the suite stays fast) and says which heavy modules
#: were imported by the end.
_PROBE = """
import contextlib, io, json, sys
from dstt.cli.main import main
runs = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["dstt", *argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as e:
            code = e.code
        else:
            code = 0
    runs.append({"code": code, "out": out.getvalue()})
heavy = sorted(m for m in ("torch", "zarr", "numcodecs") if m in sys.modules)
print(json.dumps({"runs": runs, "heavy": heavy}), file=sys.stderr)
"""


def dstt_cli(*commands: list[str]) -> tuple[list[tuple[Any, str]], list[str]]:
    """Run each ``dstt`` command line in one fresh interpreter: ([(exit
    code, stdout)] per command, heavy modules imported by them all)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([list(c) for c in commands])],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stderr.strip().splitlines()[-1])
    return [(r["code"], r["out"]) for r in report["runs"]], report["heavy"]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Two steps with a tensor of every low-precision dtype (every bit pattern of float8)."""
    path = tmp_path_factory.mktemp("torchfree") / "run"
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(6, 5, generator=g),
        "h": torch.randn(300, generator=g).to(torch.bfloat16),
        "c": torch.randn(3, generator=g, dtype=torch.complex64),
        "i": torch.arange(7, dtype=torch.int16),
        **{n: torch.arange(256, dtype=torch.uint8).view(getattr(torch, n)) for n in BITS_STORAGE if n != "bfloat16"},
    }
    for s in range(2):
        model = {k: v.clone() for k, v in state.items()}
        if s == 0:
            model["w"] = model["w"] + 1  # (a chunk step 1 does not reference: gc frees it after prune)
        dstt.save(path, s, {"model": model, "extra": {"loss": 1.0 / (s + 1)}})
    return path, state


@pytest.mark.parametrize("name", sorted(BITS_STORAGE))
def test_decode_matches_torch_for_every_bit_pattern(name: str) -> None:
    info = info_for_name(name)
    bits = np.arange(1 << (8 * info.itemsize), dtype=info.numpy_storage)
    want = torch.from_numpy(bits.copy()).view(torch_dtype(info)).to(torch.float32).numpy()
    got = decode(bits, info)
    assert got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(nan, np.isnan(got)), name
    assert np.array_equal(want[~nan].view(np.uint32), got[~nan].view(np.uint32)), name  # bits: -0.0 kept


TENSORS = ["model/w", "model/h", "model/c", "model/i", *(f"model/{n}" for n in sorted(BITS_STORAGE) if n != "bfloat16")]


def test_show_any_tensor_without_torch(mixed: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = mixed
    commands = [["show", f"{path}:1", t, "--slice", "...", "--json"] for t in TENSORS]
    commands += [["show", f"{path}:1", t] for t in ("model/h", "model/c", "model/float8_e5m2")]
    runs, heavy = dstt_cli(*commands)
    assert heavy == []
    for tensor, (code, out) in zip(TENSORS, runs):
        assert code in (0, None), (tensor, out)
        doc = json.loads(out)
        t = state[tensor.split("/")[1]]
        want = (torch.view_as_real(t) if t.is_complex() else t).to(torch.float64).numpy()
        want = np.where(np.isfinite(want), want, np.nan)  # strict JSON: NaN and Inf as null
        got = np.array(doc["values"], dtype=np.float64)
        np.testing.assert_array_equal(got, want, err_msg=tensor)
        finite = t.abs().to(torch.float64) if t.is_complex() else t.to(torch.float64)
        assert sum(doc["histogram"]["counts"]) == int(torch.isfinite(finite).sum()), tensor
    for code, out in runs[len(TENSORS):]:  # the human rendering too
        assert code in (0, None) and "histogram" in out and "values [" in out, out


def test_diff_without_torch(mixed: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, state = mixed
    runs, heavy = dstt_cli(["diff", f"{path}:0", ":1", "--json", "--no-progress"], ["diff", f"{path}:0", ":1"])
    assert heavy == []
    (code, out), (code2, human) = runs
    assert code in (0, None) and code2 in (0, None) and "model/w" in human, out
    rows = {r["name"]: r for r in json.loads(out)["tensors"]}
    w = state["w"].double()
    assert rows["model/w"]["l2_delta"] == pytest.approx(float(w.numel()) ** 0.5, rel=1e-6)  # step 0 held w + 1
    assert rows["model/w"]["rel_change"] == pytest.approx(float(w.numel()) ** 0.5 / float((w + 1).norm()), rel=1e-6)
    assert rows["model/w"]["frac_changed"] == 1.0
    assert all(rows[n]["status"] == "unchanged" for n in rows if n != "model/w")  # bf16, float8, complex too


def test_branch_and_gc_without_torch(mixed: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = mixed
    dstt.save(path, 2, {"model": {"w": torch.zeros(3)}})
    dstt.prune(path, keep_last=2)  # step 0 goes: gc frees its chunks
    runs, heavy = dstt_cli(["branch", str(path), "side", "--from", ":1", "--json"],
                           ["gc", str(path), "--json"], ["verify", str(path), "-q"])
    assert heavy == []
    (c1, o1), (c2, o2), (c3, o3) = runs
    assert c1 in (0, None) and json.loads(o1)["parent"] == {"branch": "main", "step": 1}, o1
    assert dstt.open(path).branch_info("side").parent == ("main", 1)
    assert c2 in (0, None) and json.loads(o2)["committed"] == [], o2
    assert json.loads(o2)["chunks_removed"] > 0, o2  # what prune dropped (step 0's tensors)
    assert c3 in (0, None) and o3.startswith("OK"), o3


def test_flat_exports_without_torch(mixed: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path, state = mixed
    sane = {k: v for k, v in state.items() if k != "float8_e8m0fnu"}  # (no safetensors dtype: refused)
    other = tmp_path / "run"
    dstt.save(other, 1, {"model": sane, "extra": {"loss": 0.5}})
    sf, npz, pt = tmp_path / "m.safetensors", tmp_path / "m.npz", tmp_path / "exists.pt"
    pt.write_bytes(b"mine")
    runs, heavy = dstt_cli(["export", f"{other}:1", str(sf), "--only", "model", "-q", "--json"],
                           ["export", f"{path}:1", "--out", str(npz), "-q"],
                           ["export", f"{path}:1", str(pt)],  # refused before any heavy import
                           ["export", f"{path}:1", str(tmp_path / "all.safetensors"), "-q"],
                           ["export", f"{other}:1", str(tmp_path / "x.safetensors"), "--only", "extra", "-q"])
    assert heavy == []
    (c1, o1), (c2, _), (c3, _), (c4, _), (c5, _) = runs
    assert c1 in (0, None) and json.loads(o1)["n_tensors"] == len(sane), o1
    flat = load_file(sf)
    assert set(flat) == set(sane)
    for k, v in sane.items():  # the safetensors package reads what dstt wrote, bit for bit
        assert flat[k].dtype == v.dtype and torch.equal(flat[k].view(torch.uint8), v.view(torch.uint8)), k
    with safe_open(sf, "pt") as f:
        assert f.metadata()["dstt_step"] == "1" and f.metadata()["dstt_only"] == "model"
    assert c2 in (0, None)
    with np.load(npz) as z:
        assert z["model/h"].dtype == np.float32 and np.array_equal(z["model/h"], state["h"].float().numpy())
        assert np.array_equal(z["model/c"], state["c"].numpy()) and z["model/i"].dtype == np.int16
        f8 = z["model/float8_e5m2"]
        want = state["float8_e5m2"].float().numpy()
        assert np.array_equal(f8, want, equal_nan=True)
    assert c3 == 2 and pt.read_bytes() == b"mine"
    assert c4 == 2 and not (tmp_path / "all.safetensors").exists()  # float8_e8m0fnu: refused, nothing written
    assert c5 in (0, None) and load_file(tmp_path / "x.safetensors") == {}  # extra holds values only
