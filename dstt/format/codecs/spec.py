"""Chunk encoding and array metadata, written without zarr-python's per-call
machinery but byte-for-byte what zarr-python would write and read.

zarr-python 3.1 spends ~17 ms creating an array and ~20 ms opening and
reading one (measured here); dstt stores one array per logical tensor and
touches hundreds per step, so it renders the ``zarr.json`` document itself and
encodes chunks with the same codec chain. tests/format/test_store_format.py keeps
the two in step: zarr-python, given dstt's ``zarr.json``, writes identical
chunk bytes, and plain ``zarr.open_array`` reads what dstt wrote.

Codec chains (Zarr v3 names):

* ``"none"``: ``bytes(little)`` → ``crc32c``
* ``"zstd"``: ``bytes(little)`` → ``zstd(level)`` → ``crc32c``
* ``"shuffle-zstd"``: ``bytes(little)`` → ``blosc(zstd, clevel 1, shuffle,
  typesize = itemsize, blocksize 1 MiB)`` → ``crc32c`` (core Zarr v3 codecs)
* ``"delta"``: the ``"shuffle-zstd"`` chain for keyframes; most chunks are
  instead stored as the difference to a keyframe, in a sibling array with
  the same chain (dstt/format/codecs/delta.py, docs/format.md "Delta chunks")

The crc32c codec appends the little-endian CRC-32C of the preceding bytes, so
every chunk carries its own checksum.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from dstt.errors import ChecksumMismatchError, ConfigError, CorruptStoreError
from dstt.format.codecs.crccombine import combine
from dstt.format.codecs.delta import blosc_config, blosc_decode, blosc_encode, stored_header
from dstt.format.dtypes import DtypeInfo
from dstt.format.layout import CHUNK_SEPARATOR, MAX_SLOTS

_CRC = struct.Struct("<I")


#: What ``compression=`` accepts. ``"predictive"``: parameters and optimizer
#: state predicted from the previous step by the optimizer's update rule,
#: everything else a chained delta (docs/format.md "Predictive chunks").
#: ``"auto"``: ``"predictive"``, except that a step planned while earlier
#: ones are still being written (the writer is behind) is stored without
#: compression in the same Blosc container.
COMPRESSIONS = ("none", "zstd", "shuffle-zstd", "delta", "predictive", "auto")


@dataclass(frozen=True)
class CodecSpec:
    """How chunks of an array are encoded: compression name and level.

    ``"delta"`` and ``"shuffle-zstd"`` write keyframes with the same chain,
    so they share arrays (same ``tag``); what makes an index entry delta
    coded is its ``keyframes`` list, not its codec.

    >>> CodecSpec("delta").tag, CodecSpec("shuffle-zstd").codecs_json(4)[1]["name"]
    ('bsz1', 'blosc')
    """

    compression: str = "none"
    level: int = 1

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression must be one of {', '.join(map(repr, COMPRESSIONS))}, got {self.compression!r}"
            )
        if self.compression == "zstd" and not (isinstance(self.level, int) and -7 <= self.level <= 22):
            raise ConfigError(f"zstd level must be in -7..22, got {self.level!r}")

    @property
    def blosc(self) -> bool:
        """Chunks are Blosc containers (shuffle + zstd-1): ``shuffle-zstd`` and ``delta``."""
        return self.compression in ("shuffle-zstd", "delta", "predictive", "auto")

    @property
    def delta(self) -> bool:
        """Star deltas to keyframes (docs/format.md "Delta chunks")."""
        return self.compression == "delta"

    @property
    def predictive(self) -> bool:
        """Predictive chunks (docs/format.md "Predictive chunks")."""
        return self.compression in ("predictive", "auto")

    @property
    def array_codec(self) -> "CodecSpec":
        """The codec of the arrays this mode writes (delta keyframes: shuffle-zstd)."""
        return CodecSpec("shuffle-zstd") if self.blosc else self

    @property
    def tag(self) -> str:
        if self.blosc:
            return "bsz1"
        return "raw" if self.compression == "none" else f"zstd{self.level}"

    def codecs_json(self, itemsize: int = 1) -> list[dict[str, Any]]:
        """The Zarr v3 codec chain (``itemsize``: the stored dtype's, for blosc's typesize)."""
        chain: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.compression == "zstd":
            chain.append({"name": "zstd", "configuration": {"level": self.level, "checksum": False}})
        elif self.blosc:
            chain.append({"name": "blosc", "configuration": blosc_config(itemsize)})
        chain.append({"name": "crc32c"})
        return chain

    @classmethod
    def from_codecs_json(cls, codecs: Any) -> "CodecSpec":
        try:
            names = [c["name"] for c in codecs]
            if names == ["bytes", "crc32c"]:
                return cls("none")
            if names == ["bytes", "zstd", "crc32c"]:
                return cls("zstd", int(codecs[1]["configuration"]["level"]))
            if names == ["bytes", "blosc", "crc32c"]:
                conf = codecs[1]["configuration"]
                if conf == blosc_config(conf.get("typesize")):  # exactly what dstt writes
                    return cls("shuffle-zstd")
        except (TypeError, KeyError, ValueError, AttributeError):
            pass
        raise CorruptStoreError(f"unsupported codec chain {codecs!r}")


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (the CRC of what precedes it)."""
    # google_crc32c refuses writable memoryviews but takes numpy arrays (no copy).
    return int(google_crc32c.extend(crc, np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)))


