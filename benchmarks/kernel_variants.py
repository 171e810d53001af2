"""Range-kernel variants measured on the H200 and not used by the library: eager descriptor loads (an item's
four descriptors in one round trip, the next item's before the current copy), descriptor prefetch one or two
ranges ahead in the persistent loop, and a register cap (Triton's ``maxnreg``). The sweeps in NOTES.md did not
make any of them the default; ``benchmarks/kernels.py --variants`` still times them against the library's
kernels, and ``tests/test_kernel_variants.py`` keeps them byte-exact.

The kernel is the library's range kernel (``pxn_kernels._batched_copy``) with those switches; the plan (the
split of the padded stream into ranges) is the library's own (``plan_batched_copy``), which only reads
``ranges`` and ``range_bytes`` of the settings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pxn_kernels._copy_piece import _copy_piece
from pxn_kernels._launch import CompiledKernel, anchor

STREAM_ALIGN = 16


@triton.jit
def _load_item(lengths, pad_ends, src_index, dst_index, item, valid):
    # An item's four descriptors in one round trip; zeros where ``valid`` is false (``item`` may then be the
    # item count: an empty range at the end of the stream).
    return (tl.load(lengths + item, mask=valid, other=0), tl.load(pad_ends + item, mask=valid, other=0),
            tl.load(src_index + item, mask=valid, other=0), tl.load(dst_index + item, mask=valid, other=0))


@triton.jit
def _copy_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr):
    # Bytes [lo, hi) of the stream, starting in ``item``. Three dependent loads per item before its data:
    # lengths/pad_ends, then src/dst indices (only for a piece that copies something).
    while lo < hi:
        length = tl.load(lengths + item)
        item_end = tl.load(pad_ends + item)
        item_start = item_end - ((length + 15) & -16)
        begin = lo - item_start  # multiple of 16: range bounds and padded item starts both are
        stop = tl.minimum(tl.minimum(hi, item_end) - item_start, length)  # padding is not copied
        n = stop - begin
        if n > 0:
            _copy_piece(anchor, src_base, tl.load(src_index + item), dst_base, tl.load(dst_index + item), begin, n,
                        BLOCK, TAIL_BLOCK, STREAMING)
        lo = item_end
        item += 1


@triton.jit
def _copy_range_eager(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                      length, item_end, src_i, dst_i,
                      BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr):
    # As _copy_range, with the four descriptors of ``item`` already loaded by the caller (all four in one
    # round trip), and the next item's descriptors loaded before the current piece is copied, so that their
    # latency overlaps the copy. Every load is masked by "that item is in the range": ``item`` may be the
    # item count (an empty range at the end of the stream).
    while lo < hi:
        nxt = item + 1
        more = item_end < hi
        next_length, next_end, next_src, next_dst = _load_item(lengths, pad_ends, src_index, dst_index, nxt, more)
        item_start = item_end - ((length + 15) & -16)
        begin = lo - item_start
        stop = tl.minimum(tl.minimum(hi, item_end) - item_start, length)
        n = stop - begin
        if n > 0:
            _copy_piece(anchor, src_base, src_i, dst_base, dst_i, begin, n, BLOCK, TAIL_BLOCK, STREAMING)
        lo = item_end
        item = nxt
        length = next_length
        item_end = next_end
        src_i = next_src
        dst_i = next_dst


@triton.jit
def _copy_one_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                    BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr, EAGER: tl.constexpr):
    # Range [lo, hi) from ``item`` on: EAGER loads the first item's four descriptors in one round trip here.
    if EAGER:
        length, item_end, src_i, dst_i = _load_item(lengths, pad_ends, src_index, dst_index, item, lo < hi)
        _copy_range_eager(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base,
                          lo, hi, item, length, item_end, src_i, dst_i, BLOCK, TAIL_BLOCK, STREAMING)
    else:
        _copy_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base,
                    lo, hi, item, BLOCK, TAIL_BLOCK, STREAMING)


@triton.jit
def _variant_kernel(anchor, src_index, dst_index, lengths, pad_ends, bounds, first_item,
                         src_base, dst_base, n_ranges,
                         BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr,
                         PERSISTENT: tl.constexpr = True, PREFETCH: tl.constexpr = 0,
                         EAGER: tl.constexpr = False):
    # Addresses are int64 numbers relative to ``anchor``, a 16-byte aligned uint8 pointer: an int->pointer
    # cast would lose the alignment facts the compiler needs for 16-byte vector accesses, pointer + offset
    # keeps them. ``src_base``/``dst_base`` already have the anchor's address subtracted.
    #
    # PERSISTENT: range r is copied by program r % G in round r // G: the programs resident at one time work
    # on neighbouring ranges, a moving window of memory rather than thousands of far-apart streams. Otherwise
    # the grid has one program per range (the plain-copy shape: many short programs, no loop).
    # EAGER: an item's four descriptors are loaded in one round trip (see _copy_range_eager).
    # PREFETCH (persistent only): 1 loads range r + G's bounds and first item before range r is copied; 2 also
    # loads the descriptors of that first item one round earlier (needs EAGER), so that a round's first data
    # load waits for no descriptor load at all.
    if PERSISTENT:
        nprog = tl.num_programs(0)
        last = n_ranges - 1
        if PREFETCH == 0:
            for r in range(tl.program_id(0), n_ranges, nprog):
                lo = tl.load(bounds + r)
                hi = tl.load(bounds + r + 1)
                item = tl.load(first_item + r)
                _copy_one_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                                BLOCK, TAIL_BLOCK, STREAMING, EAGER)
        elif PREFETCH == 1:
            # Indices past the last range are clamped to it: those loads are valid and their values unused.
            r0 = tl.minimum(tl.program_id(0), last)
            lo = tl.load(bounds + r0)
            hi = tl.load(bounds + r0 + 1)
            item = tl.load(first_item + r0)
            for r in range(tl.program_id(0), n_ranges, nprog):
                rn = tl.minimum(r + nprog, last)
                next_lo = tl.load(bounds + rn)
                next_hi = tl.load(bounds + rn + 1)
                next_item = tl.load(first_item + rn)
                _copy_one_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                                BLOCK, TAIL_BLOCK, STREAMING, EAGER)
                lo = next_lo
                hi = next_hi
                item = next_item
        else:
            tl.static_assert(EAGER, "PREFETCH=2 needs EAGER")
            r0 = tl.minimum(tl.program_id(0), last)
            lo = tl.load(bounds + r0)
            hi = tl.load(bounds + r0 + 1)
            item = tl.load(first_item + r0)
            r1 = tl.minimum(tl.program_id(0) + nprog, last)
            lo1 = tl.load(bounds + r1)
            hi1 = tl.load(bounds + r1 + 1)
            item1 = tl.load(first_item + r1)
            length, item_end, src_i, dst_i = _load_item(lengths, pad_ends, src_index, dst_index, item, lo < hi)
            for r in range(tl.program_id(0), n_ranges, nprog):
                r2 = tl.minimum(r + 2 * nprog, last)
                lo2 = tl.load(bounds + r2)
                hi2 = tl.load(bounds + r2 + 1)
                item2 = tl.load(first_item + r2)
                length1, item_end1, src_i1, dst_i1 = _load_item(lengths, pad_ends, src_index, dst_index, item1,
                                                                lo1 < hi1)
                _copy_range_eager(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base,
                                  lo, hi, item, length, item_end, src_i, dst_i, BLOCK, TAIL_BLOCK, STREAMING)
                lo = lo1
                hi = hi1
                item = item1
                length = length1
                item_end = item_end1
                src_i = src_i1
                dst_i = dst_i1
                lo1 = lo2
                hi1 = hi2
                item1 = item2
    else:
        r = tl.program_id(0)
        if r < n_ranges:
            lo = tl.load(bounds + r)
            hi = tl.load(bounds + r + 1)
            item = tl.load(first_item + r)
            _copy_one_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                            BLOCK, TAIL_BLOCK, STREAMING, EAGER)



@dataclass(frozen=True)
class VariantSettings:
    """The library's ``LaunchSettings`` plus the variant switches (see the module doc)."""

    block_bytes: int
    tail_block_bytes: int
    num_warps: int
    programs: int
    streaming: bool = False
    rounds: int = 1
    range_bytes: int = 0
    persistent: bool = True
    prefetch: int = 0  # persistent loop: 1 loads the next range's bounds early, 2 also its first descriptors
    eager: bool = False  # an item's four descriptors in one round trip, the next item's before the copy
    max_registers: int = 0  # > 0: registers per thread cap (maxnreg)

    def __post_init__(self):
        if not self.persistent and self.rounds != 1:
            raise ValueError(f"non-persistent launch settings need rounds == 1, got {self.rounds}")
        if self.prefetch not in (0, 1, 2) or (self.prefetch == 2 and not self.eager):
            raise ValueError(f"prefetch must be 0, 1 or 2 (2 needs eager), got {self.prefetch}")
        if self.range_bytes < 0 or self.range_bytes % STREAM_ALIGN:
            raise ValueError(f"range_bytes must be a non-negative multiple of 16, got {self.range_bytes}")

    @property
    def ranges(self) -> int:
        return self.programs * self.rounds


