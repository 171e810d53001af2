"""Peer access between GPUs, owned by the library, and which device a raw pointer lives on.

A kernel on GPU A that dereferences GPU B's memory through a raw (UVA) pointer faults with "illegal memory
access" unless peer access A -> B was enabled first, and that fault poisons the process's CUDA context for good.
So every place that hands a kernel a peer pointer (a gather from a peer GPU, a relay copy into the NIC-local GPU,
a receiver forwarding a landed chunk to another GPU) first calls :func:`ensure_peer_access`, which

* enables access once per ordered pair (``cudaDeviceEnablePeerAccess``), cached, thread-safe;
* raises :class:`PeerAccessError` naming both GPUs where the pair cannot have it (``cudaDeviceCanAccessPeer`` is
  0: PCIe-only boxes, some VMs). Callers then take a staged path (``cudaMemcpyAsync`` per piece, which the driver
  routes through host memory) or refuse; they never launch the kernel.

:func:`pointer_devices` says which device each of many raw addresses lives on from a cache of allocation ranges
(``cuMemGetAddressRange`` + ``cuPointerGetAttribute`` once per allocation, a ``searchsorted`` per call), so a
batch of 32768 pieces costs one vectorised lookup, not 32768 driver calls.

Tests force a pair to look peer-less with :func:`peer_access_disabled`.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Dict, Iterable, List, Set, Tuple

import numpy as np
from pxn_kernels.errors import PeerAccessError

DEVICE_HOST = -1

__all__ = ["PeerAccessError", "can_access_peer", "ensure_peer_access", "enabled_pairs", "peer_access_disabled",
           "pointer_devices", "forget_pointer_cache"]


_lock = threading.Lock()
_can: Dict[Tuple[int, int], bool] = {}
_enabled: Set[Tuple[int, int]] = set()
_forced_off: Set[Tuple[int, int]] = set()
_rt = None


def _runtime():
    """cuda-bindings' runtime module (imported on first use; the CPU build needs none of this)."""
    global _rt
    if _rt is None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            try:
                from cuda import cudart as rt  # cuda-python < 12.6 layout
            except ImportError as e:
                raise PeerAccessError(-1, -1, "cuda-bindings is not installed: pip install cuda-bindings") from e
        _rt = rt
    return _rt


def _check(res, what: str):
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def can_access_peer(device: int, peer: int) -> bool:
    """True when kernels on ``device`` may be given pointers into ``peer``'s memory once access is enabled.
    The same device (or host, -1, on either side) is always True. Cached per pair."""
    if device == peer or device < 0 or peer < 0:
        return True
    key = (device, peer)
    if key in _forced_off:
        return False
    got = _can.get(key)
    if got is None:
        import torch
        got = bool(torch.cuda.can_device_access_peer(device, peer))
        _can[key] = got
    return got


def ensure_peer_access(device: int, peers: Iterable[int]) -> None:
    """Enable access from kernels on ``device`` to each of ``peers`` (host -1 and ``device`` itself are skipped).

    Idempotent and cheap once done (a set lookup per pair). Raises :class:`PeerAccessError` naming both GPUs for
    a pair that cannot have peer access; nothing is enabled for that pair.
    """
    todo = [p for p in peers if p >= 0 and p != device and (device, p) not in _enabled]
    if not todo or device < 0:
        return
    for p in todo:
        if not can_access_peer(device, p):
            raise PeerAccessError(device, p)
    with _lock:
        for p in todo:
            if (device, p) in _enabled:
                continue
            _enable(device, p)
            _enabled.add((device, p))


def _enable(device: int, peer: int) -> None:
    import torch
    rt = _runtime()
    prev = torch.cuda.current_device()
    # torch.cuda.device skips cudaSetDevice when it believes the device is current already, and the runtime call
    # below acts on the thread's current device: set it explicitly, and restore it the same way
    with torch.cuda.device(device):
        _check(rt.cudaSetDevice(device), f"cudaSetDevice({device})")
        err, = rt.cudaDeviceEnablePeerAccess(peer, 0)
        code = int(err)
        # 704: cudaErrorPeerAccessAlreadyEnabled (torch or another library enabled it first)
        if code not in (0, 704):
            raise PeerAccessError(device, peer, f"cudaDeviceEnablePeerAccess returned {err!r}")
        if code == 704:
            rt.cudaGetLastError()  # clear the sticky-free error so later checks do not see it
    _check(rt.cudaSetDevice(prev), f"cudaSetDevice({prev})")


