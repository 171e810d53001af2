"""Copies between host or device pieces and one contiguous buffer: what the sender's relay slots are filled with
and what the receiver scatters a landed chunk by. One module for both sides, so that the chunk layout
(``pxn_kernels.chunk``) and the descriptor layout of the batched-copy kernel are built and read in one place.

* ``host_memmove``: host pieces to host pieces (a relay slot on a GPU-less machine, a landed host chunk).
* ``gpu_pack`` / ``gpu_pack_large``: a chunk built in a CUDA relay slot (many small pieces by one kernel launch;
  a few large ones by the copy engine).
* ``gpu_scatter`` / ``scatter_words``: a landed chunk in device memory scattered to its destinations.
* ``HostBuffer``: page-aligned host memory that stays put (slot buffers, landing and credit areas).
"""
from __future__ import annotations

import ctypes

import numpy as np


class HostBuffer:
    """Page-aligned host memory that stays put (numpy-owned)."""

    def __init__(self, nbytes: int, align: int = 4096):
        self._raw = np.empty(nbytes + align, dtype=np.uint8)
        self._raw.fill(0)  # fault every page in now, not during the first transfers that use it
        base = self._raw.ctypes.data
        offset = (-base) % align
        self.array = self._raw[offset:offset + nbytes]
        self.addr = base + offset
        self.nbytes = nbytes


def _rows(addr: int, rows: int, width: int) -> np.ndarray:
    """A (rows, width) uint8 view of host memory at ``addr`` (no copy; only the rows a caller indexes are read or
    written, so the span between them need not be mapped)."""
    from transport.fabric.memory import raw_view
    return np.frombuffer(raw_view(addr, rows * width, writable=True), dtype=np.uint8).reshape(rows, width)


_PAGED_MIN_PIECES = 16  # below this the plain loop is as fast


def host_memmove(srcs, dsts, lengths) -> None:
    """Copy piece i (``lengths[i]`` bytes) from host address ``srcs[i]`` to ``dsts[i]``; sources and destinations
    must not overlap. Arguments: int64 arrays or sequences.

    Why two ways: a ctypes memmove per piece is a Python step per piece, a large share of a call for the 32768
    pages of 2 KiB of an MHA call, on each side of a coalesced transfer. Paged KV
    caches have a shape one numpy call can copy: every piece of one length L, and every source (destination) at
    a multiple of L from the lowest one. Those go as
    rows of an (n, L) view: ``take`` into a run of contiguous rows (a chunk's payload when L is a multiple of its
    16-B alignment), an indexed store out of one, or an indexed load then store otherwise. Anything else: one
    memmove per piece (ctypes releases the GIL during each).
    """
    srcs = np.asarray(srcs, dtype=np.int64)
    dsts = np.asarray(dsts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.size)
    if n >= _PAGED_MIN_PIECES:
        width = int(lengths[0])
        if width > 0 and bool((lengths == width).all()):
            s0, d0 = int(srcs.min()), int(dsts.min())
            s_off, d_off = srcs - s0, dsts - d0
            if not (s_off % width).any() and not (d_off % width).any():
                s_rows, d_rows = s_off // width, d_off // width
                src = _rows(s0, int(s_rows.max()) + 1, width)
                dst = _rows(d0, int(d_rows.max()) + 1, width)
                ordered = np.arange(n, dtype=np.int64)
                if np.array_equal(d_rows, ordered):
                    # rows are in range by construction; "raise" would buffer the output (one more copy)
                    np.take(src, s_rows, axis=0, out=dst[:n], mode="clip")
                elif np.array_equal(s_rows, ordered):
                    dst[d_rows] = src[:n]
                else:
                    dst[d_rows] = src[s_rows]
                return
    mm = ctypes.memmove
    for s, d, k in zip(srcs.tolist(), dsts.tolist(), lengths.tolist()):
        mm(d, s, k)


def _staging(slot, need: int):
    """The slot's pinned + device descriptor buffers, grown to ``need`` bytes (allocating pinned memory costs
    far more than a chunk's copy, so it happens once per slot, not per chunk)."""
    import torch
    st = slot.staging
    if st is None or st[0].numel() < need:
        cap = max(need, 64 << 10)
        cap = 1 << (cap - 1).bit_length()
        st = slot.staging = (torch.empty(cap, dtype=torch.uint8, pin_memory=True),
                             torch.empty(cap, dtype=torch.uint8, device=slot.tensor.device))
    return st


