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
knows without reading device memory. Options (``LaunchSettings``): ranges of exactly ``range_bytes`` of the
stream instead of equal ones (their count then needs the batch's bytes, known to callers that pass them), and
one range per program instead of a persistent loop. Descriptor-prefetching variants and a register cap were
measured and are not used by default: they live in ``benchmarks/kernel_variants.py``.

Because every range starts at a 16-byte offset inside its item, a piece whose source and destination are both
16-byte aligned is copied with 16-byte vector loads/stores (``tl.multiple_of`` tells the compiler); any other
piece takes a byte-wide path, or with ``shift`` 8-byte words (``_copy_piece``). All address arithmetic is int64.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from pxn_kernels import _staging, policy as kernel_policy
from pxn_kernels._copy_piece import _copy_piece
from pxn_kernels._grid_copy import GridCopy, GridSettings, grid_settings, launch_grid_copy
from pxn_kernels._launch import CompiledKernel, anchor
from pxn_kernels._launch import multiprocessors as _multiprocessors
from pxn_kernels._row_copy import MAX_GRID_Y, RowCopy, RowSettings, launch_row_copy, row_settings
from pxn_kernels._segment_copy import (SegmentCopy, SegmentSettings, launch_segment_copy, segment_settings,
                                       segment_table)

STREAM_ALIGN = 16


@triton.jit
def _copy_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, lo, hi, item,
                BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr, SHIFT: tl.constexpr):
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
                        BLOCK, TAIL_BLOCK, STREAMING, SHIFT)
        lo = item_end
        item += 1


@triton.jit
def _batched_copy_kernel(anchor, src_index, dst_index, lengths, pad_ends, bounds, first_item,
                         src_base, dst_base, n_ranges,
                         BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, STREAMING: tl.constexpr,
                         PERSISTENT: tl.constexpr = True, SHIFT: tl.constexpr = False):
    # Addresses are int64 numbers relative to ``anchor``, a 16-byte aligned uint8 pointer: an int->pointer
    # cast would lose the alignment facts the compiler needs for 16-byte vector accesses, pointer + offset
    # keeps them. ``src_base``/``dst_base`` already have the anchor's address subtracted.
    #
    # PERSISTENT: range r is copied by program r % G in round r // G: the programs resident at one time work
    # on neighbouring ranges, a moving window of memory rather than thousands of far-apart streams. Otherwise
    # the grid has one program per range (the plain-copy shape: many short programs, no loop).
    # SHIFT: pieces whose two ends differ in alignment move as 8-byte words (see _copy_piece), not bytes.
    if PERSISTENT:
        for r in range(tl.program_id(0), n_ranges, tl.num_programs(0)):
            _copy_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, tl.load(bounds + r),
                        tl.load(bounds + r + 1), tl.load(first_item + r), BLOCK, TAIL_BLOCK, STREAMING, SHIFT)
    else:
        r = tl.program_id(0)
        if r < n_ranges:
            _copy_range(anchor, src_index, dst_index, lengths, pad_ends, src_base, dst_base, tl.load(bounds + r),
                        tl.load(bounds + r + 1), tl.load(first_item + r), BLOCK, TAIL_BLOCK, STREAMING, SHIFT)


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
    shift: bool = False  # unaligned pieces as 8-byte words assembled from two source words (else bytes)

    def __post_init__(self):
        if not self.persistent and self.rounds != 1:
            raise ValueError(f"non-persistent launch settings need rounds == 1, got {self.rounds}")
        if self.range_bytes < 0 or self.range_bytes % STREAM_ALIGN:
            raise ValueError(f"range_bytes must be a non-negative multiple of 16, got {self.range_bytes}")
        if self.block_bytes < 16 or self.block_bytes & (self.block_bytes - 1):
            raise ValueError(f"block_bytes must be a power of two >= 16, got {self.block_bytes}")

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
    streaming: bool = False
    tail_block_bytes: int = 1024
    shift: bool = False


def regime_of(entry: dict) -> Regime:
    """A ``Regime`` from a policy entry (``policy.policy(device)["range_small"]`` or ``["range_large"]``)."""
    return Regime(block_bytes=entry["block_bytes"], num_warps=entry["num_warps"],
                  programs_per_sm=entry["programs_per_sm"], range_bytes=entry["range_bytes"],
                  persistent=entry["persistent"], streaming=entry["streaming"],
                  tail_block_bytes=entry["tail_block_bytes"], shift=entry["shift"])