def enabled_pairs() -> List[Tuple[int, int]]:
    """The (device, peer) pairs this process enabled through pxn (diagnostics and tests)."""
    with _lock:
        return sorted(_enabled)


@contextlib.contextmanager
def peer_access_disabled(*pairs: Tuple[int, int]):
    """Test hook: make each (device, peer) pair (both directions) look as if ``cudaDeviceCanAccessPeer`` were 0,
    so the staged path or the refusal can be tested on a box whose GPUs do have NVLink."""
    added = set()
    for a, b in pairs:
        for key in ((a, b), (b, a)):
            if key not in _forced_off:
                _forced_off.add(key)
                added.add(key)
    try:
        yield
    finally:
        _forced_off.difference_update(added)


# --- which device a pointer is on --------------------------------------------------------------------------
class _RangeCache:
    """Sorted, non-overlapping allocation ranges [base, end) -> device, learned from the driver on misses."""

    def __init__(self):
        self.bases: List[int] = []
        self.ends: List[int] = []
        self.devs: List[int] = []
        self.arrays = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.snapshot: Tuple[tuple, tuple, tuple] = ((), (), ())  # the same as tuples, replaced whole (lock-free reads)
        self.lock = threading.Lock()

    def insert(self, base: int, end: int, dev: int) -> None:
        with self.lock:
            i = bisect.bisect_left(self.bases, base)
            # an allocation freed and replaced by a different one at an overlapping address: drop stale entries
            j = i
            while j < len(self.bases) and self.bases[j] < end:
                j += 1
            k = i
            while k > 0 and self.ends[k - 1] > base:
                k -= 1
            del self.bases[k:j], self.ends[k:j], self.devs[k:j]
            self.bases.insert(k, base)
            self.ends.insert(k, end)
            self.devs.insert(k, dev)
            self.arrays = (np.array(self.bases, np.int64), np.array(self.ends, np.int64),
                           np.array(self.devs, np.int64))
            self.snapshot = (tuple(self.bases), tuple(self.ends), tuple(self.devs))

    def clear(self) -> None:
        with self.lock:
            self.bases, self.ends, self.devs = [], [], []
            self.arrays = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
            self.snapshot = ((), (), ())

    def device_of_span(self, lowest: int, highest: int):
        """The device of the one cached allocation holding every address in [lowest, highest], else None."""
        bases, ends, devs = self.snapshot
        i = bisect.bisect_right(bases, lowest) - 1
        if i >= 0 and highest < ends[i]:
            return devs[i]
        return None


_ranges = _RangeCache()
_drv = None


def _driver_lookup(addr: int) -> Tuple[int, int, int]:
    """(start, end, device) of the allocation holding ``addr``: a CUDA index for device memory; -1 and the one
    byte at ``addr`` for host memory (pinned or pageable: only device ranges are cached). Raises RuntimeError
    when CUDA cannot tell: guessing "host" would let a kernel fault on a peer pointer."""
    global _drv
    rt = _runtime()
    err, attrs = rt.cudaPointerGetAttributes(addr)
    if int(err) != 0:
        raise RuntimeError(f"cudaPointerGetAttributes(0x{addr:x}) failed: {err!r}")
    if int(attrs.type) != int(rt.cudaMemoryType.cudaMemoryTypeDevice):
        return addr, addr + 1, DEVICE_HOST
    if _drv is None:
        from cuda.bindings import driver
        _drv = driver
    import torch
    with torch.cuda.device(int(attrs.device)):
        err, base, size = _drv.cuMemGetAddressRange(addr)
    if int(err) != 0:
        raise RuntimeError(f"cuMemGetAddressRange(0x{addr:x}) failed: {err!r}")
    return int(base), int(base) + int(size), int(attrs.device)


