#!/usr/bin/env python3
"""Host time of the public kernel calls: what a checked ``gather`` / ``scatter`` / ``copy`` costs the calling
thread (argument validation, reading the descriptors, the plan, its upload, the launch's argument set-up), and
``plan_for_lengths`` alone.

Each call is timed with both kinds of index arguments (the ``args`` field of a row):

* ``host``: numpy int64 arrays the caller already has (checked where they are, then moved to the GPU in one
  copy through a reused pinned staging buffer);
* ``device``: int64 tensors on the copy's device (a checked call reads them to the host first: on a GPU one
  device-to-host copy and one synchronisation with the stream).

and, with tensors on the device and a plan made once (``plan_for_lengths``), two rows per call for a caller that
keeps its descriptors (the ``call`` field; checked calls are ``checked``):

* ``unchecked``: the public call with ``check=False, plan=...`` over the same tensors every time (what the
  engine and relay pay per launch);
* ``bound``: the launch bound once to those tensors (``PreparedCopy``), the floor the unchecked call approaches.

On a machine without a GPU the tensors are CPU tensors and the kernel launch itself is stubbed (the Triton
kernel object's ``[grid]`` returns a no-op), so the figure is the Python / numpy / torch work around the launch;
there both kinds take the same path (numpy arrays are viewed as CPU tensors, nothing is moved).
On a GPU (``--device cuda``) nothing is stubbed: the launch, the upload and the read are real.

Target (issue 12): a checked call <= 30 us + 10 ns per piece; ``plan_for_lengths`` of 4096 pieces <= 20 us.

Usage: python3 benchmarks/kernel_host_time.py [--device cpu|cuda] [--out PATH] [--args host,device]
[--no-unchecked]
(default output: a temporary file)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

pxn_kernels = None  # imported in main(), after TRITON_INTERPRET is set for CPU runs

COUNTS = (16, 1024, 4096, 32768)


def stub_launches() -> None:
    """Make every Triton kernel launch a no-op (CPU runs: the host work around the launch is what is timed)."""
    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        cls.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)


def host_us(fn, min_seconds: float = 0.3, device=None):
    """Host microseconds per call, (median, 10th percentile), calls timed one by one for at least
    ``min_seconds``. On a shared machine the 10th percentile is the better estimate of the uncontended cost
    (other processes preempt some calls)."""
    fn()
    samples = []
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline or len(samples) < 20:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if device is not None and device.type == "cuda" and len(samples) % 50 == 0:
            torch.cuda.synchronize()  # keep the queue short
    samples.sort()
    return statistics.median(samples) * 1e6, samples[len(samples) // 10] * 1e6


class Batch:
    """``n`` pieces in a pool: ``kind`` "rows" (2 KiB rows picked at random, unsorted) or "mixed" (1 B - 8 KiB
    pieces, sorted, odd offsets); a chunk they gather into."""

    def __init__(self, n: int, kind: str, device: torch.device, rng):
        if kind == "rows":
            length = 2048
            lengths = np.full(n, length, dtype=np.int64)
            pool_rows = 2 * n
            self.pool = torch.empty(pool_rows * length, dtype=torch.uint8, device=device)
            starts = rng.permutation(pool_rows)[:n].astype(np.int64) * length
        else:
            lengths = rng.integers(1, 8193, n).astype(np.int64)
            gaps = rng.integers(0, 16, n).astype(np.int64)
            starts = np.cumsum(np.concatenate(([0], lengths[:-1] + gaps[:-1]))) + gaps[0]
            self.pool = torch.empty(int(starts[-1] + lengths[-1]) + 16, dtype=torch.uint8, device=device)
        offsets = np.concatenate(([0], np.cumsum((lengths + 15) & -16)[:-1])).astype(np.int64)
        self.chunk = torch.empty(int(offsets[-1] + lengths[-1]) + 16, dtype=torch.uint8, device=device)
        self.host_lengths = lengths
        self.pool2 = torch.empty_like(self.pool)
        self.device = self.pool.device  # with its index (a host-array copy is told its GPU)
        # the index arguments as host arrays (numpy int64) and as tensors on the device
        self.host = {"ptrs": self.pool.data_ptr() + starts, "lengths": lengths, "offsets": offsets,
                     "copy_dst": self.pool2.data_ptr() + starts}  # copy: pool -> a second pool at the same layout
        self.on_device = {k: torch.from_numpy(np.ascontiguousarray(a)).to(device) for k, a in self.host.items()}

    def calls(self, args: str = "device"):
        """The three checked calls with index arguments of kind ``args`` ("host" or "device")."""
        a = self.host if args == "host" else self.on_device
        ptrs, lengths, offsets, copy_dst = a["ptrs"], a["lengths"], a["offsets"], a["copy_dst"]
        device = self.device if args == "host" else None
        return {
            "gather": lambda: pxn_kernels.gather(ptrs, lengths, self.chunk, offsets, backend="triton"),
            "scatter": lambda: pxn_kernels.scatter(self.chunk, offsets, ptrs, lengths, backend="triton"),
            "copy": lambda: pxn_kernels.copy(ptrs, copy_dst, lengths, backend="triton", device=device),
        }

    def reused(self):
        """(unchecked public calls, bound launches) over the device tensors with one plan made before."""
        a = self.on_device
        ptrs, lengths, offsets, copy_dst = a["ptrs"], a["lengths"], a["offsets"], a["copy_dst"]
        plan = pxn_kernels.plan_for_lengths(self.host_lengths, self.device)
        chunk = self.chunk
        unchecked = {
            "gather": lambda: pxn_kernels.gather(ptrs, lengths, chunk, offsets, check=False, plan=plan,
                                                 backend="triton"),
            "scatter": lambda: pxn_kernels.scatter(chunk, offsets, ptrs, lengths, check=False, plan=plan,
                                                   backend="triton"),
            "copy": lambda: pxn_kernels.copy(ptrs, copy_dst, lengths, check=False, plan=plan, backend="triton"),
        }
        prepared = pxn_kernels.PreparedCopy
        bound = {
            "gather": prepared(ptrs, offsets, lengths, 0, chunk.data_ptr(), plan),
            "scatter": prepared(offsets, ptrs, lengths, chunk.data_ptr(), 0, plan),
            "copy": prepared(ptrs, copy_dst, lengths, 0, 0, plan),
        }
        return unchecked, bound


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    parser.add_argument("--label", default="", help="what code was measured (kept in the JSON)")
    parser.add_argument("--args", default="host,device", help="index argument kinds to time: host, device or both")
    parser.add_argument("--no-unchecked", action="store_true",
                        help="skip the unchecked-call and bound-launch rows (plan reused)")
    args = parser.parse_args()
    device = torch.device(args.device)
    global pxn_kernels
    if device.type == "cpu":
        # the CPU tensors need the interpreted kernel objects ("triton" backend); their launches are stubbed
        os.environ["TRITON_INTERPRET"] = "1"
    import pxn_kernels
    if device.type == "cpu":
        stub_launches()
    rng = np.random.default_rng(0)
    rows = []
    for n in [int(x) for x in args.counts.split(",")]:
        for kind in ("rows", "mixed"):
            batch = Batch(n, kind, device, rng)
            budget = 30 + 0.01 * n
            for arg_kind in args.args.split(","):
                for op, call in batch.calls(arg_kind).items():
                    us, p10 = host_us(call, device=device)
                    rows.append({"op": op, "call": "checked", "pieces": n, "kind": kind, "args": arg_kind,
                                 "host_us": us, "host_us_p10": p10, "target_us": budget,
                                 "within_target_p10": p10 <= budget})
                    print(f"{op:>8} {kind:>6} {arg_kind:>6} n={n:>6}: median {us:8.1f} us, p10 {p10:8.1f} "
                          f"(target {budget:6.1f})", flush=True)
            if not args.no_unchecked:
                unchecked, bound = batch.reused()
                for op in unchecked:
                    for call_kind, call in (("unchecked", unchecked[op]), ("bound", bound[op])):
                        us, p10 = host_us(call, device=device)
                        rows.append({"op": op, "call": call_kind, "pieces": n, "kind": kind, "args": "device",
                                     "host_us": us, "host_us_p10": p10})
                        print(f"{op:>8} {kind:>6} {call_kind:>9} n={n:>6}: median {us:8.1f} us, p10 {p10:8.1f}",
                              flush=True)
            plan_us, p10 = host_us(lambda: pxn_kernels.plan_for_lengths(batch.host_lengths, device), device=device)
            rows.append({"op": "plan_for_lengths", "pieces": n, "kind": kind, "host_us": plan_us, "host_us_p10": p10})
            print(f"{'plan':>8} {kind:>6} {'host':>6} n={n:>6}: median {plan_us:8.1f} us, p10 {p10:8.1f}",
                  flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {"machine": platform.node(), "load_average_1min_at_end": load, "processor": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
              "numpy": np.__version__, "date": datetime.date.today().isoformat(), "device": str(device),
              "launch": "stubbed (no GPU)" if device.type == "cpu" else "real", "label": args.label,
              "statistic": "per-call host time timed one call at a time; median and 10th percentile", "rows": rows}
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-host-time-"), "kernel-host-time.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
