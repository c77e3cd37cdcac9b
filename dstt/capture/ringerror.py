"""The error of a failed file operation on the staging ring (ring.py), with
what to do about it."""

from __future__ import annotations

import errno
import os

from dstt.capture import ringowner as O


class RingError(OSError):
    """A file operation on the staging ring failed: which one, on which
    file, the errno, and what to do about it (:func:`ring_advice`).

    >>> import errno
    >>> print(RingError("writing the seal of step 3", "/dev/shm/x/seal-3.json", OSError(errno.ENOSPC, "No space left on device")))
    writing the seal of step 3 (/dev/shm/x/seal-3.json) failed: [Errno 28] No space left on device; ... is full (the staging ring lives there):...
    """

    def __init__(self, what: str, path: str, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), path)
        self.what = what

    @property
    def brief(self) -> str:
        """What failed, where and the errno, without the advice."""
        return f"{self.what} ({self.filename}) failed: [Errno {self.errno}] {self.strerror}"

    def __str__(self) -> str:
        return f"{self.brief}; {ring_advice(self.errno)}"


def ring_advice(code: int | None) -> str:
    """What to do when a file operation on the staging ring fails with ``code``."""
    shm = os.fspath(O.shm_base())
    if code in (errno.ENOSPC, errno.EDQUOT):
        return (f"{shm} is full (the staging ring lives there): free space in it or make it larger (Docker: "
                "--shm-size), or pass shm=False to stage in process memory (steps then do not survive the trainer)")
    if code == errno.ENOENT:
        return ("the staging ring's directory was removed under the running Capture (something cleans "
                f"{shm}: e.g. systemd-logind with RemoveIPC=yes when the user logs out, a tmpfiles rule, a "
                "script): stop it, or pass shm=False")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"this process may no longer write under {shm}: check its mount and the ring's owner, or pass shm=False"
    return f"the filesystem of {shm} refused it (see the kernel log); shm=False stages in process memory instead"


__all__ = ["RingError", "ring_advice"]