_MAX_GRID = (1 << 31) - 1


def settings_for(regime: Regime, n_items: int, total_bytes: Optional[int], multiprocessors: int,
                 pol: Optional[dict] = None) -> LaunchSettings:
    """``regime`` fitted to a batch of ``n_items`` pieces of ``total_bytes`` (None: unknown) on a device with
    ``multiprocessors`` SMs, under the policy ``pol`` (default: the built-in table). Pure: no device access (the
    benchmark builds its variants with it).

    Equal split: ``max(n_items, programs_per_sm x SMs)`` programs (capped at the policy's ``max_programs``), and
    when the bytes are known, rounds of about ``rounds_bytes`` per range. Aligned (``regime.range_bytes`` and the
    bytes known): ranges of exactly that size of the padded stream -- counted on its upper bound
    ``total + 15 n``, so a few trailing ranges may be empty -- one program per range, or ``programs_per_sm x SMs``
    persistent programs. A batch that would get more than ~4 pieces per range on average (many small pieces),
    or fewer than 4 ranges per SM (a small batch: latency, not bandwidth), keeps the equal split, whose ranges
    follow the item count.
    """
    pol = pol or kernel_policy.DEFAULT
    r = regime
    floor = max(1, r.programs_per_sm * multiprocessors)
    common = dict(block_bytes=r.block_bytes, tail_block_bytes=r.tail_block_bytes, num_warps=r.num_warps,
                  streaming=r.streaming, shift=r.shift)
    if r.range_bytes and total_bytes and n_items > 0:
        ranges = -(-(int(total_bytes) + 15 * n_items) // r.range_bytes)
        if ranges >= max(-(-n_items // 4), 4 * multiprocessors):
            if r.persistent or ranges > _MAX_GRID:
                programs = max(1, min(floor, ranges))
                return LaunchSettings(programs=programs, rounds=-(-ranges // programs), range_bytes=r.range_bytes,
                                      persistent=True, **common)
            return LaunchSettings(programs=ranges, rounds=1, range_bytes=r.range_bytes, persistent=False, **common)
    programs = max(1, min(max(n_items, floor), pol["max_programs"]))
    rounds = 1 if not total_bytes or not r.persistent else \
        max(1, min(total_bytes // (programs * pol["rounds_bytes"]), pol["max_rounds"]))
    return LaunchSettings(programs=programs, rounds=int(rounds), persistent=r.persistent, **common)


def is_large(n_items: int, total_bytes: Optional[int], pol: dict) -> bool:
    """Whether a batch gets the policy's ``range_large`` settings (mean piece >= ``large_mean_bytes``)."""
    return bool(total_bytes) and n_items > 0 and total_bytes // n_items >= pol["large_mean_bytes"]


def launch_settings(n_items: int, device: torch.device, total_bytes: Optional[int] = None) -> LaunchSettings:
    """The range kernel's tile size, warps, program count and range layout for a batch of ``n_items`` on
    ``device``, from the launch policy (``pxn_kernels.policy``).

    Programs: at least ``programs_per_sm`` per multiprocessor so that large blocks keep enough bytes in flight,
    and at least one per item (capped) so that thousands of tiny pieces are copied in parallel rather than a
    few per program in sequence. Under the CPU interpreter each program is slow Python, so few are used.
    Rounds: when the caller knows the batch's bytes, it is cut into ranges of about ``rounds_bytes`` so that
    resident programs work on neighbouring memory (see the kernel); and a batch whose mean piece is at least
    ``large_mean_bytes`` gets the large-piece settings. See ``settings_for``.
    """
    if device.type != "cuda":
        i = kernel_policy.INTERPRETER
        return LaunchSettings(block_bytes=i["block_bytes"], tail_block_bytes=i["tail_block_bytes"],
                              num_warps=i["num_warps"], programs=max(1, min(n_items, i["max_programs"])),
                              shift=kernel_policy.DEFAULT["range_small"]["shift"])
    pol = kernel_policy.policy(device)
    entry = pol["range_large"] if is_large(n_items, total_bytes, pol) else pol["range_small"]
    return settings_for(regime_of(entry), n_items, total_bytes,
                        _multiprocessors(device.index if device.index is not None else 0), pol)


@dataclass
class CopyPlan:
    """How a batch is split among programs. Reusable for the same lengths.

    One of four kernels: the range plan (device tensors describing how the settings' ranges split the batch),
    or, when ``grid`` is set, the 2-D grid kernel of ``_grid_copy``, or, when ``row`` is set, the row kernel of
    ``_row_copy`` (these two need no plan tensors: pad_ends/bounds/first_item are None), or, when ``segment`` is
    set, the segment kernel of ``_segment_copy`` over the device table ``segments``.
    """

    pad_ends: Optional[torch.Tensor]  # int64 [n]
    bounds: Optional[torch.Tensor]  # int64 [ranges + 1]
    first_item: Optional[torch.Tensor]  # int64 [ranges]
    settings: Optional[LaunchSettings]
    grid: Optional[GridSettings] = None
    row: Optional[RowSettings] = None
    segment: Optional[SegmentSettings] = None
    segments: Optional[torch.Tensor] = None  # int64 [segments]: the segment table, on the device
    # GPU launches already bound with this plan, by descriptor addresses (see launch_batched_copy)
    _bound: dict = field(default_factory=dict, repr=False, compare=False)
    # the last unchecked public call's arguments and its bound launch (see relaunch)
    _recent: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def kernel(self) -> str:
        """"row", "grid", "segment" or "range"."""
        return "row" if self.row is not None else "grid" if self.grid is not None else \
            "segment" if self.segment is not None else "range"


def plan_batched_copy(lengths: torch.Tensor, settings: Optional[LaunchSettings] = None) -> CopyPlan:
    """The range plan for ``lengths`` (int64 on the target device), built with device-side torch ops only."""
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


_row_plans = {}
# (device, length) -> row plan, for the checked entries' batches of one length (no policy lookup). The keys hold the
# torch.device itself: it hashes and compares by type and index, and reading those two attributes costs more
# than the rest of a cached lookup
_equal_plans = {}


def _equal_kernel(length: int, pol: dict) -> Optional[CopyPlan]:
    """The row plan for pieces of ``length`` bytes each, when the policy gives them the row kernel."""
    key = (length, id(pol))
    plan = _row_plans.get(key)
    if plan is None:
        row = pol["row"]
        if not row["enabled"] or length > row["max_bytes"]:
            return None
        c = kernel_policy.row_class(pol, length)
        if -(-length // c["max_cols"]) > MAX_GRID_Y:
            return None
        plan = CopyPlan(None, None, None, None, row=row_settings(length, c["tile_bytes"], c["max_cols"],
                                                                c["num_warps"], c.get("split", False),
                                                                c.get("programs_per_sm", 0)))
        if len(_row_plans) > 4096:
            _row_plans.clear()
        _row_plans[key] = plan
    return plan


_PLAN_CACHE_SIZE = 64
_PLANS_PER_KEY = 8
_cached_plans = 0  # plans held in _plan_cache (key -> [(lengths' bytes or None, plan)])
_plan_cache: "OrderedDict" = OrderedDict()
_plan_lock = threading.Lock()
_WEIGHTS = np.zeros(0, dtype=np.int64)


def _forget_plans() -> None:
    global _cached_plans
    with _plan_lock:
        _plan_cache.clear()
        _cached_plans = 0
        _row_plans.clear()
        _equal_plans.clear()


kernel_policy.on_change.append(_forget_plans)


def _fingerprint(lengths: np.ndarray) -> int:
    # A position-weighted sum: two different length lists rarely share it; a hit is confirmed by comparing the
    # stored lengths, so a collision costs a rebuild, never a wrong plan.
    global _WEIGHTS
    n = lengths.size
    if _WEIGHTS.size < n:
        _WEIGHTS = np.arange(1, max(n, 2 * _WEIGHTS.size) + 1, dtype=np.int64) * 0x9E3779B1
    return int(np.dot(lengths, _WEIGHTS[:n]))


def plan_for_lengths(lengths: np.ndarray, device: torch.device, stats=None) -> CopyPlan:
    """The plan for a batch whose lengths the caller holds on the host (bytes, int64).

    Pieces all of one length: the row kernel (short rows) or the 2-D grid kernel (from the policy's
    ``grid.min_bytes``; also pieces within 10 % of one size), as the launch policy says (``pxn_kernels.policy``).
    Any other mix: on a GPU the segment kernel (its table built with numpy and moved to ``device`` in one copy),
    unless the policy turns it off; else the range plan, computed with numpy (``plan_host``) and moved the same way.
    Plans are cached by the lengths themselves (the last 64 lists per process), since callers repeat the same
    lengths call after call: a repeat costs a hash of short lists, or one comparison of the bytes of long ones,
    found by ``stats`` (or by a fingerprint without them). ``stats``: the lengths' (min, max, sum) when the caller
    has them (``_checks.LengthStats``).
    """
    global _cached_plans
    if stats is not None and stats.lmin == stats.lmax and stats.lmin > 0:
        key = (device, stats.lmin)
        plan = _equal_plans.get(key)
        if plan is not None:
            return plan
        plan = _equal_kernel(stats.lmin, kernel_policy.policy(device) if device.type == "cuda"
                             else kernel_policy.DEFAULT)
        if plan is not None:
            if len(_equal_plans) > 4096:
                _equal_plans.clear()
            _equal_plans[key] = plan
            return plan
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.size)
    # Short lists are their own key (their image None). Longer ones are keyed by what the checks already computed
    # (count, min, max, sum), or else by a position-weighted fingerprint, and each key holds the bytes of up to
    # _PLANS_PER_KEY length lists (the same multiset in several orders shares a stats key); a hit is one comparison
    # of the bytes.
    if n <= 256:
        key, image = (device, lengths.tobytes()), None
    else:
        image = lengths.tobytes()
        key = (device, n) + ((stats.lmin, stats.lmax, stats.total) if stats is not None
                             else (_fingerprint(lengths),))
    with _plan_lock:
        for stored, plan in _plan_cache.get(key, ()):
            if stored == image:
                _plan_cache.move_to_end(key)
                return plan
    plan = _new_plan(lengths, device, stats)
    with _plan_lock:
        entries = _plan_cache.setdefault(key, [])
        if len(entries) >= _PLANS_PER_KEY:
            del entries[0]
            _cached_plans -= 1
        entries.append((image, plan))
        _cached_plans += 1
        _plan_cache.move_to_end(key)
        while _cached_plans > _PLAN_CACHE_SIZE and len(_plan_cache) > 1:
            _cached_plans -= len(_plan_cache.popitem(last=False)[1])
    return plan


def _new_plan(lengths: np.ndarray, device: torch.device, stats) -> CopyPlan:
    n = int(lengths.size)
    pol = kernel_policy.policy(device) if device.type == "cuda" else kernel_policy.DEFAULT
    total = 0
    if n:
        if stats is None:
            lo, hi = int(lengths.min()), int(lengths.max())
            total = int(lengths.sum()) if lo >= 0 else int(np.maximum(lengths, 0).sum())
        else:
            lo, hi, total = stats.lmin, stats.lmax, stats.total
        if lo == hi and lo > 0:
            plan = _equal_kernel(lo, pol)
            if plan is not None:
                return plan
        grid = grid_settings(n, total, max(hi, 0), pol)
        if grid is not None:
            return CopyPlan(None, None, None, None, grid)
        if device.type == "cuda":  # under the CPU interpreter every program is slow Python: few range programs
            plan = _segment_plan(lengths, device, pol)
            if plan is not None:
                return plan
    settings = launch_settings(n, device, total)
    ranges = settings.ranges
    pad_ends, bounds, first_item = plan_host(lengths, ranges, settings.range_bytes)
    words = torch.from_numpy(np.concatenate([pad_ends, bounds, first_item]).astype(np.int64, copy=False))
    d = words.to(device, non_blocking=True) if device.type == "cuda" else words
    return CopyPlan(d[:n], d[n:n + ranges + 1], d[n + ranges + 1:], settings)


def _segment_plan(lengths: np.ndarray, device: torch.device, pol: dict) -> Optional[CopyPlan]:
    """The segment kernel's plan for ``lengths`` when the policy enables it and the table fits the kernel."""
    settings = segment_settings(pol)
    if settings is None:
        return None
    table = segment_table(lengths, settings.seg_bytes)
    if table is None:
        return None
    segments = torch.from_numpy(table).to(device, non_blocking=True)
    return CopyPlan(None, None, None, None, segment=settings, segments=segments)


def _default_plan(lengths: torch.Tensor, host_lengths: Optional[np.ndarray], stats=None) -> CopyPlan:
    """The plan the public entries build when none is given: from the host copy of the lengths when the checks
    made one (the row and grid kernels are then possible), else on the device without a host synchronisation."""
    if host_lengths is not None:
        return plan_for_lengths(host_lengths, lengths.device, stats)
    return plan_batched_copy(lengths)


def stage(arrays, device: torch.device):
    """Host int64 arrays on ``device`` in one copy: packed into one pinned buffer, moved on the current stream
    (asynchronously; torch's pinned allocator keeps the buffer until the copy has run). Returns device views,
    in order."""
    sizes = [int(a.size) for a in arrays]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    buf = staging.numpy()
    views, pos = [], 0
    for a, size in zip(arrays, sizes):
        buf[pos:pos + size] = a
        views.append((pos, size))
        pos += size
    d = staging.to(device, non_blocking=True)
    return [d[p:p + size] for p, size in views]


def run_batch(op: str, args, src_name: str, dst_name: str, src_base: int, dst_base: int, device: torch.device,
              plan: Optional[CopyPlan], stats, pool=None) -> None:
    """Launch the copy of a public entry: descriptors already on ``device``, or host arrays moved there in one
    copy through a reused staging buffer (``_staging.UploadPool``; ``pool``: another pool, tests); the plan
    given, else from the host lengths when there are any (after the checks or with host arrays), else built on
    the device."""
    values = args.values
    if args.on_host:
        host_lengths = values["lengths"]
        if plan is None:
            plan = plan_for_lengths(host_lengths, device, stats)
        # the row kernel reads no lengths: they are not uploaded (the launch gets another view of n words instead)
        arrays = (values[src_name], values[dst_name]) if plan.row is not None else \
            (values[src_name], values[dst_name], host_lengths)
        if pool is None and device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if not _staging.on_device(index):
                with torch.cuda.device(index):
                    return run_batch(op, args, src_name, dst_name, src_base, dst_base, device, plan, stats)
            pool = _staging.pool(index)
            stream = torch._C._cuda_getCurrentRawStream(index)
        else:
            stream = 0
        upload = pool.upload(arrays, stream) if pool is not None else None
        if upload is None:  # CUDA graph capture (or no pool): buffers allocated for this call
            views = stage(arrays, device)
            launch_batched_copy(views[0], views[1], views[-1], src_base, dst_base, plan)
            return
        try:
            views = upload.views
            launch_batched_copy(views[0], views[1], views[-1], src_base, dst_base, plan)
        finally:
            pool.release(upload)
        return
    lengths = values["lengths"]
    if plan is None:
        plan = _default_plan(lengths, args.host()[list(values).index("lengths")]
                             if args._host is not None else None, stats)
    launch_batched_copy(values[src_name], values[dst_name], lengths, src_base, dst_base, plan)


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


_RANGE_KERNEL = CompiledKernel(_batched_copy_kernel, n_tensors=7)


def _range_launch(src_index, dst_index, lengths, src_base, dst_base, plan):
    """(args, grid, constexprs) of one range-kernel launch."""
    settings = plan.settings
    a = anchor(lengths.device)
    base = a.data_ptr()
    args = (a, src_index, dst_index, lengths, plan.pad_ends, plan.bounds, plan.first_item,
            src_base - base, dst_base - base, settings.ranges)
    constexprs = dict(BLOCK=settings.block_bytes, TAIL_BLOCK=settings.tail_block_bytes,
                      STREAMING=settings.streaming, PERSISTENT=settings.persistent, SHIFT=settings.shift,
                      num_warps=settings.num_warps)
    return args, (settings.programs, 1), constexprs


def launch_batched_copy(src_index: torch.Tensor, dst_index: torch.Tensor, lengths: torch.Tensor,
                        src_base: int, dst_base: int, plan: CopyPlan):
    """Enqueue the copy on the current stream of the tensors' device. No checks: callers validate first.
    Returns the bound launch it used (a callable enqueuing the same copy again), or None.

    On CUDA the compiled kernel is launched through ``DirectLauncher`` (one driver call); Triton's own launch
    path re-derives every argument's specialisation per call and costs more host time than a whole small
    ``copy_``.
    """
    n = lengths.numel()
    if n == 0:
        return
    if lengths.is_cuda:
        # A caller that reuses its plan and its descriptor buffers gets the launch bound at the second call:
        # then only the driver call remains (the values are addresses, so other tensors at the same addresses
        # are fine). A first sighting launches as usual: binding costs more than one launch.
        key = (src_index.data_ptr(), dst_index.data_ptr(), lengths.data_ptr(), n, src_base, dst_base,
               lengths.get_device())
        bound = plan._bound.get(key, _UNSEEN)
        if bound is not _UNSEEN:
            if bound is None:
                bound = plan._bound[key] = _bind(src_index, dst_index, lengths, src_base, dst_base, plan)
            bound()
            return bound
        if len(plan._bound) >= _BOUND_PER_PLAN:
            plan._bound.clear()
        plan._bound[key] = None
    if plan.row is not None:
        launch_row_copy(src_index, dst_index, src_base, dst_base, plan.row)
    elif plan.grid is not None:
        launch_grid_copy(src_index, dst_index, lengths, src_base, dst_base, plan.grid)
    elif plan.segment is not None:
        launch_segment_copy(src_index, dst_index, lengths, plan.segments, src_base, dst_base, plan.segment)
    else:
        _RANGE_KERNEL.launch(*_range_launch(src_index, dst_index, lengths, src_base, dst_base, plan))


_BOUND_PER_PLAN = 8
_UNSEEN = object()
# the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 at import): CPU tensors may take the "triton"
# backend's launch path
_INTERPRETED = type(_batched_copy_kernel).__name__ == "InterpretedFunction"


def _lean(buffer, a, b, c, backend: str) -> bool:
    """Whether an unchecked call with a plan may launch at once: a contiguous uint8 ``buffer`` (None for
    ``copy``) and three contiguous int64 1-D tensors of one length, all on one GPU (or all on the CPU with the
    "triton" backend and the interpreter on) -- what the full path would accept without a copy, tested with the
    cheapest calls. False: the full path decides (it names what is wrong, and copies a strided view)."""
    try:
        index = a.get_device() if buffer is None else buffer.get_device()
        n = a.numel()
        return ((backend == "auto" or backend == "triton") if index >= 0
                else _interpreted_cpu(buffer, a, b, c, backend)) \
            and (buffer is None or (buffer.dtype is torch.uint8 and buffer.is_contiguous())) \
            and a.dtype is torch.int64 and b.dtype is torch.int64 and c.dtype is torch.int64 \
            and a.dim() == 1 and b.dim() == 1 and c.dim() == 1 and b.numel() == n and c.numel() == n \
            and a.is_contiguous() and b.is_contiguous() and c.is_contiguous() \
            and a.get_device() == index and b.get_device() == index and c.get_device() == index
    except AttributeError:  # not tensors: the full path names the argument
        return False


def _interpreted_cpu(buffer, a, b, c, backend: str) -> bool:
    return backend == "triton" and _INTERPRETED and a.device.type == "cpu" and b.device.type == "cpu" \
        and c.device.type == "cpu" and (buffer is None or buffer.device.type == "cpu")


def _no_buffer():  # the weak reference slot of a call without a buffer (``copy``)
    return None


def relaunch(plan: CopyPlan, src_index, dst_index, lengths, buffer, buffer_is_src: bool, backend: str) -> bool:
    """The unchecked public call with a plan (``check=False``): launch the copy at once when the arguments are
    what the full path would take without a copy (``_lean``); True when launched, False when the full path must
    run. ``buffer``: gather's ``out`` / scatter's ``src`` (its address is the destination / source base,
    ``buffer_is_src`` says which), None for ``copy``.

    A caller with cached descriptors passes the same tensor objects call after call; the plan remembers the last
    such call (weak references to its tensors, their addresses and count, the backend) with its bound launch,
    and a call with the same objects still at the same addresses and count launches that directly: identity,
    address and count replace the type test, since those objects passed it and a tensor's dtype, device and
    layout do not change while its address and count stay (short of ``set_`` / ``as_strided_`` / ``.data`` on
    the caller's own descriptors, which the unchecked call leaves to its caller as it does their values)."""
    recent = plan._recent
    if recent is not None:
        src_ref, dst_ref, len_ref, buf_ref, src_ptr, dst_ptr, len_ptr, buf_ptr, n, kind, launch = recent
        if src_ref() is src_index and dst_ref() is dst_index and len_ref() is lengths and buf_ref() is buffer \
                and backend == kind and src_index.data_ptr() == src_ptr and dst_index.data_ptr() == dst_ptr \
                and lengths.data_ptr() == len_ptr and (buffer is None or buffer.data_ptr() == buf_ptr) \
                and lengths.numel() == n and src_index.numel() == n and dst_index.numel() == n:
            launch()
            return True
    if not _lean(buffer, src_index, dst_index, lengths, backend):
        return False
    base = 0 if buffer is None else buffer.data_ptr()
    src_base, dst_base = (base, 0) if buffer_is_src else (0, base)
    n = lengths.numel()
    if lengths.is_cuda:
        launch = launch_batched_copy(src_index, dst_index, lengths, src_base, dst_base, plan)
    elif n:  # the interpreter: a binding costs no more than a launch
        launch = _bind(src_index, dst_index, lengths, src_base, dst_base, plan)
        launch()
    else:
        launch = None
    if launch is not None:
        plan._recent = (weakref.ref(src_index), weakref.ref(dst_index), weakref.ref(lengths),
                        _no_buffer if buffer is None else weakref.ref(buffer), src_index.data_ptr(),
                        dst_index.data_ptr(), lengths.data_ptr(), base, n, backend, launch)
    return True


def _bind(src_index, dst_index, lengths, src_base: int, dst_base: int, plan: CopyPlan):
    """A callable enqueuing the copy of ``plan`` over these descriptors on the current stream."""
    if plan.row is not None:
        return RowCopy(src_index, dst_index, src_base, dst_base, plan.row)._call
    if plan.grid is not None:
        g = plan.grid
        return GridCopy(src_index, dst_index, lengths, src_base, dst_base, g.max_bytes, g.seg_bytes, g.block_bytes,
                        g.num_warps, shift=g.shift)._call
    if plan.segment is not None:
        return SegmentCopy(src_index, dst_index, lengths, plan.segments, src_base, dst_base, plan.segment)._call
    return _RANGE_KERNEL.bind(*_range_launch(src_index, dst_index, lengths, src_base, dst_base, plan))


class PreparedCopy:
    """A batched copy bound to fixed descriptor and plan tensors, for callers that launch it many times.

    The relay reuses the same descriptor buffers for every chunk of a slot (it rewrites their contents), so
    everything but the launch itself is done once here. ``graph=True`` captures the launch in a CUDA graph:
    a graph replay costs less host time than a plain kernel launch, and for a batch of small pieces host time is
    the whole cost.

    Arguments: as ``launch_batched_copy``; the tensors must stay alive and at the same addresses.
    """

    def __init__(self, src_index, dst_index, lengths, src_base: int, dst_base: int, plan: CopyPlan,
                 graph: bool = False):
        self._keep = (src_index, dst_index, lengths, plan)
        self._device = lengths.device
        if lengths.numel() == 0:
            self._launch = lambda: None
        elif plan.row is not None:
            self._launch = RowCopy(src_index, dst_index, src_base, dst_base, plan.row)
        elif plan.grid is not None:
            g = plan.grid
            self._launch = GridCopy(src_index, dst_index, lengths, src_base, dst_base, g.max_bytes, g.seg_bytes,
                                    g.block_bytes, g.num_warps, shift=g.shift)
        elif plan.segment is not None:
            self._launch = SegmentCopy(src_index, dst_index, lengths, plan.segments, src_base, dst_base,
                                       plan.segment)
        else:
            self._launch = _RANGE_KERNEL.bind(*_range_launch(src_index, dst_index, lengths, src_base, dst_base,
                                                             plan))
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

    def __call__(self) -> None:
        """Enqueue the copy on the current stream."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self._launch()
