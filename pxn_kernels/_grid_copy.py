"""A second batched-copy kernel, for batches of large pieces: one program per (segment, piece) of a 2-D grid.

Why a second kernel: the range plan of ``_batched_copy`` lets one launch serve any mix, but every program first
walks a chain of dependent descriptor loads (range bounds -> item -> addresses) before its first data load, and that
kept 78-block batches short of one contiguous ``copy_`` whatever the tile and occupancy. Here program (s, i) copies
bytes ``[s*SEG, (s+1)*SEG)`` of piece i: its three descriptor loads depend only on the program id, so they are
issued together, one memory round trip, and there is no plan at all. The price is a grid as wide as the longest
piece: programs past the end of a shorter piece exit at once, so this kernel is only picked when the pieces are
(nearly) equal in size, which is what sglang's per-layer KV blocks are (``grid_fits``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from pxn_kernels._copy_piece import _copy_segment
from pxn_kernels._launch import CompiledKernel, anchor

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: the piece count


@triton.jit
def _grid_copy_kernel(anchor, src_index, dst_index, lengths, src_base, dst_base,
                      SEG: tl.constexpr, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, SHIFT: tl.constexpr = False):
    # Addresses are int64 offsets from ``anchor`` (16-byte aligned): see _batched_copy for why not int->pointer.
    item = tl.program_id(1)
    begin = tl.program_id(0).to(tl.int64) * SEG
    _copy_segment(anchor, src_index, dst_index, lengths, src_base, dst_base, item, begin, SEG, BLOCK, TAIL_BLOCK,
                  SHIFT)


@dataclass(frozen=True)
class GridSettings:
    """The 2-D grid kernel's shape: bytes per program (``seg_bytes``), per loop iteration (``block_bytes``),
    warps per program, and the longest piece (bytes), which sets the grid's width."""

    seg_bytes: int
    block_bytes: int
    num_warps: int
    max_bytes: int
    shift: bool = False  # unaligned pieces as 8-byte words (see _copy_piece)


def grid_settings(n_items: int, total_bytes: int, max_bytes: int, pol: dict) -> Optional[GridSettings]:
    """The grid kernel's settings for a batch of ``n_items`` pieces of ``total_bytes`` (the longest
    ``max_bytes``) under the launch policy ``pol`` (``pxn_kernels.policy``), or None when the range kernel is the
    better choice: pieces of unequal size (``grid_fits``), or small pieces (mean under the policy's
    ``grid.min_bytes``: a program per 64 B piece loses to a kernel that packs many pieces into one program)."""
    g = pol["grid"]
    if not g["enabled"] or n_items == 0:
        return None
    if total_bytes < n_items * g["min_bytes"] or not grid_fits(n_items, total_bytes, max_bytes):
        return None
    return GridSettings(g["seg_bytes"], g["block_bytes"], g["num_warps"], max_bytes, g["shift"])


def grid_fits(n_items: int, total_bytes: int, max_bytes: int, waste: float = 0.1) -> bool:
    """True when a (segments x pieces) grid wastes at most ``waste`` of its programs on pieces shorter than the
    longest, and the piece count fits gridDim.y."""
    return 0 < n_items <= MAX_GRID_Y and max_bytes * n_items <= (1 + waste) * total_bytes


_KERNEL = CompiledKernel(_grid_copy_kernel, n_tensors=4)


def launch_grid_copy(src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor, src_base: int,
                     dst_base: int, settings: GridSettings) -> None:
    """Enqueue the copy on the current stream of the tensors' device (no checks: callers validate first)."""
    n = lengths.numel()
    if not 0 < n <= MAX_GRID_Y:
        raise ValueError(f"grid copy: {n} pieces; 1..{MAX_GRID_Y} supported")
    a = anchor(lengths.device)
    base = a.data_ptr()
    _KERNEL.launch((a, src_index, dst_index, lengths, src_base - base, dst_base - base),
                   (max(1, -(-settings.max_bytes // settings.seg_bytes)), n),
                   _constexprs(settings.seg_bytes, settings.block_bytes, settings.num_warps, settings.shift))


def _constexprs(seg_bytes: int, block_bytes: int, num_warps: int, shift: bool) -> dict:
    return dict(SEG=seg_bytes, BLOCK=block_bytes, TAIL_BLOCK=1024, SHIFT=shift, num_warps=num_warps)


class GridCopy:
    """``copy`` of pieces i: ``lengths[i]`` bytes from ``src_base + src_index[i]`` to ``dst_base + dst_index[i]``,
    bound to fixed descriptor tensors (int64, on the GPU) and launched on the current stream by ``__call__``.

    Arguments:
        src_index, dst_index, lengths: int64 [n] CUDA tensors (kept alive and read at each launch).
        src_base, dst_base: added to every index (0 for raw addresses).
        max_bytes: the longest piece (bytes): the grid is ceil(max_bytes / seg_bytes) x n.
        seg_bytes: bytes per program (a multiple of block_bytes); block_bytes: bytes per loop iteration;
        num_warps: warps per program.
        anchor_tensor: the 16-byte aligned pointer the offsets are taken from (default: the device's).
        shift: unaligned pieces as 8-byte words assembled from two source words (``_copy_piece``), not bytes.
    """

    def __init__(self, src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor, src_base: int,
                 dst_base: int, max_bytes: int, seg_bytes: int = 32768, block_bytes: int = 32768,
                 num_warps: int = 8, anchor_tensor: Optional[torch.Tensor] = None, shift: bool = False):
        if seg_bytes % block_bytes or block_bytes % 16:
            raise ValueError(f"seg_bytes {seg_bytes} must be a multiple of block_bytes {block_bytes}, itself of 16")
        n = lengths.numel()
        if not 0 < n <= MAX_GRID_Y:
            raise ValueError(f"GridCopy: {n} pieces; 1..{MAX_GRID_Y} supported")
        a = anchor(lengths.device) if anchor_tensor is None else anchor_tensor
        base = a.data_ptr()
        self._keep = (src_index, dst_index, lengths)
        self._call = _KERNEL.bind((a, src_index, dst_index, lengths, src_base - base, dst_base - base),
                                  (max(1, -(-max_bytes // seg_bytes)), n),
                                  _constexprs(seg_bytes, block_bytes, num_warps, shift))

    def __call__(self) -> None:
        """Enqueue the copy on the current stream of the tensors' device."""
        self._call()
