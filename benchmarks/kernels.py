#!/usr/bin/env python3
"""Kernel benchmark: pxn gather / scatter / copy against one contiguous copy, cudaMemcpyBatchAsync and a
per-item ``copy_`` loop, on the transfer mixes sglang produces; and rows of one size picked at random from a
1 GiB pool (paged KV rows) against ``index_select`` / ``index_copy_`` on the same rows.

GB/s = payload bytes / median time per call. A call's time is measured the way a caller experiences it:
``REPEATS`` calls issued back to back between two CUDA events, so host launch overhead counts whenever it is
larger than the device time (``triton.testing.do_bench`` flushes the L2 between calls, and the flush kernel
hides host overhead, so it is not used). Item descriptors are already on the device; their upload and the
work plan are timed separately and reported in the pxn rows (``upload_us``, ``plan_us``).

Every row: ``{mix, op, method, gbps, ratio, ...}``; ``ratio`` is to one contiguous ``copy_`` of the same bytes
for the mixes, to ``index_select`` / ``index_copy_`` for the paged rows (``ratio_contiguous`` beside it). The
policy's choice is ``method == "pxn"``; other methods are candidate kernels timed in the same run, each checked
byte-exact first (``exact``).

Usage: python3 benchmarks/kernels.py [--out benchmarks/results/kernels-h200.json] [--sweep POLICY.json] [--quick]
       python3 benchmarks/kernels.py --rows-only --row-sizes 64,2048   (paged rows only)
       TRITON_INTERPRET=1 python3 benchmarks/kernels.py --smoke   (CPU dry run of this script, tiny sizes)
       python3 benchmarks/kernels.py --variants PATH [--resources PATH2]   (variants x mixes table only)
       python3 benchmarks/kernels.py --resources PATH   (no GPU needed: registers/spills per variant kernel)
Needs a CUDA GPU (except --resources); cuda-bindings for the batch_api rows (skipped with a message without it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, replace

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pxn_kernels  # noqa: E402
import kernel_variants  # noqa: E402  (benchmarks/kernel_variants.py, beside this script)
from pxn_kernels._grid_copy import GridCopy, grid_fits  # noqa: E402
from pxn_kernels import policy as kernel_policy  # noqa: E402
from pxn_kernels._batched_copy import (  # noqa: E402
    CopyPlan, LaunchSettings, PreparedCopy, is_large, launch_settings, plan_batched_copy, plan_for_lengths,
    plan_host, regime_of, settings_for,
)
from pxn_kernels._grid_copy import GridSettings  # noqa: E402
from pxn_kernels._row_copy import row_settings  # noqa: E402
from pxn_kernels._segment_copy import SegmentSettings, segment_table  # noqa: E402


def _default_regimes():
    """The built-in (small, large) range-kernel regimes of the H200 policy entry."""
    pol = kernel_policy.defaults("sm_90")
    return regime_of(pol["range_small"]), regime_of(pol["range_large"])

MIXES = {
    "aux11": [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64],
    "64Bx4096": [64] * 4096,
    "512Bx4096": [512] * 4096,
    "8KBx4096": [8192] * 4096,
    "64KBx1024": [65536] * 1024,
    "2.25MBx78": [2359296] * 78,
    "8.25MBx78": [8650752] * 78,
}


def mixed_lengths(rng) -> list:
    """Random 64 B - 8 KB pieces interleaved with 2 MB blocks (1024 small + 16 large)."""
    small = [int(x) for x in rng.integers(64, 8193, 1024)]
    out = []
    for i, length in enumerate(small):
        out.append(length)
        if i % 64 == 63:
            out.append(2 << 20)
    return out


def mixed_odd_lengths(rng) -> list:
    """Random 1 B - 8 KB pieces interleaved with pieces of 2 MB plus a few bytes (1024 small + 16 large); the
    benchmark places every piece at a random byte offset (``odd_shifts``), so almost none is 16-byte aligned."""
    small = [int(x) for x in rng.integers(1, 8193, 1024)]
    out = []
    for i, length in enumerate(small):
        out.append(length)
        if i % 64 == 63:
            out.append((2 << 20) + int(rng.integers(0, 16)))
    return out


def odd_shifts(rng, n: int) -> list:
    """A byte offset 0..15 per piece (the pieces' misalignment in the scattered buffers)."""
    return [int(x) for x in rng.integers(0, 16, n)]


# --smoke: a CPU dry run of the benchmark's own code under TRITON_INTERPRET=1 (tiny sizes, timings meaningless).
SMOKE = False


def bench_device() -> torch.device:
    return torch.device("cpu") if SMOKE else torch.device("cuda", 0)


def sync() -> None:
    if not SMOKE:
        torch.cuda.synchronize()


def empty_cache() -> None:
    if not SMOKE:
        torch.cuda.empty_cache()


def timed(fn, repeats: int, trials: int = 7) -> float:
    """Median seconds per call over ``trials`` runs of ``repeats`` back-to-back calls."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return max(time.perf_counter() - t, 1e-9)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(samples)


def repeats_for(total_bytes: int, n_items: int, method: str) -> int:
    if method == "per_item" or method == "batch_api":
        return max(1, min(20, 2000 // max(n_items, 1)))
    return max(3, min(200, int(2e9 // max(total_bytes, 1))))


class Case:
    """Device buffers for one mix: scattered pieces (64 B gaps, 16-B aligned) and a packed chunk."""

    def __init__(self, lengths, device, remote=None, shifts=None):
        # remote: where the scattered pieces live (another GPU for the NVLink runs); the chunk, and the
        # kernel, are on ``device``. shifts: per piece, bytes past a 16-byte boundary in the scattered buffers
        # (the chunk stays packed at 16-byte aligned offsets, as pack_chunk lays it out).
        remote = remote or device
        self.lengths = lengths
        n = len(lengths)
        padded = [(x + 15) // 16 * 16 for x in lengths]
        scatter_starts = np.cumsum([0] + [p + 64 for p in padded[:-1]]).astype(np.int64) + 64
        if shifts is not None:
            scatter_starts = scatter_starts + np.asarray(shifts, dtype=np.int64)
        packed = np.cumsum([0] + padded[:-1]).astype(np.int64)
        self.total = int(sum(lengths))
        span = int(scatter_starts[-1] + padded[-1] + 64)
        self.scattered_src = torch.randint(0, 256, (span,), dtype=torch.uint8, device=remote)
        self.scattered_dst = torch.empty(span, dtype=torch.uint8, device=remote)
        self.copy_dst = self.scattered_dst if remote == device else torch.empty(span, dtype=torch.uint8,
                                                                               device=device)
        self.chunk = torch.randint(0, 256, (int(packed[-1] + padded[-1]),), dtype=torch.uint8, device=device)
        self.chunk_out = torch.empty_like(self.chunk)
        self.contig_src = torch.randint(0, 256, (self.total,), dtype=torch.uint8, device=remote)
        self.contig_dst = torch.empty(self.total, dtype=torch.uint8, device=device)
        host = np.stack([self.scattered_src.data_ptr() + scatter_starts,
                         self.scattered_dst.data_ptr() + scatter_starts,
                         packed, np.asarray(lengths, dtype=np.int64),
                         self.copy_dst.data_ptr() + scatter_starts])
        self.host_desc = torch.from_numpy(host)
        if not SMOKE:
            self.host_desc = self.host_desc.pin_memory()
        self.desc = self.host_desc.to(device)
        self.src_ptrs, self.dst_ptrs, self.offsets, self.len_t = self.desc[0], self.desc[1], self.desc[2], \
            self.desc[3]
        self.copy_dst_ptrs = self.desc[4]
        self.n = n


def batch_api(case: Case, op: str, stream):
    """A closure issuing cudaMemcpyBatchAsync for this op, or None when cuda-bindings is missing."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python layout
        except ImportError:
            return None
    host = case.host_desc.numpy()
    chunk_base = {"gather": case.chunk_out.data_ptr(), "scatter": case.chunk.data_ptr()}.get(op)
    if op == "gather":
        srcs, dsts = host[0], chunk_base + host[2]
    elif op == "scatter":
        srcs, dsts = chunk_base + host[2], host[1]
    else:
        srcs, dsts = host[0], host[4]
    srcs, dsts, sizes = [int(x) for x in srcs], [int(x) for x in dsts], [int(x) for x in host[3]]
    attrs = cudart.cudaMemcpyAttributes()
    attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    handle = stream.cuda_stream

    def call():
        result = cudart.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attrs], [0], 1, handle)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err}")
    return call


def prepared(case: Case, op: str, plan, graph: bool):
    """The relay's launch path: descriptors in fixed device buffers, launch bound once (PreparedCopy)."""
    if op == "gather":
        return PreparedCopy(case.src_ptrs, case.offsets, case.len_t, 0, case.chunk_out.data_ptr(), plan, graph)
    if op == "scatter":
        return PreparedCopy(case.offsets, case.dst_ptrs, case.len_t, case.chunk.data_ptr(), 0, plan, graph)
    return PreparedCopy(case.src_ptrs, case.copy_dst_ptrs, case.len_t, 0, 0, plan, graph)


