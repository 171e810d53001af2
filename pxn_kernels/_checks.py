"""Argument validation shared by gather, scatter and copy.

Checks read the descriptors back to the host once (one synchronisation), so they are on by default for users
and switched off (``check=False``) by the engine, which builds its descriptors itself.
"""
from __future__ import annotations

import numpy as np
import torch

_INT64_MAX = (1 << 63) - 1


def check_byte_tensor(op: str, name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{op}: {name} must be uint8, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()})")


def check_index_tensors(op: str, device: torch.device, **tensors) -> int:
    """All int64, 1-D, on ``device``, same length. Returns that length."""
    count = None
    first_name = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{op}: {name} must be an int64 torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.int64:
            raise ValueError(f"{op}: {name} must be int64, got {tensor.dtype}")
        if tensor.dim() != 1:
            raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(tensor.shape)}")
        if tensor.device != device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device}")
        if count is None:
            count, first_name = tensor.numel(), name
        elif tensor.numel() != count:
            raise ValueError(f"{op}: {name} has {tensor.numel()} items but {first_name} has {count}")
    return count


def to_host(*tensors):
    """Copy several device tensors to host numpy arrays with one synchronisation."""
    if not tensors or tensors[0].numel() == 0:
        return [np.zeros(0, dtype=np.int64) for _ in tensors]
    stacked = torch.stack(tensors).cpu().numpy()
    return list(stacked)


def check_lengths(op: str, lengths: np.ndarray) -> None:
    negative = np.nonzero(lengths < 0)[0]
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"{op}: lengths[{i}] = {int(lengths[i])} is negative")


def check_addresses(op: str, name: str, addrs: np.ndarray, lengths: np.ndarray) -> None:
    """Raw addresses of non-empty items must be positive and not overflow."""
    live = lengths > 0
    bad = np.nonzero(live & (addrs <= 0))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(addrs[i])} is not a valid address (lengths[{i}] = "
                         f"{int(lengths[i])})")
    bad = np.nonzero(live & (addrs > _INT64_MAX - lengths))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = 0x{int(addrs[i]):x} + {int(lengths[i])} overflows")


def check_ranges_in(op: str, name: str, offsets: np.ndarray, lengths: np.ndarray, limit: int,
                    limit_name: str) -> None:
    """Offsets of non-empty items must satisfy ``0 <= offset`` and ``offset + length <= limit``."""
    live = lengths > 0
    bad = np.nonzero(live & (offsets < 0))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(offsets[i])} is negative")
    bad = np.nonzero(live & (offsets > limit - lengths))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{op}: {name}[{i}] = {int(offsets[i])} + lengths[{i}] = {int(lengths[i])} runs past "
                         f"{limit_name} ({limit} bytes)")


def check_no_overlap(op: str, name: str, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Written ranges must not overlap (the result would depend on the order programs run in)."""
    live = np.nonzero(lengths > 0)[0]
    if live.size < 2:
        return
    order = live[np.argsort(starts[live], kind="stable")]
    ends = starts[order] + lengths[order]
    clash = np.nonzero(ends[:-1] > starts[order][1:])[0]
    if clash.size:
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise ValueError(f"{op}: {name}[{a}] = {int(starts[a])} (length {int(lengths[a])}) overlaps "
                         f"{name}[{b}] = {int(starts[b])} (length {int(lengths[b])})")
