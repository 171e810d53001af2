"""gather: scattered pieces at raw addresses -> one contiguous uint8 buffer (a relay chunk), one launch."""
from __future__ import annotations

from typing import Optional

import torch

from pxn_kernels import _checks, _device_checks, peer_access
from pxn_kernels._batched_copy import CopyPlan, _batched_copy_kernel, relaunch, run_batch
from pxn_kernels._memory import host_copy, raw_view


def gather(src_ptrs, lengths, out: torch.Tensor, out_offsets, check: bool = True, plan: Optional[CopyPlan] = None,
           backend: str = "auto") -> torch.Tensor:
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
        The three index arguments are either tensors on ``out``'s device, or, for a GPU ``out``, host arrays
        (numpy int64 or CPU tensors): those are checked where they are and moved to the GPU in one copy.
        check: validate every argument first. Device tensors of up to 4096 pieces are checked on their GPU
            (one launch and one host synchronisation, ``_device_checks``); larger ones are read to the host
            and checked there. The engine passes False.
        plan: a ``plan_for_lengths`` / ``plan_batched_copy`` result to reuse (same lengths). If None: built from
            the host lengths when there are any (``check``, or host arrays), so the row and grid kernels can be
            picked; else on the device with no host synchronisation (range kernel).
        backend: "auto" (Triton on CUDA, memmove on CPU), "triton" (also on CPU under TRITON_INTERPRET=1),
            or "host" (memmove; CPU tensors only).
    Returns:
        ``out``. On CUDA the copy is enqueued on the current stream (asynchronous).
    Raises:
        ValueError naming the argument and value: wrong dtype / device / shape, mismatched lengths, a negative
        length, an offset range outside ``out`` or overlapping another; RuntimeError when the "triton" backend
        cannot run here. Nothing is written when an argument is rejected.
    """
    if not check and plan is not None and relaunch(plan, src_ptrs, out_offsets, lengths, out, False, backend):
        return out
    _checks.check_byte_tensor("gather", "out", out)
    device = out.device
    use_host = _use_host(backend, device)
    args = _checks.index_args("gather", device, src_ptrs=src_ptrs, lengths=lengths, out_offsets=out_offsets)
    stats = None
    on_gpu = _device_checks.check_call(args, device, plan, "src_ptrs", None, "out_offsets", out.numel()) \
        if check and args.count and not args.on_host else None
    if on_gpu is not None:
        stats, plan = on_gpu
    elif check and args.count:
        src_np, len_np, off_np = args.host()
        stats = _checks.validate(
            "gather", len_np, [_checks.address("src_ptrs", src_np),
                               _checks.within("out_offsets", off_np, out.numel(), "out")],
            written=("out_offsets", off_np),
            written_tensors=None if args.on_host else (args.values["out_offsets"], args.values["lengths"]))
        # sources on another GPU: peer access first, or piece by piece where the pair cannot have it
        if not use_host and device.type == "cuda" and \
                not peer_access.reachable(device, [src_np], len_np, [stats.spans.get("src_ptrs")]):
            peer_access.staged_copy(src_np, out.data_ptr() + off_np, len_np, device)
            return out
    if not args.count:
        return out
    if use_host:
        src_np, len_np, off_np = args.host()
        host_copy(src_np, out.data_ptr() + off_np, len_np)
        return out
    run_batch("gather", args, "src_ptrs", "out_offsets", 0, out.data_ptr(), device, plan, stats)
    return out


def gather_torch(src_ptrs: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                 out_offsets: torch.Tensor) -> torch.Tensor:
    """Reference: one ``copy_`` per item through tensor views of the raw addresses."""
    for src, length, offset in zip(src_ptrs.tolist(), lengths.tolist(), out_offsets.tolist()):
        if length:
            out[offset:offset + length].copy_(raw_view(src, length, out.device))
    return out


def _use_host(backend: str, device: torch.device) -> bool:
    """Whether the memmove path runs; raises when the requested backend cannot run on ``device``."""
    if backend not in ("auto", "triton", "host"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'host', got {backend!r}")
    if backend == "host" and device.type != "cpu":
        raise ValueError(f"backend 'host' needs CPU tensors, got a tensor on {device}")
    if backend == "triton" and device.type == "cpu":
        _require_interpreter()
    return backend == "host" or (backend == "auto" and device.type == "cpu")


def _require_interpreter() -> None:
    # The kernels were created as interpreted functions only when TRITON_INTERPRET=1 was set at import; a
    # compiled kernel launched on CPU tensors fails deep inside Triton ("0 active drivers").
    if type(_batched_copy_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("backend 'triton' on CPU tensors runs the kernel in Triton's interpreter, which must "
                           "be switched on before pxn_kernels is imported: set TRITON_INTERPRET=1 in the "
                           "environment; or use backend='auto' / 'host' (memmove) for CPU tensors, or pass CUDA "
                           "tensors")