def _lookup_cached(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fill ``out`` where ``a`` falls in a cached range; returns the mask of those hits."""
    bases, ends, devs = _ranges.arrays
    i = np.searchsorted(bases, a, side="right") - 1
    hit = i >= 0
    hit[hit] = a[hit] < ends[i[hit]]
    out[hit] = devs[i[hit]]
    return hit


def pointer_devices(addrs) -> np.ndarray:
    """Device of each raw address (int64 array-like): a CUDA index, or -1 for host memory.

    One ``searchsorted`` against the cached allocation ranges; addresses outside every cached range cost one
    driver round trip per distinct allocation (device or pinned host), after which that allocation is cached.
    Pageable host memory is not cached (one round trip per such address per call). A freed and reused range is
    re-learned on the next miss; :func:`forget_pointer_cache` drops everything.
    """
    a = np.asarray(addrs, dtype=np.int64).ravel()
    out = np.empty(a.size, dtype=np.int64)
    if a.size == 0:
        return out
    hit = _lookup_cached(a, out)
    if hit.all():
        return out
    pending = np.unique(a[~hit])
    while pending.size:
        start, end, dev = _driver_lookup(int(pending[0]))
        inside = (pending >= start) & (pending < end)
        if dev >= 0:
            _ranges.insert(start, end, dev)
        sel = ~hit & (a >= start) & (a < end)
        out[sel] = dev
        hit |= sel
        pending = pending[~inside] if inside.any() else pending[1:]
    return out


def forget_pointer_cache() -> None:
    """Drop every cached allocation range (after freeing memory whose addresses may be reused elsewhere)."""
    _ranges.clear()


def spans_on(dev: int, spans) -> bool:
    """Whether each (lowest, highest) start address of ``spans`` lies inside one cached allocation of GPU
    ``dev`` (two comparisons each; False for a None span or one the cache does not know yet)."""
    bases, ends, devs = _ranges.snapshot
    for span in spans:
        if span is None:
            return False
        i = bisect.bisect_right(bases, span[0]) - 1
        if i < 0 or span[1] >= ends[i] or devs[i] != dev:
            return False
    return True


def reachable(device, addr_lists, lengths, spans=None) -> bool:
    """For a checked kernel call on ``device`` (a torch.device or index): enable peer access to every other GPU
    that the non-empty items' raw addresses (each array of ``addr_lists``) live on. Returns False when one of
    those GPUs cannot have peer access: the caller then copies with :func:`staged_copy` instead of launching a
    kernel that would fault. Host and CPU calls: True.

    ``spans``: for each array, (lowest, highest) address of its non-empty items when the caller knows them (the
    checks do: ``LengthStats.spans``), or None. An array whose span lies inside one cached allocation is on that
    allocation's device without a look at each address (a pool, a chunk: the usual case, two comparisons); any
    other goes through :func:`pointer_devices`."""
    dev = getattr(device, "index", device)
    if getattr(device, "type", "cuda") != "cuda" or dev is None:
        return True
    if spans is not None and spans_on(dev, spans):  # the usual case
        return True
    others: Set[int] = set()
    live = None
    for j, addrs in enumerate(addr_lists):
        span = spans[j] if spans is not None else None
        if span is not None:
            found = _ranges.device_of_span(span[0], span[1])
            if found is not None:
                if found != dev:
                    others.add(found)
                continue
        if live is None:
            lengths = np.asarray(lengths)
            live = lengths > 0
            if live.all():
                live = slice(None)
        devs = pointer_devices(np.asarray(addrs)[live])
        if not devs.size:
            continue
        lo, hi = int(devs.min()), int(devs.max())
        found = (lo,) if lo == hi else np.unique(devs).tolist()
        others.update(int(d) for d in found if d >= 0 and d != dev)
    if not others:
        return True
    try:
        ensure_peer_access(dev, others)
    except PeerAccessError:
        return False
    return True


def staged_copy(srcs, dsts, lengths, device) -> None:
    """Item i: ``lengths[i]`` bytes from raw address ``srcs[i]`` to ``dsts[i]``, one ``cudaMemcpyAsync`` each on
    ``device``'s current stream (the driver stages a copy between GPUs without peer access through host
    memory). The slow but always-valid path for pairs without peer access."""
    import torch
    rt = _runtime()
    stream = torch.cuda.current_stream(device).cuda_stream
    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    for s, d, n in zip(np.asarray(srcs).tolist(), np.asarray(dsts).tolist(), np.asarray(lengths).tolist()):
        if n > 0:
            _check(rt.cudaMemcpyAsync(d, s, n, kind, stream), f"cudaMemcpyAsync(0x{d:x} <- 0x{s:x}, {n} B)")
