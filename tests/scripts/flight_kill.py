"""A trainer with a memory tier whose writer never finishes (a stalled disk):
it captures steps 0..9, raises an incident, prints "incident" and waits to be
SIGKILLed (tests/capture/test_flight_recorder.py). The reference weights of every
step go to REF (torch.save) first.

usage: flight_kill.py STORE REF
"""

from __future__ import annotations

import sys
import threading

import torch

import dstt


def main() -> None:
    store, ref_path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    cap = dstt.Capture(store, helper=False, memory_steps=4, persist="newest")
    stall = threading.Event()
    inner = cap.writer.flush_chunk

    def stalled(*a, **k):  # type: ignore[no-untyped-def]
        stall.wait()  # never set: the disk is stuck
        return inner(*a, **k)

    cap.writer.flush_chunk = stalled  # type: ignore[method-assign]
    ref = {}
    for s in range(10):
        m(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        cap.snapshot(s, model=m, optimizer=opt)
        ref[s] = {k: v.detach().clone() for k, v in m.state_dict().items()}
    torch.save(ref, ref_path)
    cap.wait_staged()
    inc = cap.incident("loss spike")
    print("incident", *inc.steps, flush=True)
    threading.Event().wait(120)  # killed long before


if __name__ == "__main__":
    main()