def variant_call(case: Case, op: str, plan, graph: bool):
    """A range-kernel variant (benchmarks/kernel_variants.py) bound like ``prepared``."""
    V = kernel_variants.VariantCopy
    if op == "gather":
        return V(case.src_ptrs, case.offsets, case.len_t, 0, case.chunk_out.data_ptr(), plan, graph)
    if op == "scatter":
        return V(case.offsets, case.dst_ptrs, case.len_t, case.chunk.data_ptr(), 0, plan, graph)
    return V(case.src_ptrs, case.copy_dst_ptrs, case.len_t, 0, 0, plan, graph)


def pxn_call(case: Case, op: str, plan):
    if op == "gather":
        return lambda: pxn_kernels.gather(case.src_ptrs, case.len_t, case.chunk_out, case.offsets, check=False,
                                          plan=plan)
    if op == "scatter":
        return lambda: pxn_kernels.scatter(case.chunk, case.offsets, case.dst_ptrs, case.len_t, check=False,
                                           plan=plan)
    return lambda: pxn_kernels.copy(case.src_ptrs, case.copy_dst_ptrs, case.len_t, check=False, plan=plan)


def per_item_call(case: Case, op: str):
    host = case.host_desc.numpy()
    device = case.chunk.device
    views = []
    for i in range(case.n):
        length = int(host[3, i])
        src_view = pxn_kernels.raw_view(int(host[0, i]), length, device)
        dst_view = pxn_kernels.raw_view(int(host[4 if op == "copy" else 1, i]), length, device)
        off = int(host[2, i])
        if op == "gather":
            views.append((case.chunk_out[off:off + length], src_view))
        elif op == "scatter":
            views.append((dst_view, case.chunk[off:off + length]))
        else:
            views.append((dst_view, src_view))

    def call():
        for dst, src in views:
            dst.copy_(src)
    return call


def verify(case: Case, op: str, plan, call=None) -> None:
    """Byte-exact check of the pxn path on this case before it is timed."""
    host = case.host_desc.numpy()
    case.chunk_out.fill_(0xA5)
    case.scattered_dst.fill_(0x5A)
    case.copy_dst.fill_(0x3C)
    (call or pxn_call(case, op, plan))()
    sync()
    src_base, dst_base = case.scattered_src.data_ptr(), case.scattered_dst.data_ptr()
    # the first and last 64 pieces, every piece of 64 KB or more, and every 16th piece in between
    check = set(range(min(case.n, 64))) | set(range(max(0, case.n - 64), case.n)) | set(range(0, case.n, 16))
    check |= {int(i) for i in np.flatnonzero(host[3] >= 65536)}
    for i in sorted(check):
        length, off = int(host[3, i]), int(host[2, i])
        s, d = int(host[0, i]) - src_base, int(host[1, i]) - dst_base
        if op == "gather":
            ok = torch.equal(case.chunk_out[off:off + length].cpu(), case.scattered_src[s:s + length].cpu())
        elif op == "scatter":
            ok = torch.equal(case.scattered_dst[d:d + length].cpu(), case.chunk[off:off + length].cpu())
        else:
            ok = torch.equal(case.copy_dst[d:d + length].cpu(), case.scattered_src[s:s + length].cpu())
        if not ok:
            raise AssertionError(f"pxn {op} wrong bytes in item {i} of {case.n}")


def enable_peer_access(device: int, peer: int) -> None:
    """Let kernels on ``device`` read/write ``peer``'s memory through raw pointers (NVLink)."""
    from cuda.bindings import runtime as cudart
    if not torch.cuda.can_device_access_peer(device, peer):
        raise SystemExit(f"GPU {device} cannot access GPU {peer} as a peer")
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        err, = cudart.cudaDeviceEnablePeerAccess(peer, 0)
        if int(err) not in (0, int(cudart.cudaError_t.cudaErrorPeerAccessAlreadyEnabled)):
            raise SystemExit(f"cudaDeviceEnablePeerAccess({peer}) failed: {err}")


def run(args) -> list:
    device = bench_device()
    remote = torch.device("cuda", 1) if args.nvlink else device
    if args.nvlink:
        enable_peer_access(0, 1)
    rng = np.random.default_rng(0)
    mixes = dict(MIXES)
    mixes["mixed"] = mixed_lengths(rng)
    mixes["mixed_odd"] = mixed_odd_lengths(rng)
    shifts = {"mixed_odd": odd_shifts(rng, len(mixes["mixed_odd"]))}
    if args.quick:
        mixes = {k: v for k, v in mixes.items() if k in ("aux11", "64Bx4096", "8KBx4096", "2.25MBx78", "mixed_odd")}
    if args.mixes:
        mixes = {k: v for k, v in mixes.items() if k in args.mixes.split(",")}
    if SMOKE:  # interpreter-sized
        mixes = {"aux11": MIXES["aux11"], "64Bx16": [64] * 16, "mixed_odd": [int(x) for x in rng.integers(1, 300, 24)]
                 + [5000, 7001]}
        shifts = {"mixed_odd": odd_shifts(rng, len(mixes["mixed_odd"]))}
    meta = run_meta(device)
    meta["placement"] = (f"pieces on {remote}, chunk and kernel on {device} (NVLink peer access)"
                         if args.nvlink else f"all on {device}")
    stream = None if SMOKE else torch.cuda.Stream()
    rows = []
    for mix, lengths in mixes.items():
        case = Case(lengths, device, remote, shifts.get(mix))
        # The plan from the host lengths (what the engine and the checked public calls do): the row kernel for
        # short pieces of one length, the grid kernel for large ones, else the range plan built with numpy.
        host_lengths = np.asarray(lengths, dtype=np.int64)
        plan = plan_for_lengths(host_lengths, device)
        candidates = candidate_plans(mix, case, host_lengths, plan, device)
        plan_s = timed(lambda: plan_for_lengths(host_lengths, device), 50)
        upload_s = timed(lambda: case.desc.copy_(case.host_desc, non_blocking=True), 50)
        contiguous_s = timed(lambda: case.contig_dst.copy_(case.contig_src),
                             repeats_for(case.total, 1, "contiguous"))
        for op in ("gather", "scatter", "copy"):
            verify(case, op, plan)
            reps = repeats_for(case.total, case.n, "pxn")
            graph_call = prepared(case, op, plan, graph=True)
            verify(case, op, plan, graph_call)
            results = {"contiguous": contiguous_s, "pxn": timed(graph_call, reps)}
            extra = {"direct_launch_us": timed(prepared(case, op, plan, graph=False), reps) * 1e6,
                     "public_call_us": timed(pxn_call(case, op, plan), reps) * 1e6}
            exact = {}
            for name, cand in candidates.items():
                try:
                    cand_call = prepared(case, op, cand, graph=True)
                    verify(case, op, cand, cand_call)
                    exact[name] = True
                    results[name] = timed(cand_call, reps)
                except Exception as exc:  # keep the other rows; say why this one is missing
                    print(f"  {mix} {op} {name}: {exc!r}", flush=True)
            call = None if SMOKE else batch_api(case, op, stream)
            if call is not None:
                try:
                    with torch.cuda.stream(stream):
                        results["batch_api"] = timed(call, repeats_for(case.total, case.n, "batch_api"), trials=3)
                except Exception as exc:  # keep the other rows; say why this one is missing
                    print(f"  batch_api {mix} {op} failed: {exc!r}", flush=True)
            if not args.skip_per_item and not SMOKE:
                results["per_item"] = timed(per_item_call(case, op), repeats_for(case.total, case.n, "per_item"),
                                            trials=3)
            for method, seconds in results.items():
                row = {"mix": mix, "op": op, "method": method, "n_items": case.n, "total_bytes": case.total,
                       "gbps": case.total / seconds / 1e9, "time_us": seconds * 1e6,
                       "ratio": contiguous_s / seconds, **meta}
                if mix in shifts:
                    row["alignment"] = "pieces at random byte offsets in the scattered buffers"
                cand = plan if method == "pxn" else candidates.get(method)
                if cand is not None:
                    row.update(plan_fields(cand), exact=True,
                               launch="cuda graph replay of the prepared launch (PreparedCopy(graph=True))")
                if method == "pxn":
                    row.update(extra)
                    row.update(plan_us=plan_s * 1e6, upload_us=upload_s * 1e6,
                               ratio_to_contiguous=contiguous_s / seconds)
                rows.append(row)
            print(f"  {mix:>10} {op:>7}: " + "  ".join(f"{m} {case.total / s / 1e9:8.2f} GB/s"
                                                     for m, s in results.items()), flush=True)
        del case
        empty_cache()
    return rows


def run_meta(device) -> dict:
    return {"gpu": "cpu (smoke run)" if SMOKE else torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "machine": platform.node()}


