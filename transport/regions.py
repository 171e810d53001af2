"""Region tables: which address ranges are registered (locally) or advertised (by a peer).

Shared by the sender (is every source inside a local region, every destination inside a region the peer
advertised?) and the receiver (is every destination of a landed chunk inside a region this receiver exposed?).

Lookups of whole batches are vectorised with numpy (``locate``): a batch of 262144 pieces is checked with one
``searchsorted`` instead of a Python loop. Regions never overlap (``add`` refuses it), so the region holding an
address is the one with the greatest start <= address. The table is copy-on-write: readers take the current
immutable snapshot without a lock, writers replace it under a lock, so many sender threads look up at once.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

import numpy as np

DEVICE_HOST = -1
# regions ending at or past this are not looked up as one span (``span_region``): an int64 start + length stays
# clear of wrapping below it; pieces there are looked up one by one
END_MAX = 1 << 62


@dataclass(frozen=True)
class Region:
    """One registered (or advertised) range.

    ``keys`` holds one key per rail (each rail is its own fabric instance, so each has its own lkey/rkey):
    locally ``(lkey, rkey)`` pairs, for a peer's region just the rkeys. ``access``: for a peer's region on a
    fabric with load/store access to peer memory (ipc), what it takes to map the region here (see
    ``transport.fabric.loadstore``); None otherwise.
    """

    addr: int
    length: int
    device: int = DEVICE_HOST
    keys: Tuple = field(default=())
    access: Optional[dict] = field(default=None, compare=False, hash=False)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        return length >= 1 and addr >= self.addr and addr + length <= self.end

    def to_wire(self) -> dict:
        d = {"addr": self.addr, "length": self.length, "device": self.device, "keys": list(self.keys)}
        if self.access is not None:
            d["access"] = self.access
        return d

    @staticmethod
    def from_wire(d: dict) -> "Region":
        access = d.get("access")
        return Region(int(d["addr"]), int(d["length"]), int(d["device"]), tuple(int(k) for k in d["keys"]),
                      dict(access) if isinstance(access, dict) else None)


class _Snapshot:
    __slots__ = ("regions", "starts", "ends", "devices", "starts_i64", "ends_i64", "start_list", "end_list",
                 "ends_after")

    def __init__(self, regions: List[Region]):
        self.regions = sorted(regions, key=lambda r: r.addr)
        self.starts = np.array([r.addr for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.end for r in self.regions], dtype=np.uint64)
        self.devices = np.array([r.device for r in self.regions], dtype=np.int64)
        self.start_list = [r.addr for r in self.regions]
        self.end_list = [r.end for r in self.regions]
        # int64 copies for the sender's lookups (its arrays are int64 already: no conversions per batch)
        fits = not self.regions or int(self.ends.max()) < 1 << 63
        self.starts_i64 = self.starts.astype(np.int64) if fits else None
        self.ends_i64 = self.ends.astype(np.int64) if fits else None
        # indexed by searchsorted(starts, addr, "right"): the end of the region an address may lie in, with -1 in
        # front for addresses below every region (see locate_inside)
        self.ends_after = (np.concatenate([np.full(1, -1, dtype=np.int64), self.ends_i64]) if fits else None)


class RegionTable:
    """A thread-safe set of non-overlapping regions with fast batch lookups."""

    def __init__(self, regions: Iterable[Region] = ()):
        self._lock = threading.Lock()
        # the current immutable snapshot, replaced (never edited) on every change: a batch reads it as an
        # attribute, and the same object later means nothing changed since
        self.snap = _Snapshot(list(regions))

    def __len__(self) -> int:
        return len(self.snap.regions)

    def regions(self) -> List[Region]:
        return list(self.snap.regions)

    def add(self, region: Region) -> Region:
        """Add ``region``. The same (addr, length) again returns the region already there; a region
        overlapping another raises ``ValueError`` naming both (lookups must be unambiguous)."""
        with self._lock:
            for r in self.snap.regions:
                if r.addr == region.addr and r.length == region.length:
                    return r
                if region.addr < r.end and r.addr < region.end:
                    raise ValueError(f"region 0x{region.addr:x}+{region.length} overlaps the registered region "
                                     f"0x{r.addr:x}+{r.length}; register disjoint ranges")
            self.snap = _Snapshot(self.snap.regions + [region])
        return region

    def replace_all(self, regions: Iterable[Region]) -> None:
        snap = _Snapshot(list(regions))
        with self._lock:
            self.snap = snap

    def remove(self, addr: int) -> Region:
        """Remove the region starting at ``addr``; ``KeyError`` naming the address when there is none."""
        with self._lock:
            keep = [r for r in self.snap.regions if r.addr != addr]
            if len(keep) == len(self.snap.regions):
                raise KeyError(f"no registered region starts at 0x{addr:x}")
            gone = next(r for r in self.snap.regions if r.addr == addr)
            self.snap = _Snapshot(keep)
        return gone

    def find(self, addr: int, length: int = 1) -> Optional[Region]:
        """The region holding ``[addr, addr + length)``, or None."""
        snap = self.snap
        if not snap.regions or addr < 0:
            return None
        i = int(np.searchsorted(snap.starts, np.uint64(addr), side="right")) - 1
        if i < 0:
            return None
        r = snap.regions[i]
        return r if r.contains(addr, length) else None

    def locate(self, addrs: np.ndarray, lengths: np.ndarray, snap: Optional[_Snapshot] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """Vectorised lookup. Returns ``(index, ok)``: per item the index into ``self.regions()`` of the same
        snapshot (valid only where ``ok``), and whether the whole item lies inside that region.

        Arguments are int64/uint64 arrays of equal length; lengths must already be known positive. ``snap``: the
        snapshot to search (default: the current one), so that indices match a snapshot the caller holds.
        """
        snap = self.snap if snap is None else snap
        n = len(addrs)
        if not snap.regions:
            return np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
        if snap.starts_i64 is not None and getattr(addrs, "dtype", None) == np.int64 \
                and getattr(lengths, "dtype", None) == np.int64:
            # the sender's case, on its hot path: int64 throughout; an end past 2**63 wraps negative and fails
            # ``e > addrs``, a negative address finds no region
            e = addrs + lengths
            idx = np.searchsorted(snap.starts_i64, addrs, side="right") - 1
            ok = (e <= snap.ends_i64[idx]) & (idx >= 0) & (e > addrs)
            return np.maximum(idx, 0), ok
        a = np.asarray(addrs).astype(np.uint64)
        e = a + np.asarray(lengths).astype(np.uint64)
        idx = np.searchsorted(snap.starts, a, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        ok = (idx >= 0) & (e <= snap.ends[safe]) & (e > a)
        return safe, ok

    def snapshot(self) -> _Snapshot:
        """The current immutable snapshot (``regions``, ``starts``, ``ends``, ``devices``)."""
        return self.snap


def span_region(snap: _Snapshot, lo: int, hi_start: int, hi_end: int, max_length: int) -> Optional[int]:
    """Index in ``snap`` of the one region that holds every piece of a batch, or None when there is no such
    region (the caller then looks pieces up one by one with ``RegionTable.locate``).

    ``lo``/``hi_start``: the smallest / largest piece start; ``hi_end``: the largest start + length, computed in
    int64; ``max_length``: the longest piece. Every piece lies in ``[lo, hi_end)``, so one region containing
    that span contains them all; ``hi_start`` and ``max_length`` guard the int64 sum against wrapping (a
    wrapped end would be negative and hide from the maximum).
    """
    if not snap.regions or lo < 0 or max_length >= END_MAX:
        return None
    i = bisect.bisect_right(snap.start_list, lo) - 1
    if i < 0:
        return None
    r = snap.regions[i]
    end = r.addr + r.length
    return i if hi_start < end and hi_end <= end and end < END_MAX else None


def locate_inside(snap: _Snapshot, addrs: np.ndarray, ends: np.ndarray) -> Optional[np.ndarray]:
    """Index in ``snap`` of the region holding each piece ``[addrs[i], ends[i])``, or None when some piece is not
    inside one region (the caller then finds and names it with ``RegionTable.locate``).

    The batch path's version of ``locate``, in five numpy calls instead of eleven: ``addrs`` and ``ends`` are
    int64 and the caller guarantees that no ``ends[i]`` wrapped (max address + max length < 2**63) and that
    every length is >= 1, so one comparison per piece decides.
    """
    if snap.ends_after is None or not snap.regions:
        return None
    pos = snap.starts_i64.searchsorted(addrs, side="right")  # region index + 1; 0: below every region
    if not (ends <= snap.ends_after[pos]).all():
        return None
    return pos - 1


def first_bad(ok: np.ndarray) -> int:
    """Index of the first False in ``ok`` (callers know there is one)."""
    return int(np.argmin(ok))
