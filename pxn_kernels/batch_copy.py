"""copy: batched memcpy between raw addresses in one launch (direct and relayed large pieces)."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, _default_plan, launch_batched_copy
from pxn_kernels._memory import host_copy, raw_view
from pxn_kernels.gather import _use_host


def copy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor, check: bool = True,
         plan: Optional[CopyPlan] = None, backend: str = "auto") -> None:
    """Copy item i: ``lengths[i]`` bytes from raw address ``src_ptrs[i]`` to ``dst_ptrs[i]``.

    Arguments:
        src_ptrs, dst_ptrs, lengths: int64 [n] tensors on the device that runs the copy (its GPU, or the CPU
            for host memory). Addresses on that GPU, a peer GPU with peer access, or pinned host memory.
            Destination ranges must not overlap.
        check, plan, backend: as for ``gather``.
    Raises:
        ValueError naming the argument and value.
    """
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"copy: lengths must be an int64 torch.Tensor, got {type(lengths).__name__}")
    count = _checks.check_index_tensors("copy", lengths.device, src_ptrs=src_ptrs, dst_ptrs=dst_ptrs,
                                        lengths=lengths)
    if check and count:
        src_np, dst_np, len_np = _checks.to_host(src_ptrs, dst_ptrs, lengths)
        _checks.check_lengths("copy", len_np)
        _checks.check_addresses("copy", "src_ptrs", src_np, len_np)
        _checks.check_addresses("copy", "dst_ptrs", dst_np, len_np)
        _checks.check_no_overlap("copy", "dst_ptrs", dst_np, len_np)
        if not peer_access.reachable(lengths.device, [src_np, dst_np], len_np):
            peer_access.staged_copy(src_np, dst_np, len_np, lengths.device)
            return
    if _use_host(backend, lengths):
        host_copy(src_ptrs, dst_ptrs, lengths)
        return
    launch_batched_copy(src_ptrs, dst_ptrs, lengths, 0, 0,
                        plan if plan is not None else _default_plan(lengths, len_np if check and count else None))


def copy_torch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    device = lengths.device
    for src, dst, length in zip(src_ptrs.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        if length:
            raw_view(dst, length, device).copy_(raw_view(src, length, device))