def plan_fields(plan) -> dict:
    """What a row records of the plan that ran."""
    if plan.row is not None:
        return {"kernel": "row", "row_settings": asdict(plan.row)}
    if plan.grid is not None:
        return {"kernel": "grid", "grid": asdict(plan.grid)}
    if plan.segment is not None:
        return {"kernel": "segment", "segment": asdict(plan.segment), "segments": int(plan.segments.numel())}
    s = plan.settings
    return {"kernel": "range", "programs": s.programs, "rounds": s.rounds, "block_bytes": s.block_bytes,
            "tail_block_bytes": s.tail_block_bytes, "num_warps": s.num_warps, "streaming": s.streaming}


def _range_plan(host_lengths, device, settings) -> CopyPlan:
    n, r = int(host_lengths.size), settings.ranges
    pad_ends, bounds, first = plan_host(host_lengths, r, settings.range_bytes)
    words = torch.from_numpy(np.concatenate([pad_ends, bounds, first]).astype(np.int64)).to(device)
    return CopyPlan(words[:n], words[n:n + r + 1], words[n + r + 1:], settings)


def candidate_plans(mix, case, host_lengths, plan, device) -> dict:
    """Other kernels timed beside the policy's choice in the same run: the range kernel where the policy picked
    another, segment-kernel candidates on mixes of unequal pieces (SEGMENT_CANDIDATES), and range-kernel policy
    candidates on the mixed mixes (RANGE_CANDIDATES)."""
    out = {}
    total = int(host_lengths.sum())
    if plan.kernel != "range":
        out["pxn_range"] = _range_plan(host_lengths, device, launch_settings(case.n, device, total))
    if plan.kernel in ("segment", "range") and not SMOKE:
        for name, (seg, block, warps) in SEGMENT_CANDIDATES.items():
            settings = SegmentSettings(seg, block, warps, kernel_policy.policy(device)["segment"]["shift"])
            if settings != plan.segment:
                out[name] = CopyPlan(None, None, None, None, segment=settings,
                                     segments=torch.from_numpy(segment_table(host_lengths, seg)).to(device))
    if mix.startswith("mixed"):
        sms = 4 if SMOKE else torch.cuda.get_device_properties(device).multi_processor_count
        for name, override in RANGE_CANDIDATES.items():
            pol = kernel_policy._merge(kernel_policy.defaults("sm_90"), override)
            entry = pol["range_large"] if is_large(case.n, total, pol) else pol["range_small"]
            settings = settings_for(regime_of(entry), case.n, total, sms, pol)
            if SMOKE:  # interpreter-sized programs, the candidate's switches kept
                base = launch_settings(case.n, device, total)
                settings = replace(base, tail_block_bytes=settings.tail_block_bytes, shift=settings.shift)
            out[name] = _range_plan(host_lengths, device, settings)
    return out


# Segment-kernel candidates on mixes of unequal pieces: (bytes per program, bytes per iteration, warps).
SEGMENT_CANDIDATES = {
    "segment:4k/b2k/w1": (4096, 2048, 1),
    "segment:8k/b4k/w1": (8192, 4096, 1),
    "segment:16k/b2k/w1": (16384, 2048, 1),
    "segment:16k/b4k/w1": (16384, 4096, 1),
    "segment:16k/b4k/w2": (16384, 4096, 2),
}


# Range-kernel candidates on the mixed mixes, as launch-policy overrides (what --sweep writes when one wins): a
# wider byte path, 8-byte funnel-shifted words for pieces whose ends differ in alignment, more programs per SM,
# more and shorter ranges.
RANGE_CANDIDATES = {
    "range:tail4k": {"range_small": {"tail_block_bytes": 4096}, "range_large": {"tail_block_bytes": 4096}},
    "range:shift": {"range_small": {"shift": True}, "range_large": {"shift": True}},
    "range:shift/tail4k": {"range_small": {"shift": True, "tail_block_bytes": 4096},
                           "range_large": {"shift": True, "tail_block_bytes": 4096}},
    "range:pps16": {"range_small": {"programs_per_sm": 16}},
    "range:pps32/w2": {"range_small": {"programs_per_sm": 32, "num_warps": 2}},
    "range:rounds8k": {"rounds_bytes": 8192},
    "range:shift/pps16/r8k": {"range_small": {"shift": True, "programs_per_sm": 16}, "rounds_bytes": 8192},
}


# --- paged rows: pieces of one length picked at random from a large pool (sglang's KV pools) ---------------

ROW_SIZES = (64, 128, 256, 576, 1024, 2048, 4096, 8192, 100, 520, 1500)
ROW_COUNT = 32768  # rows per call (32768 x 2 KiB = 64 MiB, the issue's first mix)
POOL_BYTES = 1 << 30  # rows are picked from a pool this large, so almost every row misses the L2
# Row-kernel candidates: (tile bytes per program, most columns per tile, warps, split rows, persistent programs
# per SM: 0 = one program per tile).
ROW_CANDIDATES = {
    "row:t1k/w1": (1024, 4096, 1, False, 0),
    "row:t2k/w1": (2048, 4096, 1, False, 0),
    "row:t4k/w1/split": (4096, 4096, 1, True, 0),
    "row:t4k/w1": (4096, 4096, 1, False, 0),
    "row:t1k/w1/pps16": (1024, 4096, 1, False, 16),
    "row:t2k/w1/pps16": (2048, 4096, 1, False, 16),
    "row:t1k/w1/pps32": (1024, 4096, 1, False, 32),
    "row:t2k/w1/pps32": (2048, 4096, 1, False, 32),
    "row:t4k/w1/pps32": (4096, 4096, 1, False, 32),
}


def _widest_dtype(length: int):
    for dtype in (torch.int64, torch.int32, torch.int16):
        if length % dtype.itemsize == 0:
            return dtype
    return torch.uint8


class RowCase:
    """A pool of ``POOL_BYTES`` as rows of ``length`` bytes, ``n`` distinct rows picked at random (unsorted), the
    chunk they gather into, and the torch baselines on the widest integer view of the rows."""

    def __init__(self, length: int, n: int, pool: torch.Tensor, gen: torch.Generator):
        device = pool.device
        self.length, self.n = length, n
        self.pool_rows = pool.numel() // length
        self.pool = pool
        self.idx = torch.randperm(self.pool_rows, device=device, generator=gen)[:n].contiguous()
        self.total = n * length
        self.chunk = torch.randint(0, 256, (self.total,), dtype=torch.uint8, device=device, generator=gen)
        self.out = torch.empty(self.total, dtype=torch.uint8, device=device)
        self.contig_src = torch.randint(0, 256, (self.total,), dtype=torch.uint8, device=device, generator=gen)
        self.contig_dst = torch.empty_like(self.contig_src)
        self.dtype = _widest_dtype(length)
        width = length // self.dtype.itemsize
        self.pool_view = pool[:self.pool_rows * length].view(self.dtype).view(self.pool_rows, width)
        self.out_view = self.out.view(self.dtype).view(n, width)
        self.chunk_view = self.chunk.view(self.dtype).view(n, width)
        self.src_ptrs = pool.data_ptr() + self.idx * length  # rows' addresses (gather sources)
        self.offsets = torch.arange(n, dtype=torch.int64, device=device) * length
        self.len_t = torch.full((n,), length, dtype=torch.int64, device=device)
        self.host_lengths = np.full(n, length, dtype=np.int64)

    def index_select(self):
        torch.index_select(self.pool_view, 0, self.idx, out=self.out_view)

    def index_copy(self):
        self.pool_view.index_copy_(0, self.idx, self.chunk_view)

    def contiguous(self):
        self.contig_dst.copy_(self.contig_src)

    def public(self, op: str, plan):
        """The public call with the plan reused and no checks (how a caller with cached descriptors calls)."""
        if op == "gather":
            return lambda: pxn_kernels.gather(self.src_ptrs, self.len_t, self.out, self.offsets, check=False,
                                              plan=plan)
        return lambda: pxn_kernels.scatter(self.chunk, self.offsets, self.src_ptrs, self.len_t, check=False,
                                           plan=plan)

    def prepared(self, op: str, plan):
        """The same copy bound once (PreparedCopy, direct launch): the kernel with the least host time."""
        if op == "gather":
            return PreparedCopy(self.src_ptrs, self.offsets, self.len_t, 0, self.out.data_ptr(), plan)
        return PreparedCopy(self.offsets, self.src_ptrs, self.len_t, self.chunk.data_ptr(), 0, plan)


def _row_plans(case: RowCase, device, sms: int) -> dict:
    """Candidate plans for one row size: the policy's choice, every row-kernel candidate, the grid kernel and
    the range kernel (the latter two whatever the policy would pick)."""
    plans = {"pxn": plan_for_lengths(case.host_lengths, device)}
    seen = set()
    for name, (tile, max_cols, warps, split, pps) in ROW_CANDIDATES.items():
        settings = row_settings(case.length, tile, max_cols, warps, split, pps)
        if settings not in seen:  # split is a no-op at some lengths: time each shape once
            seen.add(settings)
            plans[name] = CopyPlan(None, None, None, None, row=settings)
    plans["grid:4k/w2"] = CopyPlan(None, None, None, None, GridSettings(4096, 4096, 2, case.length))
    settings = launch_settings(case.n, device, case.total)
    pad_ends, bounds, first = plan_host(case.host_lengths, settings.ranges, settings.range_bytes)
    words = torch.from_numpy(np.concatenate([pad_ends, bounds, first]).astype(np.int64)).to(device)
    n, r = case.n, settings.ranges
    plans["range"] = CopyPlan(words[:n], words[n:n + r + 1], words[n + r + 1:], settings)
    return plans


