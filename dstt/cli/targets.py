"""What a command is pointed at: a reference ``STORE[@BRANCH][:STEP]``
(docs/cli.md), opened torch-free or with its tensors, or a whole STORE.

Shared by the command modules; opening a reference with its tensors is the
only thing here that imports torch, and only when called.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref
    from dstt.store.reader import TensorReader


def open_index(text: str) -> tuple[RunIndex, Ref]:
    """The torch-free :class:`~dstt.format.index.RunIndex` of a reference
    string, and the parsed :class:`~dstt.format.refs.Ref`."""
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref

    ref = Ref.parse(text)
    return RunIndex(text), ref


def open_tensors(text: str) -> TensorReader:
    """A :class:`~dstt.store.reader.TensorReader` of a reference string
    (imports torch): for the commands that read tensor data."""
    from dstt.format.refs import Ref
    from dstt.store.reader import TensorReader

    Ref.parse(text)  # a malformed reference: the parser's message, before any store is opened
    return TensorReader(text)


def target_text(url: str, branch: str, step: int) -> str:
    """The full reference of a resolved step, as commands print it.

    >>> target_text("runs/a", "main", 7)
    'runs/a@main:7'
    """
    return f"{url}@{branch}:{step}"


def store_arg(text: str, command: str, hint: str) -> str:
    """``text`` as the STORE of a command that works on a whole store; a
    reference (``run@main``, ``run:5``) or nothing is refused before any work
    (an empty path would otherwise mean the current directory).

    >>> store_arg("runs/a", "gc", "")
    'runs/a'
    >>> store_arg("runs/a@main", "gc", " (gc works on the whole store)")
    Traceback (most recent call last):
    ...
    dstt.errors.InvalidReferenceError: gc takes a STORE, not a reference: got 'runs/a@main' (gc works on the whole store)
    """
    from dstt.errors import InvalidReferenceError
    from dstt.format.refs import Ref

    if not text.strip():
        raise InvalidReferenceError(f"{command} needs a STORE path or URL, got an empty string")
    if os.path.exists(text):
        return text
    ref = Ref.parse(text)
    if ref.branch is not None or ref.step is not None:
        raise InvalidReferenceError(f"{command} takes a STORE, not a reference: got {text!r}{hint}")
    return text
