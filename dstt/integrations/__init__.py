"""Callbacks for the trainers people already use.

* :mod:`dstt.integrations.transformers` -- Hugging Face ``Trainer``
  (``pip install 'dstt[transformers]'``);
* :mod:`dstt.integrations.lightning` -- PyTorch Lightning
  (``pip install 'dstt[lightning]'``).

Each module imports its framework; ``import dstt`` imports neither. The
shared, framework-free parts (which branch a resumed run captures on, the
JSON-safe copy of a trainer's counters, and :class:`CallbackSettings`,
what both callbacks hold) live here.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from dstt.errors import ConfigError

if TYPE_CHECKING:
    from dstt.capture import Capture


def check_callback_options(every: Any, capture_options: dict[str, Any]) -> None:
    """Check what both trainer callbacks take (``every``, and capture options
    that are no argument of the callback itself); raise ConfigError if not.

    >>> check_callback_options(2, {"compression": "zstd"})
    >>> check_callback_options(1, {"branch": "b"})
    Traceback (most recent call last):
    ...
    dstt.errors.ConfigError: branch= is an argument of DsttCallback itself, not a capture option
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"every must be a positive integer, got {every!r}")
    for k in ("branch", "parent", "every"):
        if k in capture_options:
            raise ConfigError(f"{k}= is an argument of DsttCallback itself, not a capture option")


class CallbackSettings:
    """What a trainer callback captures and where, and the Capture once it
    is open (one per callback; the HF and Lightning callbacks hold one each).

    ``store``: path or URL; ``every``: capture when ``global_step % every ==
    0``; ``branch``: the branch to capture on (None: ``main``, or the
    resumed one); ``rng``: capture RNG states; ``capture_options``: passed
    to :class:`dstt.Capture`. Checked here (:func:`check_callback_options`).

    >>> s = CallbackSettings("runs/x", every=2, branch=None, rng=True, capture_options={"compression": "zstd"})
    >>> s.due(4), s.due(5), s.capture_options
    (True, False, {'compression': 'zstd'})
    """

    def __init__(self, store: Any, *, every: int, branch: str | None, rng: bool,
                 capture_options: dict[str, Any]) -> None:
        check_callback_options(every, capture_options)
        self.store = os.fspath(store)
        self.every = every
        self.branch = branch
        self.parent: tuple[str, int] | None = None  # a resumed run's fork point (resume_from)
        self.rng = rng
        self.capture_options = capture_options
        self.capture: Capture | None = None
        self.resume_dir: str | None = None  # a temporary resume directory, removed by close()

    def due(self, step: int) -> bool:
        """Whether ``step`` is captured (``every``)."""
        return step % self.every == 0

    def open(self) -> Capture:
        """The Capture, opened on first use (on the resumed branch, if any)."""
        if self.capture is None:
            from dstt.capture import Capture

            self.capture = Capture(self.store, every=self.every, branch=self.branch or "main", parent=self.parent,
                                   **self.capture_options)
        return self.capture

    def resume_from(self, ref: str, directory: str | None, prefix: str) -> str:
        """Resuming from ``ref`` (``STORE[@BRANCH][:STEP]``): capture continues
        on its branch when ``ref`` is that branch's latest step of this store,
        else on ``branch`` (forked at ``ref``). The directory to write the
        checkpoint into: ``directory``, or a new temporary one (``prefix``)
        that close() removes."""
        from dstt.format.refs import Ref

        if same_store(Ref.parse(ref).store, self.store):
            _store, self.branch, _step, self.parent = resume_target(ref, self.branch)
        if directory is None:
            directory = self.resume_dir = tempfile.mkdtemp(prefix=prefix)
        return directory

    def close(self) -> None:
        """Wait until every captured step is committed, release the capture,
        remove the temporary resume directory. Idempotent."""
        capture, self.capture = self.capture, None
        resume_dir, self.resume_dir = self.resume_dir, None
        close_capture(capture, resume_dir)


