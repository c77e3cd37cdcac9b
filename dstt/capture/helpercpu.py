"""The capture helper's CPU: how its coding shares the host with the trainer
(issue 27).

* :func:`single_threaded_codecs` -- Blosc (numcodecs) compresses on the
  calling thread only. numcodecs' default runs Blosc's own thread pool (up
  to 8 threads) for calls made on a process's main thread: the helper's
  main thread flushes small steps and codes steps of one group, so those
  threads competed with the helper's ``encode_threads`` and with the
  trainer's cores. Set once in the helper's process (``helper.serve``),
  never in the trainer's: the trainer's libraries keep their settings.
"""

from __future__ import annotations


def single_threaded_codecs() -> None:
    """Blosc compresses and decompresses on the calling thread in this
    process (numcodecs' ``blosc.use_threads = False``). The capture
    helper's process only (see the module doc)."""
    from numcodecs import blosc

    blosc.use_threads = False


__all__ = ["single_threaded_codecs"]
