"""pack_chunk: header + item table + every piece into one relay chunk with a single gather launch."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pxn_kernels import _checks
from pxn_kernels._batched_copy import DeviceBatch, launch_batched_copy
from pxn_kernels._memory import host_copy, raw_view
from pxn_kernels.chunk import build_header_table, payload_offset_for


def pack_chunk(src_ptrs: Sequence[int], lengths: Sequence[int], dst_addrs: Sequence[int], out: torch.Tensor,
               seq: int, sender_id: int, check: bool = True, backend: str = "auto") -> int:
    """Write a complete chunk (see ``pxn_kernels.chunk``) into ``out`` and return its size in bytes.

    Arguments:
        src_ptrs: host sequence of source addresses of the pieces (this GPU, peer GPU, pinned host; host
            memory when ``out`` is on the CPU).
        lengths: bytes of each piece (>= 0). A piece of length 0 is a no-op: it gets no table entry and no
            payload (the chunk format's items are >= 1 byte), so the chunk holds the other pieces only.
        dst_addrs: destination address of each piece at the receiver (goes into the item table).
        out: contiguous uint8 tensor (a relay slot) of at least the chunk's size.
        seq, sender_id: header fields (u64).
        check: validate addresses and sizes first (host-side, no device sync).
    Returns:
        the chunk's size in bytes (header + table + 16-byte aligned payload). On CUDA: one host-to-device copy
        of the descriptors and header/table, then one gather launch, both on the current stream.
    """
    _checks.check_byte_tensor("pack_chunk", "out", out)
    src_np = np.asarray(src_ptrs, dtype=np.int64)
    len_np = np.asarray(lengths, dtype=np.int64)
    count = len_np.size
    dst_np = np.asarray(dst_addrs, dtype=np.uint64)
    if src_np.shape != len_np.shape or dst_np.shape != len_np.shape:
        raise ValueError(f"pack_chunk: src_ptrs ({src_np.size}), lengths ({count}) and dst_addrs "
                         f"({dst_np.size}) must have the same number of items")
    if count:
        _checks.check_lengths("pack_chunk", len_np)
        if int(len_np.min()) == 0:
            keep = np.flatnonzero(len_np)
            src_np, len_np, dst_np = src_np[keep], len_np[keep], dst_np[keep]
            count = len_np.size
            dst_addrs = dst_np
    table_bytes = payload_offset_for(count)
    if out.device.type == "cpu" or backend == "host":
        header, item_offsets, chunk_bytes = build_header_table(dst_addrs, len_np, seq, sender_id)
        _check_fits(out, chunk_bytes, src_np, len_np, check)
        base = out.data_ptr()
        out[:table_bytes].copy_(torch.from_numpy(header))
        host_copy(src_np, base + item_offsets, len_np)
        return chunk_bytes
    # Header+table are staged in pinned memory and copied to the device; then one launch moves them and
    # every piece. The descriptors and the plan travel in one more copy (DeviceBatch).
    staging = torch.empty(table_bytes, dtype=torch.uint8, pin_memory=True)
    header, item_offsets, chunk_bytes = build_header_table(dst_addrs, len_np, seq, sender_id,
                                                           out=staging.numpy())
    _check_fits(out, chunk_bytes, src_np, len_np, check)
    header_dev = staging.to(out.device, non_blocking=True)
    base = out.data_ptr()
    batch = DeviceBatch(np.concatenate(([header_dev.data_ptr()], src_np)),
                        np.concatenate(([base], base + item_offsets)),
                        np.concatenate(([table_bytes], len_np)), out.device)
    launch_batched_copy(batch.src, batch.dst, batch.lengths, 0, 0, batch.plan)
    # Keep the device copies alive until the launch has run on this stream.
    header_dev.record_stream(torch.cuda.current_stream(out.device))
    batch.device_buf.record_stream(torch.cuda.current_stream(out.device))
    return chunk_bytes


def pack_chunk_torch(src_ptrs: Sequence[int], lengths: Sequence[int], dst_addrs: Sequence[int], out: torch.Tensor,
                     seq: int, sender_id: int) -> int:
    """Reference: the same chunk built with ``build_header_table`` and one ``copy_`` per piece (no checks)."""
    keep = [i for i, n in enumerate(lengths) if n]
    lengths = [int(lengths[i]) for i in keep]
    header, item_offsets, chunk_bytes = build_header_table([dst_addrs[i] for i in keep], lengths, seq, sender_id)
    out[:header.size].copy_(torch.from_numpy(header.copy()))
    for i, length, offset in zip(keep, lengths, item_offsets.tolist()):
        out[offset:offset + length].copy_(raw_view(int(src_ptrs[i]), length, out.device))
    return chunk_bytes


def _check_fits(out, chunk_bytes, src_np, len_np, check):
    if chunk_bytes > out.numel():
        raise ValueError(f"pack_chunk: chunk needs {chunk_bytes} bytes, out has {out.numel()}")
    if check and len_np.size:
        _checks.check_addresses("pack_chunk", "src_ptrs", src_np, len_np)
