"""One exception hierarchy for dstt.

Every error dstt raises on purpose derives from :class:`DsttError`, and each
also subclasses the closest builtin so callers can catch it generically
(``except FileNotFoundError`` catches a missing store). Messages say what was
expected and what came in, on one line, so the CLI can print them as is.
"""

from __future__ import annotations


class DsttError(Exception):
    """Base class of every error dstt raises deliberately."""


class StoreNotFoundError(DsttError, FileNotFoundError):
    """The store location does not exist."""


class StoreExistsError(DsttError, FileExistsError):
    """Something already exists where a new store was to be created."""


class NotADsttStoreError(DsttError, ValueError):
    """The location exists but holds no dstt store (or an unreadable root)."""


class FormatVersionError(DsttError, ValueError):
    """The store was written by an incompatible format version."""


class BranchNotFoundError(DsttError, KeyError):
    """No branch of that name exists in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BranchExistsError(DsttError, FileExistsError):
    """A branch of that name already exists."""


class StepNotFoundError(DsttError, KeyError):
    """The branch has no committed step of that number."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TensorNotFoundError(DsttError, KeyError):
    """The step has no tensor of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StepExistsError(DsttError, FileExistsError):
    """A step of that number is already committed on the branch."""


class StepOrderError(DsttError, ValueError):
    """Steps on a branch must be saved in increasing order."""


class InvalidReferenceError(DsttError, ValueError):
    """A ``STORE[@BRANCH][:STEP]`` reference could not be parsed or resolved."""


class InvalidNameError(DsttError, ValueError):
    """A branch or tensor name is not acceptable."""


class UnsupportedValueError(DsttError, TypeError):
    """A value in the state cannot be stored (without ``allow_pickle=True``)."""


class PickleNotAllowedError(DsttError, PermissionError):
    """Reading a pickled value needs an explicit ``allow_pickle=True``."""


class UnsupportedDtypeError(DsttError, TypeError):
    """A tensor dtype dstt cannot store bit-exactly."""


class ShardingError(DsttError, ValueError):
    """Shards of a logical tensor are inconsistent (overlap, gap, bad offset)."""


class CorruptStoreError(DsttError, ValueError):
    """Stored data or metadata failed validation (checksum, JSON, bounds)."""


class ChecksumMismatchError(CorruptStoreError):
    """A chunk or tensor checksum does not match its recorded value."""


class StoreLockedError(DsttError, BlockingIOError):
    """Another live writer holds the branch's write lock."""


class StoreNotWritableError(DsttError, PermissionError):
    """The store cannot be written here (a read-only filesystem, no permission)."""


class CaptureError(DsttError, RuntimeError):
    """Background capture work failed; the message names the step."""


class RestoreMismatchError(DsttError, ValueError):
    """A stored step does not match the live objects it is restored into;
    ``problems`` lists every mismatch (the message spells out the first few)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems or ())


class ConfigError(DsttError, ValueError):
    """An invalid configuration value."""


class ScanError(DsttError, RuntimeError):
    """A scan over tensor data could not finish: a worker died or its
    executor failed. Nothing partial is returned (docs/analysis.md)."""


# ----------------------------------------------------------------------------- warnings

class DsttWarning(UserWarning):
    """Base class of every warning dstt emits: filter them all with
    ``warnings.filterwarnings("ignore", category=dstt.DsttWarning)``, or one
    kind by its subclass. Each also subclasses the builtin category it was
    emitted as before it had a class of its own (``RuntimeWarning`` for
    what happens during capture), so older filters keep working.

    >>> import warnings, dstt
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("example", dstt.SkippedStepWarning)
    >>> issubclass(seen[0].category, dstt.DsttWarning), issubclass(seen[0].category, RuntimeWarning)
    (True, True)
    """


class CaptureWarning(DsttWarning, RuntimeWarning):
    """Something during capture the trainer should know; no step was stored wrong."""


class SkippedStepWarning(CaptureWarning):
    """A step was not captured: the skip policy (``on_full="skip"``) dropped it."""


class HelperLostWarning(CaptureWarning):
    """The capture helper process died or stopped answering: this Capture
    commits in its own process from then on (no step is lost)."""


class StagingRingWarning(CaptureWarning):
    """The /dev/shm staging ring could not be used as asked (not ours, full,
    refused an operation) or a ring that does not check out was set aside."""


class NodeLossWarning(CaptureWarning):
    """Steps held in memory by a lost node could not be rebuilt (more nodes
    lost than ``redundancy=`` covers, or none asked for): the run goes on
    from the newest step in the store (capture/nodeloss.py)."""


class MemoryTierWarning(CaptureWarning):
    """The flight recorder's memory tier dropped memory-only steps (its
    captured state changed size, or its ring had to go)."""


class RestoreWarning(DsttWarning):
    """A restore did less than everything: a partial restore, or an RNG
    state left as it was."""


class StoreWarning(DsttWarning):
    """A property of the store weaker than dstt would like (e.g. a
    conditional create that is not atomic on this object store)."""
