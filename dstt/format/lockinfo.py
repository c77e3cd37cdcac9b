"""Who holds a branch lock: the record a lock file or lease holds
(:class:`LockInfo`), and this process's identity written into it -- host,
boot id, PID namespace and start time -- so a holder that is provably dead
on this host can be told from a live one elsewhere.

>>> info = LockInfo.parse("main", _record("main", "t0"))
>>> info.branch, info.token, info.gone()
('main', 't0', False)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from dstt.format.localio import pid_alive


@dataclass
class LockInfo:
    """Who holds (or last held) a branch lock, as recorded in the lock file."""

    branch: str
    pid: int | None = None
    host: str | None = None
    since: float | None = None
    expires: float | None = None
    token: str | None = None
    #: Where the holder ran, to tell a dead holder on this host from a live
    #: one elsewhere (:meth:`gone`): the kernel's boot id, the holder's PID
    #: namespace and its start time (clock ticks after boot; a reused pid
    #: has another). None in records written before they were recorded.
    boot: str | None = None
    pidns: str | None = None
    start: int | None = None

    @classmethod
    def parse(cls, branch: str, data: bytes | None) -> "LockInfo":
        try:
            doc = json.loads((data or b"").decode("utf-8"))
        except (ValueError, RecursionError):  # bad UTF-8 or JSON, or an over-long integer
            return cls(branch)
        if not isinstance(doc, dict):
            return cls(branch)

        def num(k: str) -> Any:
            v = doc.get(k)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        def text(k: str) -> Any:
            v = doc.get(k)
            return v[:200] if isinstance(v, str) else None

        pid, start = num("pid"), num("start")
        return cls(branch, int(pid) if pid is not None else None, text("host"), num("since"),
                   num("expires"), text("token"), text("boot"), text("pidns"),
                   int(start) if start is not None else None)

    def gone(self) -> bool:
        """Whether the holder is provably dead: it ran on this host, in this
        boot and PID namespace, and its pid is gone (or taken by a process
        started at another time). False wherever that cannot be told -- a
        holder on another host, in another container, or a record without
        these fields is presumed alive (its lease expires by itself)."""
        if self.pid is None or self.host != socket.gethostname() or self.boot is None or self.pidns is None:
            return False
        here = _identity()
        if (self.boot, self.pidns) != (here.get("boot"), here.get("pidns")):
            return False
        if not pid_alive(self.pid):
            return True
        return self.start is not None and _start_ticks(self.pid) not in (None, self.start)

    def describe(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "an unknown process"
        if self.host:
            who += f" on {self.host}"
        if self.since is not None:
            who += " since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return who

    def to_dict(self) -> dict[str, Any]:
        return {"branch": self.branch, "pid": self.pid, "host": self.host,
                "since": self.since, "expires": self.expires}


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read(4096).rsplit(b")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _identity() -> dict[str, Any]:
    """This process's boot id, PID namespace and start time (Linux; absent elsewhere)."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            out["boot"] = f.read(64).decode("ascii", "replace").strip()
    with contextlib.suppress(OSError):
        out["pidns"] = os.readlink("/proc/self/ns/pid")
    start = _start_ticks(os.getpid())
    if start is not None:
        out["start"] = start
    return out


def _record(branch: str, token: str, ttl: float | None = None) -> bytes:
    now = time.time()
    doc = {"branch": branch, "pid": os.getpid(), "host": socket.gethostname(), "since": now, "token": token,
           **_identity()}
    if ttl is not None:
        doc["expires"] = now + ttl
    return json.dumps(doc).encode()
