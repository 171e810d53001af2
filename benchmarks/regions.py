#!/usr/bin/env python3
"""Batches over many registered regions, as sglang makes them: the message path's time per call when every
piece lies in a region of its own on both sides, against the same pieces inside one region on each side.

sglang registers each layer's KV buffer and each aux buffer on its own (``batch_register`` of a pointer per
buffer), so one of its ``batch_transfer_sync`` calls names a region per layer, or per aux buffer, on each side.
Two processes, ipc fabric with ``loadstore=False`` (the message path), host memory or, with ``--device N``, GPU
``N``'s memory on both sides; the receiver registers one extra region per piece. Per shape and layout: every piece
verified byte for byte once, then ``--calls`` calls timed after ``--warm`` (median and 10th percentile, µs per
call).

Shapes: ``aux11`` (sglang's aux batch), ``78x64KB`` (a block per layer of a 78-layer model) and, on a GPU,
``78x2.25MB`` (the per-layer latent blocks of the sglang 64k shape, 184 MB). On a machine with two rails the
planner cuts a batch of several MB into a run per rail, each written inline by the caller in either layout.

Usage: python3 benchmarks/regions.py [--device N] [--shapes aux11,78x64KB] [--calls 300] [--warm 50] [--seed N]
[--out PATH]   (default output: a temporary file)
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
SHAPES = {"aux11": [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64], "78x64KB": [65536] * 78,
          "78x2.25MB": [2359296] * 78}
HOST_SHAPES = ("aux11", "78x64KB")  # the default on host memory: 78 x 2.25 MB is a GPU shape
PAD = 64  # bytes around each piece inside its own region (the piece sits at an odd offset)


def _units(stats: dict) -> dict:
    return {path: v["units"] for path, v in stats["paths"].items()}


def timed(eng, session, srcs, dsts, lens, warm: int, calls: int) -> dict:
    """Median and 10th percentile µs per call, and per call: the units of each path the engine made (a batch
    written inline or posted whole is one direct unit) and the engine's own ms in each step (``stats()["time_s"]``)."""
    for _ in range(warm):
        eng.batch_write(session, srcs, dsts, lens)
    before = eng.stats()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        eng.batch_write(session, srcs, dsts, lens)
        times.append(time.perf_counter() - t0)
    after = eng.stats()
    u0, u1 = _units(before), _units(after)
    return {"median_us": round(float(np.median(times)) * 1e6, 1),
            "p10_us": round(float(np.percentile(times, 10)) * 1e6, 1),
            "units_per_call": {p: round((u1[p] - u0.get(p, 0)) / calls, 2) for p in u1 if u1[p] != u0.get(p, 0)},
            "ms_per_call": {k: round((v - before["time_s"].get(k, 0)) / calls * 1e3, 4)
                            for k, v in after["time_s"].items() if v != before["time_s"].get(k, 0)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls per shape and layout")
    ap.add_argument("--warm", type=int, default=50, help="untimed calls before them")
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: random, printed)")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    ap.add_argument("--device", type=int, default=-1, help="GPU index for both sides' memory (default -1: host)")
    ap.add_argument("--shapes", default=None,
                    help=f"comma-separated subset of {', '.join(SHAPES)} (default: {', '.join(HOST_SHAPES)} on host "
                         f"memory, all on a GPU)")
    args = ap.parse_args()
    if args.calls < 1 or args.warm < 0:
        ap.error(f"--calls must be >= 1 and --warm >= 0, got {args.calls} and {args.warm}")
    names = args.shapes.split(",") if args.shapes else list(HOST_SHAPES if args.device < 0 else SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    from engine_helpers import EnginePeer, Expected
    from transport import TransferEngine
    from transport.peer_process import POISON, Buffer, digest
    dev = args.device
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    memory = "host" if dev < 0 else f"GPU {dev}"
    print(f"regions: ipc loadstore=False, {memory} memory; seed {seed}; {args.calls} calls after {args.warm}",
          flush=True)
    rows = []
    total = sum(sum(SHAPES[n]) for n in names)
    peer = EnginePeer(2 * total + 2 * MB, device=dev, fabric="ipc", loadstore=False)
    seeds = iter(rng.integers(0, 1 << 31, size=1 + sum(len(SHAPES[n]) for n in names)).tolist())
    try:
        with TransferEngine(fabric="ipc", loadstore=False) as eng:
            one = Buffer(2 * total + 2 * MB, dev, random_seed=next(seeds))
            eng.register(one.addr, one.nbytes, device=dev)
            one_host = one.host()
            pos = 0
            for name in names:
                lengths = SHAPES[name]
                ln = np.asarray(lengths, dtype=np.int64)
                # one region each side: the pieces at odd offsets inside the two big buffers
                offs = pos + np.cumsum(ln + 3) - ln
                pos = int(offs[-1] + ln[-1] + 64)
                layouts = {"one region": (one.addr + offs, peer.base + offs, None)}
                # a region per piece each side
                bufs = [Buffer(n + PAD, dev, random_seed=next(seeds)) for n in lengths]
                for b in bufs:
                    eng.register(b.addr, b.nbytes, device=dev)
                extras = [peer.call("register_extra", size=n + PAD, device=dev) for n in lengths]
                s_off, d_off = rng.integers(1, PAD, ln.size), rng.integers(1, PAD, ln.size)
                layouts["region per piece"] = (np.array([b.addr + int(o) for b, o in zip(bufs, s_off)]),
                                               np.array([a + int(o) for a, o in zip(extras, d_off)]), extras)
                for layout, (srcs, dsts, ex) in layouts.items():
                    srcs, dsts = srcs.astype(np.int64), dsts.astype(np.int64)
                    peer.poison()
                    eng.batch_write(peer.session, srcs, dsts, ln)
                    if ex is None:
                        exp = Expected(peer.size)
                        exp.apply(one_host, offs, offs, lengths)
                        exact = peer.call("digest") == exp.digest()
                    else:
                        exact = True
                        for k, (a, n) in enumerate(zip(ex, lengths)):
                            img = np.full(n + PAD, POISON, dtype=np.uint8)
                            img[d_off[k]:d_off[k] + n] = bufs[k].host()[s_off[k]:s_off[k] + n]
                            exact &= peer.call("extra_digest", addr=a) == digest(img)
                    row = {"shape": name, "pieces": int(ln.size), "bytes": int(ln.sum()), "layout": layout,
                           "byte_exact": bool(exact), **timed(eng, peer.session, srcs, dsts, ln, args.warm, args.calls)}
                    rows.append(row)
                    print(f"  {name:9s} {layout:17s} {row['median_us']:9.1f} us median {row['p10_us']:9.1f} us p10 "
                          f"exact={exact} units/call {row['units_per_call']}", flush=True)
            paths = eng.stats()["paths"]
    finally:
        peer.close()
    out = {"rows": rows, "seed": seed, "calls": args.calls, "warm": args.warm, "fabric": "ipc", "memory": memory,
           "paths": paths, "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "numpy": np.__version__, "load_average_1min_at_end": round(os.getloadavg()[0], 2),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if dev >= 0:
        import torch
        import triton
        out.update(gpu=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__)
    path = args.out or os.path.join(tempfile.gettempdir(), "pxn-regions-cpu.json" if dev < 0 else "pxn-regions-gpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0 if all(r["byte_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
