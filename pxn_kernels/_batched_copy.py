"""The one Triton kernel behind gather, scatter, copy and chunk packing: a batched memcpy over raw addresses.

Item i copies ``lengths[i]`` bytes from ``src_base + src_index[i]`` to ``dst_base + dst_index[i]``. gather is
``src_base = 0, dst_base = out`` (``dst_index`` = out offsets), scatter is the mirror, copy has both bases 0,
so one kernel and one plan serve all three and there is a single place to tune.

Work split (the "plan", built on the device with a few torch ops and no host synchronisation): items are laid
end to end in a virtual stream, each padded to 16 bytes; ``pad_ends`` is the inclusive prefix sum of the padded
lengths. The stream is cut into ``G`` equal byte ranges at 16-byte boundaries, one per program, and
``first_item[p]`` is the item holding range p's first byte (a searchsorted). So a program copies a
contiguous slice of the stream whatever the mix: one 8 MB block is shared by hundreds of programs, and
thousands of 64 B pieces are spread a few per program. ``G`` depends only on the item count, which the host
knows without reading device memory. Variants (``LaunchSettings``): ranges of exactly ``range_bytes`` of the
stream instead of equal ones (their count then needs the batch's bytes, known to callers that pass them), one
range per program instead of a persistent loop, and fewer dependent descriptor loads before a range's first
data load (``eager``, ``prefetch``).

Because every range starts at a 16-byte offset inside its item, a piece whose source and destination are both
16-byte aligned is copied with 16-byte vector loads/stores (``tl.multiple_of`` tells the compiler); any other
piece takes a byte-wide path. All address arithmetic is int64.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from pxn_kernels._copy_piece import _copy_piece
from pxn_kernels._direct_launch import DirectLauncher
from pxn_kernels._grid_copy import GridCopy, GridSettings, grid_settings, launch_grid_copy

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
def _batched_copy_kernel(anchor, src_index, dst_index, lengths, pad_ends, bounds, first_item,
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
class LaunchSettings:
    """Tile size (bytes per loop iteration of one program), warps per program, the program count, and how the
    stream is cut into ranges and walked (see the kernel)."""

    block_bytes: int
    tail_block_bytes: int
    num_warps: int
    programs: int
    streaming: bool = False  # evict-first loads / streaming stores on whole tiles (large pieces)
    rounds: int = 1  # ranges per program: the stream is cut into programs * rounds ranges
    # > 0: range r is exactly bytes [r * range_bytes, (r + 1) * range_bytes) of the padded stream (clamped to
    # it; the last range runs to the end), so a range is a whole number of tiles when range_bytes is a
    # multiple of block_bytes. 0: programs * rounds equal ranges cut at 16-byte boundaries.
    range_bytes: int = 0
    persistent: bool = True  # False: one range per program, no loop (rounds must be 1)
    prefetch: int = 0  # persistent loop: 1 loads the next range's bounds early, 2 also its first descriptors
    eager: bool = False  # an item's four descriptors in one round trip, the next item's before the copy
    # > 0: cap on registers per thread (Triton's maxnreg). Uncapped, the kernel takes 54 registers at 4 KB /
    # 4 warps (Triton 3.6, sm_90, offline compile), room for 9 resident programs per SM (36 of 64 warps); 32
    # allows 16 (benchmarks/kernels.py --resources reports registers, spills and 16-byte accesses).
    max_registers: int = 0

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
class Regime:
    """The launch parameters of one kind of batch; ``settings_for`` fits them to a batch's size."""

    block_bytes: int
    num_warps: int
    programs_per_sm: int
    range_bytes: int = 0  # aligned ranges of this size when the batch's bytes are known; 0: equal split
    persistent: bool = True
    prefetch: int = 0
    eager: bool = False
    streaming: bool = False
    tail_block_bytes: int = 1024
    max_registers: int = 0


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def _regime_from_env(prefix: str, block: int, warps: int, per_sm: int) -> Regime:
    return Regime(block_bytes=_env_int(prefix + "BLOCK_BYTES", block),
                  num_warps=_env_int(prefix + "NUM_WARPS", warps),
                  programs_per_sm=_env_int(prefix + "PROGRAMS_PER_SM", per_sm),
                  range_bytes=_env_int(prefix + "ALIGNED_RANGE_BYTES", 0),
                  persistent=bool(_env_int(prefix + "PERSISTENT", 1)),
                  prefetch=_env_int(prefix + "PREFETCH", 0),
                  eager=bool(_env_int(prefix + "EAGER", 0)),
                  max_registers=_env_int(prefix + "MAX_REGISTERS", 0),
                  streaming=bool(_env_int("PXN_KERNEL_STREAMING", 0)))


