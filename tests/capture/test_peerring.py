"""capture/peerring.py: another rank's ring read in place only where it is
proven the same host and the same files the owner stated, every chunk
bounded and checked, untrusted; a lease changed after the copy is seen.
Real files in a ring root under tmp_path (no process of another rank: the
offer is what its owner would state; tests/system/test_rewind_peers.py
runs the real thing under torchrun)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dstt.capture import peerring as P
from dstt.capture import ringowner as O
from dstt.format.dtypes import info_for_name

#: The step's tensor: 256 float32 values, two chunks of 128.
LAYOUTS = {"w": SimpleNamespace(shape=(256,), dtype=info_for_name("float32"))}
VALUES = torch.arange(256, dtype=torch.float32) * 0.5


def make_ring(root: Path, name: str = "ring") -> tuple[Path, P.Offer]:
    """A ring of the owner under ``root``'s ring root: a pool file whose
    second page holds VALUES, its lease, and the owner's offer."""
    ring = O.ring_root(root) / ("a" * 24) / name
    ring.mkdir(parents=True, mode=0o700)
    pool = ring / "pool-0.bin"
    page = P.PAGE
    pool.write_bytes(b"\0" * page + VALUES.numpy().tobytes() + b"\0" * page)
    lease, nonce = P.write_lease(ring, 5)
    st = os.stat(pool)
    chunks = [("w", (0,), (128,), torch.float32, page, 512), ("w", (128,), (128,), torch.float32, page + 512, 512)]
    return ring, P.Offer(chunks, P.host_identity(), os.fspath(ring), "pool-0.bin", (st.st_dev, st.st_ino),
                         lease.name, nonce)


def test_a_peers_chunks_are_mapped_bit_exact_and_a_changed_lease_is_seen(tmp_path: Path) -> None:
    ring, offer = make_ring(tmp_path)
    m, why = P.open_peer(offer, [0, 1], LAYOUTS, root=tmp_path)
    assert m is not None, why
    assert torch.equal(torch.cat(m.views), VALUES)
    assert m.unchanged()
    m.views[0].fill_(-1)  # (a write here never reaches the owner's file: a private mapping)
    assert (ring / "pool-0.bin").read_bytes()[P.PAGE:P.PAGE + 1024] == VALUES.numpy().tobytes()
    lease = ring / offer.lease  # type: ignore[operator]
    again = lease.with_name("again")
    again.write_bytes(lease.read_bytes())
    os.replace(again, lease)  # the same bytes, another file: the owner let the step go and leased it again
    assert not m.unchanged()
    m2, _ = P.open_peer(offer, [1], LAYOUTS, root=tmp_path)
    assert m2 is not None and torch.equal(m2.views[0], VALUES[128:])
    P.drop_lease(lease)
    assert not m2.unchanged()  # its lease gone


def _another_host(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.host = {**o.host, "node": "elsewhere"}


def _another_boot(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.host = {**o.host, "boot": "0" * 36}


def _outside_root(o: P.Offer, ring: Path, tmp: Path) -> None:
    other = tmp / "other"
    os.rename(ring.parent, other)
    o.ring = os.fspath(other / ring.name)


def _symlinked_pool(o: P.Offer, ring: Path, tmp: Path) -> None:
    (ring / "pool-0.bin").rename(ring / "real.bin")
    (ring / "pool-0.bin").symlink_to(ring / "real.bin")


def _another_file(o: P.Offer, ring: Path, tmp: Path) -> None:
    data = (ring / "pool-0.bin").read_bytes()
    (ring / "copy.bin").write_bytes(data)
    os.replace(ring / "copy.bin", ring / "pool-0.bin")  # the same bytes, not the file the owner stated


def _short_pool(o: P.Offer, ring: Path, tmp: Path) -> None:
    os.truncate(ring / "pool-0.bin", P.PAGE + 600)


def _past_the_end(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("w", (128,), (128,), torch.float32, 1 << 40, 512)


def _unknown_tensor(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("x", (128,), (128,), torch.float32, P.PAGE + 512, 512)


def _box_outside(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("w", (200,), (128,), torch.float32, P.PAGE + 512, 512)


def _wrong_bytes(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("w", (128,), (128,), torch.float32, P.PAGE + 512, 4096)


def _wrong_dtype(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("w", (128,), (128,), torch.float64, P.PAGE + 512, 1024)


def _not_a_dtype(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.chunks[1] = ("w", (128,), (128,), "float32", P.PAGE + 512, 512)  # type: ignore[assignment]


def _lease_of_another(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.nonce = "f" * 32


def _lease_a_fifo(o: P.Offer, ring: Path, tmp: Path) -> None:
    lease = ring / str(o.lease)
    lease.unlink()
    os.mkfifo(lease, 0o600)


def _no_lease(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.lease = None


def _no_nonce(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.nonce = None
    (ring / str(o.lease)).write_text("{}")  # (a lease without one would match an offer without one)


def _dotted_pool(o: P.Offer, ring: Path, tmp: Path) -> None:
    o.pool = "../" + ring.name + "/pool-0.bin"


@pytest.mark.parametrize("spoil,why", [
    (_another_host, "another host"), (_another_boot, "another host"), (_outside_root, "not under"),
    (_symlinked_pool, "cannot be opened"), (_another_file, "not the pool file"), (_short_pool, "past the end"),
    (_past_the_end, "past the end"), (_unknown_tensor, "does not have"), (_box_outside, "outside its shape"),
    (_wrong_bytes, "not its shape"), (_wrong_dtype, "element size"), (_not_a_dtype, "element size"),
    (_lease_of_another, "not the one"), (_lease_a_fifo, "cannot be read"), (_no_lease, "in place"),
    (_no_nonce, "in place"),
    (_dotted_pool, "not under"),
])
def test_a_ring_that_does_not_check_out_is_not_mapped(tmp_path: Path, spoil: Any, why: str) -> None:
    ring, offer = make_ring(tmp_path)
    spoil(offer, ring, tmp_path)
    m, reason = P.open_peer(offer, [0, 1], LAYOUTS, root=tmp_path)
    assert m is None and why in reason, reason


def test_a_tensor_whose_chunks_did_not_all_come_is_refused_not_read_from_uninitialized_memory() -> None:
    """rewind.parts_reader: a tensor (or the box of it a rank restores)
    assembled from chunks must be covered by them -- a chunk another rank's
    ring should have given and did not is a StepNotFoundError."""
    from dstt.capture.rewind import parts_reader
    from dstt.errors import StepNotFoundError

    layout = SimpleNamespace(name="w", shape=(256,), dtype=info_for_name("float32"))
    half = [((0,), (128,), VALUES[:128])]
    read = parts_reader(5, [layout], {"w": half + [((128,), (128,), VALUES[128:])]})
    assert torch.equal(read("w", None), VALUES)
    read = parts_reader(5, [layout], {"w": half + half})  # (the same chunk twice: from two rings)
    assert torch.equal(read("w", (slice(0, 100),)), VALUES[:100])  # the box it covers
    with pytest.raises(StepNotFoundError, match="not whole"):
        read("w", None)
    with pytest.raises(StepNotFoundError, match="not whole"):
        read("w", (slice(100, 200),))
