"""Same-host load/store path: a whole batch written into a peer process's memory from the caller's thread.

Why: on the ipc fabric every write message is a socket round trip (REQ -> GRANT -> copy -> DONE -> ACK) handed
between Python threads, and on a GPU that, not the bytes, is nearly the whole cost: a large batch takes many
times one device copy of its bytes. A peer on the same host needs none of
it: its GPU allocations can be mapped here once (CUDA IPC) and its host memory written by cross-memory attach,
so a batch is one ``pxn_kernels.copy`` launch (every GPU piece, any mix of sizes, straight to its destination:
no relay chunk, no receiver scatter) plus one ``process_vm_writev`` for host pieces. This is what NCCL does
inside a node: the NIC path, relay slots and coalesced chunks exist for peers on other hosts.

What replaces the receiver's check: the sender already checks every destination against the regions the peer
advertised before anything is written (``TransferEngine._submit``), and the peer only advertises (and exports IPC
handles for) memory it registered. A peer's ``deregister`` bumps a generation counter
(``transport.fabric.region_counter``, an 8-byte memfd the sender maps read-only); every batch reads it first and
re-fetches the region list when it moved, so a batch submitted after ``deregister`` returned never writes into the
removed region. As with an RDMA write, a batch racing a ``deregister`` of its own destination is the caller's error
(the tcp/ipc message path pins regions and refuses; this path cannot).

Batches this path does not take (the caller uses the message path): pieces between host and GPU memory, a peer
GPU that is not visible in this process, a peer whose rails are down.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from transport.arrays import distinct
from transport.errors import PeerLost, TransferError
from transport.fabric.gpu_copy import Pending
from transport.fabric.procmem import process_vm_write
from transport.fabric.region_counter import CounterReader

log = logging.getLogger(__name__)

_MAX_RUNS = 16  # a multi-region batch cut into more runs than this is classified piece by piece


class LoadStoreWriter:
    """Writes batches into one same-host peer (an ``IpcFabric`` endpoint's process) by direct loads/stores.

    Arguments:
        fabric: the rail-0 ``IpcFabric`` (it opens and caches the peer's CUDA IPC handles).
        ep: its endpoint to the peer (the pid verified at connect).
        gen_addr, gen_fd: address and memfd, in the peer, of its ``GenerationCounter``.
        gen_seen: the counter's value when the peer built the region list this engine holds.
    """

    def __init__(self, fabric, ep, gen_addr: int, gen_seen: int, gen_fd: int = -1):
        self.fabric = fabric
        self.ep = ep
        self.pid = fabric.peer_pid(ep)
        self._counter = CounterReader(self.pid, int(gen_fd), int(gen_addr))
        self.gen_seen = int(gen_seen)
        self._maps = {}  # source device -> (region snapshot, int64 array: mapped start per region or -1)
        self._copies = fabric.bound_copies  # plans and bound launches, shared with the fabric's message path

    # --- region freshness ------------------------------------------------------------------------------------
    def stale(self) -> bool:
        """True when the peer deregistered something since its region list was fetched. Raises PeerLost when
        the peer process cannot be read any more."""
        return self._counter.read() != self.gen_seen

    def close(self) -> None:
        """Unmap the peer's counter (the IPC mappings belong to the fabric and go with it)."""
        self._counter.close()

    # --- the write ---------------------------------------------------------------------------------------------
    def write(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, src_dev: np.ndarray,
              dst_index: np.ndarray, rsnap, wait: bool = True, length_stats=None) -> Optional[Pending]:
        """Write piece i (``lengths[i]`` bytes from local ``src[i]`` on ``src_dev[i]``) to the peer's ``dst[i]``,
        which lies in region ``rsnap.regions[dst_index[i]]`` (the caller validated both sides). ``src_dev`` and
        ``dst_index`` may be scalars: one device / one region for every piece. ``length_stats``: (sum, min, max)
        of ``lengths`` when the caller has them (saves three passes over the lengths).

        Returns None, having written nothing, when the batch is not for this path; else a ``Pending`` (already
        waited for when ``wait``). Raises TransferError (PeerLost when the peer is gone) on a failed copy.
        """
        # scalars (Python or numpy ints, ndim 0) vs per-piece arrays, by attribute: np.ndim() costs more per call
        if getattr(dst_index, "ndim", 0) == 0 and getattr(src_dev, "ndim", 0) == 0:
            # every piece in one local and one peer region (the caller's span check): no per-piece work
            s_dev, d_dev = int(src_dev), int(rsnap.devices[dst_index])
            if s_dev < 0 and d_dev < 0:
                host, gpu_groups = (src, dst, lengths), []
            elif s_dev >= 0 and d_dev >= 0:
                start = int(self._mapped_starts(rsnap, s_dev)[dst_index])
                if start < 0:
                    return None  # the peer's GPU is not mappable here
                host, gpu_groups = None, [(s_dev, src, dst, lengths, start - int(rsnap.start_list[dst_index]))]
            else:
                return None  # host <-> GPU: the message path stages them
        else:
            # one side may be a scalar (one region); np.broadcast_to costs more per call even on an array
            if getattr(src_dev, "ndim", 0) == 0:
                src_dev = np.full(lengths.size, int(src_dev), dtype=np.int64)
            if getattr(dst_index, "ndim", 0) == 0:
                dst_index = np.full(lengths.size, int(dst_index), dtype=np.int64)
            host, gpu_groups = self._classify(src, dst, lengths, src_dev, dst_index, rsnap)
            if gpu_groups is None:
                return None
        # From here on bytes move. GPU pieces first: their copy runs on the device while this thread writes the
        # host pieces, so the two overlap (the host write itself runs a little slower meanwhile, far less than the
        # copy takes).
        whole = length_stats
        if len(gpu_groups) != 1 or gpu_groups[0][3] is not lengths:
            length_stats = None  # they describe the whole batch, not a subset
        launched = [self._copies.launch(d, s, m, n, length_stats, dst_shift=shift)
                    for d, s, m, n, shift in gpu_groups]
        try:
            if host is not None:
                h_src, h_dst, h_len = host
                try:
                    # no GPU group: the host part is the whole batch, whose total the caller knows
                    process_vm_write(self.pid, h_src, h_dst, h_len, whole[0] if whole and not gpu_groups else None)
                except OSError as e:
                    if e.errno == 3:  # ESRCH
                        raise PeerLost(f"same-host peer pid {self.pid} is gone: {e}") from e
                    raise TransferError(f"cross-memory write to pid {self.pid} failed: {e}", [e]) from e
        finally:
            work = self._copies.finish(launched, wait)
        return Pending(work)

    def _classify(self, src, dst, lengths, src_dev, dst_index, rsnap):
        """Split a batch spread over several regions into its host part and its GPU groups.

        Returns ``(host, gpu_groups)``: ``host`` None or ``(src, dst, lengths)`` of the host -> host pieces;
        ``gpu_groups`` a list of ``(source device, src, mapped dst, lengths, 0)`` (the 0: no further shift of
        the destinations), or None when the batch is not for
        this path (a host <-> GPU piece, or a destination GPU not mappable here).

        Why runs: callers put each buffer's pieces together (sglang's KV blocks, then its aux pieces), so a
        batch is a few runs of pieces with one (source device, destination region) each, and every run is a
        slice: views instead of masks and fancy indexing (the per-piece version's masks are a sizeable share of a
        KV + aux batch). A batch of many short runs takes the per-piece version.
        """
        n = lengths.size
        cut = ((src_dev[1:] != src_dev[:-1]) | (dst_index[1:] != dst_index[:-1])).nonzero()[0]
        if cut.size >= _MAX_RUNS:
            return self._classify_pieces(src, dst, lengths, src_dev, dst_index, rsnap)
        bounds = [0] + (cut + 1).tolist() + [n]
        host_runs = []
        gpu_runs = {}  # source device -> [(a, b, mapped start - region start)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            s_dev, r = int(src_dev[a]), int(dst_index[a])
            d_dev = int(rsnap.devices[r])
            if s_dev < 0 and d_dev < 0:
                host_runs.append((a, b))
            elif s_dev >= 0 and d_dev >= 0:
                start = int(self._mapped_starts(rsnap, s_dev)[r])
                if start < 0:
                    return None, None  # a destination GPU not mappable here
                gpu_runs.setdefault(s_dev, []).append((a, b, start - rsnap.start_list[r]))
            else:
                return None, None  # host <-> GPU pieces: the message path stages them

        def take(runs, arr):
            if len(runs) > 1:
                return np.concatenate([arr[a:b] for a, b, *_ in runs])
            a, b = runs[0][0], runs[0][1]
            return arr if (a == 0 and b == n) else arr[a:b]  # the batch's own array: its length stats hold

        host = None
        if host_runs:
            host = (take(host_runs, src), take(host_runs, dst), take(host_runs, lengths))
        gpu_groups = []
        for d, runs in gpu_runs.items():
            mapped = np.concatenate([dst[a:b] + delta for a, b, delta in runs]) if len(runs) > 1 \
                else dst[runs[0][0]:runs[0][1]] + runs[0][2]
            gpu_groups.append((d, take(runs, src), mapped, take(runs, lengths), 0))
        return host, gpu_groups

    def _classify_pieces(self, src, dst, lengths, src_dev, dst_index, rsnap):
        """``_classify`` for batches of many short runs: per-piece masks (same result)."""
        dst_dev = rsnap.devices[dst_index]
        gpu = (src_dev >= 0) & (dst_dev >= 0)
        host = (src_dev < 0) & (dst_dev < 0)
        if not bool((gpu | host).all()):
            return None, None  # host <-> GPU pieces: the message path stages them
        gpu_groups = []
        if gpu.any():
            g_src, g_dst, g_len, g_dev, g_idx = src[gpu], dst[gpu], lengths[gpu], src_dev[gpu], dst_index[gpu]
            starts_i64 = rsnap.starts_i64 if rsnap.starts_i64 is not None else rsnap.starts.astype(np.int64)
            for d in distinct(g_dev):
                m = g_dev == d
                idx = g_idx[m]
                base = self._mapped_starts(rsnap, d)[idx]
                if int(base.min()) < 0:
                    return None, None  # a destination GPU not mappable here
                gpu_groups.append((d, g_src[m], base + (g_dst[m] - starts_i64[idx]), g_len[m], 0))
        return ((src[host], dst[host], lengths[host]) if host.any() else None), gpu_groups

    # --- GPU pieces ----------------------------------------------------------------------------------------------
    def _mapped_starts(self, rsnap, device: int) -> np.ndarray:
        """Per region of ``rsnap``: the device pointer (in ``device``'s context) of its first byte, -1 when the
        region is host memory or its GPU cannot be mapped here. Cached per snapshot (snapshots are immutable)."""
        cached = self._maps.get(device)
        if cached is not None and cached[0] is rsnap:
            return cached[1]
        out = np.full(len(rsnap.regions), -1, dtype=np.int64)
        for i, r in enumerate(rsnap.regions):
            acc = r.access
            if r.device < 0 or not acc or "handle" not in acc:
                continue
            try:
                out[i] = self.fabric.map_gpu(acc, device) + (r.addr - int(acc["base"]))
            except Exception as e:  # noqa: BLE001 — the message path still works for this region
                log.info("load/store: cannot map peer region 0x%x on device %d (%s); message path instead",
                         r.addr, device, e)
        self._maps[device] = (rsnap, out)
        return out
