"""Every ``DSTT_*`` environment setting, in one place, read when used.

Settings are read at call time, never at import, so a test (or a launcher)
may set them at any point before the work that reads them; a process
started later (the capture helper, a torchrun worker) inherits them through
its environment. :func:`override` sets some for the duration of a block.

| variable | accessor | meaning | default |
|---|---|---|---|
| ``DSTT_PACK_CHUNK_BYTES`` | :func:`pack_chunk_bytes` | chunks below this many bytes go into packs (0: no packs) | 1 MiB |
| ``DSTT_SHM_DIR`` | :func:`shm_dir` | the directory holding ``dstt-<uid>`` staging rings | ``/dev/shm`` |
| ``DSTT_RANK_WAIT_S`` | :func:`rank_wait_s` | how long rank 0's helper waits for the other ranks' records of a step | 300 |
| ``DSTT_RANK_WAIT_DEAD_S`` | :func:`rank_wait_dead_s` | the same once those ranks' trainers are known dead | 60 |
| ``DSTT_COLLECTIVE_TIMEOUT_S`` | :func:`collective_timeout_s` | how long one of dstt's own collectives (its gloo group) waits for the other ranks | 600 |
| ``DSTT_DEBUG`` | :func:`debug` | the CLI prints tracebacks | off |
| ``DSTT_EXECUTOR`` | :func:`executor` | where scans over tensor data run: ``processes``, ``threads``, ``inline`` or ``dask://HOST:PORT`` | ``processes`` |
| ``DSTT_WORKERS`` | :func:`workers` | workers of the local executor (0: one per core) | 0 |
| ``DSTT_UPDATE_STATS_BYTES`` | :func:`update_stats_bytes` | host memory a capture without memory tier may hold for the update statistics (the previous step's values; 0: none) | a quarter of physical memory |
| ``DSTT_OBJECT_CLIENT`` | :func:`object_client` | the client of ``s3://``, ``gs://``, ``az://`` stores: ``obstore`` or ``fsspec`` | obstore where installed |
| ``DSTT_NODE_ID`` | :func:`node_id` | the node this process counts as, for peer redundancy (one machine may stand for several) | the host name |
| ``DSTT_REDUNDANCY_STORE`` | :func:`redundancy_store` | ``HOST:PORT`` of the c10d TCPStore the capture helpers exchange copies through | ``MASTER_ADDR:MASTER_PORT`` |
| ``DSTT_REDUNDANCY_TRANSPORT`` | :func:`redundancy_transport` | how redundancy blocks travel: ``p2p`` (a gloo group of the helpers, point to point) or ``store`` (through that TCPStore) | ``p2p`` |
| ``DSTT_DEVICE_STAGING`` | :func:`device_staging` | a step's GPU state is copied on the GPU inside ``snapshot()`` and moved to the host in the background, where the device has room (``auto``), or never (``off``) | ``auto`` |
| ``DSTT_AUTO_SPARE_CORES`` | :func:`auto_spare_cores` | ``compression="auto"`` in a capture helper codes a step only while the host's CPUs of the helper had at least this many cores' worth idle (0: no CPU rule) | 0.5 |

>>> with override(DSTT_PACK_CHUNK_BYTES="0"):
...     pack_chunk_bytes()
0
>>> with override(DSTT_DEBUG="1"):
...     debug()
True
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from dstt.errors import ConfigError

#: The variables this module knows (``override`` refuses any other name).
KNOBS = ("DSTT_PACK_CHUNK_BYTES", "DSTT_SHM_DIR", "DSTT_RANK_WAIT_S", "DSTT_RANK_WAIT_DEAD_S", "DSTT_DEBUG",
         "DSTT_EXECUTOR", "DSTT_WORKERS", "DSTT_OBJECT_CLIENT", "DSTT_NODE_ID", "DSTT_REDUNDANCY_STORE",
         "DSTT_UPDATE_STATS_BYTES", "DSTT_COLLECTIVE_TIMEOUT_S", "DSTT_AUTO_SPARE_CORES",
         "DSTT_REDUNDANCY_TRANSPORT", "DSTT_DEVICE_STAGING")
#: Clients an object store URL may be served by (DSTT_OBJECT_CLIENT).
OBJECT_CLIENTS = ("obstore", "fsspec")

PACK_CHUNK_BYTES_DEFAULT = 1 << 20
AUTO_SPARE_CORES_DEFAULT = 0.5


def _text(name: str) -> str:
    return os.environ.get(name, "").strip()


def _choice(name: str, choices: tuple[str, str]) -> str:
    """One of two words (any case), the first where the variable is unset or empty."""
    text = _text(name).lower() or choices[0]
    if text not in choices:
        raise ConfigError(f"{name}={text!r}: expected {choices[0]} or {choices[1]}")
    return text


def _number(name: str, default: float, *, integer: bool = False) -> float:
    text = _text(name)
    if not text:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected {'an integer' if integer else 'a number'}") from None
    if value < 0 or value != value:
        raise ConfigError(f"{name}={text!r}: expected a number >= 0")
    return value


def auto_spare_cores() -> float:
    """Idle cores (of the CPUs the capture helper may run on) below which
    ``compression="auto"`` stores steps fast (capture/helpercpu.py); 0: never
    for lack of CPU.

    >>> with override(DSTT_AUTO_SPARE_CORES="2"):
    ...     auto_spare_cores()
    2.0
    """
    return _number("DSTT_AUTO_SPARE_CORES", AUTO_SPARE_CORES_DEFAULT)


def node_id() -> str:
    """The node this process counts as (peer redundancy): DSTT_NODE_ID, else the host name."""
    import socket

    return _text("DSTT_NODE_ID")[:256] or socket.gethostname()


def redundancy_store() -> tuple[str, int] | None:
    """(host, port) of the TCPStore the capture helpers exchange copies
    through: DSTT_REDUNDANCY_STORE, else MASTER_ADDR:MASTER_PORT (the
    job's own c10d store); None if neither is set."""
    text = _text("DSTT_REDUNDANCY_STORE")
    if not text:
        host, port = _text("MASTER_ADDR"), _text("MASTER_PORT")
        if not (host and port):
            return None
        text = f"{host}:{port}"
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"DSTT_REDUNDANCY_STORE={text!r}: expected HOST:PORT")
    return host, int(port)