def _row_exact(case: RowCase, op: str, call, gen, expect_gather, pool_before, expect_pool) -> bool:
    """Byte-exact check of one candidate: gather output poisoned first; scatter on a restored pool, compared
    whole (the rows written and every other byte untouched)."""
    if op == "gather":
        case.out.random_(0, 256, generator=gen)
        call()
        sync()
        return bool(torch.equal(case.out, expect_gather))
    case.pool.copy_(pool_before)
    call()
    sync()
    return bool(torch.equal(case.pool, expect_pool))


def paged_rows(args, meta: dict) -> list:
    """Rows of one size picked at random from a 1 GiB pool: pxn gather / scatter (the policy's plan through the
    public call, and every candidate kernel through a prepared launch) against ``index_select`` /
    ``index_copy_`` on the same rows (widest integer view) and one contiguous ``copy_`` of the same bytes, all
    in this run. Every pxn row carries ``exact`` (byte-exact against the torch result)."""
    device = bench_device()
    sms = 4 if SMOKE else torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    pool_bytes = (1 << 16) if SMOKE else POOL_BYTES
    pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device=device, generator=gen)
    pool_before = torch.empty_like(pool)
    sizes = [int(x) for x in args.row_sizes.split(",")] if args.row_sizes else list(ROW_SIZES)
    rows = []
    t0 = time.time()
    for length in sizes:
        case = RowCase(length, min(16 if SMOKE else ROW_COUNT, pool.numel() // length), pool, gen)
        pool_before.copy_(pool)
        expect_gather = pool_before.view(-1)[:case.pool_rows * length].view(case.pool_rows, length)[case.idx] \
            .reshape(-1).clone()
        expect_pool = pool_before.clone()
        expect_pool[:case.pool_rows * length].view(case.pool_rows, length).index_copy_(
            0, case.idx, case.chunk.view(case.n, length))
        est = max(5e-6, 2 * case.total / 3.0e12)
        reps = max(3, min(300, int(args.target_ms * 1e-3 / est)))
        base = {"mix": f"rows{length}B", "n_items": case.n, "total_bytes": case.total, "row_bytes": length,
                "pool_bytes": pool.numel(), "repeats": reps, **meta}
        contiguous_s = timed(case.contiguous, reps)
        plans = _row_plans(case, device, sms)
        for op in ("gather", "scatter"):
            torch_name = "index_select" if op == "gather" else "index_copy_"
            torch_s = timed(case.index_select if op == "gather" else case.index_copy, reps)
            pool.copy_(pool_before)
            op_rows = [dict(base, op=op, method=torch_name, gbps=case.total / torch_s / 1e9, time_us=torch_s * 1e6,
                            dtype=str(case.dtype).replace("torch.", "")),
                       dict(base, op=op, method="contiguous", gbps=case.total / contiguous_s / 1e9,
                            time_us=contiguous_s * 1e6)]
            for name, plan in plans.items():
                row = dict(base, op=op, method=name, kernel=plan.kernel,
                           launch="public call, plan reused, check=False" if name == "pxn" else "PreparedCopy")
                if plan.row is not None:
                    row["row_settings"] = asdict(plan.row)
                if name != "pxn" and time.time() - t0 > args.rows_budget_s:
                    row["skipped"] = "time budget (--rows-budget-s)"
                    op_rows.append(row)
                    continue
                try:
                    call = case.public(op, plan) if name == "pxn" else case.prepared(op, plan)
                    row["exact"] = _row_exact(case, op, call, gen, expect_gather, pool_before, expect_pool)
                    seconds = timed(call, reps)
                    row.update(gbps=case.total / seconds / 1e9, time_us=seconds * 1e6)
                except Exception as exc:  # keep the other candidates; say why this one is missing
                    row["error"] = repr(exc)[:300]
                    print(f"  rows{length}B {op} {name}: {exc!r}", flush=True)
                op_rows.append(row)
            for row in op_rows:
                if "time_us" in row:
                    row["ratio"] = torch_s * 1e6 / row["time_us"]
                    row["ratio_contiguous"] = contiguous_s * 1e6 / row["time_us"]
            rows.extend(op_rows)
            pool.copy_(pool_before)
            best = max((r for r in op_rows if r["method"] not in (torch_name, "contiguous") and "ratio" in r
                        and r.get("exact")), key=lambda r: r["ratio"], default=None)
            pxn = next(r for r in op_rows if r["method"] == "pxn")
            print(f"  rows{length:>5}B {op:>7}: {torch_name} {case.total / torch_s / 1e9:7.1f} GB/s, contiguous "
                  f"{case.total / contiguous_s / 1e9:7.1f}, pxn {pxn.get('gbps', float('nan')):7.1f} "
                  f"(x{pxn.get('ratio', float('nan')):.2f}, {pxn.get('kernel')}), best "
                  f"{best['method'] if best else '-'} x{best['ratio'] if best else float('nan'):.2f}  "
                  f"[{time.time() - t0:.0f} s]", flush=True)
        del case, expect_gather, expect_pool
        empty_cache()
    del pool, pool_before
    empty_cache()
    return rows


def policy_from_rows(rows: list, mix_rows: list = ()) -> dict:
    """A ``PXN_KERNEL_POLICY`` file from this run: per row-size class, the row-kernel candidate with the best
    worst-case ratio to index_select / index_copy_ (gather and scatter, exact only); the row kernel's
    ``max_bytes`` raised to the largest measured size where it beats the grid kernel; and the range kernel's
    ``shift`` / ``tail_block_bytes`` from the mixed mixes when a candidate beats the default by 3 % on every
    op of both mixes."""
    range_entry = _range_policy(mix_rows)
    classes = [(64, (64,)), (256, (100, 128, 256)), (640, (520, 576)), (1024, (1024,)), (1 << 62, (1500, 2048))]
    by = {}
    for r in rows:
        if "ratio" in r and r.get("exact") and r["method"].startswith(("row:", "grid:")):
            by.setdefault((r["method"], r["row_bytes"]), []).append(r["ratio"])
    out_classes = []
    for up_to, sizes in classes:
        scores = {}
        for name in ROW_CANDIDATES:
            got = [min(by[(name, s)]) for s in sizes if (name, s) in by]
            if got:
                scores[name] = min(got)
        if not scores:
            continue
        tile, max_cols, warps, split, pps = ROW_CANDIDATES[max(scores, key=scores.get)]
        out_classes.append({"up_to": up_to, "tile_bytes": tile, "max_cols": max_cols, "num_warps": warps,
                            "split": split, "programs_per_sm": pps})
    if not out_classes:
        return {"_note": "no exact row-kernel measurement", **range_entry}
    out_classes[-1]["up_to"] = 1 << 62
    max_bytes = 4095
    for size in (4096, 8192):
        row_best = max((min(v) for (name, s), v in by.items() if s == size and name.startswith("row:")), default=0)
        grid_best = max((min(v) for (name, s), v in by.items() if s == size and name.startswith("grid:")), default=0)
        if row_best > grid_best:
            max_bytes = size
    arch = "sm_90" if SMOKE else f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return {"_note": f"written by benchmarks/kernels.py --sweep on {run_meta(bench_device())['gpu']}, "
                     f"{datetime.date.today().isoformat()}",
            arch: {"row": {"max_bytes": max_bytes, "classes": out_classes}, **range_entry}}


def _range_policy(mix_rows) -> dict:
    """The RANGE_CANDIDATES override that beats the policy's range kernel by >= 3 % on every op of the mixed
    mixes (the best such by its worst gain), or {}."""
    by = {(r["mix"], r["op"], r["method"]): r["gbps"] for r in mix_rows if r["mix"].startswith("mixed")}
    keys = {(m, o) for m, o, meth in by if meth == "pxn"}
    best, best_gain = {}, 1.03
    for name, change in RANGE_CANDIDATES.items():
        gains = [by.get((m, o, name), 0) / by[(m, o, "pxn")] for m, o in keys]
        if gains and min(gains) >= best_gain:
            best, best_gain = change, min(gains)
    return dict(best)


def print_rows_table(rows: list) -> None:
    print(f"\n{'rows':>8} {'op':>7} {'torch GB/s':>10} {'contig':>8} {'pxn':>8} {'x torch':>7} {'x contig':>8} "
          f"{'kernel':>6}  best candidate")
    for r in rows:
        if r["method"] != "pxn":
            continue
        same = [x for x in rows if x["mix"] == r["mix"] and x["op"] == r["op"]]
        t = next(x for x in same if x["method"] in ("index_select", "index_copy_"))
        c = next(x for x in same if x["method"] == "contiguous")
        cands = [x for x in same if "ratio" in x and x.get("exact") and x["method"] not in
                 ("pxn", "index_select", "index_copy_", "contiguous")]
        best = max(cands, key=lambda x: x["ratio"], default=None)
        print(f"{r['mix']:>8} {r['op']:>7} {t['gbps']:10.1f} {c['gbps']:8.1f} {r.get('gbps', float('nan')):8.1f} "
              f"{r.get('ratio', float('nan')):7.3f} {r.get('ratio_contiguous', float('nan')):8.3f} "
              f"{r.get('kernel', '?'):>6}  {best['method'] + ' x%.3f' % best['ratio'] if best else '-'}"
              f"{'' if r.get('exact') else '  NOT EXACT'}")


def sweep(args) -> list:
    """Gather time per mix for a grid of launch settings (to choose the defaults; see NOTES.md)."""
    device = torch.device("cuda")
    rng = np.random.default_rng(1)
    mixes = dict(MIXES)
    mixes["mixed"] = mixed_lengths(rng)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = []
    only = os.environ.get("SWEEP_MIXES")
    for mix, lengths in mixes.items():
        if only and mix not in only.split(","):
            continue
        case = Case(lengths, device)
        contiguous_s = timed(lambda: case.contig_dst.copy_(case.contig_src), repeats_for(case.total, 1, "c"))
        grid_blocks = [int(x) for x in os.environ.get("SWEEP_BLOCKS", "2048,4096,8192,16384").split(",")]
        grid_warps = [int(x) for x in os.environ.get("SWEEP_WARPS", "4,8").split(",")]
        grid_per_sm = [int(x) for x in os.environ.get("SWEEP_PER_SM", "4,8,16,32").split(",")]
        grid_streaming = [bool(int(x)) for x in os.environ.get("SWEEP_STREAMING", "0").split(",")]
        grid_range_kb = [int(x) for x in os.environ.get("SWEEP_RANGE_KB", "0").split(",")]
        for block in grid_blocks:
            for warps in grid_warps:
                for per_sm, streaming, range_kb in [(p, st, rk) for p in grid_per_sm for st in grid_streaming
                                                    for rk in grid_range_kb]:
                    programs = max(1, min(max(case.n, per_sm * sms), 1 << 16))
                    rounds = 1 if not range_kb else max(1, min(case.total // (programs * range_kb * 1024), 64))
                    settings = LaunchSettings(block, 1024, warps, programs, streaming, rounds)
                    plan = plan_batched_copy(case.len_t, settings)
                    seconds = timed(pxn_call(case, "gather", plan), repeats_for(case.total, case.n, "pxn"), 5)
                    out.append({"mix": mix, "block_bytes": block, "num_warps": warps, "programs_per_sm": per_sm, "streaming": streaming, "range_kb": range_kb, "rounds": rounds,
                                "programs": settings.programs, "gbps": case.total / seconds / 1e9,
                                "ratio_to_contiguous": contiguous_s / seconds})
        best = max((r for r in out if r["mix"] == mix), key=lambda r: r["ratio_to_contiguous"])
        print(f"sweep {mix:>10}: best {best}", flush=True)
        del case
        torch.cuda.empty_cache()
    return out


@triton.jit
def _plain_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    # Calibration only: the simplest Triton copy of one contiguous buffer, one tile per program.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def calibrate() -> dict:
    """How close the simplest Triton copy gets to ``copy_`` at 674 MB: the ceiling for any Triton copy."""
    device = torch.device("cuda", 0)
    n = 78 * 8650752
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = {"bytes": n, "copy_gbps": n / timed(lambda: dst.copy_(src), 5) / 1e9}
    for block in (4096, 16384, 32768):
        for warps in (4, 8, 16):
            fn = lambda: _plain_copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=warps)
            out[f"plain_triton_b{block}_w{warps}_gbps"] = n / timed(fn, 5) / 1e9
    print("calibrate:", json.dumps(out), flush=True)
    return out


def probe() -> dict:
    """Where host time goes on the aux batch: Triton's launch, the direct launch, a graph replay, a copy_."""
    import pxn_kernels._launch as launch_mod
    device = torch.device("cuda")
    case = Case(MIXES["aux11"], device)
    plan = plan_batched_copy(case.len_t, launch_settings(case.n, device, case.total))
    call = pxn_call(case, "gather", plan)
    copy_call = lambda: case.contig_dst.copy_(case.contig_src)
    out = {"contiguous_us": timed(copy_call, 200) * 1e6, "host_copy_us": host_us(copy_call)}
    for launcher in ("jit", "direct"):
        launch_mod.USE_DIRECT = launcher == "direct"
        out[f"public_gather_{launcher}_us"] = timed(call, 200) * 1e6
        out[f"host_public_gather_{launcher}_us"] = host_us(call)
    direct = prepared(case, "gather", plan, graph=False)
    graph = prepared(case, "gather", plan, graph=True)
    from pxn_kernels._batched_copy import _RANGE_KERNEL
    out["launchers"] = [type(v).__name__ for v in _RANGE_KERNEL._compiled.values()]
    out["prepared_direct_us"] = timed(direct, 200) * 1e6
    out["host_prepared_direct_us"] = host_us(direct)
    out["prepared_graph_us"] = timed(graph, 200) * 1e6
    out["host_prepared_graph_us"] = host_us(graph)
    out["host_stream_lookup_us"] = host_us(lambda: launch_mod.current_stream(0))
    out["plan_us"] = timed(lambda: plan_batched_copy(case.len_t, plan.settings), 200) * 1e6
    stream = torch.cuda.Stream()
    for name, fn in (("gather", direct), ("copy_", copy_call)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(20):
                    fn()
        out[f"device_{name}_us"] = timed(g.replay, 20) * 1e6 / 20
    print("probe:", json.dumps(out), flush=True)
    return out


def host_us(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def timeit_us(fn, n=10000):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


# --- variants: kernel/plan variants against the current defaults (--variants), and their resources ---------

def _variant(name, tests, predict, small, large=None):
    return {"name": name, "tests": tests, "predict": dict(zip(VARIANT_MIXES, predict)), "small": small,
            "large": large or small}


VARIANT_MIXES = ("8KBx4096", "64KBx1024", "2.25MBx78", "8.25MBx78", "mixed", "64Bx4096", "aux11")
COPY_TOO = ("2.25MBx78", "8.25MBx78")  # mixes timed for copy as well as gather


def variants() -> list:
    """The candidate settings, current defaults first (and again last, to show the run's drift).

    Each variant is a pair of ``Regime``s: ``small`` for batches whose mean piece is under LARGE_MEAN_BYTES,
    ``large`` for the others (the split ``launch_settings`` makes); one Regime for both where the variant is a
    single policy. Aligned variants fall back to the equal split on small batches (see ``settings_for``).
    ``predict``: the gather ratio to copy_ predicted for each of VARIANT_MIXES before the first measurement
    (base: the v2b measurement). Resources of each kernel: ``--resources``.
    """
    from dataclasses import replace
    small, large = _variant_regimes()
    r32 = replace(small, max_registers=32)

    def uni(block, warps, range_kb, persistent=False, per_sm=8, prefetch=0, eager=True, regs=32):
        return kernel_variants.VariantRegime(block_bytes=block, num_warps=warps, programs_per_sm=per_sm, range_bytes=range_kb << 10,
                      persistent=persistent, prefetch=prefetch, eager=eager, max_registers=regs)
    #               8KBx4096 64KBx1024 2.25MBx78 8.25MBx78 mixed 64Bx4096 aux11
    return [
        _variant("base", "current defaults", (0.79, 0.88, 0.93, 0.925, 0.82, 1.33, 1.87), small, large),
        _variant("r32", "small regime capped at 32 registers: 16 programs/SM instead of 9 (occupancy alone)",
                 (0.86, 0.88, 0.93, 0.925, 0.82, 1.6, 1.87), r32, large),
        _variant("r32+eager", "r32 + an item's 4 descriptors in one round trip (H2; large: eager, 64 regs)",
                 (0.89, 0.885, 0.93, 0.925, 0.85, 1.7, 1.87), replace(r32, eager=True),
                 replace(large, eager=True, max_registers=64)),
        _variant("L:aligned32k", "large regime: ranges of exactly 32 KB = 1 tile, no partial tile (H1 alone)",
                 (0.79, 0.88, 0.935, 0.93, 0.82, 1.33, 1.87), small, replace(large, range_bytes=32 << 10)),
        _variant("L:aligned32k+pf2", "large: aligned 32 KB, eager, prefetch 2, 4 programs/SM = resident only, "
                 "64 regs; small as r32+eager", (0.89, 0.885, 0.94, 0.935, 0.85, 1.7, 1.87),
                 replace(r32, eager=True),
                 replace(large, range_bytes=32 << 10, eager=True, prefetch=2, programs_per_sm=4, max_registers=64)),
        _variant("np4k", "plain-copy shape: aligned 4 KB ranges, 1 per program, 4 KB/4 warps, eager, 32 regs",
                 (0.88, 0.93, 0.96, 0.96, 0.90, 1.7, 1.87), uni(4096, 4, 4)),
        _variant("np4k-lazy", "np4k with lazy descriptor loads (eager alone, one-range programs)",
                 (0.85, 0.92, 0.955, 0.955, 0.88, 1.6, 1.87), uni(4096, 4, 4, eager=False)),
        _variant("np16k/4k", "aligned 16 KB ranges, 4 KB tiles/4 warps: descriptors paid once per 4 tiles",
                 (0.88, 0.93, 0.955, 0.955, 0.89, 1.7, 1.87), uni(4096, 4, 16)),
        _variant("np8k/8k", "aligned 8 KB ranges, 8 KB tiles/4 warps (64 B per thread in flight)",
                 (0.91, 0.94, 0.96, 0.96, 0.90, 1.7, 1.87), uni(8192, 4, 8)),
        _variant("np4k/w2", "aligned 4 KB ranges, 4 KB tiles/2 warps: 32 programs/SM, 64 B per thread",
                 (0.90, 0.93, 0.96, 0.96, 0.90, 1.75, 1.87), uni(4096, 2, 4, per_sm=16)),
        _variant("np16k/16k/w8", "aligned 16 KB ranges, 16 KB tiles/8 warps, 32 regs (8 programs/SM)",
                 (0.88, 0.93, 0.95, 0.95, 0.88, 1.25, 1.85), uni(16384, 8, 16)),
        _variant("np32k/32k/w8", "aligned 32 KB ranges, 32 KB tiles/8 warps, 64 regs (the base large tile)",
                 (0.80, 0.90, 0.935, 0.935, 0.84, 0.8, 1.85), uni(32768, 8, 32, regs=64)),
        _variant("p16k/4k+pf2", "persistent, 16 programs/SM (one resident wave), aligned 16 KB, 4 KB tiles, "
                 "eager, prefetch 2", (0.90, 0.92, 0.955, 0.955, 0.88, 1.65, 1.85),
                 uni(4096, 4, 16, persistent=True, per_sm=16, prefetch=2)),
        _variant("p16k/8k+pf2", "as p16k/4k+pf2 with 8 KB tiles (64 B per thread in flight)",
                 (0.92, 0.93, 0.96, 0.96, 0.89, 1.65, 1.85),
                 uni(8192, 4, 16, persistent=True, per_sm=16, prefetch=2)),
        _variant("p16k/4k+pf1-lazy", "as p16k/4k+pf2 with prefetch 1 and lazy loads",
                 (0.87, 0.91, 0.95, 0.95, 0.86, 1.6, 1.85),
                 uni(4096, 4, 16, persistent=True, per_sm=16, prefetch=1, eager=False)),
        _variant("base-again", "current defaults, repeated: the run's drift and noise",
                 (0.79, 0.88, 0.93, 0.925, 0.82, 1.33, 1.87), small, large),
        # --- the 2-D grid kernel (pxn_kernels/_grid_copy.py), one descriptor round trip, no plan. Only for
        # batches of (nearly) equal pieces; other mixes are skipped. Predictions written before the first run.
        _variant("np32k-lazy", "np32k/32k/w8 without eager loads, no register cap",
                 (0.87, 0.95, 0.95, 0.95, 0.79, 0.5, 1.7), uni(32768, 8, 32, eager=False, regs=0)),
        _variant("np64k/32k/w8", "aligned 64 KB ranges, 32 KB tiles/8 warps: descriptors paid once per 2 tiles",
                 (0.86, 0.95, 0.955, 0.955, 0.79, 0.5, 1.7), uni(32768, 8, 64, regs=64)),
        _grid("g4k/4k/w4", "grid: 4 KB per program, 4 KB tiles, 4 warps (the plain copy's shape + 1 round trip)",
              (0.93, 0.95, 0.95, 0.95), 4096, 4096, 4),
        _grid("g8k/8k/w4", "grid: 8 KB per program, 8 KB tiles, 4 warps (64 B per thread in flight)",
              (0.94, 0.955, 0.955, 0.955), 8192, 8192, 4),
        _grid("g16k/4k/w4", "grid: 16 KB per program as 4 tiles of 4 KB, 4 warps",
              (0.92, 0.96, 0.96, 0.96), 16384, 4096, 4),
        _grid("g16k/16k/w8", "grid: 16 KB per program, 16 KB tiles, 8 warps",
              (0.93, 0.95, 0.95, 0.95), 16384, 16384, 8),
        _grid("g32k/32k/w8", "grid: 32 KB per program, 32 KB tiles, 8 warps (np32k without the range plan)",
              (0.90, 0.955, 0.955, 0.955), 32768, 32768, 8),
        _grid("g64k/32k/w8", "grid: 64 KB per program as 2 tiles of 32 KB, 8 warps",
              (0.87, 0.955, 0.955, 0.955), 65536, 32768, 8),
        # --- the 8 KB and 64 KB pieces (first grid run: 0.925 and 0.949 at best; targets 0.95)
        _grid("g4k/4k/w2", "grid: 4 KB per program, 2 warps: 32 programs/SM resident, 64 B per thread",
              (0.935, 0.95, 0.975, 0.975), 4096, 4096, 2),
        _grid("g8k/8k/w2", "grid: 8 KB per program, 2 warps: 128 B per thread in flight",
              (0.93, 0.95, 0.97, 0.97), 8192, 8192, 2),
        _grid("g8k/8k/w8", "grid: 8 KB per program, 8 warps: 32 B per thread",
              (0.92, 0.945, 0.97, 0.97), 8192, 8192, 8),
        _grid("g16k/16k/w4", "grid: 16 KB per program, 4 warps: 128 B per thread",
              (0.91, 0.95, 0.96, 0.96), 16384, 16384, 4),
        _grid("g2k/2k/w2", "grid: 2 KB per program, 2 warps (the plain copy's bytes per warp, twice the programs)",
              (0.92, 0.94, 0.97, 0.97), 2048, 2048, 2),
    ]


def _grid(name, tests, predict, seg, block, warps):
    """A variant run by the 2-D grid kernel (GridCopy) instead of the range plan."""
    v = _variant(name, tests, tuple(predict) + (None, None, None), _variant_regimes()[0])
    v["grid"] = {"seg_bytes": seg, "block_bytes": block, "num_warps": warps}
    return v


def variant_settings(variant: dict, n_items: int, total_bytes: int, multiprocessors: int):
    """VariantSettings of ``variant`` for one batch: the regime ``launch_settings`` would pick, fitted."""
    large = is_large(n_items, total_bytes, kernel_policy.defaults("sm_90"))
    return kernel_variants.variant_settings(variant["large" if large else "small"], n_items, total_bytes,
                                            multiprocessors)


def _variant_regimes():
    """The library's default (small, large) range regimes as VariantRegimes (no variant switch on)."""
    return tuple(kernel_variants.VariantRegime(r.block_bytes, r.num_warps, r.programs_per_sm, r.range_bytes,
                                               r.persistent, 0, False, r.streaming, r.tail_block_bytes, 0)
                 for r in _default_regimes())


def check_full(case: Case, op: str, call, rng_gen) -> None:
    """Byte-exact check of one op against the torch reference on fresh random data, whole output compared.

    The source is redrawn and the output poisoned with random bytes before the call, so unwritten bytes,
    stray writes and stale data all show.
    """
    case.scattered_src.random_(0, 256, generator=rng_gen)
    out = case.chunk_out if op == "gather" else case.copy_dst
    out.random_(0, 256, generator=rng_gen)
    ref = out.clone()
    call()
    if op == "gather":
        pxn_kernels.gather_torch(case.src_ptrs, case.len_t, ref, case.offsets)
    else:
        pxn_kernels.copy_torch(case.src_ptrs, case.copy_dst_ptrs - out.data_ptr() + ref.data_ptr(), case.len_t)
    torch.cuda.synchronize()
    if not torch.equal(out, ref):
        bad = (out != ref).nonzero()
        raise AssertionError(f"{op}: {bad.numel()} wrong bytes, first at {int(bad[0])} of {out.numel()}")
    # The reference itself moved the last piece (guards against a vacuous comparison).
    host = case.host_desc.numpy()
    i = case.n - 1
    s = int(host[0, i]) - case.scattered_src.data_ptr()
    d = int(host[2, i]) if op == "gather" else int(host[4, i]) - case.copy_dst.data_ptr()
    length = int(host[3, i])
    assert torch.equal(ref[d:d + length], case.scattered_src[s:s + length]), "reference did not copy"
    del ref


def device_us(fn, launches: int = 20) -> float:
    """Device time per launch: ``launches`` calls captured in one CUDA graph, replays timed."""
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(launches):
                fn()
    torch.cuda.synchronize()
    return timed(graph.replay, 10) * 1e6 / launches


def variants_run(args, device=None, multiprocessors=None) -> dict:
    """Every variant x mix: gather (and copy on the 78-block mixes) as a ratio of one contiguous copy_, each
    cell checked byte-exact (``check_full``) before it is timed. The JSON at ``args.variants`` is rewritten
    after every mix, so a run cut short keeps what it measured.

    ``device``/``multiprocessors`` default to CUDA device 0 and its SM count (a CPU dry run passes others).
    """
    device = device or torch.device("cuda", 0)
    sms = multiprocessors or torch.cuda.get_device_properties(device).multi_processor_count
    rng = np.random.default_rng(0)
    all_mixes = dict(MIXES)
    all_mixes["mixed"] = mixed_lengths(rng)
    names = args.variant_mixes.split(",") if args.variant_mixes else list(VARIANT_MIXES)
    chosen = [v for v in variants() if not args.variant_names or v["name"] in args.variant_names.split(",")]
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
              "multiprocessors": sms, "torch": torch.__version__, "triton": triton.__version__,
              "machine": platform.node(), "date": datetime.date.today().isoformat(),
              "variants": [{"name": v["name"], "tests": v["tests"], "predict": v["predict"],
                            "small": asdict(v["small"]), "large": asdict(v["large"])} for v in chosen],
              "mixes": {}, "rows": []}
    for mix in names:
        try:
            _variants_one_mix(args, mix, all_mixes[mix], chosen, device, sms, gen, t0, result)
        except Exception as exc:  # keep the other mixes; say why this one is missing
            print(f"  {mix}: {exc!r}", flush=True)
            result["mixes"].setdefault(mix, {})["error"] = repr(exc)[:300]
        torch.cuda.empty_cache()
        result["seconds"] = time.time() - t0
        if getattr(args, "variants", None):
            with open(args.variants, "w") as f:
                json.dump(result, f, indent=1)
    return result


def _variants_one_mix(args, mix, lengths, chosen, device, sms, gen, t0, result) -> None:
    case = Case(lengths, device)
    contig = lambda: case.contig_dst.copy_(case.contig_src)
    # Each timed trial ~target_ms of back-to-back calls (estimate: bytes at ~1.8 TB/s, >= 6 us per call).
    est = max(6e-6, 2 * case.total / 3.6e12)
    reps = max(3, min(400, int(args.target_ms * 1e-3 / est)))
    meta = result["mixes"][mix] = {"n_items": case.n, "total_bytes": case.total, "repeats": reps,
                                   "trials": args.trials}
    meta["contiguous_us_before"] = timed(contig, reps, args.trials) * 1e6
    small = case.total < (4 << 20)
    if small:
        meta["contiguous_device_us"] = device_us(contig)
    rows = []
    for v in chosen:
        if time.time() - t0 > args.budget_s:
            rows.append({"mix": mix, "variant": v["name"], "skipped": "time budget"})
            continue
        settings = variant_settings(v, case.n, case.total, sms)
        grid = v.get("grid")
        if grid and not grid_fits(case.n, case.total, max(lengths)):
            rows.append({"mix": mix, "variant": v["name"], "skipped": "grid kernel: pieces not of one size"})
            continue
        for op in ("gather", "copy") if mix in COPY_TOO else ("gather",):
            row = {"mix": mix, "variant": v["name"], "op": op, **({"grid": grid} if grid else {
                k: getattr(settings, k) for k in ("block_bytes", "num_warps", "programs", "rounds", "range_bytes",
                                                  "persistent", "prefetch", "eager", "max_registers")})}
            try:
                if grid:
                    if op == "gather":
                        call = GridCopy(case.src_ptrs, case.offsets, case.len_t, 0, case.chunk_out.data_ptr(),
                                        max(lengths), **grid)
                    else:
                        call = GridCopy(case.src_ptrs, case.copy_dst_ptrs, case.len_t, 0, 0, max(lengths), **grid)
                else:
                    plan = plan_batched_copy(case.len_t, settings)
                    call = variant_call(case, op, plan, graph=True)
                check_full(case, op, call, gen)
                seconds = timed(call, reps, args.trials)
                row.update(time_us=seconds * 1e6, gbps=case.total / seconds / 1e9, verified=True)
                if small and not grid:
                    row["device_us"] = device_us(variant_call(case, op, plan, graph=False))
                del call
            except Exception as exc:  # keep the other cells; say why this one is missing
                row["error"] = repr(exc)[:300]
                print(f"  {mix} {v['name']} {op}: {exc!r}", flush=True)
            rows.append(row)
    meta["contiguous_us_after"] = timed(contig, reps, args.trials) * 1e6
    contiguous_us = (meta["contiguous_us_before"] + meta["contiguous_us_after"]) / 2
    meta["contiguous_gbps"] = case.total / contiguous_us / 1e3
    for row in rows:
        if "time_us" in row:
            row["ratio"] = contiguous_us / row["time_us"]
    result["rows"].extend(rows)
    print(f"  {mix}: contiguous {meta['contiguous_us_before']:.2f} / {meta['contiguous_us_after']:.2f} us, "
          f"{time.time() - t0:.0f} s", flush=True)
    del case


def print_variant_table(result: dict) -> None:
    """Variant x mix: measured ratio to copy_ | the ratio predicted before the run (gather; copy columns too)."""
    cols = []
    for mix in result["mixes"]:
        cols.append((mix, "gather"))
        if mix in COPY_TOO:
            cols.append((mix, "copy"))
    cell = {(r["variant"], r["mix"], r.get("op")): r for r in result["rows"]}
    heads = [(m if op == "gather" else m.split("x")[0] + "-copy") for m, op in cols]
    print("\nratio to one contiguous copy_ of the same bytes: measured|predicted (pxn gather unless -copy)")
    print(f"{'variant':>16} " + " ".join(f"{h[:10]:>10}" for h in heads))
    for v in result["variants"]:
        vals = []
        for mix, op in cols:
            r = cell.get((v["name"], mix, op))
            measured = "  -  " if r is None or "ratio" not in r else f"{r['ratio']:.3f}"
            p = v["predict"].get(mix)
            p = float("nan") if p is None else p
            vals.append(f"{measured}|{f'{p:.3f}'[1:] if p < 1 else f'{p:.2f}'}".rjust(10))
        print(f"{v['name'][:16]:>16} " + " ".join(vals))
    spread = " ".join(f"{m}: {x['contiguous_us_before']:.1f}/{x['contiguous_us_after']:.1f}"
                      for m, x in result["mixes"].items() if "contiguous_us_after" in x)
    print(f"contiguous copy_ us before/after: {spread}")


def kernel_resources(target_cc: int = 90) -> list:
    """Compile every kernel configuration the variants use for sm_``target_cc`` (no GPU needed) and report
    registers, spills, local memory, 16-byte accesses in the PTX and the resident programs per SM they allow.

    Registers come from Triton's own cubin (``cuobjdump --dump-resource-usage``), spills from ``ptxas -v``
    on its PTX, both with the tools Triton bundles. Needs the real (not interpreted) kernel: run without
    TRITON_INTERPRET=1.
    """
    import re
    import subprocess
    import tempfile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernel_variants import _variant_kernel
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    configs = {}
    for v in variants():
        if v.get("grid"):
            continue  # the grid kernel's resources are not reported here (range kernel only)
        for regime_name in ("small", "large"):
            r = v[regime_name]
            key = (r.block_bytes, r.tail_block_bytes, r.num_warps, r.streaming, r.persistent,
                   r.prefetch if r.persistent else 0, r.eager, r.max_registers)
            users = configs.setdefault(key, [])
            if v["name"] not in users:
                users.append(v["name"])
    pointer = {"anchor": "*u8", **{k: "*i64" for k in ("src_index", "dst_index", "lengths", "pad_ends", "bounds",
                                                        "first_item")}}
    signature = {**pointer, "src_base": "i64", "dst_base": "i64", "n_ranges": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}  # aligned pointers, 16-divisible bases
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (block, tail, warps, streaming, persistent, prefetch, eager, regs), users in configs.items():
            constexprs = dict(BLOCK=block, TAIL_BLOCK=tail, STREAMING=streaming, PERSISTENT=persistent,
                              PREFETCH=prefetch, EAGER=eager)
            options = dict(num_warps=warps, **({"maxnreg": regs} if regs else {}))
            compiled = triton.compile(ASTSource(fn=_variant_kernel,
                                                signature={**signature, **{k: "constexpr" for k in constexprs}},
                                                constexprs=constexprs, attrs=attrs),
                                      target=GPUTarget("cuda", target_cc, 32), options=options)
            ptx = compiled.asm["ptx"]
            cubin, ptx_path = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            with open(ptx_path, "w") as f:
                f.write(ptx)
            usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                                   capture_output=True, text=True).stdout
            arch = f"sm_{target_cc}a" if target_cc >= 90 else f"sm_{target_cc}"
            # Triton's own ptxas flags (make_cubin): -lineinfo -v --gpu-name=sm_90a.
            for ptxas in ("ptxas", "ptxas-blackwell"):  # the PTX may need the newer of the two bundled
                verbose = subprocess.run([os.path.join(tools, ptxas), "-lineinfo", "-v", f"--gpu-name={arch}",
                                          ptx_path, "-o", os.path.join(tmp, "v.cubin")],
                                         capture_output=True, text=True).stderr
                if "spill stores" in verbose:
                    break
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True).stdout
            n_regs = int(re.search(r"REG:(\d+)", usage).group(1))
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
            per_warp = -(-n_regs * 32 // 256) * 256
            resident = min(32, 64 // warps, 65536 // (per_warp * warps))
            rows.append({"block_bytes": block, "num_warps": warps, "tail_block_bytes": tail, "persistent": persistent,
                         "prefetch": prefetch, "eager": eager, "max_registers": regs, "n_regs": n_regs,
                         "local_bytes": int(re.search(r"LOCAL:(\d+)", usage).group(1)),
                         "spill_stores": int(spill.group(1)) if spill else None,
                         "spill_loads": int(spill.group(2)) if spill else None,
                         **({} if spill else {"ptxas_error": verbose[-300:]}),
                         "ld_v4": len(re.findall(r"ld\.global[^\n;]*\.v4", ptx)),
                         "st_v4": len(re.findall(r"st\.global[^\n;]*\.v4", ptx)),
                         "ld_b8": ptx.count("ld.global.b8"), "tile_loop_local_ops": _tile_loop_local_ops(sass),
                         "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
                         "resident_programs_per_sm": resident,
                         "resident_warps_per_sm": resident * warps, "used_by": users})
    return rows


def _tile_loop_local_ops(sass: str) -> int:
    """Local-memory loads/stores (spill traffic) inside the innermost SASS loop that holds unpredicated 16-byte
    loads (the whole-tile loop); -1 when no such loop is found."""
    import re
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
             for m in [re.search(r"/\*([0-9a-f]{4,})\*/", line)] if m]
    best = None
    for address, line in lines:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if not target or int(target.group(1), 16) >= address:
            continue
        body = [text for a, text in lines if int(target.group(1), 16) <= a <= address]
        if any("LDG.E.128" in text and "@" not in text.split("LDG")[0] for text in body):
            if best is None or len(body) < len(best):
                best = body
    return -1 if best is None else sum(("LDL" in text or "STL" in text) for text in best)


def print_resources(rows, version: str) -> None:
    print(f"\nTriton {version}, sm_90 offline compile: registers, spills and 16-byte accesses per configuration")
    print(f"{'block':>6} {'w':>2} {'pers':>4} {'pf':>2} {'eager':>5} {'cap':>3} {'regs':>4} {'spill':>5} "
          f"{'v4 ld/st':>8} {'loopLDL':>7} {'res/SM':>6} {'warps':>5}  used by")
    for r in rows:
        print(f"{r['block_bytes']:6d} {r['num_warps']:2d} {int(r['persistent']):4d} {r['prefetch']:2d} "
              f"{int(r['eager']):5d} {r['max_registers']:3d} {r['n_regs']:4d} "
              f"{'?' if r['spill_stores'] is None else r['spill_stores']:>5} {r['ld_v4']:>3}/{r['st_v4']:<4} "
              f"{r['tile_loop_local_ops']:7d} {r['resident_programs_per_sm']:6d} {r['resident_warps_per_sm']:5d}"
              f"  {', '.join(r['used_by'])}")


def print_table(rows) -> None:
    by_key = {(r["mix"], r["op"], r["method"]): r for r in rows}
    print(f"\n{'mix':>10} {'op':>7} {'pxn GB/s':>9} {'contig':>8} {'ratio':>6} {'batch_api':>10} {'per_item':>9} "
          f"{'pxn/batch':>9} {'pxn us':>8} {'plan us':>8} {'upload us':>9}")
    for (mix, op, method), r in by_key.items():
        if method != "pxn":
            continue
        c = by_key[(mix, op, "contiguous")]["gbps"]
        b = by_key.get((mix, op, "batch_api"), {}).get("gbps", float("nan"))
        p = by_key.get((mix, op, "per_item"), {}).get("gbps", float("nan"))
        print(f"{mix:>10} {op:>7} {r['gbps']:9.2f} {c:8.2f} {r['gbps'] / c:6.3f} {b:10.3f} {p:9.3f} "
              f"{r['gbps'] / b:9.1f} {r['time_us']:8.2f} {r['plan_us']:8.2f} {r['upload_us']:9.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="JSON path (default: a temporary file; benchmarks/results/kernels-h200.json to commit)")
    parser.add_argument("--sweep", metavar="PATH",
                        help="write a launch-policy file (PXN_KERNEL_POLICY) from this run's paged-row candidates")
    parser.add_argument("--range-sweep", metavar="PATH",
                        help="also sweep range-kernel tile / warps / programs on the mixes, JSON to PATH")
    parser.add_argument("--mixes", default="", help="comma-separated subset of the mixes")
    parser.add_argument("--no-rows", action="store_true", help="skip the paged-row section")
    parser.add_argument("--rows-only", action="store_true", help="only the paged-row section")
    parser.add_argument("--row-sizes", default="", help="comma-separated row sizes (bytes) for the paged rows")
    parser.add_argument("--rows-budget-s", type=float, default=200.0,
                        help="paged rows: time only the policy's choice and the baselines after this many seconds")
    parser.add_argument("--probe", metavar="PATH", help="host-overhead probe on the aux batch, JSON to PATH")
    parser.add_argument("--nvlink", action="store_true",
                        help="pieces on GPU 1, chunk and kernel on GPU 0 (needs 2 GPUs); default --out "
                             "results/kernels-nvlink.json")
    parser.add_argument("--quick", action="store_true", help="four mixes only")
    parser.add_argument("--skip-per-item", action="store_true", help="skip the slow per-item loop")
    parser.add_argument("--variants", metavar="PATH",
                        help="only the kernel variants x mixes table (see variants()), JSON to PATH")
    parser.add_argument("--variant-names", default="", help="comma-separated subset of the variants")
    parser.add_argument("--variant-mixes", default="", help="comma-separated subset of " + ",".join(VARIANT_MIXES))
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="--variants: skip the remaining cells after this many seconds of measuring")
    parser.add_argument("--target-ms", type=float, default=8.0, help="--variants / paged rows: ms per timed trial")
    parser.add_argument("--trials", type=int, default=9, help="--variants: timed trials per cell (median)")
    parser.add_argument("--resources", metavar="PATH",
                        help="registers/spills/16-B accesses of every variant's kernel, compiled for sm_90 "
                             "(no GPU needed), JSON to PATH; with --variants on a GPU, also run there")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU dry run of this script under TRITON_INTERPRET=1 (tiny sizes; timings meaningless)")
    args = parser.parse_args()
    if args.smoke:
        global SMOKE
        SMOKE = True
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
    if args.resources:
        try:
            rows = kernel_resources()
        except Exception as exc:  # with --variants, the GPU table matters more: report and go on
            if not args.variants:
                raise
            print(f"--resources failed: {exc!r}", flush=True)
            rows = []
        with open(args.resources, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, f, indent=1)
        if not args.variants:
            print_resources(rows, triton.__version__)
            return 0
    if not torch.cuda.is_available() and not SMOKE:
        print("benchmarks/kernels.py needs a CUDA GPU; none is visible. (CPU runs: pxn bench)", file=sys.stderr)
        return 2
    if args.out is None:
        import tempfile
        args.out = os.path.join(tempfile.mkdtemp(prefix="pxn-kernels-"),
                                "kernels-nvlink.json" if args.nvlink else "kernels-h200.json")
    if args.nvlink and torch.cuda.device_count() < 2:
        print("--nvlink needs 2 GPUs", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.variants:
        result = variants_run(args)  # writes args.variants after every mix
        print(f"\nwrote {len(result['rows'])} cells to {args.variants} in {time.time() - t0:.0f} s")
        if args.resources and rows:
            print_resources(rows, triton.__version__)
        print_variant_table(result)
        return 0
    if args.probe:
        with open(args.probe, "w") as f:
            json.dump({"aux11": probe(), "calibration": calibrate()}, f, indent=1)
    if args.range_sweep:
        sweep_rows = sweep(args)
        with open(args.range_sweep, "w") as f:
            json.dump({"machine": platform.node(), "gpu": torch.cuda.get_device_name(), "rows": sweep_rows}, f,
                      indent=1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = [] if args.rows_only else run(args)
    if rows:
        print_table(rows)
    with open(args.out, "w") as f:  # written now too, so a later failure keeps these rows
        json.dump(rows, f, indent=1)
    row_rows = [] if args.no_rows or args.nvlink else paged_rows(args, run_meta(bench_device()))
    rows += row_rows
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if row_rows:
        print_rows_table(row_rows)
    if args.sweep:
        pol = policy_from_rows(row_rows, rows)
        with open(args.sweep, "w") as f:
            json.dump(pol, f, indent=1)
        print(f"\nwrote the launch policy to {args.sweep} (use: PXN_KERNEL_POLICY={args.sweep}): {json.dumps(pol)}")
    print(f"\nwrote {len(rows)} rows to {args.out} in {time.time() - t0:.0f} s")
    from transport.plots import plot_kernels
    for png in plot_kernels(rows, os.path.splitext(args.out)[0] + ".png"):  # GB/s by mix (matplotlib)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