def encode_chunk(raw: memoryview, codec: CodecSpec, raw_crc: int | None = None, itemsize: int = 1,
                 *, fast: bool = False, noise: bool = False) -> list[Any]:
    """Encoded chunk as a list of buffers to write back to back (no copy for
    raw, stored whole or in a fast Blosc container: ``[header, raw, trailer]``). ``raw_crc``, the CRC-32C of ``raw`` if already known, is reused as
    the trailer of uncompressed chunks; ``itemsize`` is blosc's typesize;
    ``fast``: blosc chunks stored uncompressed (same chain, any reader);
    ``noise``: blosc chunks of noise in bit-shuffle + lz4 (delta.NOISE_CNAME)."""
    if codec.blosc and fast and not noise:
        header = stored_header(len(raw), itemsize)
        if header is not None:  # the container is the header and raw as it is: raw not copied (issue 25)
            crc = combine(crc32c(header), raw_crc, len(raw)) if raw_crc is not None else crc32c(raw, crc32c(header))
            return [header, raw, _CRC.pack(crc)]
    if codec.blosc:
        body: Any = blosc_encode(raw, itemsize, stored=fast, noise=noise)
        crc = crc32c(body)
    elif codec.compression == "zstd":
        from numcodecs import Zstd

        body = Zstd(level=codec.level).encode(raw)
        crc = crc32c(body)
    else:
        body = raw
        crc = crc32c(body) if raw_crc is None else raw_crc
    return [body, _CRC.pack(crc)]


def max_stored_bytes(codec: CodecSpec, nbytes: int) -> int:
    """The most bytes a stored chunk of ``nbytes`` raw bytes can take with
    ``codec`` (CRC trailer included): reads of untrusted stores are bounded
    by it. Compressors expand incompressible data by well under 1/64 plus a
    small header (zstd's bound is n/256 + 64 KiB-ish small-input slack)."""
    if codec.compression == "none":
        return nbytes + 4
    return nbytes + nbytes // 64 + 64 * 1024 + 4


