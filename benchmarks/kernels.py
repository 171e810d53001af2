#!/usr/bin/env python3
"""Kernel benchmark: pxn gather / scatter / copy against one contiguous copy, cudaMemcpyBatchAsync and a
per-item ``copy_`` loop, on the transfer mixes sglang produces.

GB/s = payload bytes / median time per call. A call's time is measured the way a caller experiences it:
``REPEATS`` calls issued back to back between two CUDA events, so host launch overhead counts whenever it is
larger than the device time (``triton.testing.do_bench`` flushes the L2 between calls, and the flush kernel
hides host overhead, so it is not used). Item descriptors are already on the device; their upload and the
work plan are timed separately and reported in the pxn rows (``upload_us``, ``plan_us``).

Usage: python3 benchmarks/kernels.py [--out benchmarks/results/kernels-h200.json] [--sweep] [--quick]
Needs a CUDA GPU; cuda-bindings for the batch_api rows (skipped with a message without it).
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

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pxn_kernels  # noqa: E402
from pxn_kernels._batched_copy import (  # noqa: E402
    LaunchSettings, PreparedCopy, launch_settings, plan_batched_copy,
)

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


def timed(fn, repeats: int, trials: int = 7) -> float:
    """Median seconds per call over ``trials`` runs of ``repeats`` back-to-back calls."""
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

    def __init__(self, lengths, device, remote=None):
        # remote: where the scattered pieces live (another GPU for the NVLink runs); the chunk, and the
        # kernel, are on ``device``.
        remote = remote or device
        self.lengths = lengths
        n = len(lengths)
        padded = [(x + 15) // 16 * 16 for x in lengths]
        scatter_starts = np.cumsum([0] + [p + 64 for p in padded[:-1]]).astype(np.int64) + 64
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
        self.host_desc = torch.from_numpy(host).pin_memory()
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
    torch.cuda.synchronize()
    src_base, dst_base = case.scattered_src.data_ptr(), case.scattered_dst.data_ptr()
    for i in list(range(min(case.n, 64))) + list(range(max(0, case.n - 64), case.n)):
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
    device = torch.device("cuda", 0)
    remote = torch.device("cuda", 1) if args.nvlink else device
    if args.nvlink:
        enable_peer_access(0, 1)
    rng = np.random.default_rng(0)
    mixes = dict(MIXES)
    mixes["mixed"] = mixed_lengths(rng)
    if args.quick:
        mixes = {k: v for k, v in mixes.items() if k in ("aux11", "64Bx4096", "8KBx4096", "2.25MBx78")}
    meta = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "machine": platform.node(),
            "placement": (f"pieces on {remote}, chunk and kernel on {device} (NVLink peer access)"
                          if args.nvlink else f"all on {device}")}
    stream = torch.cuda.Stream()
    rows = []
    for mix, lengths in mixes.items():
        case = Case(lengths, device, remote)
        settings = launch_settings(case.n, device, case.total)
        plan = plan_batched_copy(case.len_t, settings)
        plan_s = timed(lambda: plan_batched_copy(case.len_t, settings), 50)
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
            call = batch_api(case, op, stream)
            if call is not None:
                try:
                    with torch.cuda.stream(stream):
                        results["batch_api"] = timed(call, repeats_for(case.total, case.n, "batch_api"), trials=3)
                except Exception as exc:  # keep the other rows; say why this one is missing
                    print(f"  batch_api {mix} {op} failed: {exc!r}", flush=True)
            if not args.skip_per_item:
                results["per_item"] = timed(per_item_call(case, op), repeats_for(case.total, case.n, "per_item"),
                                            trials=3)
            for method, seconds in results.items():
                row = {"mix": mix, "op": op, "method": method, "n_items": case.n, "total_bytes": case.total,
                       "gbps": case.total / seconds / 1e9, "time_us": seconds * 1e6, **meta}
                if method == "pxn":
                    row.update(extra)
                    row.update(launch="cuda graph replay of the prepared launch (PreparedCopy(graph=True))",
                               rounds=settings.rounds, streaming=settings.streaming)
                    row.update(plan_us=plan_s * 1e6, upload_us=upload_s * 1e6,
                               ratio_to_contiguous=contiguous_s / seconds, programs=settings.programs,
                               block_bytes=settings.block_bytes, num_warps=settings.num_warps)
                rows.append(row)
            print(f"  {mix:>10} {op:>7}: " + "  ".join(f"{m} {case.total / s / 1e9:8.2f} GB/s"
                                                     for m, s in results.items()), flush=True)
        del case
        torch.cuda.empty_cache()
    return rows


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
    import pxn_kernels._batched_copy as bc
    device = torch.device("cuda")
    case = Case(MIXES["aux11"], device)
    plan = plan_batched_copy(case.len_t, launch_settings(case.n, device, case.total))
    call = pxn_call(case, "gather", plan)
    copy_call = lambda: case.contig_dst.copy_(case.contig_src)
    out = {"contiguous_us": timed(copy_call, 200) * 1e6, "host_copy_us": host_us(copy_call)}
    for launcher in ("jit", "direct"):
        bc._LAUNCHER = launcher
        out[f"public_gather_{launcher}_us"] = timed(call, 200) * 1e6
        out[f"host_public_gather_{launcher}_us"] = host_us(call)
    direct = prepared(case, "gather", plan, graph=False)
    graph = prepared(case, "gather", plan, graph=True)
    out["launchers"] = [type(v).__name__ for v in bc._COMPILED.values()]
    out["prepared_direct_us"] = timed(direct, 200) * 1e6
    out["host_prepared_direct_us"] = host_us(direct)
    out["prepared_graph_us"] = timed(graph, 200) * 1e6
    out["host_prepared_graph_us"] = host_us(graph)
    out["host_stream_lookup_us"] = host_us(lambda: bc._current_stream(0))
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
    parser.add_argument("--out", default=None, help="JSON path (default results/kernels-h200.json)")
    parser.add_argument("--sweep", metavar="PATH", help="also sweep launch settings, JSON to PATH")
    parser.add_argument("--probe", metavar="PATH", help="host-overhead probe on the aux batch, JSON to PATH")
    parser.add_argument("--nvlink", action="store_true",
                        help="pieces on GPU 1, chunk and kernel on GPU 0 (needs 2 GPUs); default --out "
                             "results/kernels-nvlink.json")
    parser.add_argument("--quick", action="store_true", help="four mixes only")
    parser.add_argument("--skip-per-item", action="store_true", help="skip the slow per-item loop")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU; none is visible. (CPU runs: pxn bench)", file=sys.stderr)
        return 2
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "kernels-nvlink.json" if args.nvlink else "kernels-h200.json")
    if args.nvlink and torch.cuda.device_count() < 2:
        print("--nvlink needs 2 GPUs", file=sys.stderr)
        return 2
    t0 = time.time()
    if args.probe:
        with open(args.probe, "w") as f:
            json.dump({"aux11": probe(), "calibration": calibrate()}, f, indent=1)
    if args.sweep:
        sweep_rows = sweep(args)
        with open(args.sweep, "w") as f:
            json.dump({"machine": platform.node(), "gpu": torch.cuda.get_device_name(), "rows": sweep_rows}, f,
                      indent=1)
    rows = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print_table(rows)
    print(f"\nwrote {len(rows)} rows to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
