"""The regions a socket fabric registered: keys, bounds, writable views of host regions, landing handlers, the
pins of regions a received write is being placed into (``deregister`` waits for them), and the local checks of a
post against them.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from operator import add
from typing import Dict, List, Optional, Sequence

import numpy as np

from transport.arrays import distinct
from transport.errors import RegionError
from transport.fabric.base import DEVICE_HOST, IMM_MAX, MemoryRegion, WriteBatch, WriteRequest, check_range
from transport.fabric.memory import check_device, raw_view
from transport.fabric.wire import I64, ST_BAD_RKEY, ST_BOUNDS

log = logging.getLogger(__name__)

_LAYOUTS_KEPT = 64  # batch layouts over several local regions whose checks are remembered (_remember_layout)


class RegionBook:
    """The registered regions of one fabric (``owner``: its id, for messages). ``lock`` guards registration;
    ``region_lock`` (``region_cv``) guards the pins, and a small write is placed into a host region under it
    instead of pinning it (``deregister`` takes it before it returns)."""

    def __init__(self, owner: str):
        self.owner = owner
        self.lock = threading.RLock()
        self.regions: Dict[int, MemoryRegion] = {}
        self.generation = 0  # bumped whenever ``regions`` changes: ``_remember_layout``'s entries hold its value
        self._layouts: Dict[bytes, tuple] = {}  # ``_remember_layout``: lkeys' bytes -> (generation, ...)
        # rkey -> (region, writable view of it) for host regions: small pieces are placed by slice assignment,
        # a C copy without the ctypes call (and GIL release) of a memmove per piece
        self.host_views: Dict[int, tuple] = {}
        self.region_use: Dict[int, int] = {}  # rkey -> pieces being placed right now (deregister waits)
        self.landing: Dict[int, object] = {}  # rkey -> landing handler (``set_landing_handler``)
        self.region_lock = threading.Lock()
        self.region_cv = threading.Condition(self.region_lock)  # ``with`` on the lock itself: no Python frame

    def register(self, addr: int, length: int, device: int = DEVICE_HOST) -> MemoryRegion:
        """A new region of ``length`` bytes at ``addr`` on ``device`` under a fresh random key (its lkey and
        rkey). Raises ValueError for a bad range or address 0."""
        check_range(addr, length, "register")
        check_device(device)
        if addr == 0:
            raise ValueError("register: address 0 (NULL) cannot be registered")
        with self.lock:
            while True:
                key = secrets.randbits(32)
                # random keys: a stale rkey of a deregistered region is unlikely to match a new one
                if key and key not in self.regions:
                    break
            mr = MemoryRegion(addr=addr, length=length, lkey=key, rkey=key, device=device)
            self.regions[key] = mr
            self.generation += 1
            if device == DEVICE_HOST:
                self.host_views[key] = (mr, raw_view(addr, length, writable=True))
        return mr

    def drop(self, mr: MemoryRegion) -> None:
        """Forget ``mr`` at once (a registration whose export failed; nothing can be using it yet)."""
        with self.lock:
            self.regions.pop(mr.rkey, None)
            self.host_views.pop(mr.rkey, None)
            self.generation += 1

    def deregister(self, mr: MemoryRegion) -> None:
        """Forget ``mr``, then wait (10 s at most) until no write being placed holds it, so that the caller may free
        its memory once this returns. RegionError when ``mr`` is not registered here."""
        with self.lock:
            cur = self.regions.get(getattr(mr, "rkey", None))
            if cur is None or cur != mr:
                raise RegionError(f"deregister: region {mr!r} is not registered with {self.owner}")
            del self.regions[mr.rkey]
            self.generation += 1
            self.host_views.pop(mr.rkey, None)
            self.landing.pop(mr.rkey, None)
        # A write being placed right now may still touch the memory: wait until it is done so the caller can
        # free the memory safely once we return.
        deadline = time.monotonic() + 10.0
        with self.region_cv:
            while self.region_use.get(mr.rkey, 0) > 0:
                if not self.region_cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    log.warning("deregister of rkey 0x%x: placements still running after 10 s", mr.rkey)
                    break

    def set_landing_handler(self, mr: MemoryRegion, handler) -> None:
        """Register ``handler`` for the host region ``mr`` (the contract: ``TcpFabric.set_landing_handler``)."""
        with self.lock:
            if self.regions.get(mr.rkey) is not mr or mr.device != DEVICE_HOST:
                raise RegionError(f"set_landing_handler: {mr!r} is not a host region registered with {self.owner}")
            if handler is None:
                self.landing.pop(mr.rkey, None)
            else:
                self.landing[mr.rkey] = handler

    def lookup_local(self, r: WriteRequest) -> MemoryRegion:
        mr = self.regions.get(r.lkey)
        if mr is None:
            raise RegionError(f"wr_id={r.wr_id}: lkey 0x{r.lkey:x} is not a region registered with {self.owner}")
        if not mr.contains(r.local_addr, r.length):
            raise RegionError(f"wr_id={r.wr_id}: local range 0x{r.local_addr:x}+{r.length} lies outside the "
                              f"region of lkey 0x{r.lkey:x} (0x{mr.addr:x}+{mr.length})")
        return mr

    def validate_many(self, requests: Sequence[WriteRequest]) -> Optional[List[MemoryRegion]]:
        """The checks of ``SocketFabric.validate`` for many requests in a few numpy calls (a Python step per request
        is most of a post of many writes). None when any request fails a check: the per-request loop then raises
        the error that names it."""
        cols = [(r.local_addr, r.length, r.remote_addr, r.rkey, r.lkey, 0 if r.imm is None else r.imm)
                for r in requests]
        if not set(map(type, itertools.chain.from_iterable(cols))) <= {int}:
            return None  # a bool, float or other non-int somewhere
        try:
            a = np.array(cols, dtype=np.int64)
        except OverflowError:
            return None
        la, ln, ra, rk, lk, imm = a.T
        regions, k, problem = self.check_write_arrays(la, ln, ra, rk, lk, imm)
        if problem is not None:
            return None
        return [regions[0]] * len(requests) if len(regions) == 1 else [regions[j] for j in k.tolist()]

    @staticmethod
    def _first_bad_value(la, ln, ra, rk, imm) -> Optional[tuple]:
        """``(write, "value", what is wrong)`` for the first write with a bad value, in the order of the checks;
        None when every value is good."""
        checks = [(ln <= 0, "length must be positive"), (la < 0, "local address is negative"),
                  (ra < 0, "remote address is negative"), (la > I64 - ln, "local range overflows"),
                  (ra > I64 - ln, "remote range overflows"),
                  ((rk < 0) | (rk > 0xFFFFFFFF), "rkey is not a 32-bit unsigned int")]
        if imm is not None:
            checks.append(((imm < 0) | (imm > IMM_MAX), "imm is not a 32-bit unsigned int"))
        for bad, what in checks:
            if bad.any():
                return int(np.flatnonzero(bad)[0]), "value", what
        return None

    def check_write_arrays(self, la, ln, ra, rk, lk, imm=None) -> tuple:
        """The local checks of a post on whole int64 arrays (local address, length, remote address, rkey, lkey,
        immediate): lengths, addresses and keys in range, each local range inside the region of its lkey. Returns
        ``(regions, k, None)``: the distinct regions and each write's index into them; or ``(None, None,
        (write, kind, detail))`` for the first bad write, ``kind`` "value" (``detail``: what is wrong), "lkey"
        (the unknown key) or "outside" (its region)."""
        def first(mask) -> int:
            return int(np.flatnonzero(mask)[0])

        lmax, la_min = int(ln.max()), int(la.min())
        if not (int(ln.min()) > 0 and la_min >= 0 and int(ra.min()) >= 0 and int(la.max()) + lmax <= I64
                and int(ra.max()) + lmax <= I64 and int(rk.min()) >= 0 and int(rk.max()) <= 0xFFFFFFFF
                and (imm is None or (int(imm.min()) >= 0 and int(imm.max()) <= IMM_MAX))):
            # some value may be bad (these extremes, fewer numpy calls than the masks, pass every good post):
            # the first write at fault, in the order of the checks
            problem = self._first_bad_value(la, ln, ra, rk, imm)
            if problem is not None:
                return None, None, problem
        layout = self._layouts.get(lk.tobytes()) if lk.size > 1 and lk.dtype == np.int64 else None
        if layout is not None and layout[0] == self.generation:
            _, regions, k, lo, hi, _ = layout
        else:
            keys = np.asarray(distinct(lk), dtype=np.int64)
            regions = []
            for key in keys.tolist():
                mr = self.regions.get(key)
                if mr is None:
                    return None, None, (first(lk == key), "lkey", key)
                regions.append(mr)
            if len(regions) == 1:
                # one region (the common case): its bounds against the extremes, without per-write index arrays
                m = regions[0]
                k = np.zeros(ln.size, dtype=np.int64)
                if la_min >= m.addr and int((la + ln).max()) <= m.addr + m.length:
                    return regions, k, None
                lo, hi = m.addr, m.addr + m.length
            else:
                _, regions, k, lo, hi, _ = self._remember_layout(lk, keys, regions)
        out = (la < lo) | (la + ln > hi)
        if out.any():
            i = first(out)
            return None, None, (i, "outside", regions[int(k[i])])
        return regions, k, None

    def _remember_layout(self, lk: np.ndarray, keys: np.ndarray, regions: list) -> tuple:
        """Remember, by the bytes of the lkey array ``lk``, what ``check_write_arrays`` derives from it when it
        names several regions (``keys``: its distinct values, ``regions`` theirs): (the registration counter,
        regions, each write's index into them, start and end of each write's region, each write's device). Why: a
        batch over many regions (sglang registers a buffer per layer) would pay a ``np.unique`` and Python steps
        per region and post for these, though its lkeys repeat call after call; any registration or deregistration
        changes the counter, and the entry is made again.
        The arrays are shared between calls: read only."""
        k = np.searchsorted(keys, lk)
        lo = np.array([m.addr for m in regions], dtype=np.int64)[k]
        hi = lo + np.array([m.length for m in regions], dtype=np.int64)[k]
        devices = np.array([m.device for m in regions], dtype=np.int64)[k]
        for a in (k, lo, hi, devices):
            a.flags.writeable = False
        layout = (self.generation, regions, k, lo, hi, devices)
        memo = self._layouts
        if len(memo) >= _LAYOUTS_KEPT:
            try:
                memo.pop(next(iter(memo)))
            except (StopIteration, RuntimeError, KeyError):  # another thread changed it: it stays bounded
                pass
        if lk.dtype == np.int64:
            memo[lk.tobytes()] = layout
        return layout

    def validate_batch(self, b: WriteBatch) -> np.ndarray:
        """The checks of ``SocketFabric.validate`` for a ``WriteBatch``, in whole-array numpy. Returns each write's
        source device. Raises ``ValueError`` / ``RegionError`` naming the first bad write."""
        la, ln, ra, rk = b.local_addr, b.length, b.remote_addr, b.rkey
        regions, k, problem = self.check_write_arrays(la, ln, ra, rk, b.lkey)
        if problem is not None:
            i, kind, detail = problem
            if kind == "value":
                raise ValueError(f"batch wr_id={b.wr_id}, write {i} (local 0x{int(la[i]):x}, {int(ln[i])} B, remote "
                                 f"0x{int(ra[i]):x}, rkey {int(rk[i])}): {detail}")
            if kind == "lkey":
                raise RegionError(f"batch wr_id={b.wr_id}, write {i}: lkey 0x{detail:x} is not a region registered "
                                  f"with {self.owner}")
            raise RegionError(f"batch wr_id={b.wr_id}, write {i}: local range 0x{int(la[i]):x}+{int(ln[i])} lies "
                              f"outside the region of lkey 0x{detail.lkey:x} (0x{detail.addr:x}+{detail.length})")
        if len(regions) > 1:
            layout = self._layouts.get(b.lkey.tobytes()) if b.lkey.dtype == np.int64 else None
            if layout is not None and layout[1] is regions:
                return layout[5]
        return np.array([m.device for m in regions], dtype=np.int64)[k]

    def validate_pieces(self, table: np.ndarray) -> tuple:
        """Check every piece against this fabric's regions and pin the regions it uses (deregister waits).
        Returns (statuses bytearray, regions per piece, pinned rkeys)."""
        return self.validate_lists(table["addr"].tolist(), table["len"].tolist(), table["waddr"].tolist(),
                                    table["wlen"].tolist(), table["rkey"].tolist())

    def validate_lists(self, addrs, lens, waddrs, wlens, rkeys) -> tuple:
        """``validate_pieces`` of a table given as one list of ints per column."""
        n = len(lens)
        statuses = bytearray(n)
        regions: List[Optional[MemoryRegion]] = [None] * n
        pinned = set()
        with self.region_cv:
            for i in range(n):
                mr = self.regions.get(rkeys[i])
                if mr is None:
                    statuses[i] = ST_BAD_RKEY
                    continue
                a, ln, wa, wl = addrs[i], lens[i], waddrs[i], wlens[i]
                # the whole write must be inside the region and the piece inside the whole write
                if not (ln >= 1 and mr.contains(wa, wl) and wa <= a and a + ln <= wa + wl):
                    statuses[i] = ST_BOUNDS
                    continue
                regions[i] = mr
                pinned.add(mr.rkey)
            for k in pinned:
                self.region_use[k] = self.region_use.get(k, 0) + 1
        return statuses, regions, pinned

    def unpin(self, pinned) -> None:
        with self.region_cv:
            for k in pinned:
                c = self.region_use.get(k, 0) - 1
                if c <= 0:
                    self.region_use.pop(k, None)
                else:
                    self.region_use[k] = c
            self.region_cv.notify_all()

    def pin_span(self, dsts, lens) -> Optional[tuple]:
        """(rkey, writable view, base address) of a host region registered here that holds every range
        (``dsts[i]``, ``lens[i]``), pinned against ``deregister`` (``unpin``); None when no one region does."""
        lo, hi = min(dsts), max(map(add, dsts, lens))
        with self.region_cv:
            for rk, (m, view) in list(self.host_views.items()):
                # still registered (deregister drops it before it waits for pinned placements, under this lock)
                if m.addr <= lo and hi <= m.addr + m.length and self.regions.get(rk) is m:
                    self.region_use[rk] = self.region_use.get(rk, 0) + 1
                    return rk, view, m.addr
        return None
