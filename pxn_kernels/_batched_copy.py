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
knows without reading device memory.

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

from pxn_kernels._direct_launch import DirectLauncher

STREAM_ALIGN = 16


@triton.jit
def _batched_copy_kernel(anchor, src_index, dst_index, lengths, pad_ends, bounds, first_item,
                         src_base, dst_base, n_ranges,
                         BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr):
    # Addresses are int64 numbers relative to ``anchor``, a 16-byte aligned uint8 pointer: an int->pointer
    # cast would lose the alignment facts the compiler needs for 16-byte vector accesses, pointer + offset
    # keeps them. ``src_base``/``dst_base`` already have the anchor's address subtracted.
    vec_offs = tl.arange(0, BLOCK)
    byte_offs = tl.arange(0, TAIL_BLOCK)
    # Range r is copied by program r % G in round r // G: the programs resident at one time work on
    # neighbouring ranges, a moving window of memory rather than thousands of far-apart streams.
    for r in range(tl.program_id(0), n_ranges, tl.num_programs(0)):
        lo = tl.load(bounds + r)
        hi = tl.load(bounds + r + 1)
        item = tl.load(first_item + r)
        while lo < hi:
            length = tl.load(lengths + item)
            item_end = tl.load(pad_ends + item)
            item_start = item_end - ((length + 15) & -16)
            begin = lo - item_start  # multiple of 16: program ranges and padded item starts both are
            stop = tl.minimum(tl.minimum(hi, item_end) - item_start, length)  # padding is not copied
            n = stop - begin
            if n > 0:
                src = src_base + tl.load(src_index + item) + begin
                dst = dst_base + tl.load(dst_index + item) + begin
                if ((src | dst) & 15) == 0:
                    body = tl.multiple_of(n & -16, 16)
                    full = body // BLOCK * BLOCK
                    src_vec = anchor + tl.multiple_of(src, 16)
                    dst_vec = anchor + tl.multiple_of(dst, 16)
                    for off in range(0, full, BLOCK):  # whole tiles: no mask to compute
                        if STREAMING:
                            tl.store(dst_vec + off + vec_offs,
                                     tl.load(src_vec + off + vec_offs, eviction_policy="evict_first"),
                                     cache_modifier=".cs")
                        else:
                            tl.store(dst_vec + off + vec_offs, tl.load(src_vec + off + vec_offs))
                    if full < body:
                        mask = vec_offs < body - full
                        tl.store(dst_vec + full + vec_offs, tl.load(src_vec + full + vec_offs, mask=mask),
                                 mask=mask)
                    src = src + body
                    dst = dst + body
                    n = n - body
                for off in range(0, n, TAIL_BLOCK):
                    mask = byte_offs < n - off
                    tl.store(anchor + dst + off + byte_offs, tl.load(anchor + src + off + byte_offs, mask=mask),
                             mask=mask)
            lo = item_end
            item += 1


@dataclass(frozen=True)
class LaunchSettings:
    """Tile size (bytes per loop iteration of one program), warps per program, and the program count."""

    block_bytes: int
    tail_block_bytes: int
    num_warps: int
    programs: int
    streaming: bool = False  # evict-first loads / streaming stores on whole tiles (large pieces)
    rounds: int = 1  # ranges per program: the stream is cut into programs * rounds ranges

    @property
    def ranges(self) -> int:
        return self.programs * self.rounds


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


# Read once: PXN_KERNEL_* let a benchmark sweep the settings without code changes.
# Defaults from the H200 sweeps in benchmarks/NOTES.md. Two regimes: batches of large pieces want big tiles
# and many resident programs (32 KB, 8 warps, 32 programs/SM: 0.94 of copy_ on the 78-block mixes, against
# 0.86 with the small settings); batches of small pieces want little device time per launch (4 KB, 4 warps,
# 8 programs/SM: 2.2 us on the aux batch, against 6.0 us with the large settings).
_BLOCK_BYTES = _env_int("PXN_KERNEL_BLOCK_BYTES", 4096)
_NUM_WARPS = _env_int("PXN_KERNEL_NUM_WARPS", 4)
_PROGRAMS_PER_SM = _env_int("PXN_KERNEL_PROGRAMS_PER_SM", 8)
_LARGE_BLOCK_BYTES = _env_int("PXN_KERNEL_LARGE_BLOCK_BYTES", 32768)
_LARGE_NUM_WARPS = _env_int("PXN_KERNEL_LARGE_NUM_WARPS", 8)
_LARGE_PROGRAMS_PER_SM = _env_int("PXN_KERNEL_LARGE_PROGRAMS_PER_SM", 32)
_LARGE_MEAN_BYTES = _env_int("PXN_KERNEL_LARGE_MEAN_BYTES", 512 << 10)
_MAX_PROGRAMS = _env_int("PXN_KERNEL_MAX_PROGRAMS", 1 << 16)
_STREAMING = bool(_env_int("PXN_KERNEL_STREAMING", 0))
_RANGE_BYTES = _env_int("PXN_KERNEL_RANGE_BYTES", 32 << 10)
_MAX_ROUNDS = _env_int("PXN_KERNEL_MAX_ROUNDS", 16)
_LAUNCHER = os.environ.get("PXN_KERNEL_LAUNCHER", "direct")
_COMPILED = {}


