"""How a :class:`~dstt.store.writer.Writer` stores steps: :class:`WriteOptions`,
one frozen object validated once, in its ``__post_init__``.

Every entry point builds one: ``dstt.save`` from its keywords,
:class:`dstt.Capture` from its :class:`~dstt.capture.config.CaptureConfig`
(``capture.config.write_options``, the one place that maps one to the
other), the capture helper from the options its trainer sends. The Writer
takes it as it is and checks nothing again. Torch-free: what each field
means is the format's (codecs, chunk sizes, packs).

>>> WriteOptions(compression="zstd", zstd_level=3).codec
CodecSpec(compression='zstd', level=3)
>>> WriteOptions(parent=("main", 3)).parent
StepRef(branch='main', step=3)
>>> WriteOptions(threads=0)
Traceback (most recent call last):
dstt.errors.ConfigError: threads must be a positive integer, got 0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dstt import knobs
from dstt.format import args as A
from dstt.format.codecs.keyframes import DEFAULT_KEYFRAME_EVERY
from dstt.format.codecs.spec import COMPRESSIONS, CodecSpec
from dstt.format.geometry import DEFAULT_MAX_CHUNK_BYTES
from dstt.format.layout import StepRef
from dstt.format.refs import parent_arg


@dataclass(frozen=True)
class WriteOptions:
    """What a Writer stores and how (see the module docstring).

    ``branch`` (created on first write, forked at ``parent``: a
    ``(branch, step)`` pair or a reference inside the store such as
    ``"main:1200"``); ``compression`` (``"none"``, ``"zstd"``,
    ``"shuffle-zstd"``, ``"delta"``, ``"predictive"``, ``"auto"``) at
    ``zstd_level``, a keyframe at least every ``keyframe_every`` steps;
    chunks of at most ``max_chunk_bytes``; ``allow_pickle`` (store values
    that are not tensors or plain data by pickling them); ``dedup`` (a
    chunk equal to the previous step's is linked, not written);
    ``threads`` (the flusher's); ``storage_options`` (fsspec's, for a URL);
    ``pack_chunk_bytes`` (chunks smaller than this go into packs; 0: none;
    None: ``$DSTT_PACK_CHUNK_BYTES``, else 1 MiB, read when the options are made).
    """

    branch: str = "main"
    parent: StepRef | tuple[str, int] | str | None = None
    compression: str = "none"
    zstd_level: int = 1
    keyframe_every: int = DEFAULT_KEYFRAME_EVERY
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    allow_pickle: bool = False
    dedup: bool = True
    threads: int = 2
    storage_options: dict[str, Any] | None = None
    pack_chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        """Every field through its validator (dstt.format.args): the one check."""
        A.branch(self.branch)
        object.__setattr__(self, "parent", parent_arg(self.parent))
        A.choice("compression", self.compression, COMPRESSIONS)
        A.zstd_level(self.zstd_level)
        for name in ("keyframe_every", "max_chunk_bytes", "threads"):
            A.positive_int(name, getattr(self, name))
        A.flag("allow_pickle", self.allow_pickle)
        A.flag("dedup", self.dedup)
        A.options("storage_options", self.storage_options)
        if self.pack_chunk_bytes is None:
            object.__setattr__(self, "pack_chunk_bytes", knobs.pack_chunk_bytes())
        A.non_negative_int("pack_chunk_bytes", self.pack_chunk_bytes)

    @property
    def fork(self) -> StepRef | str | None:
        """``parent`` as checked: a StepRef, a reference inside the store, or None."""
        parent = self.parent
        assert parent is None or isinstance(parent, (StepRef, str))  # (__post_init__: parent_arg)
        return parent

    @property
    def codec(self) -> CodecSpec:
        """The codec of ``compression`` at ``zstd_level``."""
        return CodecSpec(self.compression, self.zstd_level)

    @property
    def packs_below(self) -> int:
        """``pack_chunk_bytes`` as resolved (an int)."""
        return int(self.pack_chunk_bytes or 0)

    def but(self, **changes: Any) -> WriteOptions:
        """These options with ``changes`` (checked again: a new object).

        >>> WriteOptions(compression="zstd").but(branch="b").compression
        'zstd'
        """
        return dataclasses.replace(self, **changes)

    def shipped(self) -> dict[str, Any]:
        """The fields as plain data (JSON) for another process's Writer of
        the same branch (the capture helper: ``WriteOptions(**shipped)``)."""
        out = dataclasses.asdict(self)
        parent = self.parent
        out["parent"] = list(parent) if isinstance(parent, StepRef) else parent
        return out


__all__ = ["WriteOptions"]
