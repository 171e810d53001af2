"""The segment kernel: one program per segment of at most ``seg_bytes`` of one piece, for mixes of unequal pieces.

Why a fourth kernel: the range kernel cuts the batch into equal byte ranges, so a range inside a run of small
pieces walks them one after the other, each behind its own chain of dependent descriptor loads, while the ranges
inside large pieces stream; the small-piece ranges finish last, on mixes of 64 B - 8 KB pieces with 2 MB blocks
(sglang's aux and indexer pieces beside its KV blocks) well short of one contiguous ``copy_`` of the same bytes.
Here every piece is cut into segments of ``seg_bytes`` (a 64 B piece is one segment, a 2 MB block 128 of 16 KB),
and program p copies segment p: one load of its table entry, then the piece's three descriptors, then the
data. No program walks more than one piece, and the load is balanced to within one segment.

The segment table depends only on the lengths, so it is built once per lengths on the host
(``segment_table``) and cached with the plan; entry p is ``item << 32 | k`` for bytes
``[k * seg_bytes, (k + 1) * seg_bytes)`` of piece ``item``. Pieces of 0 bytes have no segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from pxn_kernels._copy_piece import _copy_segment
from pxn_kernels._launch import CompiledKernel, anchor

MAX_SEGMENTS = (1 << 31) - 1  # CUDA's limit on gridDim.x
MAX_PIECES = 1 << 31  # the table's item field
MAX_SEGMENTS_PER_PIECE = 1 << 32  # the table's segment field


@triton.jit
def _segment_copy_kernel(anchor, src_index, dst_index, lengths, segments, src_base, dst_base,
                         SEG: tl.constexpr, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # Addresses are int64 offsets from ``anchor`` (16-byte aligned): see _batched_copy for why not int->pointer.
    entry = tl.load(segments + tl.program_id(0))
    item = entry >> 32
    begin = (entry & 0xFFFFFFFF) * SEG
    _copy_segment(anchor, src_index, dst_index, lengths, src_base, dst_base, item, begin, SEG, BLOCK, TAIL_BLOCK,
                  SHIFT)


@dataclass(frozen=True)
class SegmentSettings:
    """The segment kernel's shape: bytes per program (``seg_bytes``, a multiple of ``block_bytes``), bytes per loop
    iteration (``block_bytes``, a power of two >= 16), warps per program, and whether pieces whose ends differ in
    alignment move as 8-byte words (``shift``, see ``_copy_piece``) rather than bytes."""

    seg_bytes: int
    block_bytes: int
    num_warps: int
    shift: bool = False

    def __post_init__(self):
        if self.block_bytes < 16 or self.block_bytes & (self.block_bytes - 1):
            raise ValueError(f"SegmentSettings.block_bytes must be a power of two >= 16, got {self.block_bytes}")
        if self.seg_bytes < self.block_bytes or self.seg_bytes % self.block_bytes:
            raise ValueError(f"SegmentSettings.seg_bytes {self.seg_bytes} must be a multiple of block_bytes "
                             f"{self.block_bytes}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"SegmentSettings.num_warps must be a power of two, got {self.num_warps}")


def segment_settings(pol: dict) -> Optional[SegmentSettings]:
    """The segment kernel's settings under the launch policy ``pol`` (``pxn_kernels.policy``), or None when the
    policy leaves it off."""
    s = pol["segment"]
    if not s["enabled"]:
        return None
    return SegmentSettings(s["seg_bytes"], s["block_bytes"], s["num_warps"], s["shift"])


def segment_table(lengths: np.ndarray, seg_bytes: int) -> Optional[np.ndarray]:
    """The segment table of ``lengths`` (bytes, int64): int64 ``item << 32 | k`` per segment, in piece order, or
    None when it does not fit the kernel (more than ``MAX_SEGMENTS`` segments or ``MAX_PIECES`` pieces). Negative
    lengths count as 0 bytes."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size > MAX_PIECES:
        return None
    counts = -(-np.maximum(lengths, 0) // seg_bytes)
    total = int(counts.sum())
    if total > MAX_SEGMENTS or (counts.size and int(counts.max()) > MAX_SEGMENTS_PER_PIECE):
        return None
    items = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    firsts = np.cumsum(counts) - counts
    ks = np.arange(total, dtype=np.int64) - np.repeat(firsts, counts)
    return (items << 32) | ks


_KERNEL = CompiledKernel(_segment_copy_kernel, n_tensors=5)


def _args(src_index, dst_index, lengths, segments, src_base: int, dst_base: int):
    a = anchor(lengths.device)
    base = a.data_ptr()
    return (a, src_index, dst_index, lengths, segments, src_base - base, dst_base - base)


def _constexprs(settings: SegmentSettings) -> dict:
    return dict(SEG=settings.seg_bytes, BLOCK=settings.block_bytes, TAIL_BLOCK=1024, SHIFT=settings.shift,
                num_warps=settings.num_warps)


def launch_segment_copy(src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor,
                        segments: torch.Tensor, src_base: int, dst_base: int, settings: SegmentSettings) -> None:
    """Enqueue the copy on the current stream of the tensors' device (no checks: callers validate first).
    ``segments``: ``segment_table`` of the lengths for ``settings.seg_bytes``, on the device."""
    if segments.numel() == 0:
        return
    _KERNEL.launch(_args(src_index, dst_index, lengths, segments, src_base, dst_base), (segments.numel(), 1),
                   _constexprs(settings))


class SegmentCopy:
    """The segment copy bound to fixed descriptor tensors (int64 [n] on the GPU, kept alive and read at each
    launch) and a segment table, launched on the current stream by ``__call__``."""

    def __init__(self, src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor,
                 segments: torch.Tensor, src_base: int, dst_base: int, settings: SegmentSettings):
        self._keep = (src_index, dst_index, lengths, segments)
        self._call = (lambda: None) if segments.numel() == 0 else _KERNEL.bind(
            _args(src_index, dst_index, lengths, segments, src_base, dst_base), (segments.numel(), 1),
            _constexprs(settings))

    def __call__(self) -> None:
        self._call()
