"""A new ring's group may be removed by another process's sweep (it finds
the group empty) between the group's creation and the ring's: seen as
"recovering the steps sealed by an earlier run failed: ... RingUnavailable:
No such file or directory" at a two-rank Capture's start, when rank 1's
sweep removed the group rank 0 had just made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dstt.capture import ring as R
from dstt.capture import ringowner as O

IDENTITY = {"store": "/s", "branch": "main", "branch_id": 0, "branch_created": 0.0, "rank": 0}


def test_a_group_swept_away_before_its_ring_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = O.make_private
    swept: list[Path] = []

    def make_private(path: Path) -> None:
        if path.parent.name != path.name and path.name.startswith(f"{os.getpid()}-") and not swept:
            path.parent.rmdir()  # another process's sweep: the group is empty
            swept.append(path.parent)
        real(path)

    monkeypatch.setattr(O, "make_private", make_private)
    ring = R.Ring(IDENTITY, base=tmp_path)
    try:
        assert swept == [ring.group]
        assert ring.dir.is_dir() and (ring.dir / O.LOCK_FILE).is_file()
    finally:
        ring.close()


def test_a_group_that_keeps_going_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = O.make_private

    def make_private(path: Path) -> None:
        if path.name.startswith(f"{os.getpid()}-"):
            path.parent.rmdir()
        real(path)

    monkeypatch.setattr(O, "make_private", make_private)
    with pytest.raises(R.RingUnavailable, match="refusing to stage there"):
        R.Ring(IDENTITY, base=tmp_path)
