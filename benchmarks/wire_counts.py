#!/usr/bin/env python3
"""What goes on the wire: RDMA work requests, ``post_send`` calls and signalled completions per batch, over verbs.

A sender engine (this process) and a receiving engine (a spawned process) on the verbs fabric, two rails each,
host memory, or GPU memory on both sides with ``--memory gpu`` (softverbs' GPUDirect model: dma-buf MRs, the
receiver's flushes counted too). For every shape the batch is written once and compared byte for byte with the expected image of
the receiver's buffer (guards included), then ``--repeat`` more times; the sender's and the receiver's
``stats()["rails"][*]["wire"]`` counters (``VerbsFabric.wire_counts``) give the counts per batch.

Counts, not speed: on softverbs (a software model of pyverbs and RC semantics, used where no RDMA NIC exists) the
timings mean nothing, and none are reported. The targets:

* ``aux11``: one WRITE_WITH_IMM in one ``post_send`` (one coalesced chunk);
* coalesced batches (``4096x64B``, the small pieces of ``mix2000+8x2MB``): ceil(chunk bytes / slot) writes;
* direct pieces (``1024x64KB``, ``kv78x2.25MB``, the 2 MB pieces of the mix): one chain per rail used, one
  signalled work request each.

    python3 benchmarks/wire_counts.py                        # softverbs beside the checkout, JSON to a temp file
    python3 benchmarks/wire_counts.py --softverbs PATH --out benchmarks/results/wire-counts-softverbs.json
    python3 benchmarks/wire_counts.py --memory gpu --out benchmarks/results/wire-counts-softverbs-gpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.append(p)

KB, MB = 1 << 10, 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
BUFFER = 256 * MB
SOFTVERBS_DEVICES = "mlx5_0:1:eth:nogid,mlx5_1:1:eth:gid,mlx5_2:1:eth:gid"


def shapes(rng) -> dict:
    mix = rng.integers(1, 8193, size=2000).tolist() + [2 * MB] * 8
    return {"aux11": list(AUX), "4096x64B": [64] * 4096, "1024x64KB": [64 * KB] * 1024,
            "kv78x2.25MB": [2359296] * 78, "mix2000+8x2MB": mix}


def use_softverbs(path: str) -> str:
    """softverbs on the path of this process and of those it starts, unless pyverbs is importable already."""
    import importlib.util
    if importlib.util.find_spec("pyverbs") is not None:
        return "pyverbs"
    if not os.path.isdir(os.path.join(path, "pyverbs")):
        raise SystemExit(f"wire_counts: no pyverbs, and no softverbs at {path} (give --softverbs PATH)")
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("SOFTVERBS_DEVICES", SOFTVERBS_DEVICES)
    os.environ.setdefault("SOFTVERBS_DIR", tempfile.mkdtemp(prefix="pxn-wire-counts-"))
    return f"softverbs ({os.environ['SOFTVERBS_DEVICES']})"


def wire_totals(stats: dict) -> dict:
    out = {"post_send": 0, "work_requests": 0, "signaled": 0, "inline": 0, "with_imm": 0}
    per_rail = []
    for r in stats["rails"]:
        w = r.get("wire") or {}
        per_rail.append(dict(w))
        for k in out:
            out[k] += int(w.get(k, 0))
    out["rails_used"] = per_rail
    return out


def flushes(stats: dict) -> dict:
    """The receiver's GPUDirect flushes so far, by method."""
    rx = stats.get("receiver", {})
    return {k[len("gpu_flush_"):]: v for k, v in rx.items() if k.startswith("gpu_flush_") and k != "gpu_flush_s"}


def delta(after: dict, before: dict, n: int) -> dict:
    d = {k: (after[k] - before[k]) / n for k in after if k != "rails_used"}
    d["rails_used"] = sum(1 for a, b in zip(after["rails_used"], before["rails_used"])
                             if a.get("post_send", 0) > b.get("post_send", 0))
    return d


