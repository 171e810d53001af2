"""copy: batched memcpy between raw addresses in one launch (direct and relayed large pieces)."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, _device_checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, relaunch, run_batch
from pxn_kernels._memory import host_copy, raw_view
from pxn_kernels.gather import _use_host


def copy(src_ptrs, dst_ptrs, lengths, check: bool = True, plan: Optional[CopyPlan] = None, backend: str = "auto",
         device: Optional[torch.device] = None) -> None:
    """Copy item i: ``lengths[i]`` bytes from raw address ``src_ptrs[i]`` to ``dst_ptrs[i]``.

    Arguments:
        src_ptrs, dst_ptrs, lengths: int64 [n] tensors on the device that runs the copy (its GPU, or the CPU
            for host memory). Addresses on that GPU, a peer GPU with peer access, or pinned host memory.
            Destination ranges must not overlap. Host arrays (numpy int64 or CPU tensors) with ``device`` a GPU:
            checked on the host and moved to that GPU in one copy.
        check, plan, backend: as for ``gather``.
        device: the GPU that runs the copy when the index arguments are host arrays (default: the device of
            ``lengths``).
    Raises:
        ValueError naming the argument and value.
    """
    if not check and plan is not None and device is None and relaunch(plan, src_ptrs, dst_ptrs, lengths, None, False,
                                                                       backend):
        return
    if device is None:
        if not isinstance(lengths, torch.Tensor):
            raise ValueError(f"copy: lengths must be an int64 torch.Tensor (or pass device=), got "
                             f"{type(lengths).__name__}")
        device = lengths.device
    device = torch.device(device)
    use_host = _use_host(backend, device)
    args = _checks.index_args("copy", device, src_ptrs=src_ptrs, dst_ptrs=dst_ptrs, lengths=lengths)
    stats = None
    on_gpu = _device_checks.check_call(args, device, plan, "src_ptrs", None, "dst_ptrs", None) \
        if check and args.count and not args.on_host else None
    if on_gpu is not None:
        stats, plan = on_gpu
    elif check and args.count:
        src_np, dst_np, len_np = args.host()
        stats = _checks.validate(
            "copy", len_np, [_checks.address("src_ptrs", src_np), _checks.address("dst_ptrs", dst_np)],
            written=("dst_ptrs", dst_np),
            written_tensors=None if args.on_host else (args.values["dst_ptrs"], args.values["lengths"]))
        if not use_host and device.type == "cuda" and not peer_access.reachable(
                device, [src_np, dst_np], len_np, [stats.spans.get("src_ptrs"), stats.spans.get("dst_ptrs")]):
            peer_access.staged_copy(src_np, dst_np, len_np, device)
            return
    if not args.count:
        return
    if use_host:
        host_copy(*args.host())
        return
    run_batch("copy", args, "src_ptrs", "dst_ptrs", 0, 0, device, plan, stats)


def copy_torch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, lengths: torch.Tensor) -> None:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    device = lengths.device
    for src, dst, length in zip(src_ptrs.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        if length:
            raw_view(dst, length, device).copy_(raw_view(src, length, device))
