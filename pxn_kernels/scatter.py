"""scatter: pieces of one contiguous uint8 buffer (a landed chunk) -> raw destination addresses, one launch."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, _default_plan, launch_batched_copy
from pxn_kernels._memory import host_copy, raw_view
from pxn_kernels.gather import _use_host


def scatter(src: torch.Tensor, src_offsets: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor,
            check: bool = True, plan: Optional[CopyPlan] = None, backend: str = "auto") -> None:
    """Copy ``src[src_offsets[i]:src_offsets[i] + lengths[i]]`` to raw address ``dst_ptrs[i]``.

    Arguments:
        src: contiguous uint8 tensor holding the pieces.
        src_offsets: int64 [n] byte offsets into ``src``.
        dst_ptrs: int64 [n] destination addresses (this GPU, a peer GPU with peer access, or pinned host);
            destination ranges must not overlap.
        lengths: int64 [n] bytes per item, >= 0.
        check, plan, backend: as for ``gather``.
    Raises:
        ValueError naming the argument and value (as ``gather``).
    """
    _checks.check_byte_tensor("scatter", "src", src)
    count = _checks.check_index_tensors("scatter", src.device, src_offsets=src_offsets, dst_ptrs=dst_ptrs,
                                        lengths=lengths)
    if check and count:
        off_np, dst_np, len_np = _checks.to_host(src_offsets, dst_ptrs, lengths)
        _checks.check_lengths("scatter", len_np)
        _checks.check_ranges_in("scatter", "src_offsets", off_np, len_np, src.numel(), "src")
        _checks.check_addresses("scatter", "dst_ptrs", dst_np, len_np)
        _checks.check_no_overlap("scatter", "dst_ptrs", dst_np, len_np)
        if not peer_access.reachable(src.device, [dst_np], len_np):
            peer_access.staged_copy(off_np + src.data_ptr(), dst_np, len_np, src.device)
            return
    if _use_host(backend, src):
        base = src.data_ptr()
        host_copy([base + int(o) for o in src_offsets.tolist()], dst_ptrs, lengths)
        return
    launch_batched_copy(src_offsets, dst_ptrs, lengths, src.data_ptr(), 0,
                        plan if plan is not None else _default_plan(lengths, len_np if check and count else None))


def scatter_torch(src: torch.Tensor, src_offsets: torch.Tensor, dst_ptrs: torch.Tensor,
                  lengths: torch.Tensor) -> None:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    for offset, dst, length in zip(src_offsets.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        if length:
            raw_view(dst, length, src.device).copy_(src[offset:offset + length])
