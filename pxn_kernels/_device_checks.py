"""The summary kernel: the checks of index tensors that live on the GPU, computed there.

Why: a checked ``gather`` / ``scatter`` / ``copy`` whose index arguments are CUDA tensors must know, before it
launches, that no piece is bad. Reading the tensors to the host for the numpy checks costs one device-to-host
copy per tensor (or one for tensors close together), each with its own latency on the GPU, then the checks'
passes on the host. Here one launch computes
what decides the usual case and writes it, with a copy of the lengths (a mix of lengths needs them for its
plan), straight into a pinned buffer of the calling thread; the host reads it after one synchronisation.

What the kernel computes, over a batch of ``n`` pieces, two index arguments ``a`` and ``b`` (``b`` holds the
written ranges) and their lengths:

* program (0, T) (T tiles of ``TILE`` pieces): the lengths' min, max and sum; for each argument the lowest and
  highest start of the pieces of positive length, and whether one of them breaks its rule: an address below 1
  or whose end passes 2**63 - 1, or an offset below 0 or whose end passes the buffer (``limit`` bytes);
* program (i, j), j >= i: every pair of written ranges of positive length, one in tile i and one in tile j;
  an overlap sets the flag word. That is n**2 / 2 comparisons, a few microseconds of GPU time up to
  ``MAX_PIECES``; larger batches are read to the host and checked there (``_checks.validate``). A tile whose
  ranges all end before the later tile's ranges start is settled by those two extremes (in a batch in
  ascending order, every tile but the diagonal).

Layout of the result (int64 words): 0 the overlap flag (zeroed by the host before the launch); 1-3 the
lengths' min, max and sum; 4-6 ``a``'s lowest and highest start and its broken-rule flag; 7-9 the same for ``b``;
from word ``HEADER`` the lengths. The summary only settles the case where nothing is wrong:
when it finds anything, the caller reads the tensors and runs the host checks, which name the first bad piece
and its value.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from pxn_kernels import _staging, peer_access
from pxn_kernels._batched_copy import plan_for_lengths
from pxn_kernels._checks import LengthStats
from pxn_kernels._direct_launch import DirectLauncher
from pxn_kernels._libcuda import check, driver

MAX_PIECES = 4096  # larger batches: the n**2 pair test would cost more than the host checks
TILE = 64  # pieces per side of one program's block of pairs
BLOCK = 1024  # pieces per step of the reduction program
NUM_WARPS = 4
HEADER = 16  # words before the lengths' copy
_INT64_MAX = (1 << 63) - 1


@triton.jit
def _breaks_rule(values, lengths, limit, IS_RANGE: tl.constexpr):
    # only read where lengths > 0: there ``INT64_MAX - lengths`` cannot wrap
    if IS_RANGE:
        return (values < 0) | (values > limit - lengths)
    else:
        return (values < 1) | (values > 0x7FFFFFFFFFFFFFFF - lengths)


@triton.jit(do_not_specialize=["lengths", "a", "b", "out", "n", "limit_a", "limit_b"])
def _summary_kernel(lengths, a, b, out, n, limit_a, limit_b, A_RANGE: tl.constexpr, B_RANGE: tl.constexpr,
                    TILE: tl.constexpr, BLOCK: tl.constexpr, LENGTHS_AT: tl.constexpr):
    # do_not_specialize: one binary for every n, limit and pointer alignment (index tensors may be views at any
    # multiple of 8 bytes), which the direct launcher can then fill positionally
    i = tl.program_id(0)
    j = tl.program_id(1)
    tiles = tl.num_programs(0)
    if j == tiles:
        if i == 0:
            offs = tl.arange(0, BLOCK)
            big = tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64)
            lmin = big
            lmax = -big
            total = tl.zeros([BLOCK], tl.int64)
            a_lo = big
            a_hi = -big
            b_lo = big
            b_hi = -big
            a_bad = tl.zeros([BLOCK], tl.int32)
            b_bad = tl.zeros([BLOCK], tl.int32)
            for start in range(0, n, BLOCK):
                idx = start + offs
                inside = idx < n
                length = tl.load(lengths + idx, mask=inside, other=0)
                av = tl.load(a + idx, mask=inside, other=0)
                bv = tl.load(b + idx, mask=inside, other=0)
                live = inside & (length > 0)
                lmin = tl.minimum(lmin, tl.where(inside, length, big))
                lmax = tl.maximum(lmax, tl.where(inside, length, -big))
                total += length
                a_lo = tl.minimum(a_lo, tl.where(live, av, big))
                a_hi = tl.maximum(a_hi, tl.where(live, av, -big))
                b_lo = tl.minimum(b_lo, tl.where(live, bv, big))
                b_hi = tl.maximum(b_hi, tl.where(live, bv, -big))
                a_bad = a_bad | (live & _breaks_rule(av, length, limit_a, A_RANGE)).to(tl.int32)
                b_bad = b_bad | (live & _breaks_rule(bv, length, limit_b, B_RANGE)).to(tl.int32)
                tl.store(out + LENGTHS_AT + idx, length, mask=inside)
            tl.store(out + 1, tl.min(lmin, axis=0))
            tl.store(out + 2, tl.max(lmax, axis=0))
            tl.store(out + 3, tl.sum(total, axis=0))
            tl.store(out + 4, tl.min(a_lo, axis=0))
            tl.store(out + 5, tl.max(a_hi, axis=0))
            tl.store(out + 6, tl.max(a_bad, axis=0).to(tl.int64))
            tl.store(out + 7, tl.min(b_lo, axis=0))
            tl.store(out + 8, tl.max(b_hi, axis=0))
            tl.store(out + 9, tl.max(b_bad, axis=0).to(tl.int64))
    elif j >= i:
        rows = i * TILE + tl.arange(0, TILE)
        cols = j * TILE + tl.arange(0, TILE)
        row_len = tl.load(lengths + rows, mask=rows < n, other=0)
        col_len = tl.load(lengths + cols, mask=cols < n, other=0)
        row_start = tl.load(b + rows, mask=rows < n, other=0)
        col_start = tl.load(b + cols, mask=cols < n, other=0)
        # pieces past n have length 0; a range whose end wraps is flagged by the reduction program
        row_end = row_start + row_len
        col_end = col_start + col_len
        big = 0x7FFFFFFFFFFFFFFF
        # a tile whose live ranges all end before the later tile's first start holds no overlap with it: in a
        # batch in ascending order (a gather into a chunk) every tile but the diagonal ones is settled by these
        # two extremes
        before = tl.max(tl.where(row_len > 0, row_end, -big), axis=0) <= \
            tl.min(tl.where(col_len > 0, col_start, big), axis=0)
        if (i == j) | (before == 0):
            clash = (rows[:, None] < cols[None, :]) & (row_len[:, None] > 0) & (col_len[None, :] > 0) \
                & (row_start[:, None] < col_end[None, :]) & (col_start[None, :] < row_end[:, None])
            found = tl.sum(tl.sum(clash.to(tl.int32), axis=1), axis=0)
            tl.store(out, (found > 0).to(tl.int64), mask=found > 0)


class Summary(NamedTuple):
    """What the checks of one batch found: the lengths' stats with each address argument's (lowest, highest)
    start (``LengthStats``), and the lengths as a host array (a view of the calling thread's buffer, valid until
    its next summary)."""

    stats: LengthStats
    lengths: np.ndarray


def summary_torch(lengths: torch.Tensor, a: torch.Tensor, b: torch.Tensor, limit_a: int, limit_b: int,
                  a_range: bool, b_range: bool) -> list:
    """Reference: the kernel's result words 0..9 (see the module docstring) in plain torch on any
    device, the pair test by sorting (``_checks._disjoint_sorted``'s rule: every i-th smallest end at most the
    (i+1)-th smallest start)."""
    live = lengths > 0
    big = _INT64_MAX

    def extremes(values):
        v = values[live]
        return (int(v.min()), int(v.max())) if v.numel() else (big, -big)

    def bad(values, limit, is_range):
        v, n = values[live], lengths[live]
        if is_range:
            return int(bool(((v < 0) | (v > limit - n)).any()))
        return int(bool(((v < 1) | (v > big - n)).any()))

    starts, ends = b[live], b[live] + lengths[live]
    overlap = 0
    if starts.numel() > 1:
        overlap = int(bool((torch.sort(ends).values[:-1] > torch.sort(starts).values[1:]).any()))
    return [overlap, int(lengths.min()), int(lengths.max()), int(lengths.sum()), *extremes(a),
            bad(a, limit_a, a_range), *extremes(b), bad(b, limit_b, b_range)]


def grid(n: int) -> Tuple[int, int]:
    """(T, T + 1) programs for ``n`` pieces: the tiles' pairs, and the reduction program at (0, T)."""
    tiles = max(1, -(-n // TILE))
    return tiles, tiles + 1


_tls = threading.local()
_launchers = {}
_launchers_lock = threading.Lock()


def _buffer(index: int, words: int):
    """(pinned tensor, numpy view, address) of the calling thread's result buffer for GPU ``index``, at least
    ``words`` int64: the kernel writes it through unified addressing, so the result needs no copy of its own."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    entry = bufs.get(index)
    if entry is None or entry[1].size < words:
        host = torch.empty(max(HEADER + 1024, 1 << (words - 1).bit_length()), dtype=torch.int64, pin_memory=True)
        entry = bufs[index] = (host, host.numpy(), host.data_ptr())
    return entry


def _launcher(index: int, a_range: bool, b_range: bool, wide_a: bool, wide_b: bool):
    """The direct launcher of the kernel for these constexprs and integer widths (compiled once per GPU), or
    False where it declined (then Triton's own launch runs)."""
    key = (index, a_range, b_range, wide_a, wide_b)
    found = _launchers.get(key)
    if found is not None:
        return found
    with _launchers_lock:
        found = _launchers.get(key)
        if found is None:
            device = torch.device("cuda", index)
            # arguments at an address that is a multiple of 8 but not of 16, and integers that are neither 1 nor
            # multiples of 16: the binary then assumes nothing that another call's values could break
            scratch = torch.zeros(4, dtype=torch.int64, device=device)[1:]
            host = torch.zeros(HEADER + 8, dtype=torch.int64, pin_memory=True)[1:]
            la = (1 << 40) + 3 if wide_a else 3
            lb = (1 << 40) + 3 if wide_b else 3
            with torch.cuda.device(index):
                compiled = _summary_kernel.warmup(scratch, scratch, scratch, host, 3, la, lb, grid=(1, 2),
                                                  A_RANGE=a_range, B_RANGE=b_range, TILE=TILE, BLOCK=BLOCK,
                                                  LENGTHS_AT=HEADER, num_warps=NUM_WARPS)
                found = DirectLauncher.create(compiled, n_user=7, device=index) or False
            _launchers[key] = found
    return found


def summarize(lengths: torch.Tensor, a: torch.Tensor, b: torch.Tensor, limit_a: Optional[int],
              limit_b: Optional[int], names: Tuple[str, str]) -> Optional[Summary]:
    """The checks of a batch whose index tensors (contiguous int64, one length, on one GPU) are ``lengths``,
    ``a`` and ``b`` (``b``: the written ranges), run on that GPU after the work queued on its current stream.

    ``limit_a`` / ``limit_b``: the buffer's size in bytes for an offset argument, None for an address argument.
    ``names``: the arguments' names (the keys of ``LengthStats.spans``, which holds the address arguments).
    Returns the summary when every piece passes; None when some check fails, when no piece has a positive
    length, or when the batch has more than ``MAX_PIECES`` pieces: the caller then checks on the host.
    """
    n = lengths.numel()
    if n > MAX_PIECES or n == 0:
        return None
    index = lengths.get_device()
    if not _staging.on_device(index):
        with torch.cuda.device(index):
            return summarize(lengths, a, b, limit_a, limit_b, names)
    a_range, b_range = limit_a is not None, limit_b is not None
    la, lb = limit_a or 0, limit_b or 0
    host, buf, ptr = _buffer(index, HEADER + n)
    buf[0] = 0
    tiles, columns = grid(n)
    stream = torch._C._cuda_getCurrentRawStream(index)
    launcher = _launcher(index, a_range, b_range, la >= 1 << 31, lb >= 1 << 31)
    if launcher:
        launcher.launch(tiles, stream, (lengths.data_ptr(), a.data_ptr(), b.data_ptr(), ptr, n, la, lb),
                        grid_y=columns)
    else:
        _summary_kernel[(tiles, columns)](lengths, a, b, host, n, la, lb, A_RANGE=a_range, B_RANGE=b_range,
                                          TILE=TILE, BLOCK=BLOCK, LENGTHS_AT=HEADER, num_warps=NUM_WARPS)
    check(driver().cuStreamSynchronize(stream), "cuStreamSynchronize", "index summary")
    overlap, lmin, lmax, total, a_lo, a_hi, a_bad, b_lo, b_hi, b_bad = buf[:10].tolist()
    if overlap or a_bad or b_bad or lmin < 0 or lmax <= 0:
        return None
    spans = {}
    if not a_range:
        spans[names[0]] = (a_lo, a_hi)
    if not b_range:
        spans[names[1]] = (b_lo, b_hi)
    return Summary(LengthStats(lmin, lmax, total, spans), buf[HEADER:HEADER + n])


def check_call(args, device: torch.device, plan, a_name: str, limit_a: Optional[int], b_name: str,
               limit_b: Optional[int]):
    """``summarize`` for a checked public call on GPU ``device``: its index arguments ``args``
    (``_checks.IndexArgs``, with a ``lengths`` entry), ``a_name`` and ``b_name`` (``b``: the written ranges) with
    their limits as there. Returns (``LengthStats``, the plan): ``plan`` when given, else the one for the
    summary's lengths. None, and the caller checks on the host, unless the arguments are tensors on a GPU, at
    most ``MAX_PIECES``, every piece passes, and every address argument lies in memory of that GPU itself as far
    as ``peer_access``'s cache of allocations already knows (a peer GPU's addresses go the host way, which
    enables peer access or copies piece by piece)."""
    if args.on_host or args.count > MAX_PIECES:
        return None
    values = args.values
    lengths = values["lengths"]
    index = lengths.get_device()  # the GPU of every index tensor (index_args checked that); -1: the CPU
    if index < 0:
        return None
    found = summarize(lengths, values[a_name], values[b_name], limit_a, limit_b, (a_name, b_name))
    if found is None or not peer_access.spans_on(index, found.stats.spans.values()):
        return None
    return found.stats, plan if plan is not None else plan_for_lengths(found.lengths, device, found.stats)
