"""A second batched-copy kernel, for batches of large pieces: one program per (segment, piece) of a 2-D grid.

Why a second kernel: the range plan of ``_batched_copy`` lets one launch serve any mix, but every program first
walks a chain of dependent descriptor loads (range bounds -> item -> addresses) before its first data load, and
on the H200 that capped 78-block batches at 0.93-0.95 of one contiguous ``copy_`` whatever the tile and
occupancy (benchmarks/NOTES.md, kernel sweep of call 2). Here program (s, i) copies bytes ``[s*SEG, (s+1)*SEG)``
of piece i: its three descriptor loads depend only on the program id, so they are issued together, one memory
round trip, and there is no plan at all. The price is a grid as wide as the longest piece: programs past the end
of a shorter piece exit at once, so this kernel is only picked when the pieces are (nearly) equal in size, which
is what sglang's per-layer KV blocks are (``grid_fits``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from pxn_kernels._copy_piece import _copy_piece
from pxn_kernels._direct_launch import DirectLauncher

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: the piece count


@triton.jit
def _grid_copy_kernel(anchor, src_index, dst_index, lengths, src_base, dst_base,
                      SEG: tl.constexpr, BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    # Addresses are int64 offsets from ``anchor`` (16-byte aligned): see _batched_copy for why not int->pointer.
    item = tl.program_id(1)
    begin = tl.program_id(0).to(tl.int64) * SEG
    # all three descriptor loads depend on the program id only: one round trip before the data
    length = tl.load(lengths + item)
    src_i = tl.load(src_index + item)
    dst_i = tl.load(dst_index + item)
    n = tl.minimum(length - begin, SEG)
    if n > 0:
        _copy_piece(anchor, src_base, src_i, dst_base, dst_i, begin, n, BLOCK, TAIL_BLOCK, False)


@dataclass(frozen=True)
class GridSettings:
    """The 2-D grid kernel's shape: bytes per program (``seg_bytes``), per loop iteration (``block_bytes``),
    warps per program, and the longest piece (bytes), which sets the grid's width."""

    seg_bytes: int
    block_bytes: int
    num_warps: int
    max_bytes: int


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


# Read once. Defaults from the H200 sweeps of calls 3 and 4 (benchmarks/NOTES.md): 4 KB programs took the
# 78-block mixes to 0.98 of copy_ (range kernel 0.93); with 2 warps (32 programs resident per SM) also the best
# on 8 KB and 64 KB pieces (0.945 / 0.949, range kernel 0.79 / 0.88).
_GRID = bool(_env_int("PXN_KERNEL_GRID", 1))
_GRID_MIN_MEAN_BYTES = _env_int("PXN_KERNEL_GRID_MIN_MEAN_BYTES", 4096)
_GRID_SEG_BYTES = _env_int("PXN_KERNEL_GRID_SEG_BYTES", 4096)
_GRID_NUM_WARPS = _env_int("PXN_KERNEL_GRID_NUM_WARPS", 2)


def grid_settings(lengths: np.ndarray) -> Optional[GridSettings]:
    """The grid kernel's settings for a batch with these (host) lengths, or None when the range kernel is the
    better choice: pieces of unequal size (``grid_fits``), or small pieces (mean under
    ``PXN_KERNEL_GRID_MIN_MEAN_BYTES``: a program per 64 B piece loses to the range kernel, which packs many
    pieces into one program). ``PXN_KERNEL_GRID=0`` turns the grid kernel off."""
    n = int(lengths.size)
    if not _GRID or n == 0:
        return None
    total, longest = int(lengths.sum()), int(lengths.max())
    if total < n * _GRID_MIN_MEAN_BYTES or not grid_fits(n, total, longest):
        return None
    return GridSettings(_GRID_SEG_BYTES, _GRID_SEG_BYTES, _GRID_NUM_WARPS, longest)


def grid_fits(n_items: int, total_bytes: int, max_bytes: int, waste: float = 0.1) -> bool:
    """True when a (segments x pieces) grid wastes at most ``waste`` of its programs on pieces shorter than the
    longest, and the piece count fits gridDim.y."""
    return 0 < n_items <= MAX_GRID_Y and max_bytes * n_items <= (1 + waste) * total_bytes