def launch_settings(n_items: int, device: torch.device, total_bytes: Optional[int] = None) -> LaunchSettings:
    """Pick tile size, warps and program count for a batch of ``n_items`` on ``device``.

    Programs: at least ``PROGRAMS_PER_SM`` per multiprocessor so that large blocks keep enough bytes in flight,
    and at least one per item (capped) so that thousands of tiny pieces are copied in parallel rather than a
    few per program in sequence. Under the CPU interpreter each program costs ~0.5 ms, so few are used.
    Rounds: when the caller knows the batch's bytes, it is cut into ranges of about ``RANGE_BYTES`` so that
    resident programs work on neighbouring memory (see the kernel); and a batch whose mean piece is at least
    ``LARGE_MEAN_BYTES`` gets the large-piece tile settings.
    """
    if device.type != "cuda":
        return LaunchSettings(block_bytes=256, tail_block_bytes=16, num_warps=1,
                              programs=max(1, min(n_items, 16)))
    large = bool(total_bytes) and n_items > 0 and total_bytes // n_items >= _LARGE_MEAN_BYTES
    block, warps, per_sm = ((_LARGE_BLOCK_BYTES, _LARGE_NUM_WARPS, _LARGE_PROGRAMS_PER_SM) if large
                            else (_BLOCK_BYTES, _NUM_WARPS, _PROGRAMS_PER_SM))
    floor = per_sm * _multiprocessors(device.index if device.index is not None else 0)
    programs = max(1, min(max(n_items, floor), _MAX_PROGRAMS))
    rounds = 1 if not total_bytes else max(1, min(total_bytes // (programs * _RANGE_BYTES), _MAX_ROUNDS))
    return LaunchSettings(block_bytes=block, tail_block_bytes=1024, num_warps=warps,
                          programs=programs, streaming=_STREAMING, rounds=int(rounds))


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
    """Device tensors describing how the settings' ranges split a batch. Reusable for the same lengths."""

    pad_ends: torch.Tensor  # int64 [n]
    bounds: torch.Tensor  # int64 [ranges + 1]
    first_item: torch.Tensor  # int64 [ranges]
    settings: LaunchSettings


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
    # (r * total) // ranges stays below 2**63 for totals under 2**43 B with 2**20 ranges.
    bounds = (torch.arange(ranges + 1, device=device, dtype=torch.int64) * total // ranges) & -16
    bounds[-1:] = total
    first_item = torch.searchsorted(pad_ends, bounds[:-1], right=True)
    return CopyPlan(pad_ends, bounds, first_item, settings)




def _int_spec(value: int):
    # Mirrors what Triton specialises integer arguments on (width, == 1, divisible by 16).
    return (-(1 << 31) <= value < (1 << 31), value == 1, value % 16 == 0)


def plan_host(lengths: np.ndarray, ranges: int):
    """The same plan as ``plan_batched_copy``, computed with numpy on the host: (pad_ends, bounds, first_item).

    For callers that hold descriptors on the host anyway (the engine, ``pack_chunk``): the plan then travels
    to the device in the same copy as the descriptors instead of costing several small device launches.
    """
    pad_ends = np.cumsum((np.maximum(lengths, 0) + 15) & -16)
    total = int(pad_ends[-1]) if pad_ends.size else 0
    bounds = (np.arange(ranges + 1, dtype=np.int64) * total // ranges) & -16
    bounds[-1] = total
    first_item = np.searchsorted(pad_ends, bounds[:-1], side="right")
    return pad_ends, bounds, first_item


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
        pad_ends, bounds, first_item = plan_host(lengths, ranges)
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
                      STREAMING=settings.streaming, num_warps=settings.num_warps)
    # Triton turns an int argument equal to 1 into a constant and drops its parameter; the direct launcher
    # fills parameters by position, so such a launch goes through Triton's own path.
    if _LAUNCHER != "direct" or lengths.device.type != "cuda" or 1 in args[7:]:
        return None, None, args, constexprs
    key = (lengths.device.index, settings.block_bytes, settings.tail_block_bytes, settings.num_warps,
           settings.streaming, tuple(t.data_ptr() % 16 == 0 for t in args[1:7]),
           tuple(_int_spec(v) for v in args[7:]))
    launcher = _COMPILED.get(key)
    if launcher is None:
        compiled = _batched_copy_kernel.warmup(*args, grid=(settings.programs,), **constexprs)
        launcher = _COMPILED.setdefault(key, DirectLauncher.create(compiled, n_user=len(args)) or False)
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
        if self._launcher is None:
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