def redundancy_transport() -> str:
    """How redundancy blocks travel between the capture helpers: ``p2p``
    (capture/transport.py) or ``store`` (the TCPStore as their mailbox).

    >>> with override(DSTT_REDUNDANCY_TRANSPORT="store"):
    ...     redundancy_transport()
    'store'
    """
    return _choice("DSTT_REDUNDANCY_TRANSPORT", ("p2p", "store"))


def device_staging() -> str:
    """``auto``: a step's GPU sources are copied on the GPU first where the
    device has room (capture/devicestage.py); ``off``: never.

    >>> with override(DSTT_DEVICE_STAGING="off"):
    ...     device_staging()
    'off'
    """
    return _choice("DSTT_DEVICE_STAGING", ("auto", "off"))


def pack_chunk_bytes() -> int:
    """Chunks smaller than this many bytes are stored in packs; 0 turns packs off."""
    return int(_number("DSTT_PACK_CHUNK_BYTES", PACK_CHUNK_BYTES_DEFAULT, integer=True))


def shm_dir() -> Path | None:
    """The directory holding ``dstt-<uid>`` staging rings, if set (else /dev/shm)."""
    text = _text("DSTT_SHM_DIR")
    return Path(text) if text else None


def rank_wait_s() -> float:
    """Seconds rank 0's capture helper waits for every rank's record of a step."""
    return _number("DSTT_RANK_WAIT_S", 300.0)


def rank_wait_dead_s() -> float:
    """Seconds it waits once the missing ranks' trainers are known dead."""
    return _number("DSTT_RANK_WAIT_DEAD_S", 60.0)


def collective_timeout_s() -> float:
    """Seconds one of dstt's own collectives waits for the other ranks (a
    rank that died or hangs: a dstt error, not a wait of torch's 30 min)."""
    return _number("DSTT_COLLECTIVE_TIMEOUT_S", 600.0)


def debug() -> bool:
    """Whether the CLI prints tracebacks (``DSTT_DEBUG`` set and not ``0``)."""
    return _text("DSTT_DEBUG") not in ("", "0")


def executor() -> str | None:
    """Where scans over tensor data run (``DSTT_EXECUTOR``), None if unset;
    checked by :func:`dstt.format.scan.parse_executor`."""
    return _text("DSTT_EXECUTOR") or None


def workers() -> int:
    """Workers of the local executor (``DSTT_WORKERS``); 0: one per core."""
    return int(_number("DSTT_WORKERS", 0, integer=True))


def update_stats_bytes() -> int | None:
    """Bytes of previous-step values a capture without memory tier may hold
    for ``update_norm``/``update_ratio`` (dstt.store.prevvalues); None when
    not set (a quarter of physical memory); 0 turns those statistics off.

    >>> with override(DSTT_UPDATE_STATS_BYTES="0"):
    ...     update_stats_bytes()
    0
    """
    return int(_number("DSTT_UPDATE_STATS_BYTES", 0, integer=True)) if _text("DSTT_UPDATE_STATS_BYTES") else None


def object_client() -> str:
    """Which client serves ``s3://``, ``gs://`` and ``az://`` stores:
    ``"obstore"`` or ``"fsspec"`` (s3fs, gcsfs, adlfs); empty when not set
    (then obstore where it is installed: benchmarks/bench_s3.py).

    >>> with override(DSTT_OBJECT_CLIENT="fsspec"):
    ...     object_client()
    'fsspec'
    """
    text = _text("DSTT_OBJECT_CLIENT").lower()
    if text and text not in OBJECT_CLIENTS:
        raise ConfigError(f"DSTT_OBJECT_CLIENT={text!r}: expected one of {', '.join(OBJECT_CLIENTS)}")
    return text


def s3_endpoint() -> str:
    """The S3 endpoint the standard AWS variables name (``AWS_ENDPOINT_URL_S3``,
    else ``AWS_ENDPOINT_URL``; empty: AWS itself). Read by the obstore
    backend only to allow plain ``http://`` to such a server."""
    return _text("AWS_ENDPOINT_URL_S3") or _text("AWS_ENDPOINT_URL")


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Set (a string) or unset (None) some ``DSTT_*`` variables for the
    duration of the block, for this process and the processes it starts."""
    unknown = sorted(set(values) - set(KNOBS))
    if unknown:
        raise ConfigError(f"not a dstt setting: {', '.join(unknown)} (known: {', '.join(KNOBS)})")
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _set(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set(name, value)


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