_COMPILED = {}


def _launcher(args, grid, constexprs, device_index: int):
    """A DirectLauncher for this argument specialisation (compiled once), or None for Triton's own launch."""
    key = (device_index, tuple(sorted(constexprs.items())), tuple(t.data_ptr() % 16 == 0 for t in args[:4]),
           tuple((-(1 << 31) <= v < (1 << 31), v % 16 == 0) for v in args[4:]))
    launcher = _COMPILED.get(key)
    if launcher is None:
        # compiled and loaded in the context of the device it will run on (see _batched_copy._launcher)
        with torch.cuda.device(device_index):
            compiled = _grid_copy_kernel.warmup(*args, grid=grid, **constexprs)
            launcher = _COMPILED.setdefault(key, DirectLauncher.create(compiled, n_user=len(args), device=device_index) or False)
    return launcher or None


def launch_grid_copy(src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor, src_base: int,
                     dst_base: int, settings: GridSettings) -> None:
    """Enqueue the copy on the current stream of the tensors' device (no checks: callers validate first)."""
    GridCopy(src_index, dst_index, lengths, src_base, dst_base, settings.max_bytes, settings.seg_bytes,
             settings.block_bytes, settings.num_warps)()


class GridCopy:
    """``copy`` of pieces i: ``lengths[i]`` bytes from ``src_base + src_index[i]`` to ``dst_base + dst_index[i]``,
    bound to fixed descriptor tensors (int64, on the GPU) and launched on the current stream by ``__call__``.

    Arguments:
        src_index, dst_index, lengths: int64 [n] CUDA tensors (kept alive and read at each launch).
        src_base, dst_base: added to every index (0 for raw addresses).
        max_bytes: the longest piece (bytes): the grid is ceil(max_bytes / seg_bytes) x n.
        seg_bytes: bytes per program (a multiple of block_bytes); block_bytes: bytes per loop iteration;
        num_warps: warps per program.
    """

    def __init__(self, src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor, src_base: int,
                 dst_base: int, max_bytes: int, seg_bytes: int = 32768, block_bytes: int = 32768,
                 num_warps: int = 8, anchor: Optional[torch.Tensor] = None):
        if seg_bytes % block_bytes or block_bytes % 16:
            raise ValueError(f"seg_bytes {seg_bytes} must be a multiple of block_bytes {block_bytes}, itself of 16")
        n = lengths.numel()
        if not 0 < n <= MAX_GRID_Y:
            raise ValueError(f"GridCopy: {n} pieces; 1..{MAX_GRID_Y} supported")
        from pxn_kernels._batched_copy import _anchor
        self._anchor = _anchor(lengths.device) if anchor is None else anchor
        a = self._anchor.data_ptr()
        self._keep = (src_index, dst_index, lengths)
        self._device = lengths.device
        self._grid = (max(1, -(-max_bytes // seg_bytes)), n)
        self._args = (self._anchor, src_index, dst_index, lengths, src_base - a, dst_base - a)
        self._constexprs = dict(SEG=seg_bytes, BLOCK=block_bytes, TAIL_BLOCK=1024, num_warps=num_warps)
        self._launcher = None
        # Triton turns an int argument equal to 1 into a constant (dropping its parameter), which the
        # positional direct launcher cannot fill: such launches take Triton's own path.
        if lengths.device.type == "cuda" and 1 not in self._args[4:]:
            self._launcher = _launcher(self._args, self._grid, self._constexprs, lengths.device.index)
        self._values = [t.data_ptr() for t in self._args[:4]] + list(self._args[4:])

    def __call__(self) -> None:
        """Enqueue the copy on the current stream of the tensors' device."""
        if self._launcher is None:
            _grid_copy_kernel[self._grid](*self._args, **self._constexprs)
        else:
            self._launcher.launch(self._grid[0], torch._C._cuda_getCurrentRawStream(self._device.index),
                                  self._values, grid_y=self._grid[1])
