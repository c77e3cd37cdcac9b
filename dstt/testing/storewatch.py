"""A c10d TCPStore served on 127.0.0.1 and looked at while a job uses it:
what the helpers of a run keep in the job's store (tests and benchmarks
of peer redundancy: no redundancy block should pass through it).

>>> seen = []
>>> with StoreWatch(seen.append, interval_s=0.01) as watch:
...     watch.server.set("dstt-redundancy/run//node/0", b"n0")
...     import time; time.sleep(0.2)
>>> ("dstt-redundancy/run//node/0", b"n0") in [kv for one in seen for kv in one]
True
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: The prefix of every key the helpers' redundancy puts in the job's store.
PREFIX = "dstt-redundancy/"


def value_of(server: Any, key: str) -> bytes:
    """``key``'s value, b"" if it was taken meanwhile -- never waited for (a
    compare-and-set against a value no key holds changes nothing and
    answers the value, or that value back where the key is gone)."""
    absent = b"\0dstt: no such value\0"
    value = bytes(server.compare_set(key, absent, b"-"))
    return b"" if value == absent else value


class StoreWatch:
    """The store (``server``, at ``addr``), and a thread that every
    ``interval_s`` hands ``see`` the (key, value) pairs under
    :data:`PREFIX` it holds at that moment, until closed."""

    def __init__(self, see: Callable[[list[tuple[str, bytes]]], None], interval_s: float = 0.01,
                 timeout_s: float = 30.0) -> None:
        from torch._C._distributed_c10d import TCPStore

        self.server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=timeout_s),
                               wait_for_workers=False)
        self.addr = f"127.0.0.1:{self.server.port}"
        self._see, self._interval_s = see, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> StoreWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._see([(k, value_of(self.server, k)) for k in self.server.list_keys() if k.startswith(PREFIX)])


__all__ = ["PREFIX", "StoreWatch", "value_of"]
