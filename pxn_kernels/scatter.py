"""scatter: pieces of one contiguous uint8 buffer (a landed chunk) -> raw destination addresses, one launch."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, _device_checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, relaunch, run_batch
from pxn_kernels._memory import host_copy, raw_view
from pxn_kernels.gather import _use_host


def scatter(src: torch.Tensor, src_offsets, dst_ptrs, lengths, check: bool = True, plan: Optional[CopyPlan] = None,
            backend: str = "auto") -> None:
    """Copy ``src[src_offsets[i]:src_offsets[i] + lengths[i]]`` to raw address ``dst_ptrs[i]``.

    Arguments:
        src: contiguous uint8 tensor holding the pieces.
        src_offsets: int64 [n] byte offsets into ``src``.
        dst_ptrs: int64 [n] destination addresses (this GPU, a peer GPU with peer access, or pinned host);
            destination ranges must not overlap (in any order: unordered ones are sorted to check).
        lengths: int64 [n] bytes per item, >= 0.
        check, plan, backend, host arrays: as for ``gather``.
    Raises:
        ValueError naming the argument and value (as ``gather``).
    """
    if not check and plan is not None and relaunch(plan, src_offsets, dst_ptrs, lengths, src, True, backend):
        return
    _checks.check_byte_tensor("scatter", "src", src)
    device = src.device
    use_host = _use_host(backend, device)
    args = _checks.index_args("scatter", device, src_offsets=src_offsets, dst_ptrs=dst_ptrs, lengths=lengths)
    stats = None
    on_gpu = _device_checks.check_call(args, device, plan, "src_offsets", src.numel(), "dst_ptrs", None) \
        if check and args.count and not args.on_host else None
    if on_gpu is not None:
        stats, plan = on_gpu
    elif check and args.count:
        off_np, dst_np, len_np = args.host()
        stats = _checks.validate(
            "scatter", len_np, [_checks.within("src_offsets", off_np, src.numel(), "src"),
                                _checks.address("dst_ptrs", dst_np)],
            written=("dst_ptrs", dst_np),
            written_tensors=None if args.on_host else (args.values["dst_ptrs"], args.values["lengths"]))
        if not use_host and device.type == "cuda" and \
                not peer_access.reachable(device, [dst_np], len_np, [stats.spans.get("dst_ptrs")]):
            peer_access.staged_copy(src.data_ptr() + off_np, dst_np, len_np, device)
            return
    if not args.count:
        return
    if use_host:
        off_np, dst_np, len_np = args.host()
        host_copy(src.data_ptr() + off_np, dst_np, len_np)
        return
    run_batch("scatter", args, "src_offsets", "dst_ptrs", src.data_ptr(), 0, device, plan, stats)


def scatter_torch(src: torch.Tensor, src_offsets: torch.Tensor, dst_ptrs: torch.Tensor,
                  lengths: torch.Tensor) -> None:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    for offset, dst, length in zip(src_offsets.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        if length:
            raw_view(dst, length, src.device).copy_(src[offset:offset + length])
