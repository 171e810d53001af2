"""What an ipc writer knows of its peers' regions: the descriptions their GRANTs gave, each peer's region counter
(mapped here, read before every write that skips the round trip), the peers' GPU allocations opened here through
CUDA IPC handles, and the arrays derived from the descriptions that posts over many regions reuse.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional

import numpy as np

from transport.arrays import distinct
from transport.errors import FabricError, FabricUnavailable
from transport.fabric.base import DEVICE_HOST, RegionSpans, WriteBounds
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.region_counter import CounterReader

_SPANS_CHECKED = 64  # batch layouts over several regions whose checks are remembered (checked_spans, remembered)


class _Cuda:
    """The few CUDA runtime/driver calls ipc needs, through cuda-bindings (imported on first GPU use)."""

    def __init__(self):
        try:
            from cuda.bindings import driver, runtime
        except ImportError:
            try:
                from cuda import cuda as driver, cudart as runtime  # cuda-python < 12.6 layout
            except ImportError as e:
                raise FabricUnavailable("ipc on GPU memory needs cuda-bindings: pip install cuda-bindings") from e
        self.rt, self.drv = runtime, driver

    def _ok(self, res, what):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if int(err) != 0:
            raise FabricError(f"{what} failed: {err!r}")
        return rest[0] if len(rest) == 1 else rest

    def export(self, addr: int, length: int, device: int) -> dict:
        import torch
        with torch.cuda.device(device):
            # torch skips cudaSetDevice when it believes ``device`` is already current, and a thread that got its
            # tensors from the caching allocator never made a runtime call: the driver call below would then find
            # no current context (CUDA_ERROR_INVALID_CONTEXT, seen on an engine's second handshake on the H200)
            self._ok(self.rt.cudaSetDevice(device), f"cudaSetDevice({device})")
            base, size = self._ok(self.drv.cuMemGetAddressRange(addr), f"cuMemGetAddressRange(0x{addr:x})")
            base, size = int(base), int(size)
            if addr + length > base + size:
                raise FabricError(f"ipc: region 0x{addr:x}+{length} spans several CUDA allocations (the one at "
                                  f"0x{base:x} has {size} B); register each allocation separately")
            handle = self._ok(self.rt.cudaIpcGetMemHandle(base), f"cudaIpcGetMemHandle(0x{base:x})")
            uuid = str(torch.cuda.get_device_properties(device).uuid)
        return {"handle": bytes(handle.reserved).hex(), "base": base, "uuid": uuid}

    def open(self, handle_hex: str, device: int) -> int:
        import torch
        h = self.rt.cudaIpcMemHandle_t()
        h.reserved = bytes.fromhex(handle_hex)
        with torch.cuda.device(device):
            ptr = self._ok(self.rt.cudaIpcOpenMemHandle(h, getattr(self.rt, "cudaIpcMemLazyEnablePeerAccess", 1)),
                           "cudaIpcOpenMemHandle")
        return int(ptr)

    def close(self, ptr: int) -> None:
        try:
            self.rt.cudaIpcCloseMemHandle(ptr)
        except Exception:  # noqa: BLE001 — best effort at shutdown
            pass



class PeerRegions:
    """The peers' regions as one ipc fabric's writer knows them. ``regions``: the fabric's own registered regions
    (by key) and ``own_gen`` its region counter, which ``checked_spans`` checks the local side against."""

    def __init__(self, regions: dict, own_gen):
        self._regions = regions
        self._own_gen = own_gen
        self._opened: Dict[tuple, int] = {}  # (CUDA IPC handle, device here) -> device pointer
        self._open_lock = threading.Lock()
        self._cuda: Optional[_Cuda] = None
        self._uuid_to_index = None
        self.granted: Dict[str, Dict[int, tuple]] = {}  # peer id -> rkey -> (description, counter value)
        self.changes = 0  # bumped whenever ``granted`` changes: ``target_layouts``' entries hold it
        self.target_layouts: Dict[tuple, tuple] = {}  # ``IpcFabric._regions_target``: (peer id, rkeys) -> layout
        self._spans: Dict[int, tuple] = {}  # ``checked_spans``: what it found, by id of the remote spans
        self._by_descriptions: Dict[tuple, tuple] = {}  # ``remembered``: arrays of the target's descriptions
        self._gen_readers: Dict[str, object] = {}

    def record_grant(self, ep: SocketEndpoint, info: dict, gen: int) -> None:
        """Keep the descriptions ``info`` (rkey -> description) a GRANT of ``ep``'s peer gave while its regions were
        pinned, at counter value ``gen`` or later: valid for as long as its counter stays at ``gen``."""
        known = self.granted.setdefault(ep.peer_id, {})
        for k, v in info.items():
            known[k] = (v, gen)
        self.changes += 1

    def close(self) -> None:
        """Close every peer allocation opened here."""
        if self._cuda is not None:
            for ptr in self._opened.values():
                self._cuda.close(ptr)
        self._opened.clear()

    def cuda_api(self) -> _Cuda:
        if self._cuda is None:
            self._cuda = _Cuda()
        return self._cuda

    def gen_reader(self, ep: SocketEndpoint):
        """The peer's region counter, mapped once (None when its descriptor has none)."""
        reader = self._gen_readers.get(ep.peer_id)
        if reader is None:
            d = ep.peer_desc
            if "gen_addr" not in d:
                return None
            reader = self._gen_readers[ep.peer_id] = CounterReader(int(d["pid"]), int(d.get("gen_fd", -1)),
                                                                   int(d["gen_addr"]))
        return reader

    def current_info(self, ep: SocketEndpoint, table, keys=None):
        """(descriptions by rkey, counter value) when every rkey of ``table`` (or every one of ``keys``) was
        described by a GRANT and the peer deregistered nothing since; else (None, the counter value or None)."""
        reader = self.gen_reader(ep)
        if reader is None:
            return None, None
        gen = reader.read()
        known = self.granted.get(ep.peer_id)
        if not known:
            return None, gen
        info = {}
        for k in (distinct(table["rkey"]) if keys is None else keys):
            got = known.get(k)
            if got is None or got[1] != gen:
                return None, gen
            info[k] = got[0]
        return info, gen

    def mapped(self, reg: dict, open_dev: int) -> int:
        key = (reg["handle"], open_dev)
        with self._open_lock:
            ptr = self._opened.get(key)
            if ptr is None:
                ptr = self._opened[key] = self.cuda_api().open(reg["handle"], open_dev)
        return ptr

    def local_index(self, uuid: str) -> int:
        import torch
        if self._uuid_to_index is None:
            self._uuid_to_index = {str(torch.cuda.get_device_properties(d).uuid): d
                                   for d in range(torch.cuda.device_count())}
        try:
            return self._uuid_to_index[uuid]
        except KeyError:
            raise FabricError(f"ipc: the target's GPU {uuid} is not visible in this process "
                              f"(CUDA_VISIBLE_DEVICES?)") from None

    def remembered(self, kind: tuple, regs: list, make):
        """``make(regs)``, remembered by ``kind`` and the identity of the description objects ``regs`` (the target's
        regions named by a message, or None for an unknown rkey). A description is replaced by a new object
        whenever a GRANT describes its region again, and the entry holds ``regs``, so equal identities mean the
        same descriptions. Why: a batch over many regions (sglang's region per layer) paid a Python step per
        region and post for these arrays, though the same regions come back call after call."""
        key = kind + tuple(map(id, regs))
        got = self._by_descriptions.get(key)
        if got is not None:
            return got[1]
        value = make(regs)
        with self._open_lock:
            if len(self._by_descriptions) >= _SPANS_CHECKED:
                self._by_descriptions.pop(next(iter(self._by_descriptions)))
            self._by_descriptions[key] = (regs, value)
        return value

    @staticmethod
    def bounds_of(regs: list) -> tuple:
        """(known, start, end, on host) of each description in ``regs`` (numpy arrays by position)."""
        known = np.array([r is not None for r in regs], dtype=bool)
        lo = np.array([r["addr"] if r else 0 for r in regs], dtype=np.int64)
        hi = lo + np.array([r["length"] if r else 0 for r in regs], dtype=np.int64)
        on_host = np.array([r is not None and r["device"] == DEVICE_HOST for r in regs], dtype=bool)
        return known, lo, hi, on_host

    def shifts_on(self, regs: list, dev: int) -> np.ndarray:
        """What to add to an address in each GPU region of ``regs`` to reach its mapping in GPU ``dev``'s context
        (int64 by position; 0 for host regions and unknown rkeys, which no GPU copy takes)."""
        shift = np.zeros(len(regs), dtype=np.int64)
        for j, r in enumerate(regs):
            if r is not None and r["device"] != DEVICE_HOST:
                shift[j] = self.mapped(r, dev) - r["base"]
        return shift

    def remember_target(self, ep: SocketEndpoint, rk: np.ndarray, keys: list, regs: list, valid: tuple) -> tuple:
        """Remember, by the peer and the bytes of the rkey array ``rk`` (``keys``: its distinct values, ``regs``
        their current descriptions, read at ``valid``: the peer's counter value and the fabric's count of GRANT
        changes), what ``_regions_target`` derives from them: (valid, regs, each write's position in them, start
        and end of each write's region, True / False when every region is on the host / on a GPU (None: both),
        and a dict for each write's shift into its mapping by source GPU). Valid while the peer deregisters
        nothing and no GRANT describes a region again. Why: sglang's batches name the same regions (a buffer per
        layer) call after call, and working them out per post costs a ``np.unique`` and Python steps per region.
        The arrays are shared between calls: read only."""
        k = np.searchsorted(np.asarray(keys, dtype=np.int64), rk)
        _, lo, hi, on_host = self.bounds_of(regs)
        lo, hi = lo[k], hi[k]
        for a in (k, lo, hi):
            a.flags.writeable = False
        side = True if on_host.all() else (False if not on_host.any() else None)
        layout = (valid, regs, k, lo, hi, side, {})
        with self._open_lock:
            memo = self.target_layouts
            if len(memo) >= _SPANS_CHECKED:
                memo.pop(next(iter(memo)))
            if rk.dtype == np.int64:
                memo[(ep.peer_id, rk.tobytes())] = layout
        return layout

    def bounded_target(self, ep: SocketEndpoint, bd: WriteBounds, src_dev: int) -> Optional[dict]:
        """The peer's current description of region ``bd.rkey`` when it contains the remote extremes of ``bd`` and
        lies on the same side (host or GPU) as the sources' device ``src_dev``; else None."""
        info, _ = self.current_info(ep, None, (bd.rkey,))
        if info is None:
            return None
        reg = info[bd.rkey]
        if (src_dev == DEVICE_HOST) != (reg["device"] == DEVICE_HOST):
            return None
        lo = reg["addr"]
        return reg if lo <= bd.remote_min and bd.remote_end <= lo + reg["length"] else None

    def checked_spans(self, ep: SocketEndpoint, spans: RegionSpans):
        """(the local regions' device, what to add to each peer address to reach its mapping here) when every
        local region of ``spans`` is registered here and covers its span, all on one device, and every peer
        region's kept description is current, on the same side (host or GPU), and covers its span; else None.
        The shift is an int for one peer region, else an int64 array by position in ``spans.remote`` (None for
        host memory). Remembered for the same ``local`` and ``remote`` tuple objects on the same endpoint
        (the engine passes the same ones for a layout it saw before: ``Pipeline._region_spans``) while neither
        side has deregistered anything since: those counters are what any change of the checked facts bumps."""
        own = self._own_gen.value
        reader = self.gen_reader(ep)
        if reader is None:
            return None
        one = spans.remote_index is None
        memo = self._spans.get(id(spans.remote))
        if memo is not None and memo[0] is spans.local and memo[1] is spans.remote and memo[2] is ep \
                and memo[3] == own and memo[4] == reader.read() and memo[5] == one:
            return memo[6]
        dev = self._local_device(spans.local)
        if dev is None:
            return None
        checked = self._remote_regions(ep, spans.remote, dev)
        if checked is None:
            return None
        regs, gen = checked
        if dev == DEVICE_HOST:
            shift = None
        elif one:
            shift = self.mapped(regs[0], dev) - regs[0]["base"]
        else:
            shift = np.array([self.mapped(reg, dev) - reg["base"] for reg in regs], dtype=np.int64)
        with self._open_lock:
            if len(self._spans) >= _SPANS_CHECKED:
                self._spans.pop(next(iter(self._spans)))
            self._spans[id(spans.remote)] = (spans.local, spans.remote, ep, own, gen, one, (dev, shift))
        return dev, shift

    def _local_device(self, local) -> Optional[int]:
        """The one device of the local regions of ``local`` ((lkey, low, high) spans) when each is registered here
        and covers its span; else None."""
        dev = None
        for lkey, lo, hi in local:
            mr = self._regions.get(lkey)
            if mr is None or not (mr.addr <= lo and hi <= mr.addr + mr.length) or dev not in (None, mr.device):
                return None
            dev = mr.device
        return dev

    def _remote_regions(self, ep: SocketEndpoint, remote, dev: int) -> Optional[tuple]:
        """(the peer's current description of each region of ``remote`` ((rkey, low, high) spans), the generation
        it was read at) when every one is on the same side (host or GPU) as ``dev`` and covers its span; else
        None."""
        keys = [k for k, _, _ in remote]
        if not keys or not all(0 <= k <= 0xFFFFFFFF for k in keys):
            return None
        info, gen = self.current_info(ep, None, keys)
        if info is None:
            return None
        regs = [info[k] for k in keys]
        for reg, (_, lo, hi) in zip(regs, remote):
            if (dev == DEVICE_HOST) != (reg["device"] == DEVICE_HOST) or \
                    not (reg["addr"] <= lo and hi <= reg["addr"] + reg["length"]):
                return None
        return regs, gen