def gpu_pack(slot, srcs: np.ndarray, lens: np.ndarray, dsts: np.ndarray, seq: int, sender_id: int,
             sync: bool = True, key=None) -> int:
    """Build a chunk in a CUDA relay slot (``transport.relay.Slot``) with one H2D copy and one gather launch on the lane's stream (synchronised
    unless ``sync`` is False: the ring then synchronises once for every slot it filled).

    The slot's pinned staging buffer holds, as int64: src | dst-offset | lengths | plan (pad_ends, bounds,
    first_item, computed on the host: ``plan_host``), followed by the chunk's header + table. Item 0 of the
    copy is the header + table itself (source: its place in the device copy of the staging buffer), items 1..n
    the pieces, so one launch writes the whole chunk -- the layout of ``pxn_kernels.pack_chunk``, without its
    per-call pinned allocation and device-side plan. ``key``: the peer's chunk key (the header + table carry their
    MAC, ``pxn_kernels.chunk``). Returns the chunk's bytes.
    """
    import torch
    from pxn_kernels._batched_copy import CopyPlan, launch_batched_copy, launch_settings, plan_host
    from pxn_kernels.chunk import build_header_table, payload_offset_for
    n = int(lens.size) + 1
    table_bytes = payload_offset_for(n - 1)
    device = slot.tensor.device
    settings = launch_settings(n, device, int(lens.sum()) + table_bytes)
    ranges = settings.ranges
    words = 4 * n + 2 * ranges + 1
    desc_bytes = words * 8
    need = desc_bytes + table_bytes
    pinned, dev_buf = _staging(slot, need)
    host = pinned.numpy()
    _, offsets, chunk_bytes = build_header_table(dsts, lens, seq, sender_id, out=host[desc_bytes:need], key=key)
    if chunk_bytes > slot.nbytes:
        raise ValueError(f"chunk of {chunk_bytes} B does not fit slot of {slot.nbytes} B")
    w = host[:desc_bytes].view(np.int64)
    w[0] = dev_buf.data_ptr() + desc_bytes
    w[1:n] = srcs
    w[n] = 0
    w[n + 1:2 * n] = offsets
    w[2 * n] = table_bytes
    w[2 * n + 1:3 * n] = lens
    pad_ends, bounds, first_item = plan_host(w[2 * n:3 * n], ranges)
    w[3 * n:4 * n] = pad_ends
    w[4 * n:4 * n + ranges + 1] = bounds
    w[4 * n + ranges + 1:words] = first_item
    stream = slot.ring.stream(slot.lane)
    with torch.cuda.stream(stream):
        dev_buf[:need].copy_(pinned[:need], non_blocking=True)
        d = dev_buf[:desc_bytes].view(torch.int64)
        plan = CopyPlan(d[3 * n:4 * n], d[4 * n:4 * n + ranges + 1], d[4 * n + ranges + 1:words], settings)
        launch_batched_copy(d[0:n], d[n:2 * n], d[2 * n:3 * n], 0, slot.tensor.data_ptr(), plan)
    if sync:
        stream.synchronize()
    return chunk_bytes


def gpu_pack_large(slot, srcs: np.ndarray, lens: np.ndarray, dsts: np.ndarray, seq: int,
                   sender_id: int, sync: bool = True, key=None) -> int:
    """Build a chunk of large pieces in a CUDA slot: header + table by one H2D copy, each piece by the copy
    engine (``cudaMemcpyAsync``, over NVLink from a peer GPU), then a synchronise of the lane's stream. The
    range kernel of ``gpu_pack`` is sized for many small items; a few MB-sized ones run far below link speed
    there. ``key``: as ``gpu_pack``. Returns the chunk's bytes."""
    import torch
    from pxn_kernels.chunk import build_header_table, payload_offset_for
    from transport.fabric.memory import memcpy_async
    table_bytes = payload_offset_for(int(lens.size))
    pinned, _ = _staging(slot, table_bytes)
    host = pinned.numpy()
    _, offsets, chunk_bytes = build_header_table(dsts, lens, seq, sender_id, out=host[:table_bytes], key=key)
    if chunk_bytes > slot.nbytes:
        raise ValueError(f"chunk of {chunk_bytes} B does not fit slot of {slot.nbytes} B")
    stream = slot.ring.stream(slot.lane)
    with torch.cuda.stream(stream):
        slot.tensor[:table_bytes].copy_(pinned[:table_bytes], non_blocking=True)
    for s_, o, n in zip(srcs.tolist(), offsets.tolist(), lens.tolist()):
        memcpy_async(slot.addr + o, s_, n, stream)
    if sync:
        stream.synchronize()
    return chunk_bytes


def gpu_scatter(pinned, dev_buf, src, offsets: np.ndarray, dsts: np.ndarray, lens: np.ndarray, stream) -> None:
    """Scatter pieces of the CUDA byte tensor ``src`` (a landed chunk) to raw device addresses: descriptors and
    a host-computed plan in one H2D copy through the caller's (pinned, device) buffers, one launch, then a
    synchronise of ``stream`` (the buffers are reused for the next chunk)."""
    import torch
    from pxn_kernels._batched_copy import CopyPlan, launch_batched_copy, launch_settings, plan_host
    n = int(lens.size)
    settings = launch_settings(n, src.device, int(lens.sum()))
    ranges = settings.ranges
    words = 4 * n + 2 * ranges + 1
    if pinned.numel() < words * 8:
        raise ValueError(f"scatter staging of {pinned.numel()} B is smaller than the {words * 8} B needed")
    w = pinned[:words * 8].numpy().view(np.int64)
    w[0:n] = offsets
    w[n:2 * n] = dsts
    w[2 * n:3 * n] = lens
    pad_ends, bounds, first_item = plan_host(lens, ranges)
    w[3 * n:4 * n] = pad_ends
    w[4 * n:4 * n + ranges + 1] = bounds
    w[4 * n + ranges + 1:] = first_item
    with torch.cuda.stream(stream):
        dev_buf[:words * 8].copy_(pinned[:words * 8], non_blocking=True)
        d = dev_buf[:words * 8].view(torch.int64)
        plan = CopyPlan(d[3 * n:4 * n], d[4 * n:4 * n + ranges + 1], d[4 * n + ranges + 1:], settings)
        launch_batched_copy(d[0:n], d[n:2 * n], d[2 * n:3 * n], src.data_ptr(), 0, plan)
    stream.synchronize()


def scatter_words(n: int, device, nbytes: int) -> int:
    """Bytes of staging ``gpu_scatter`` needs for ``n`` pieces of ``nbytes`` in total."""
    from pxn_kernels._batched_copy import launch_settings
    return (4 * n + 2 * launch_settings(n, device, nbytes).ranges + 1) * 8
