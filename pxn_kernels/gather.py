"""gather: scattered pieces at raw addresses -> one contiguous uint8 buffer (a relay chunk), one launch."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, _default_plan, launch_batched_copy
from pxn_kernels._memory import host_copy, raw_view


def gather(src_ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, out_offsets: torch.Tensor,
           check: bool = True, plan: Optional[CopyPlan] = None, backend: str = "auto") -> torch.Tensor:
    """Copy item i (``lengths[i]`` bytes at raw address ``src_ptrs[i]``) to ``out[out_offsets[i]:...]``.

    Arguments:
        src_ptrs: int64 [n] source addresses: memory of ``out``'s GPU, of a peer GPU (read over NVLink), or
            pinned host memory (read over PCIe through UVA). Any alignment. A checked call enables peer access
            to the sources' GPUs itself, and copies piece by piece (``cudaMemcpyAsync``, staged by the driver)
            from a GPU that cannot have it; with ``check=False`` the caller must have enabled it
            (``pxn_kernels.peer_access.ensure_peer_access``).
        lengths: int64 [n] bytes per item, >= 0 (0 is a no-op).
        out: contiguous uint8 tensor receiving the pieces.
        out_offsets: int64 [n] byte offsets into ``out``; written ranges must not overlap.
        check: validate every argument first (one host synchronisation). The engine passes False.
        plan: a ``plan_for_lengths`` / ``plan_batched_copy`` result to reuse (same lengths). If None: built from
            the checks' host copy of the lengths when ``check`` (so the grid kernel can be picked), else on the
            device with no host synchronisation (range kernel).
        backend: "auto" (Triton on CUDA, memmove on CPU), "triton" (also on CPU under TRITON_INTERPRET=1),
            or "host" (memmove; CPU tensors only).
    Returns:
        ``out``. On CUDA the copy is enqueued on the current stream (asynchronous).
    Raises:
        ValueError naming the argument and value: wrong dtype / device / shape, mismatched lengths, a negative
        length, an offset range outside ``out`` or overlapping another.
    """
    _checks.check_byte_tensor("gather", "out", out)
    count = _checks.check_index_tensors("gather", out.device, src_ptrs=src_ptrs, lengths=lengths,
                                        out_offsets=out_offsets)
    if check and count:
        src_np, len_np, off_np = _checks.to_host(src_ptrs, lengths, out_offsets)
        _checks.check_lengths("gather", len_np)
        _checks.check_addresses("gather", "src_ptrs", src_np, len_np)
        _checks.check_ranges_in("gather", "out_offsets", off_np, len_np, out.numel(), "out")
        _checks.check_no_overlap("gather", "out_offsets", off_np, len_np)
        if not peer_access.reachable(out.device, [src_np], len_np):
            peer_access.staged_copy(src_np, off_np + out.data_ptr(), len_np, out.device)
            return out
    if _use_host(backend, out):
        base = out.data_ptr()
        host_copy(src_ptrs, [base + int(o) for o in out_offsets.tolist()], lengths)
        return out
    launch_batched_copy(src_ptrs, out_offsets, lengths, 0, out.data_ptr(),
                        plan if plan is not None else _default_plan(lengths, len_np if check and count else None))
    return out


def gather_torch(src_ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                 out_offsets: torch.Tensor) -> torch.Tensor:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    for src, length, offset in zip(src_ptrs.tolist(), lengths.tolist(), out_offsets.tolist()):
        if length:
            out[offset:offset + length].copy_(raw_view(src, length, out.device))
    return out


def _use_host(backend: str, tensor: torch.Tensor) -> bool:
    if backend not in ("auto", "triton", "host"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'host', got {backend!r}")
    if backend == "host" and tensor.device.type != "cpu":
        raise ValueError(f"backend 'host' needs CPU tensors, got a tensor on {tensor.device}")
    return backend == "host" or (backend == "auto" and tensor.device.type == "cpu")