@dataclass(frozen=True)
class VariantRegime:
    """A ``Regime`` of the library plus the variant switches; ``variant_settings`` fits it to a batch."""

    block_bytes: int
    num_warps: int
    programs_per_sm: int
    range_bytes: int = 0
    persistent: bool = True
    prefetch: int = 0
    eager: bool = False
    streaming: bool = False
    tail_block_bytes: int = 1024
    max_registers: int = 0


def variant_settings(regime: VariantRegime, n_items: int, total_bytes, multiprocessors: int) -> VariantSettings:
    """``regime`` fitted to a batch, by the library's own rule (``settings_for``), switches carried over."""
    from pxn_kernels._batched_copy import Regime, settings_for
    base = settings_for(Regime(regime.block_bytes, regime.num_warps, regime.programs_per_sm, regime.range_bytes,
                               regime.persistent, regime.streaming, regime.tail_block_bytes),
                        n_items, total_bytes, multiprocessors)
    return VariantSettings(base.block_bytes, base.tail_block_bytes, base.num_warps, base.programs, base.streaming,
                           base.rounds, base.range_bytes, base.persistent, regime.prefetch, regime.eager,
                           regime.max_registers)


_KERNEL = CompiledKernel(_variant_kernel, n_tensors=7)


class VariantCopy:
    """One variant launch bound to fixed descriptor tensors and a plan (``plan_batched_copy(lengths, settings)``);
    ``graph=True`` captures it in a CUDA graph, as ``PreparedCopy`` does."""

    def __init__(self, src_index, dst_index, lengths, src_base: int, dst_base: int, plan, graph: bool = False):
        settings = plan.settings
        a = anchor(lengths.device)
        base = a.data_ptr()
        args = (a, src_index, dst_index, lengths, plan.pad_ends, plan.bounds, plan.first_item,
                src_base - base, dst_base - base, settings.ranges)
        constexprs = dict(BLOCK=settings.block_bytes, TAIL_BLOCK=settings.tail_block_bytes,
                          STREAMING=settings.streaming, PERSISTENT=settings.persistent, PREFETCH=settings.prefetch,
                          EAGER=settings.eager, num_warps=settings.num_warps)
        if settings.max_registers:
            constexprs["maxnreg"] = settings.max_registers
        self._keep = (src_index, dst_index, lengths, plan)
        self._launch = (lambda: None) if lengths.numel() == 0 else _KERNEL.bind(args, (settings.programs, 1),
                                                                               constexprs)
        self._graph = None
        device = lengths.device
        if graph and device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._launch()
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=side):
                    self._launch()
            torch.cuda.current_stream(device).wait_stream(side)

    def __call__(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._launch()