def decode_chunk(data: bytes | bytearray | memoryview, codec: CodecSpec, expected_nbytes: int, where: str) -> memoryview:
    """Verify the trailing CRC-32C and undo compression; raise on any mismatch."""
    view = memoryview(data).cast("B")
    if len(view) < 4:
        raise ChecksumMismatchError(f"{where}: chunk truncated to {len(view)} bytes")
    body = view[:-4]
    (stored,) = _CRC.unpack(view[-4:])
    if crc32c(body) != stored:
        raise ChecksumMismatchError(f"{where}: chunk CRC-32C mismatch (corrupted chunk)")
    if codec.blosc:
        return blosc_decode(body, expected_nbytes, where)
    if codec.compression == "zstd":
        from numcodecs import Zstd

        size = _zstd_content_size(body)
        if size is not None and size != expected_nbytes:
            raise CorruptStoreError(
                f"{where}: chunk has {size} bytes after decoding, expected {expected_nbytes}")
        try:
            # Into a buffer of the known size: a hostile frame cannot make
            # dstt allocate what its header claims.
            out = np.empty(expected_nbytes, dtype=np.uint8)
            body = memoryview(Zstd().decode(body, out=out)).cast("B")
        except Exception as e:  # numcodecs raises RuntimeError/ValueError variants
            raise CorruptStoreError(f"{where}: cannot decompress chunk: {e}") from None
    if len(body) != expected_nbytes:
        raise CorruptStoreError(
            f"{where}: chunk has {len(body)} bytes after decoding, expected {expected_nbytes}"
        )
    return body


def _zstd_content_size(frame: memoryview) -> int | None:
    """The Frame_Content_Size of a zstd frame header (RFC 8878 3.1.1.1), None if absent."""
    if len(frame) < 5 or bytes(frame[:4]) != b"\x28\xb5\x2f\xfd":
        return None  # not a zstd frame: numcodecs reports it
    desc = frame[4]
    single = (desc >> 5) & 1
    fcs_size = (1 if single else 0, 2, 4, 8)[desc >> 6]
    start = 5 + (0 if single else 1) + (0, 1, 2, 4)[desc & 3]
    if fcs_size == 0 or len(frame) < start + fcs_size:
        return None
    size = int.from_bytes(bytes(frame[start:start + fcs_size]), "little")
    return size + 256 if fcs_size == 2 else size


def _fill_value(info: DtypeInfo) -> Any:
    if info.storage == "bool":
        return False
    if info.storage.startswith("complex"):
        return [0.0, 0.0]
    if info.storage.startswith("float"):
        return 0.0
    return 0


def array_metadata(
    info: DtypeInfo,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    codec: CodecSpec,
    name: str,
) -> bytes:
    """The ``zarr.json`` of a tensor's array: a leading sparse slot axis."""
    doc = {
        "shape": [MAX_SLOTS, *shape],
        "data_type": info.storage,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *chunk_shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}},
        "fill_value": _fill_value(info),
        "codecs": codec.codecs_json(info.itemsize),
        "attributes": {
            "dstt": {"name": name, "dtype": info.logical, "shape": list(shape)}
        },
        "dimension_names": ["slot", *[f"d{i}" for i in range(len(shape))]],
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }
    return json.dumps(doc, indent=2).encode()


def delta_array_metadata(info: DtypeInfo, shape: tuple[int, ...], chunk_shape: tuple[int, ...], name: str) -> bytes:
    """The ``zarr.json`` of a delta-coded tensor's difference array: the
    unsigned integers of the tensor's item size, same grid and chain as its
    keyframe array (docs/format.md "Delta chunks")."""
    bits = 8 * info.itemsize
    doc = {
        "shape": [MAX_SLOTS, *shape],
        "data_type": f"uint{bits}",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *chunk_shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}},
        "fill_value": 0,
        "codecs": CodecSpec("shuffle-zstd").codecs_json(info.itemsize),
        "attributes": {
            "dstt": {"name": name, "dtype": info.logical, "shape": list(shape),
                     "delta": f"zigzag(bits - keyframe bits) as uint{bits}; see the dstt docs/format.md"}
        },
        "dimension_names": ["slot", *[f"d{i}" for i in range(len(shape))]],
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }
    return json.dumps(doc, indent=2).encode()


def group_metadata(attributes: dict[str, Any] | None = None) -> bytes:
    doc = {"attributes": attributes or {}, "zarr_format": 3, "node_type": "group"}
    return json.dumps(doc, indent=2).encode()