def close_capture(capture: Capture | None, resume_dir: str | None) -> None:
    """What ending a callback does: wait until every captured step is
    committed and release the capture, then remove the temporary resume
    directory (if any), even when closing failed."""
    try:
        if capture is not None:
            capture.close()
    finally:
        if resume_dir is not None:
            shutil.rmtree(resume_dir, ignore_errors=True)


def plain_values(obj: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of ``obj``: numbers, strings, None, lists and
    str-keyed dicts are kept; anything else (objects, tensors, callables)
    is dropped. Non-finite floats are kept (dstt stores them tagged).

    >>> plain_values({"a": 1, "b": [2.5, "x"], "f": len, 3: 4})
    {'a': 1, 'b': [2.5, 'x']}
    """
    if depth > 32:
        return None
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float:
        return obj
    if isinstance(obj, (list, tuple)):
        return [v for v in (plain_values(x, depth + 1) for x in obj) if v is not _DROP]
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str) or k.startswith("$"):
                continue
            pv = plain_values(v, depth + 1)
            if pv is not _DROP:
                out[k] = pv
        return out
    return _DROP


class _Drop:
    def __repr__(self) -> str:
        return "<dropped>"


_DROP: Any = _Drop()


def numbers_only(logs: dict[str, Any] | None) -> dict[str, float | int]:
    """The finite-or-not numeric entries of a trainer's log dict.

    >>> numbers_only({"loss": 0.5, "epoch": 1, "note": "x", "nan": float("nan")})
    {'loss': 0.5, 'epoch': 1, 'nan': nan}
    """
    out: dict[str, float | int] = {}
    for k, v in (logs or {}).items():
        if isinstance(k, str) and type(v) in (int, float) and not k.startswith("$"):
            out[k] = v
    return out


def resume_target(ref: str, branch: str | None) -> tuple[str, str, int, tuple[str, int] | None]:
    """Where a run resumed from ``ref`` (``STORE[@BRANCH][:STEP]``) captures:
    ``(store, branch, step, parent)``. Resuming from the latest step of a
    branch continues that branch (``parent`` None); resuming from an earlier
    step needs a new ``branch`` (forked there, ``parent=(branch, step)``),
    because committed steps are never overwritten.
    """
    from dstt.format.index import RunIndex
    from dstt.format.refs import Ref

    parsed = Ref.parse(ref)
    run = RunIndex(ref)
    try:
        src_branch, step = run.resolve()
        latest_branch, latest = run.resolve("latest", branch=run.default_branch)
    finally:
        run.close()
    # (a branch without steps of its own resolves to its fork point: continuing it is fine)
    continuing = (src_branch, step) == (latest_branch, latest)
    if branch is None or branch == run.default_branch:
        if not continuing:
            raise ConfigError(
                f"step {step} is not the latest step of branch {run.default_branch!r} ({latest}): "
                "pass branch='NAME' to continue on a new branch forked at it"
            )
        return parsed.store, run.default_branch, step, None
    return parsed.store, branch, step, (src_branch, step)


def dumps(obj: Any) -> str:
    """JSON with non-finite floats as strings (what trainer state files accept)."""
    def fix(o: Any) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            return None
        if isinstance(o, dict):
            return {k: fix(v) for k, v in o.items()}
        if isinstance(o, list):
            return [fix(v) for v in o]
        return o

    return json.dumps(fix(obj), indent=2, sort_keys=True)


def optimizer_state_dict(saved: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (integer ids) from dstt's by-name form, for an
    optimizer built the same way (parameters in the stored group order).

    >>> optimizer_state_dict({"w": {"step": 1}, "b": {},
    ...                       "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]})
    {'state': {0: {'step': 1}}, 'param_groups': [{'lr': 0.1, 'params': [0, 1]}]}
    """
    groups, state, index = [], {}, 0
    for g in saved["param_groups"]:
        g = dict(g)
        ids = []
        for name in g["params"]:
            if saved.get(name):
                state[index] = dict(saved[name])
            ids.append(index)
            index += 1
        g["params"] = ids
        groups.append(g)
    return {"state": state, "param_groups": groups}


def same_store(a: str, b: str) -> bool:
    """Do two store strings name the same place?"""

    if "://" in a + b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)
