"""A receiving rail's landing pool: slots shared by every sender of one engine, lent to them as credits.

``LandingPool`` holds one rail's landing memory on one device (host or a CUDA device), ``landing_bytes // stride``
slots registered once with the rail's fabric, and the bookkeeping of who holds which slot: free slots, the
owner (sender state, credit index) of each lent one, and the senders waiting for a slot, served round-robin. The
receiver (``transport.receiver.Receiver``) owns the pools and guards them with its lock; the credit protocol is
described there.
"""
from __future__ import annotations

import collections
import time
from typing import List, Optional, Tuple

from transport.packing import HostBuffer


class LandingPool:
    """One rail's landing slots on one device, shared by every sender: ``nslots`` slots of ``stride`` bytes,
    registered once. ``free``: pool slots lent to nobody; ``owner[p]``: (sender, credit index) holding slot
    ``p``; ``waiters``: senders waiting for a credit, served round-robin. Guarded by the receiver's ``_lock``."""

    def __init__(self, fab, rail: int, device: int, nbytes: int, stride: int):
        self.rail, self.device, self.stride = rail, device, stride
        self.nslots = nbytes // stride
        size = self.nslots * stride
        if device < 0:
            self.buf, self.tensor = HostBuffer(size), None
        else:
            import torch
            self.tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
            self.buf = _TensorBuffer(self.tensor)
        self.mr = fab.register(self.buf.addr, size, device)
        self.nbytes = size
        self.free: collections.deque = collections.deque(range(self.nslots))
        self.owner: List[Optional[tuple]] = [None] * self.nslots
        self.waiters: collections.deque = collections.deque()
        self.users: set = set()  # ids of the states of senders holding a slot or waiting (the fair share)

    def share(self) -> int:
        """Slots a sender may keep while others wait: the pool split evenly over senders holding or waiting."""
        return max(1, self.nslots // max(1, len(self.users)))

    def _touch(self, st) -> None:
        if (st.lent[self.rail] or st.queued[self.rail]) and not st.retired:
            self.users.add(id(st))
        else:
            self.users.discard(id(st))

    def lend(self, st) -> Optional[Tuple[int, int]]:
        """Lend a free slot to ``st`` under its lowest free credit index: (credit index, pool slot), or None."""
        lent, returning = st.lent[self.rail], st.returning[self.rail]
        if not self.free or len(lent) + len(returning) >= st.slots or st.retired:
            return None
        # not a credit whose return is still being written: the grant could overtake that ack
        k = next(i for i in range(st.slots) if i not in lent and i not in returning)
        p = self.free.popleft()
        lent[k] = p
        st.leased[self.rail][k] = time.monotonic()
        self.owner[p] = (st, k)
        self._touch(st)
        return k, p

    def take_back(self, st, k: int) -> None:
        p = st.lent[self.rail].pop(k)
        st.leased[self.rail].pop(k, None)
        self.owner[p] = None
        self.free.append(p)
        self._touch(st)

    def enqueue(self, st) -> None:
        if not st.queued[self.rail] and not st.retired:
            st.queued[self.rail] = True
            self.waiters.append(st)
            self._touch(st)

    def dispatch(self) -> List[tuple]:
        """Hand free slots to waiting senders, one at a time, round-robin: [(sender, rail, credit index, pool
        slot)]."""
        rail = self.rail
        out = []
        while self.free and self.waiters:
            st = self.waiters.popleft()
            st.queued[rail] = False
            got = self.lend(st) if st.want[rail] > 0 else None
            if got is not None:
                st.want[rail] -= 1
                out.append((st, rail, got[0], got[1]))
                if st.want[rail] > 0:
                    self.enqueue(st)
            self._touch(st)
        return out

    def forget(self, st) -> None:
        """Every credit of ``st`` on this rail back to the pool, and ``st`` out of the queue."""
        rail = self.rail
        for k in list(st.lent[rail]):
            self.take_back(st, k)
        st.want[rail] = 0
        if st.queued[rail]:
            st.queued[rail] = False
            try:
                self.waiters.remove(st)
            except ValueError:
                pass
        self.users.discard(id(st))

    def stats(self) -> dict:
        return {"rail": self.rail, "device": self.device, "slots": self.nslots, "stride": self.stride,
                "bytes": self.nbytes, "free": len(self.free), "waiting": len(self.waiters),
                "senders": len(self.users)}


class _TensorBuffer:
    def __init__(self, tensor):
        self.tensor = tensor
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel()