def expected(lengths, coalesce_bytes: int, slot_bytes: int, rails: int) -> dict:
    """What the targets allow: ceil(bytes / slot) chunk writes (WRITE_WITH_IMM) for the coalesced pieces, one work
    request per direct piece, and at most one post per chunk plus one chain per rail for the direct pieces."""
    small = sum(n for n in lengths if n < coalesce_bytes)
    direct = sum(1 for n in lengths if n >= coalesce_bytes)
    chunks = math.ceil(small / slot_bytes)
    return {"chunk_writes": chunks, "direct_writes": direct, "posts_max": chunks + min(rails, direct)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--softverbs", default=os.environ.get("PXN_SOFTVERBS")
                    or os.path.join(os.path.dirname(ROOT), "shared", "softverbs"),
                    help="softverbs folder, used where pyverbs is not importable (default: ../shared/softverbs)")
    ap.add_argument("--repeat", type=int, default=3, help="batches counted per shape after the checked one")
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--shapes", default="", help="comma-separated subset of " + ", ".join(shapes(
        np.random.default_rng(0))))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--memory", choices=("host", "gpu"), default="host",
                    help="where the sources and the receiver's buffer live (gpu: cuda:0 on both sides)")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args()
    if args.repeat < 1 or args.rails < 1:
        ap.error(f"--repeat and --rails must be >= 1 (got {args.repeat}, {args.rails})")
    out_path = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-wire-counts-"), "wire-counts.json")
    if args.out:
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            ap.error(f"--out {args.out}: {parent} is not a writable folder")
    verbs = use_softverbs(args.softverbs)
    logging.basicConfig(level=logging.ERROR)
    from engine_helpers import EnginePeer, disjoint_offsets, write_and_check
    from transport import TransferEngine

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    table = shapes(rng)
    wanted = [s for s in args.shapes.split(",") if s] or list(table)
    unknown = [s for s in wanted if s not in table]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {list(table)}")
    src = rng.integers(0, 256, BUFFER, dtype=np.uint8)
    device = 0 if args.memory == "gpu" else -1
    src_addr, src_mem = src.ctypes.data, src
    if device >= 0:
        import torch
        if not torch.cuda.is_available():
            ap.error("--memory gpu: no CUDA GPU here")
        src_mem = torch.from_numpy(src).to("cuda:0")
        src_addr = src_mem.data_ptr()
    rows = []
    peer = EnginePeer(BUFFER, device=device, fabric="verbs", rails=args.rails, secret="wire-counts-benchmark-secret")
    try:
        with TransferEngine(fabric="verbs", rails=args.rails, secret="wire-counts-benchmark-secret") as eng:
            eng.register(src_mem)
            for name in wanted:
                lengths = np.asarray(table[name], dtype=np.int64)
                so = disjoint_offsets(rng, lengths, BUFFER)
                do = disjoint_offsets(rng, lengths, BUFFER)
                write_and_check(eng, peer, src_addr, src, so, do, lengths)  # byte-exact, handshake done
                s0, r0 = wire_totals(eng.stats()), wire_totals(peer.call("stats"))
                f0 = flushes(peer.call("stats"))
                srcs = (src_addr + so).tolist()
                dsts = (peer.base + do).tolist()
                for _ in range(args.repeat):
                    eng.batch_write(peer.session, srcs, dsts, lengths.tolist())
                s1, r1 = wire_totals(eng.stats()), wire_totals(peer.call("stats"))
                send, recv = delta(s1, s0, args.repeat), delta(r1, r0, args.repeat)
                recv["gpu_flushes"] = {k: (v - f0.get(k, 0)) / args.repeat
                                       for k, v in flushes(peer.call("stats")).items()}
                exp = expected(lengths.tolist(), eng.config.coalesce_bytes, eng.config.relay_slot_bytes, args.rails)
                meets = (send["post_send"] <= exp["posts_max"] and send["with_imm"] == exp["chunk_writes"]
                         and send["work_requests"] == exp["chunk_writes"] + exp["direct_writes"]
                         and send["signaled"] == send["post_send"])
                if device >= 0:
                    meets = meets and send["inline"] == 0  # the CPU cannot copy GPU memory into a WQE
                if name == "aux11":
                    meets = meets and send["post_send"] == 1 and send["with_imm"] == 1 and send["work_requests"] == 1
                rows.append({"shape": name, "pieces": int(lengths.size), "bytes": int(lengths.sum()),
                             "sender": send, "receiver": recv, "expected": exp, "meets": bool(meets)})
                print(f"{name:>15}: {send['work_requests']:7.1f} WR {send['post_send']:5.1f} posts "
                      f"{send['signaled']:5.1f} signalled {send['with_imm']:5.1f} imm {send['inline']:6.1f} inline "
                      f"({send['rails_used']} rails used over {args.repeat} batches) | receiver {recv['work_requests']:5.1f} WR "
                      f"{recv['post_send']:5.1f} posts | {'meets' if meets else 'MISSES'} {exp}", flush=True)
            coalesce, slot = eng.config.coalesce_bytes, eng.config.relay_slot_bytes
    finally:
        peer.close()
    import torch
    doc = {"benchmark": "wire_counts", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "verbs": verbs, "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__, "seed": seed,
        "memory": args.memory, "rails": args.rails, "repeat": args.repeat, "coalesce_bytes": coalesce, "slot_bytes": slot,
        "note": "counts per batch (means over --repeat batches); speed on a model means nothing", "rows": rows}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out_path}")
    return 0 if all(r["meets"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
