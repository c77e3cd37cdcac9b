"""``redundancy="parity:k+m"`` (``m >= 2``) in the capture helpers (issue
26): Reed-Solomon across a group of ``k + m`` nodes (one rank of each),
through pyeclib (dstt.format.rsacc: the layout, the coding, the checks).

The guard is ``parity:k``'s (capture/paritygroup.py: the same transport, the
same parity files under ``<DSTT_SHM_DIR or /dev/shm>/dstt-<uid>-parity/``,
the same acknowledgements and protection records) with two differences:

* each step's image goes out as ``k`` stripes, each to the ``m`` holders
  of its codeword (every other member gets the stripes of the codewords it
  holds, one block: ``m`` images sent a step in all);
* a holder buffers a codeword's stripes until its ``k`` are in, then
  encodes it and keeps only its own parity fragment
  (dstt.format.rsacc.RSAccumulator, at most 16 steps open): ``m/k`` of an
  image a step, plus the data fragments' headers (80 bytes each).

A step is protected once every other member of the group acknowledged it:
all ``m`` holders of each of its ``k`` stripes hold their fragment.
Recovery of up to ``m`` lost members of a group: capture/rsrecover.py.
"""

from __future__ import annotations

from typing import Any

from dstt.capture.paritygroup import ParityGuard
from dstt.capture.peerguard import post_block
from dstt.format import rsacc as RS


class RSGuard(ParityGuard):
    """One helper's part of ``redundancy="parity:k+m"`` (see the module docstring)."""

    def _accumulator(self) -> Any:
        return RS.RSAccumulator(self.run, self.branch_id, self.rank, self.members, self.scheme.m)

    def _post(self, step: int, image: bytes) -> None:
        """Send ``step``'s stripes to each other member, those of the codewords it holds."""
        for h in self.out_seq:
            data = RS.stripe_block(image, run=self.run, branch_id=self.branch_id, step=step, src=self.rank,
                                   holder=h, members=self.members, m=self.scheme.m)
            post_block(self.box, f"pst/{self.rank}/{h}/{self.out_seq[h]}", data, dst=h)
            self.out_seq[h] += 1
            self.bytes_sent += len(data)
        self.answers[step] = set()


__all__ = ["RSGuard"]
