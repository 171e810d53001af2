"""Views of raw addresses as torch tensors, and memory-kind helpers shared by the references and host paths."""
from __future__ import annotations

import ctypes

import torch


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter so ``torch.as_tensor`` can view a raw device address."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "strides": None, "version": 3,
        }


def host_view(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor aliasing ``nbytes`` of host memory at ``addr`` (no copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def raw_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor aliasing ``nbytes`` at ``addr``.

    On CUDA the address may be device memory (any GPU: torch places the view on the owning device) or pinned
    host memory (then a host view is returned, which torch copies with the copy engine).
    """
    if device.type != "cuda" or nbytes == 0:
        return host_view(addr, nbytes)
    try:
        return torch.as_tensor(_CudaArray(addr, nbytes), device=None)
    except (RuntimeError, ValueError, TypeError):
        return host_view(addr, nbytes)


def host_copy(src_addrs, dst_addrs, lengths) -> None:
    """Copy item i: ``lengths[i]`` bytes from host address ``src_addrs[i]`` to ``dst_addrs[i]`` (memmove).

    The CPU path of gather / scatter / copy and the engine's path for host pieces. Arguments are sequences of
    ints (lists, numpy arrays or CPU tensors). No checks: callers validate.
    """
    memmove = ctypes.memmove
    for src, dst, length in zip(_as_list(src_addrs), _as_list(dst_addrs), _as_list(lengths)):
        if length:
            memmove(dst, src, length)


def _as_list(values):
    if isinstance(values, torch.Tensor):
        return values.tolist()
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)
