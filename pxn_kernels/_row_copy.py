"""The row kernel: a batch of pieces that all have the same length, such as rows of a paged KV pool picked at
random (sglang's indexer rows, fp8 MLA token rows, 2 KiB pages).

Why a third kernel: the range kernel walks a chain of dependent descriptor loads (range bounds -> item ->
addresses) before each piece's data, and copies one piece at a time per program; for thousands of 64 B - 8 KiB
rows that chain, not the memory, sets the speed. Here program (r, c) copies bytes ``[c * COLS, (c + 1) * COLS)``
of rows ``r * ROWS .. r * ROWS + ROWS - 1`` as one 2-D tile: the row addresses are one vector load (one memory
round trip, no plan, no search), and every row of the tile is in flight at once.

Persistent programs: with ``programs_per_sm`` set, a grid of that many programs per multiprocessor walks the row
tiles in a grid-stride loop, and each program loads the next tile's row addresses before it copies the current
tile, so that round trip overlaps the copy instead of preceding it. Rows picked at random from a large pool
(every row a miss) gain most.

Vector width: the widest of 16 / 8 / 4 / 2 / 1 bytes that divides the length and every row address of the
tile (both ends), decided per program at run time, so rows whose size is not a multiple of 16 (100 B, 520 B,
1500 B) still move 4- or 8-byte words. The tile is laid out ``[ROWS, COLS / VEC, VEC]`` so that the mask is
constant along the last axis and the compiler can emit one VEC-byte access per thread and row.

Split rows: a tile's width is a power of two, so a 520 B or 576 B row in a 1 KiB tile leaves almost half of the
lanes masked. With ``tail`` set, a row is copied as a head tile of ``cols`` bytes (the largest power of two
below the length) and a tail tile of ``tail`` bytes right after it, so the masked share is that of the tail only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pxn_kernels._launch import CompiledKernel, anchor, multiprocessors

MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: the column tiles of one row


@triton.jit
def _copy_tile(anchor_ptr, src, dst, live, col0, length, COLS: tl.constexpr, VEC: tl.constexpr):
    # src/dst: [ROWS] int64 offsets from the anchor of each row's first byte; VEC divides both and length.
    # ``x // VEC * VEC`` does not change the value: it states the alignment in a form the compiler tracks
    # (a hint on a function parameter would be dropped).
    s = src // VEC * VEC
    d = dst // VEC * VEC
    col = col0 + tl.arange(0, COLS // VEC).to(tl.int64) * VEC
    mask = live[:, None, None] & (col < length)[None, :, None]
    offs = col[None, :, None] + tl.arange(0, VEC)[None, None, :]
    tl.store(anchor_ptr + (d[:, None, None] + offs), tl.load(anchor_ptr + (s[:, None, None] + offs), mask=mask),
             mask=mask)


@triton.jit
def _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS: tl.constexpr, TAIL: tl.constexpr,
                    VEC: tl.constexpr):
    _copy_tile(anchor_ptr, src, dst, live, col0, length, COLS, VEC)
    if TAIL > 0:
        _copy_tile(anchor_ptr, src, dst, live, col0 + COLS, length, TAIL, VEC)


@triton.jit
def _copy_rows(anchor_ptr, src, dst, live, col0, length, COLS: tl.constexpr, TAIL: tl.constexpr):
    # The tile's rows: ``length`` bytes from anchor + src[r] to anchor + dst[r] where ``live[r]``, in the widest
    # vector (<= 16 bytes) dividing every live row's two addresses and the length.
    low = tl.where(live, (src | dst | length) & 15, 0)
    vec = tl.min(tl.where(low == 0, 16, low & -low), axis=0)
    if vec == 16:
        _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, 16)
    elif vec == 8:
        _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, 8)
    elif vec == 4:
        _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, 4)
    elif vec == 2:
        _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, 2)
    else:
        _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, 1)


@triton.jit
def _row_copy_kernel(anchor_ptr, src_index, dst_index, src_base, dst_base, n_rows, length,
                     ROWS: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr, VEC: tl.constexpr = 16,
                     PERSISTENT: tl.constexpr = False, FALLBACK_COLS: tl.constexpr = 64):
    # Row i: ``length`` bytes from anchor + src_base + src_index[i] to anchor + dst_base + dst_index[i]
    # (bases already relative to the anchor). Columns [y * COLS, ...) of the rows.
    col0 = tl.program_id(1).to(tl.int64) * COLS
    if PERSISTENT:
        # Program x copies row tiles x, x + X, x + 2X, ... and requests the next tile's row addresses before
        # this tile's data moves, so their round trip overlaps the copy. VEC (bytes) divides the length. The
        # first loop runs while every tile's addresses are VEC-aligned too; from the first tile that is not, the
        # second loop copies the rest byte-wise, FALLBACK_COLS columns at a time. Any wider byte tile, or a choice
        # of widths there, holds registers that the whole kernel then pays for in occupancy.
        n_tiles = tl.cdiv(n_rows, ROWS)
        step = tl.num_programs(0)
        tile = tl.program_id(0)
        rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < n_rows
        src = src_base + tl.load(src_index + rows, mask=live, other=0)
        dst = dst_base + tl.load(dst_index + rows, mask=live, other=0)
        aligned = tl.max(tl.where(live, (src | dst) & (VEC - 1), 0), axis=0) == 0
        while (tile < n_tiles) & aligned:
            next_tile = tile + step
            next_rows = next_tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
            next_live = next_rows < n_rows
            next_src = src_base + tl.load(src_index + next_rows, mask=next_live, other=0)
            next_dst = dst_base + tl.load(dst_index + next_rows, mask=next_live, other=0)
            _copy_row_tiles(anchor_ptr, src, dst, live, col0, length, COLS, TAIL, VEC)
            tile = next_tile
            live = next_live
            src = next_src
            dst = next_dst
            aligned = tl.max(tl.where(live, (src | dst) & (VEC - 1), 0), axis=0) == 0
        end = tl.minimum(length, col0 + COLS + TAIL)  # this program's columns of every row
        while tile < n_tiles:
            for c in range(0, COLS + TAIL, FALLBACK_COLS):
                _copy_tile(anchor_ptr, src, dst, live, col0 + c, end, FALLBACK_COLS, 1)
            tile = tile + step
            rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
            live = rows < n_rows
            src = src_base + tl.load(src_index + rows, mask=live, other=0)
            dst = dst_base + tl.load(dst_index + rows, mask=live, other=0)
    else:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = rows < n_rows
        src = src_base + tl.load(src_index + rows, mask=live, other=0)
        dst = dst_base + tl.load(dst_index + rows, mask=live, other=0)
        _copy_rows(anchor_ptr, src, dst, live, col0, length, COLS, TAIL)


@dataclass(frozen=True)
class RowSettings:
    """The row kernel's shape for one batch: ``length`` bytes per row, ``rows`` rows and ``cols`` bytes (a power
    of two >= 16) per program, ``num_warps`` warps per program. ``tail`` (bytes; 0, or a power of two >= 16 with
    ``cols < length <= cols + tail``): each program copies whole rows as a ``cols`` head and a ``tail`` tile.
    ``programs_per_sm``: 0 for one program per row tile, else a persistent grid of at most that many programs per
    multiprocessor, each walking tiles in a grid-stride loop."""

    length: int
    rows: int
    cols: int
    num_warps: int
    tail: int = 0
    programs_per_sm: int = 0

    def __post_init__(self):
        for name in ("rows", "cols", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"RowSettings.{name} must be a power of two, got {value}")
        if self.cols < 16:
            raise ValueError(f"RowSettings.cols must be >= 16, got {self.cols}")
        if self.length < 1 or -(-self.length // self.cols) > MAX_GRID_Y:
            raise ValueError(f"RowSettings.length {self.length}: 1 .. {MAX_GRID_Y} x cols ({self.cols}) supported")
        if self.tail and (self.tail < 16 or self.tail & (self.tail - 1)
                          or not self.cols < self.length <= self.cols + self.tail):
            raise ValueError(f"RowSettings.tail {self.tail}: 0, or a power of two >= 16 with cols ({self.cols}) < "
                             f"length ({self.length}) <= cols + tail")
        if self.programs_per_sm < 0:
            raise ValueError(f"RowSettings.programs_per_sm must be >= 0, got {self.programs_per_sm}")

    def grid(self, n_rows: int, multiprocessors: int = 0):
        """(programs along the row tiles, column tiles) for ``n_rows`` rows on a GPU with ``multiprocessors``
        SMs (0: unknown, one program per row tile)."""
        tiles = max(1, -(-n_rows // self.rows))
        if self.programs_per_sm and multiprocessors:
            tiles = min(tiles, self.programs_per_sm * multiprocessors)
        return (tiles, 1 if self.tail else -(-self.length // self.cols))


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def row_settings(length: int, tile_bytes: int, max_cols: int, num_warps: int, split: bool = False,
                 programs_per_sm: int = 0) -> RowSettings:
    """The row kernel's settings for rows of ``length`` bytes: a tile of about ``tile_bytes``, as many whole
    rows as fit (columns: the row rounded up to a power of two, at most ``max_cols``). ``split``: a row that is
    not a power of two and fits ``max_cols`` is copied as a head and a tail tile (``RowSettings.tail``) when that
    masks fewer lanes. ``programs_per_sm``: see ``RowSettings``. Pure: no device access."""
    cols = max(16, min(_pow2_at_least(length), max_cols))
    tail = 0
    if split and 16 < length < cols:
        head = cols // 2
        rest = max(16, _pow2_at_least(length - head))
        if rest < head:
            cols, tail = head, rest
    width = cols + tail
    rows = max(1, _pow2_at_least(tile_bytes // width) if tile_bytes >= width else 1)
    if rows * width > tile_bytes and rows > 1:
        rows //= 2
    return RowSettings(int(length), rows, cols, num_warps, tail, programs_per_sm)


_KERNEL = CompiledKernel(_row_copy_kernel, n_tensors=3)


def _args(src_index, dst_index, src_base, dst_base, n_rows, settings: RowSettings):
    a = anchor(src_index.device)
    base = a.data_ptr()
    return (a, src_index, dst_index, src_base - base, dst_base - base, n_rows, settings.length)


def _grid(settings: RowSettings, n_rows: int, device: torch.device):
    # the CPU interpreter counts as one multiprocessor (its programs run one after the other anyway)
    if not settings.programs_per_sm:
        return settings.grid(n_rows)
    return settings.grid(n_rows, multiprocessors(device.index if device.index is not None else 0)
                         if device.type == "cuda" else 1)


def _constexprs(settings: RowSettings) -> dict:
    out = dict(ROWS=settings.rows, COLS=settings.cols, TAIL=settings.tail, num_warps=settings.num_warps)
    if settings.programs_per_sm:
        length = settings.length
        out.update(PERSISTENT=True, VEC=min(16, length & -length))
    return out


def launch_row_copy(src_index: torch.Tensor, dst_index: torch.Tensor, src_base: int, dst_base: int,
                    settings: RowSettings) -> None:
    """Enqueue the copy of ``src_index.numel()`` rows on the current stream (no checks: callers validate)."""
    n = src_index.numel()
    if n == 0:
        return
    _KERNEL.launch(_args(src_index, dst_index, src_base, dst_base, n, settings),
                   _grid(settings, n, src_index.device), _constexprs(settings))


class RowCopy:
    """The row copy bound to fixed descriptor tensors (int64 [n], kept alive), launched by ``__call__``."""

    def __init__(self, src_index: torch.Tensor, dst_index: torch.Tensor, src_base: int, dst_base: int,
                 settings: RowSettings):
        n = src_index.numel()
        self._keep = (src_index, dst_index)
        self._call = (lambda: None) if n == 0 else _KERNEL.bind(
            _args(src_index, dst_index, src_base, dst_base, n, settings), _grid(settings, n, src_index.device),
            _constexprs(settings))

    def __call__(self) -> None:
        self._call()
