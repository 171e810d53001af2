"""Host and device memory helpers shared by the fabrics and the engine's core: views of raw addresses (host
memoryviews, torch tensors over CUDA ranges), one-call device copies, and cached scratch buffers and streams.

Nothing here knows a fabric or a peer; callers have checked the ranges they pass.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from transport.errors import FabricError
from transport.fabric.base import DEVICE_HOST

log = logging.getLogger(__name__)

_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PyBUF_READ, _PyBUF_WRITE = 0x100, 0x200


def raw_view(addr: int, length: int, writable: bool = False) -> memoryview:
    """A memoryview of ``length`` bytes of host memory at ``addr`` (no copy; the caller vouches for the range)."""
    return _PyMemoryView_FromMemory(addr, length, _PyBUF_WRITE if writable else _PyBUF_READ)


class _CudaView:
    """Exposes a raw CUDA address range as ``__cuda_array_interface__`` so torch can wrap it without a copy."""

    def __init__(self, addr: int, length: int):
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def cuda_tensor(addr: int, length: int, device: int):
    """A torch uint8 tensor viewing ``length`` bytes of device memory at ``addr`` (no copy).

    No ``device=`` goes to torch: it finds the owning GPU from the pointer, and a mismatching ``device`` would make
    it *copy* (a write into that copy would be lost). ``device`` only selects the current device meanwhile."""
    import torch
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaView(addr, length))


BIG_GPU_PIECE = 256 << 10
"""Pieces of at least this many bytes get their own cudaMemcpy (copy engine, full bandwidth); smaller ones share
one batched-copy launch, whose cost does not grow with the piece count."""

_batched_copy_fn = None
MEMCPY_MAX = 16  # gpu_batch_copy: up to this many pieces go as one cudaMemcpyAsync each


def gpu_batch_copy(src_ptrs, dst_ptrs, lengths, device: int) -> None:
    """Copy piece i (``lengths[i]`` bytes, device/UVA addresses) on the current stream of ``device``: one
    ``pxn_kernels.copy`` launch (descriptors uploaded in one copy) when that package works here, else one copy per
    piece. Arguments: int64 arrays or sequences; the caller checked the ranges."""
    global _batched_copy_fn
    import torch
    if _batched_copy_fn is None:
        try:
            from pxn_kernels import copy as fn
        except Exception as e:  # noqa: BLE001 — missing package or a Triton that cannot load
            log.info("pxn_kernels.copy unavailable (%s); device pieces are copied one by one", e)
            fn = False
        _batched_copy_fn = fn
    src_ptrs, dst_ptrs, lengths = (np.asarray(v, dtype=np.int64) for v in (src_ptrs, dst_ptrs, lengths))
    # a few pieces: one cudaMemcpyAsync each, less host time in all than the launch with its descriptor upload
    if _batched_copy_fn and lengths.size > MEMCPY_MAX:
        _batched_copy_fn(src_ptrs, dst_ptrs, lengths, check=False, device=torch.device("cuda", device))
        return
    stream = torch.cuda.current_stream(device)
    for s_, d_, n_ in zip(src_ptrs.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        memcpy_async(d_, s_, n_, stream)


_memcpy_rt = None


def memcpy_async(dst: int, src: int, n: int, stream) -> None:
    """``n`` bytes from ``src`` to ``dst`` (device, UVA or pinned host addresses) on the torch ``stream``, via
    ``cudaMemcpyAsync`` from cuda-bindings (a few µs of Python per call, where wrapping both sides as torch
    tensors costs tens); falls back to a torch copy when cuda-bindings is missing."""
    global _memcpy_rt
    if _memcpy_rt is None:
        try:
            from cuda.bindings import runtime as rt
            _memcpy_rt = rt
        except ImportError:
            _memcpy_rt = False
    if _memcpy_rt:
        rt = _memcpy_rt
        err, = rt.cudaMemcpyAsync(dst, src, n, rt.cudaMemcpyKind.cudaMemcpyDefault, stream.cuda_stream)
        if int(err) != 0:
            raise FabricError(f"cudaMemcpyAsync(0x{dst:x} <- 0x{src:x}, {n} B) failed: {err!r}")
        return
    import torch
    with torch.cuda.stream(stream):
        _any_tensor(dst, n).copy_(_any_tensor(src, n), non_blocking=True)


def _any_tensor(addr: int, n: int):
    import torch
    try:
        return cuda_tensor(addr, n, torch.cuda.current_device())
    except Exception:  # noqa: BLE001 — a host (pinned) address: view it on the CPU
        return torch.frombuffer(raw_view(addr, n, writable=True), dtype=torch.uint8)


def pinned_buffer(cache: dict, n: int):
    """A pinned host uint8 tensor of at least ``n`` bytes, reused from ``cache`` (grows by doubling)."""
    import torch
    t = cache.get("pinned")
    if t is None or t.numel() < n:
        size = max(n, 2 * (t.numel() if t is not None else 0), 1 << 20)
        t = cache["pinned"] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return t


def device_scratch(cache: dict, device: int, n: int):
    """A device uint8 tensor of at least ``n`` bytes on ``device``, reused from ``cache``."""
    import torch
    d = cache.setdefault("dev", {})
    t = d.get(device)
    if t is None or t.numel() < n:
        size = max(n, 2 * (t.numel() if t is not None else 0), 1 << 20)
        t = d[device] = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    return t


def cuda_stream(cache: dict, device: int):
    """A torch stream of ``device`` for side copies, one per device, reused from ``cache``."""
    import torch
    d = cache.setdefault("streams", {})
    st = d.get(device)
    if st is None:
        st = d[device] = torch.cuda.Stream(device=device)
    return st


def check_device(device: int) -> None:
    """``ValueError`` unless ``device`` is -1 (host) or a CUDA index; ``FabricError`` for an index this process
    does not see."""
    if not isinstance(device, int) or device < DEVICE_HOST:
        raise ValueError(f"device must be -1 (host) or a CUDA index, got {device!r}")
    if device >= 0:
        try:
            import torch
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            n = 0
        if device >= n:
            raise FabricError(f"cannot register memory on CUDA device {device}: {n} CUDA device(s) visible")
