"""Validated settings of :class:`dstt.Capture`."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from dstt import knobs
from dstt.capture.waits import DEFAULT_TIMEOUT_S
from dstt.errors import ConfigError
from dstt.format import args as A
from dstt.format.codecs.keyframes import DEFAULT_KEYFRAME_EVERY
from dstt.format.geometry import DEFAULT_MAX_CHUNK_BYTES
from dstt.format.layout import StepRef
from dstt.format.writeoptions import WriteOptions

ON_FULL = ("wait", "skip")
PERSIST = ("all", "newest")
#: The memory tier holds at most this many steps (a sanity bound, not a tuning).
MAX_MEMORY_STEPS = 1024


@dataclass
class CaptureConfig:
    """Everything :class:`dstt.Capture` can be told, checked on construction.

    ``host_buffer_bytes`` bounds the host staging pool. ``None`` sizes it
    automatically to two steps of this process's state (so step k+1 can be
    staged while step k is written). An explicit value must be at least
    ``max_chunk_bytes``: every chunk is staged whole, so the pool must hold
    the largest one (tensors larger than the pool are split into chunks and
    staged in parts).

    >>> CaptureConfig(every=10, on_full="skip").every
    10
    >>> CaptureConfig(on_full="drop")
    Traceback (most recent call last):
    ...
    dstt.errors.ConfigError: on_full must be one of ('wait', 'skip'), got 'drop'
    """

    every: int = 1
    branch: str = "main"
    parent: StepRef | tuple[str, int] | str | None = None
    host_buffer_bytes: int | None = None
    on_full: str = "wait"
    #: None (the default): ``"auto"`` (predictive coding in the capture
    #: helper, off the trainer's process, stored fast when the helper falls
    #: behind) where the helper runs, ``"none"`` where the capture writes in
    #: this process (its encoding would share the trainer's CPU and GIL).
    #: Under torch.distributed the same: each rank's helper codes that
    #: rank's own shards (docs/format.md "Predictive chunks").
    compression: str | None = None
    zstd_level: int = 1
    #: With ``compression="delta"`` (or ``"auto"``): a chunk is stored whole
    #: (a keyframe) at least every this many steps; deltas reference it.
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    flush_threads: int = 2
    #: Threads the capture helper codes a step's predictive chunks on
    #: (``compression="predictive"``/``"auto"``; docs/format.md "Predictive chunks").
    encode_threads: int = 2
    allow_pickle: bool = False
    dedup: bool = True
    #: Nice value of dstt's background threads (Linux): the trainer's threads
    #: win the CPU when both want it; 0 leaves them at the trainer's priority.
    background_nice: int = 10
    #: Linux: dstt's background threads and its capture helper also run
    #: under the SCHED_IDLE policy, so a trainer's thread that wakes up (an
    #: OpenMP worker of a CPU run) takes its core at once instead of waiting
    #: out a time slice. False: the nice value alone.
    background_idle: bool = True
    #: At interpreter exit, a Capture never closed waits up to this many
    #: seconds for its queued steps to commit, then says on stderr what it lost.
    exit_drain_s: float = 60.0
    #: Stage in a file under /dev/shm (steps sealed there survive the
    #: trainer and are committed by the next Capture); False: in-process
    #: memory only. None: /dev/shm when it has room, else in-process with a warning.
    shm: bool | None = None
    #: Write and commit in a helper process that outlives the trainer
    #: (capture/helper.py); False: in this process's threads. None: the
    #: helper where it can run (single process, local store, /dev/shm).
    helper: bool | None = None
    #: Options for fsspec when the store is a URL such as ``s3://``
    #: (endpoint, credentials; docs/object-stores.md).
    storage_options: dict[str, Any] | None = None
    #: The flight recorder's memory tier (capture/tier.py): keep the last
    #: this many captured steps in host memory (the /dev/shm ring where it
    #: fits), persisted or not. Host memory used: (memory_steps + 4) x one
    #: step (K kept, one being staged, one being written and the step before
    #: it for the update statistics, one being checked for NaN/Inf), stated
    #: at the first snapshot (log level INFO); with
    #: ``host_buffer_bytes`` set, that is the cap (a CaptureError if K steps
    #: do not fit). Writes run in this process's threads (no helper process).
    memory_steps: int | None = None
    #: Which captured steps go to the store: "all" (backpressure: the
    #: trainer waits for the disk), "newest" (never wait: whenever the writer
    #: is free it persists the newest staged step; the others live only in
    #: memory until evicted) or N (every N-th captured step, waiting for
    #: those). None: "newest" with ``memory_steps``, else "all". Anything
    #: but "all" needs ``memory_steps``.
    persist: str | int | None = None
    #: With ``memory_steps``: check every captured floating-point tensor for
    #: NaN/Inf in the background and raise an incident (persist the ring)
    #: at the first step that has some (and again only after a clean step).
    watch_nonfinite: bool = True
    #: Peer redundancy of the memory tier (issue 26, docs/flight-recorder.md
    #: "Surviving a node"): ``"none"``, ``"pair"`` -- under
    #: torch.distributed with ``memory_steps``, each node's held steps are
    #: copied by its capture helpers to the next node's, so the loss of one
    #: node (its processes and its /dev/shm) loses no step the tier held;
    #: ``"parity:k"``: groups of k+1 nodes, each keeping the XOR parity
    #: of a stripe of the others' held steps (1/k extra memory, one loss a group);
    #: ``"parity:k+m"`` (m >= 2; the ``erasure`` extra, pyeclib): groups of
    #: k+m nodes, Reed-Solomon (m/k extra memory, m losses a group);
    #: ``"replicas"`` -- each rank's ring also holds the replicated chunks
    #: other holders write (R x the replicated bytes per rank), and a lost
    #: rank's steps are rebuilt from a replica's ring (capture/replicaguard.py);
    #: ``"auto"`` -- ``replicas`` where every tensor has a replica on another
    #: node (DDP, HSDP), else ``pair``, chosen at the first snapshot
    #: (capture/redundancychoice.py; ``Capture.redundancy_chosen``).
    redundancy: str = "none"

    #: Every wait of the capture (the capture helper's answer for a step, a
    #: staging block, a background thread, ``wait()``, ``close()``...) gives
    #: up after this many seconds during which nothing it waits for made
    #: progress (no step committed, no chunk written, no answer of the
    #: helper: its CPU time and I/O do not count), with a CaptureError naming what did not answer; a helper
    #: that does not answer is killed (its sealed steps stay in /dev/shm for
    #: the next Capture or ``dstt gc``). Raise it only for steps whose commit
    #: alone can stall that long (capture/waits.py).
    background_timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        """Every field through its validator (dstt.format.args), before anything is built."""
        for name in ("every", "flush_threads", "encode_threads"):
            A.positive_int(name, getattr(self, name))
        # What a Writer of these steps takes -- branch, parent, codec, chunks,
        # pickling, dedup, storage options -- is checked once, by WriteOptions.
        self.parent = write_options(self).parent
        A.choice("on_full", self.on_full, ON_FULL)
        for name in ("background_idle", "watch_nonfinite"):
            A.flag(name, getattr(self, name))
        A.int_in("background_nice", self.background_nice, 0, 19)
        A.seconds("exit_drain_s", self.exit_drain_s)
        A.seconds("background_timeout_s", self.background_timeout_s, allow_zero=False)
        A.auto_flag("shm", self.shm)
        A.auto_flag("helper", self.helper)
        knobs.auto_spare_cores()  # (read by the helper: a bad DSTT_AUTO_SPARE_CORES is refused here)
        self._check_memory_tier()
        self._check_redundancy()
        if self.host_buffer_bytes is not None:
            A.positive_int("host_buffer_bytes", self.host_buffer_bytes)
            if self.host_buffer_bytes < self.max_chunk_bytes:
                raise ConfigError(
                    f"host_buffer_bytes ({self.host_buffer_bytes}) must be at least max_chunk_bytes "
                    f"({self.max_chunk_bytes}): the staging pool must hold the largest chunk; "
                    "lower max_chunk_bytes or raise host_buffer_bytes"
                )

    def _check_memory_tier(self) -> None:
        if self.memory_steps is not None:
            A.int_in("memory_steps", self.memory_steps, 1, MAX_MEMORY_STEPS)
            if self.on_full != "wait":
                raise ConfigError("memory_steps: the memory tier never skips a step; use persist='newest' "
                                  "(never wait for the disk) instead of on_full='skip'")
        p = self.persist
        if p is None:
            return
        if not (p in PERSIST or A.is_int(p) and p >= 1):  # type: ignore[operator]
            raise ConfigError(f"persist must be 'all', 'newest' or a positive integer N (every N-th captured "
                              f"step), got {A.shown(p)}")
        if p != "all" and self.memory_steps is None:
            raise ConfigError(f"persist={p!r} keeps the other steps in memory only: it needs memory_steps=K "
                              "(how many captured steps the memory tier holds)")

    def _check_redundancy(self) -> None:
        from dstt.format.redundancy import parse_scheme

        if self.redundancy == "auto":  # replicas where the state allows, else pair (capture/redundancychoice.py)
            if self.memory_steps is None:
                raise ConfigError("redundancy='auto' protects the steps the memory tier holds: it needs memory_steps=K")
            return
        scheme = parse_scheme(self.redundancy)
        if scheme.kind != "none" and self.memory_steps is None:
            raise ConfigError(f"redundancy={self.redundancy!r} protects the steps the memory tier holds: "
                              "it needs memory_steps=K")
        if scheme.kind == "parity" and scheme.m > 1:  # (pyeclib there, and a backend for k, m: ConfigError if not)
            from dstt.format.rsacc import driver

            driver(scheme.k, scheme.m)

    @property
    def persist_policy(self) -> str | int:
        """``persist`` with its default applied."""
        if self.persist is not None:
            return self.persist
        return "newest" if self.memory_steps is not None else "all"


def write_options(cfg: CaptureConfig, **changes: Any) -> WriteOptions:
    """The options of a Writer storing ``cfg``'s steps -- the one place that
    maps a CaptureConfig to them -- with ``changes`` on top (the default
    compression settled, a rewind's branch, the threads of the flusher).
    Checked by WriteOptions itself (a ConfigError naming the option).

    >>> write_options(CaptureConfig(compression="zstd", branch="b"), threads=1)
    ... # doctest: +ELLIPSIS
    WriteOptions(branch='b', parent=None, compression='zstd', ..., threads=1, ...)
    """
    fields_: dict[str, Any] = {"branch": cfg.branch, "parent": cfg.parent,
                               "compression": "none" if cfg.compression is None else cfg.compression,
                               "zstd_level": cfg.zstd_level, "keyframe_every": cfg.keyframe_every,
                               "max_chunk_bytes": cfg.max_chunk_bytes, "allow_pickle": cfg.allow_pickle,
                               "dedup": cfg.dedup, "storage_options": cfg.storage_options}
    fields_.update(changes)
    return WriteOptions(**fields_)


def make_config(config: CaptureConfig | None, overrides: dict[str, Any]) -> CaptureConfig:
    """``config`` (default: the defaults) with ``overrides`` applied and
    checked; an unknown option is a ConfigError naming the known ones.

    >>> make_config(None, {"every": 5}).every
    5
    >>> make_config(CaptureConfig(every=5), {"branch": "b"}).every
    5
    >>> make_config(None, {"evry": 5})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    dstt.errors.ConfigError: unknown Capture option 'evry'; known: every, branch, parent, ...
    """
    if config is not None and not isinstance(config, CaptureConfig):
        raise ConfigError(f"config must be a CaptureConfig, got {type(config).__name__}")
    known = [f.name for f in fields(CaptureConfig)]
    for key in overrides:
        if key not in known:
            raise ConfigError(f"unknown Capture option {key!r}; known: {', '.join(known)}")
    if overrides.get("max_chunk_bytes", 0) is None:  # None meant "the default" before options were listed once
        overrides = {k: v for k, v in overrides.items() if k != "max_chunk_bytes"}
    if config is None:
        return CaptureConfig(**overrides)
    return replace(config, **overrides)  # __post_init__ checks the result
