"""Which host-to-device copies stop the host while a side stream is busy (loopvq_calib.runtime.streams.SideStream).

Each case queues about 0.3 s of device work on a fresh side stream, then times one copy queued behind it and says
whether the side stream was still busy afterwards (the copy did not wait for it). The last case is the same copy
with the default stream busy.

    python scripts/probe_pinned_copies.py
"""

from __future__ import annotations

import time

import torch

from loopvq_calib.runtime.streams import SideStream


def main() -> None:
    x = torch.randn(256, 256, dtype=torch.float64)
    for _ in range(2):  # pinned blocks in the host allocator's pool before the timed cases
        p = x.pin_memory()
        p.to("cuda", non_blocking=True)
        del p
    torch.cuda.synchronize()
    print(torch.__version__)

    def timed(label: str, fn) -> None:
        side = SideStream("cuda")
        with side.queue():
            torch.cuda._sleep(600_000_000)
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
        print(label, round(dt, 4), "side busy after:", not side.stream.query(), flush=True)
        torch.cuda.synchronize()

    pinned = x.pin_memory()
    timed("pin_memory() alone", lambda: x.pin_memory())
    timed("copy of a kept pinned tensor", lambda: pinned.to("cuda", non_blocking=True))
    timed("pin + copy", lambda: x.pin_memory().to("cuda", non_blocking=True))
    timed("empty_pinned", lambda: torch.empty(x.shape, dtype=x.dtype, pin_memory=True))
    timed("pageable copy", lambda: x.to("cuda"))
    torch.cuda._sleep(600_000_000)
    t = time.perf_counter()
    x.pin_memory().to("cuda", non_blocking=True)
    print("pin+copy, default stream busy", round(time.perf_counter() - t, 4), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