# Read once: PXN_KERNEL_* let a benchmark sweep the settings without code changes; the PXN_KERNEL_LARGE_*
# forms apply to the large-piece regime. Defaults from the H200 sweeps in benchmarks/NOTES.md. Two regimes:
# batches of large pieces want big tiles and many resident programs (32 KB, 8 warps, 32 programs/SM: 0.94
# of copy_ on the 78-block mixes, against 0.86 with the small settings); batches of small pieces want little
# device time per launch (4 KB, 4 warps, 8 programs/SM: 2.2 us on the aux batch, against 6.0 us with the
# large settings). The range layout, loop shape and register cap (ALIGNED_RANGE_BYTES, PERSISTENT, PREFETCH,
# EAGER, MAX_REGISTERS) default to the equal split, a persistent loop, no prefetch, lazy descriptor loads and
# no cap until an H200 sweep says otherwise (benchmarks/kernels.py --variants).
_SMALL = _regime_from_env("PXN_KERNEL_", 4096, 4, 8)
_LARGE = _regime_from_env("PXN_KERNEL_LARGE_", 32768, 8, 32)
_LARGE_MEAN_BYTES = _env_int("PXN_KERNEL_LARGE_MEAN_BYTES", 512 << 10)
_MAX_PROGRAMS = _env_int("PXN_KERNEL_MAX_PROGRAMS", 1 << 16)
_RANGE_BYTES = _env_int("PXN_KERNEL_RANGE_BYTES", 32 << 10)
_MAX_ROUNDS = _env_int("PXN_KERNEL_MAX_ROUNDS", 16)
_LAUNCHER = os.environ.get("PXN_KERNEL_LAUNCHER", "direct")
_MAX_GRID = (1 << 31) - 1
_COMPILED = {}


