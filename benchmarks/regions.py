#!/usr/bin/env python3
"""Batches over many registered regions, as sglang makes them: the message path's time per call when every
piece lies in a region of its own on both sides, against the same pieces inside one region on each side.

sglang registers each layer's KV buffer and each aux buffer on its own (``batch_register`` of a pointer per
buffer), so one of its ``batch_transfer_sync`` calls names a region per layer, or per aux buffer, on each side.
Two processes, ipc fabric with ``loadstore=False`` (the message path), host memory; the receiver registers one
extra region per piece. Per shape and layout: every piece verified byte for byte once, then ``--calls`` calls
timed after ``--warm`` (median and 10th percentile, µs per call).

Shapes: ``aux11`` (sglang's aux batch) and ``78x64KB`` (a block per layer of a 78-layer model). On a machine
with two rails the planner splits a batch of several MB between them, which is posted either way.

Usage: python3 benchmarks/regions.py [--calls 300] [--warm 50] [--seed N] [--out PATH]
(default output: a temporary file)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.append(p)  # appended: a PYTHONPATH given by the caller (another checkout) takes precedence

MB = 1 << 20
SHAPES = {"aux11": [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64], "78x64KB": [65536] * 78}
PAD = 64  # bytes around each piece inside its own region (the piece sits at an odd offset)


def timed(eng, session, srcs, dsts, lens, warm: int, calls: int) -> dict:
    for _ in range(warm):
        eng.batch_write(session, srcs, dsts, lens)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        eng.batch_write(session, srcs, dsts, lens)
        times.append(time.perf_counter() - t0)
    return {"median_us": round(float(np.median(times)) * 1e6, 1),
            "p10_us": round(float(np.percentile(times, 10)) * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls per shape and layout")
    ap.add_argument("--warm", type=int, default=50, help="untimed calls before them")
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: random, printed)")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args()
    if args.calls < 1 or args.warm < 0:
        ap.error(f"--calls must be >= 1 and --warm >= 0, got {args.calls} and {args.warm}")
    from engine_helpers import EnginePeer, Expected
    from transport import TransferEngine
    from transport.peer_process import POISON, digest
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    print(f"regions: ipc loadstore=False, host memory; seed {seed}; {args.calls} calls after {args.warm}", flush=True)
    rows = []
    total = sum(sum(v) for v in SHAPES.values())
    peer = EnginePeer(2 * total + 2 * MB, fabric="ipc", loadstore=False)
    try:
        with TransferEngine(fabric="ipc", loadstore=False) as eng:
            one = np.frombuffer(rng.bytes(2 * total + 2 * MB), dtype=np.uint8).copy()
            eng.register(one)
            pos = 0
            for name, lengths in SHAPES.items():
                ln = np.asarray(lengths, dtype=np.int64)
                # one region each side: the pieces at odd offsets inside the two big buffers
                offs = pos + np.cumsum(ln + 3) - ln
                pos = int(offs[-1] + ln[-1] + 64)
                layouts = {"one region": (one.ctypes.data + offs, peer.base + offs, [one], None)}
                # a region per piece each side
                bufs = [np.frombuffer(rng.bytes(n + PAD), dtype=np.uint8).copy() for n in lengths]
                for b in bufs:
                    eng.register(b)
                extras = [peer.call("register_extra", size=n + PAD, device=-1) for n in lengths]
                s_off, d_off = rng.integers(1, PAD, ln.size), rng.integers(1, PAD, ln.size)
                layouts["region per piece"] = (np.array([b.ctypes.data + int(o) for b, o in zip(bufs, s_off)]),
                                               np.array([a + int(o) for a, o in zip(extras, d_off)]), bufs, extras)
                for layout, (srcs, dsts, _, ex) in layouts.items():
                    srcs, dsts = srcs.astype(np.int64), dsts.astype(np.int64)
                    peer.poison()
                    eng.batch_write(peer.session, srcs, dsts, ln)
                    if ex is None:
                        exp = Expected(peer.size)
                        exp.apply(one, offs, offs, lengths)
                        exact = peer.call("digest") == exp.digest()
                    else:
                        exact = True
                        for k, (a, n) in enumerate(zip(ex, lengths)):
                            img = np.full(n + PAD, POISON, dtype=np.uint8)
                            img[d_off[k]:d_off[k] + n] = bufs[k][s_off[k]:s_off[k] + n]
                            exact &= peer.call("extra_digest", addr=a) == digest(img)
                    row = {"shape": name, "pieces": int(ln.size), "bytes": int(ln.sum()), "layout": layout,
                           "byte_exact": bool(exact), **timed(eng, peer.session, srcs, dsts, ln, args.warm, args.calls)}
                    rows.append(row)
                    print(f"  {name:8s} {layout:17s} {row['median_us']:9.1f} us median {row['p10_us']:9.1f} us p10 "
                          f"exact={exact}", flush=True)
            paths = eng.stats()["paths"]
    finally:
        peer.close()
    out = {"rows": rows, "seed": seed, "calls": args.calls, "warm": args.warm, "fabric": "ipc", "memory": "host",
           "paths": paths, "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "numpy": np.__version__, "load_average_1min_at_end": round(os.getloadavg()[0], 2),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path = args.out or os.path.join(tempfile.gettempdir(), "pxn-regions-cpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0 if all(r["byte_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