def settings_for(regime: Regime, n_items: int, total_bytes: Optional[int], multiprocessors: int) -> LaunchSettings:
    """``regime`` fitted to a batch of ``n_items`` pieces of ``total_bytes`` (None: unknown) on a device with
    ``multiprocessors`` SMs. Pure: no device access (the benchmark builds its variants with it).

    Equal split: ``max(n_items, programs_per_sm x SMs)`` programs (capped), and when the bytes are known, rounds
    of about ``RANGE_BYTES`` per range. Aligned (``regime.range_bytes`` and the bytes known): ranges of exactly
    that size of the padded stream -- counted on its upper bound ``total + 15 n``, so a few trailing ranges may
    be empty -- one program per range, or ``programs_per_sm x SMs`` persistent programs. A batch that would get
    more than ~4 pieces per range on average (many small pieces), or fewer than 4 ranges per SM (a small batch:
    latency, not bandwidth), keeps the equal split, whose ranges follow the item count.
    """
    r = regime
    floor = max(1, r.programs_per_sm * multiprocessors)
    common = dict(block_bytes=r.block_bytes, tail_block_bytes=r.tail_block_bytes, num_warps=r.num_warps,
                  streaming=r.streaming, prefetch=r.prefetch, eager=r.eager, max_registers=r.max_registers)
    if r.range_bytes and total_bytes and n_items > 0:
        ranges = -(-(int(total_bytes) + 15 * n_items) // r.range_bytes)
        if ranges >= max(-(-n_items // 4), 4 * multiprocessors):
            if r.persistent or ranges > _MAX_GRID:
                programs = max(1, min(floor, ranges))
                return LaunchSettings(programs=programs, rounds=-(-ranges // programs), range_bytes=r.range_bytes,
                                      persistent=True, **common)
            return LaunchSettings(programs=ranges, rounds=1, range_bytes=r.range_bytes, persistent=False, **common)
    programs = max(1, min(max(n_items, floor), _MAX_PROGRAMS))
    rounds = 1 if not total_bytes or not r.persistent else \
        max(1, min(total_bytes // (programs * _RANGE_BYTES), _MAX_ROUNDS))
    return LaunchSettings(programs=programs, rounds=int(rounds), persistent=r.persistent, **common)


def launch_settings(n_items: int, device: torch.device, total_bytes: Optional[int] = None) -> LaunchSettings:
    """Pick tile size, warps, program count and range layout for a batch of ``n_items`` on ``device``.

    Programs: at least ``PROGRAMS_PER_SM`` per multiprocessor so that large blocks keep enough bytes in flight,
    and at least one per item (capped) so that thousands of tiny pieces are copied in parallel rather than a
    few per program in sequence. Under the CPU interpreter each program costs ~0.5 ms, so few are used.
    Rounds: when the caller knows the batch's bytes, it is cut into ranges of about ``RANGE_BYTES`` so that
    resident programs work on neighbouring memory (see the kernel); and a batch whose mean piece is at least
    ``LARGE_MEAN_BYTES`` gets the large-piece settings. See ``settings_for``.
    """
    if device.type != "cuda":
        return LaunchSettings(block_bytes=256, tail_block_bytes=16, num_warps=1,
                              programs=max(1, min(n_items, 16)))
    large = bool(total_bytes) and n_items > 0 and total_bytes // n_items >= _LARGE_MEAN_BYTES
    return settings_for(_LARGE if large else _SMALL, n_items, total_bytes,
                        _multiprocessors(device.index if device.index is not None else 0))


_ANCHORS = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """A small 16-byte aligned uint8 tensor per device whose pointer the kernel offsets from."""
    key = str(device)
    anchor = _ANCHORS.get(key)
    if anchor is None:
        anchor = _ANCHORS.setdefault(key, torch.zeros(16, dtype=torch.uint8, device=device))
    return anchor


@dataclass
class CopyPlan:
    """How a batch is split among programs. Reusable for the same lengths.

    Either the range plan (device tensors describing how the settings' ranges split the batch) or, when
    ``grid`` is set, the 2-D grid kernel of ``_grid_copy`` (no tensors: pad_ends/bounds/first_item are None).
    """

    pad_ends: Optional[torch.Tensor]  # int64 [n]
    bounds: Optional[torch.Tensor]  # int64 [ranges + 1]
    first_item: Optional[torch.Tensor]  # int64 [ranges]
    settings: LaunchSettings
    grid: Optional[GridSettings] = None


def plan_batched_copy(lengths: torch.Tensor, settings: Optional[LaunchSettings] = None) -> CopyPlan:
    """Build the work split for ``lengths`` (int64 on the target device) with device-side torch ops only."""
    device = lengths.device
    if settings is None:
        settings = launch_settings(lengths.numel(), device)
    ranges = settings.ranges
    if lengths.numel() == 0:
        zeros = torch.zeros(ranges + 1, dtype=torch.int64, device=device)
        return CopyPlan(zeros[:0], zeros, zeros[:ranges], settings)
    pad_ends = torch.cumsum((lengths.clamp_min(0) + 15) & -16, 0)
    total = pad_ends[-1:]
    r = torch.arange(ranges + 1, device=device, dtype=torch.int64)
    if settings.range_bytes:
        bounds = torch.minimum(r * settings.range_bytes, total)
    else:
        # (r * total) // ranges stays below 2**63 for totals under 2**43 B with 2**20 ranges.
        bounds = (r * total // ranges) & -16
    bounds[-1:] = total
    first_item = torch.searchsorted(pad_ends, bounds[:-1], right=True)
    return CopyPlan(pad_ends, bounds, first_item, settings)




def _int_spec(value: int):
    # Mirrors what Triton specialises integer arguments on (width, == 1, divisible by 16).
    return (-(1 << 31) <= value < (1 << 31), value == 1, value % 16 == 0)


def plan_host(lengths: np.ndarray, ranges: int, range_bytes: int = 0):
    """The same plan as ``plan_batched_copy``, computed with numpy on the host: (pad_ends, bounds, first_item).

    ``ranges`` and ``range_bytes``: the settings' ``ranges`` and ``range_bytes``. For callers that hold
    descriptors on the host anyway (the engine, ``pack_chunk``): the plan then travels to the device in the
    same copy as the descriptors instead of costing several small device launches.
    """
    pad_ends = np.cumsum((np.maximum(lengths, 0) + 15) & -16)
    total = int(pad_ends[-1]) if pad_ends.size else 0
    r = np.arange(ranges + 1, dtype=np.int64)
    bounds = np.minimum(r * range_bytes, total) if range_bytes else (r * total // ranges) & -16
    bounds[-1] = total
    first_item = np.searchsorted(pad_ends, bounds[:-1], side="right")
    return pad_ends, bounds, first_item


def plan_for_lengths(lengths: np.ndarray, device: torch.device) -> CopyPlan:
    """The plan for a batch whose lengths the caller holds on the host: the 2-D grid kernel when the pieces are
    large and of one size (``_grid_copy.grid_settings``), else the range plan, computed here with numpy
    (``plan_host``) and moved to ``device`` in one copy."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.size)
    settings = launch_settings(n, device, int(np.maximum(lengths, 0).sum()))
    grid = grid_settings(lengths)
    if grid is not None:
        return CopyPlan(None, None, None, settings, grid)
    ranges = settings.ranges
    pad_ends, bounds, first_item = plan_host(lengths, ranges, settings.range_bytes)
    words = torch.from_numpy(np.concatenate([pad_ends, bounds, first_item]).astype(np.int64))
    d = words.to(device) if device.type == "cuda" else words
    return CopyPlan(d[:n], d[n:n + ranges + 1], d[n + ranges + 1:], settings)


def _default_plan(lengths: torch.Tensor, host_lengths: Optional[np.ndarray]) -> CopyPlan:
    """The plan the public entries build when none is given: from the host copy of the lengths when the checks
    made one (the grid kernel is then possible), else on the device without a host synchronisation."""
    if host_lengths is not None:
        return plan_for_lengths(host_lengths, lengths.device)
    return plan_batched_copy(lengths)


class DeviceBatch:
    """Descriptors and plan of one batched copy, staged in pinned host memory and moved in one copy.

    Layout of the single int64 buffer: src | dst | lengths | pad_ends (n each) | bounds (R+1) | first_item (R),
    R = the settings' ranges.
    """

    def __init__(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, device: torch.device,
                 settings: Optional[LaunchSettings] = None):
        n = int(lengths.size)
        self.settings = settings or launch_settings(n, device, int(np.maximum(lengths, 0).sum()))
        ranges = self.settings.ranges
        staging = torch.empty(4 * n + 2 * ranges + 1, dtype=torch.int64, pin_memory=device.type == "cuda")
        buf = staging.numpy()
        buf[0:n], buf[n:2 * n], buf[2 * n:3 * n] = src, dst, lengths
        pad_ends, bounds, first_item = plan_host(lengths, ranges, self.settings.range_bytes)
        buf[3 * n:4 * n] = pad_ends
        buf[4 * n:4 * n + ranges + 1] = bounds
        buf[4 * n + ranges + 1:] = first_item
        self.staging = staging
        self.device_buf = staging.to(device, non_blocking=True) if device.type == "cuda" else staging
        d = self.device_buf
        self.src, self.dst, self.lengths = d[0:n], d[n:2 * n], d[2 * n:3 * n]
        self.plan = CopyPlan(d[3 * n:4 * n], d[4 * n:4 * n + ranges + 1], d[4 * n + ranges + 1:], self.settings)


def _resolve(src_index, dst_index, lengths, src_base, dst_base, plan):
    """(launcher, argument values, Triton args, constexprs) for one launch; compiles on first use."""
    settings = plan.settings
    anchor = _anchor(lengths.device)
    anchor_addr = anchor.data_ptr()
    args = (anchor, src_index, dst_index, lengths, plan.pad_ends, plan.bounds, plan.first_item,
            src_base - anchor_addr, dst_base - anchor_addr, settings.ranges)
    constexprs = dict(BLOCK=settings.block_bytes, TAIL_BLOCK=settings.tail_block_bytes,
                      STREAMING=settings.streaming, PERSISTENT=settings.persistent, PREFETCH=settings.prefetch,
                      EAGER=settings.eager, num_warps=settings.num_warps)
    if settings.max_registers:
        constexprs["maxnreg"] = settings.max_registers
    # Triton turns an int argument equal to 1 into a constant and drops its parameter; the direct launcher
    # fills parameters by position, so such a launch goes through Triton's own path.
    if _LAUNCHER != "direct" or lengths.device.type != "cuda" or 1 in args[7:]:
        return None, None, args, constexprs
    key = (lengths.device.index, settings.block_bytes, settings.tail_block_bytes, settings.num_warps,
           settings.streaming, settings.persistent, settings.prefetch, settings.eager, settings.max_registers,
           tuple(t.data_ptr() % 16 == 0 for t in args[1:7]),
           tuple(_int_spec(v) for v in args[7:]))
    launcher = _COMPILED.get(key)
    if launcher is None:
        # compiled and loaded in the context of the device it will run on: a function loaded in another GPU's
        # context fails to launch there (CUDA_ERROR_INVALID_HANDLE)
        with torch.cuda.device(lengths.device):
            compiled = _batched_copy_kernel.warmup(*args, grid=(settings.programs,), **constexprs)
            launcher = _COMPILED.setdefault(key, DirectLauncher.create(compiled, n_user=len(args), device=lengths.device.index) or False)
    values = [t.data_ptr() for t in args[:7]] + list(args[7:])
    return launcher or None, values, args, constexprs


def launch_batched_copy(src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor,
                        src_base: int, dst_base: int, plan: CopyPlan) -> None:
    """Enqueue the copy on the current stream of the tensors' device. No checks: callers validate first.

    On CUDA the compiled kernel is launched through ``DirectLauncher`` (one driver call); Triton's own launch
    path re-derives every argument's specialisation per call and costs ~18 us of host time on the H200 VM,
    twice a whole small ``copy_`` (benchmarks/NOTES.md). ``PXN_KERNEL_LAUNCHER=jit`` restores Triton's path.
    """
    if lengths.numel() == 0:
        return
    if plan.grid is not None:
        launch_grid_copy(src_index, dst_index, lengths, src_base, dst_base, plan.grid)
        return
    launcher, values, args, constexprs = _resolve(src_index, dst_index, lengths, src_base, dst_base, plan)
    if launcher is None:
        _batched_copy_kernel[(plan.settings.programs,)](*args, **constexprs)
        return
    launcher.launch(plan.settings.programs, _current_stream(lengths.device.index), values)


class PreparedCopy:
    """A batched copy bound to fixed descriptor and plan tensors, for callers that launch it many times.

    The relay reuses the same descriptor buffers for every chunk of a slot (it rewrites their contents), so
    everything but the launch itself is done once here. ``graph=True`` captures the launch in a CUDA graph:
    on the H200 VM a graph replay costs ~5 us of host time against ~10 us for a plain kernel launch, and for a
    batch of small pieces host time is the whole cost.

    Arguments: as ``launch_batched_copy``; the tensors must stay alive and at the same addresses.
    """

    def __init__(self, src_index, dst_index, lengths, src_base: int, dst_base: int, plan: CopyPlan,
                 graph: bool = False):
        self._keep = (src_index, dst_index, lengths, plan)
        self._device = lengths.device
        self._programs = plan.settings.programs
        self._grid_copy = None
        if plan.grid is not None:
            g = plan.grid
            self._grid_copy = GridCopy(src_index, dst_index, lengths, src_base, dst_base, g.max_bytes, g.seg_bytes,
                                       g.block_bytes, g.num_warps)
        else:
            self._launcher, self._values, self._args, self._constexprs = _resolve(
                src_index, dst_index, lengths, src_base, dst_base, plan)
        self._graph = None
        if graph and self._device.type == "cuda":
            side = torch.cuda.Stream(self._device)
            side.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(side):
                self._launch()  # first launch outside capture: module load, lazy init
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, stream=side):
                    self._launch()
            torch.cuda.current_stream(self._device).wait_stream(side)

    def _launch(self):
        if self._grid_copy is not None:
            self._grid_copy()
        elif self._launcher is None:
            _batched_copy_kernel[(self._programs,)](*self._args, **self._constexprs)
        else:
            self._launcher.launch(self._programs, _current_stream(self._device.index), self._values)

    def __call__(self) -> None:
        """Enqueue the copy on the current stream."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self._launch()


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)
