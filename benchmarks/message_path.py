#!/usr/bin/env python3
"""The message path and PXN on a machine with two GPUs: two processes, GPU memory, every shape byte-exact.

The message path is the path that leaves the host: planner, relay rings, fabric writes, receiver, acks. Here the
ipc fabric with ``loadstore=False`` (CUDA IPC as the wire) and tcp stand in for the NIC. Both ends keep their
data on GPU 1; their one NIC sits next to GPU 1 or GPU 0 (``transport.topology.synthetic(2, {gpu: ["mlx5_0"]})``):

* ``direct``: both NICs next to GPU 1;
* ``pxn_send``: the sender's NIC next to GPU 0: the sender relays through GPU 0 (NVLink copy, then the write);
* ``pxn_recv``: the receiver's NIC next to GPU 0: chunks land on GPU 0 and the receiver forwards them;
* ``pxn_both``: both.

Rows of two more kinds, measured in the same run, are the yardsticks: ``loadstore`` (ipc, the same-host
load/store shortcut, direct topology) and ``nvlink_copy`` (one contiguous ``copy_`` of the shape's bytes from
GPU 1 to GPU 0).

For every (fabric, topology) a sender engine and a receiving engine in a spawned process are made; for every
shape the receiver's buffer (with guards) is poisoned, the shape written once and compared with the expected
image, then timed: wall time of ``batch_write`` calls, median of ``--repeat``. Each row carries the engine's
``stats()`` time breakdown per call, the ipc rows their floor (``copy_alone_ms``: the same pieces through the
fabric's bound GPU copy alone, in the sender's process), and the streamed columns: ms per batch with
``--inflight`` batches submitted before waiting (``batch_write_async``), where host work overlaps earlier
batches' copies.

With one GPU visible, only the direct and loadstore rows are measured (both processes on that GPU, both NICs
next to it) and the files are named ``-x1`` instead of ``-x2``, plus ``relay_x1``: the direct topology with the
sender's engine made with ``relay="always"``, so that every piece goes through a relay slot on the data's own GPU
(a copy into the slot, then the write from it): the relay's machinery and its host cost, without NVLink.

Writes ``pxn-x2.json`` (direct, pxn_* and relay_x1 rows, both fabrics) and ``message-path-x2.json`` (ipc rows,
loadstore and nvlink_copy) into ``--out`` (default: a fresh temporary folder) and prints a table last.

    python3 benchmarks/message_path.py --out $OUT
    python3 benchmarks/message_path.py --fabrics ipc --shapes aux11,kv78x2.25MB --repeat 5   # quick look
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.append(p)  # appended: a PYTHONPATH given by the caller (another checkout) takes precedence

KB, MB = 1 << 10, 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
TOPOLOGIES = {"direct": (1, 1), "pxn_send": (0, 1), "pxn_recv": (1, 0), "pxn_both": (0, 0)}
# GPU of the NIC at (sender, receiver) per topology, with the data on GPU 1; on a machine with one GPU only the
# direct rows exist (both NICs next to GPU 0, where the data is) and the files are named -x1
ONE_GPU_TOPOLOGIES = {"direct": (0, 0), "relay_x1": (0, 0)}  # relay_x1: the sender relays every piece
BUFFER = 256 * MB


def shapes(rng) -> dict:
    """The shapes by name. ``2808x64KB`` holds the bytes of ``kv78x2.25MB`` exactly (184 MB) in 64 KB pieces: the
    piece size compared at equal bytes per batch, where ``1024x64KB`` (67 MB) also differs in batch size, which
    on a wire of ~2 TB/s puts a batch's fixed host cost into the comparison."""
    mix = rng.integers(1, 8193, size=2000).tolist() + [2 * MB] * 8
    return {"kv78x2.25MB": [2359296] * 78, "1024x64KB": [64 * KB] * 1024, "2808x64KB": [64 * KB] * 2808,
            "4096x64B": [64] * 4096, "aux11": list(AUX), "mix2000+8x2MB": mix}


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    import torch
    import triton
    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "date": _now()}


def _time_breakdown(before: dict, after: dict, calls: int) -> dict:
    keys = set(before) | set(after)
    return {k: round((after.get(k, 0) - before.get(k, 0)) / calls * 1e3, 4) for k in sorted(keys)}


def _write_profile(prof, path: str) -> None:
    """The calling thread's profile of the timed calls: the 40 functions with the most cumulative time."""
    import io
    import pstats
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def _receiver_breakdown(before: dict, after: dict, calls: int) -> dict:
    """The receiver's chunks and items per timed call, and its milliseconds per call in each step (``*_s``
    counters: queue, validate, scatter, ack)."""
    out = {}
    for k, v in after.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or k in ("senders", "landing_slots", "slot_bytes"):
            continue
        d = (v - before.get(k, 0)) / calls
        out[k[:-2] + "_ms" if k.endswith("_s") else k] = round(d * 1e3 if k.endswith("_s") else d, 4)
    return out


def run_pair(fabric: str, topology: str, all_shapes: dict, repeat: int, rng, args) -> list:
    import torch
    from engine_helpers import EnginePeer, Expected, disjoint_offsets
    from transport import TransferEngine
    from transport.topology import synthetic
    loadstore = topology == "loadstore"
    gpus = 2 if args.data_gpu == 1 else 1
    send_nic, recv_nic = (TOPOLOGIES if gpus == 2 else ONE_GPU_TOPOLOGIES)["direct" if loadstore else topology]
    kw = {"fabric": fabric}
    if fabric == "ipc":
        kw["loadstore"] = loadstore
    if not args.no_topology:
        kw_send = dict(kw, topology=synthetic(gpus, {send_nic: ["mlx5_0"]}))
        kw_recv = dict(kw, topology=synthetic(gpus, {recv_nic: ["mlx5_0"]}))
    else:
        kw_send = kw_recv = kw
    if topology == "relay_x1":
        kw_send = dict(kw_send, relay="always")
    if args.forward_large:
        kw_recv = dict(kw_recv, forward_large=True)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        tag = f"{fabric}-{topology}"
        kw_send = dict(kw_send, trace_path=os.path.join(args.trace, f"trace-send-{tag}.json"))
        kw_recv = dict(kw_recv, trace_path=os.path.join(args.trace, f"trace-recv-{tag}.json"))
    rows = []
    peer = EnginePeer(BUFFER, device=args.data_gpu, **kw_recv)
    try:
        with TransferEngine(**kw_send) as eng:
            src = torch.randint(0, 256, (BUFFER,), dtype=torch.uint8, device=f"cuda:{args.data_gpu}")
            eng.register(src)
            src_host = src.cpu().numpy()
            for name, lengths in all_shapes.items():
                s_off = disjoint_offsets(rng, lengths, BUFFER)
                d_off = disjoint_offsets(rng, lengths, BUFFER)
                srcs = (src.data_ptr() + s_off).astype(np.int64)
                dsts = (peer.base + d_off).astype(np.int64)
                lens = np.asarray(lengths, dtype=np.int64)
                nbytes = int(lens.sum())
                row = {"fabric": fabric, "topology": topology, "shape": name, "pieces": len(lengths),
                       "bytes": nbytes, "forward_large": bool(args.forward_large)}
                try:
                    peer.poison()
                    exp = Expected(BUFFER)
                    exp.apply(src_host, s_off, d_off, lengths)
                    eng.batch_write(peer.session, srcs, dsts, lens)
                    try:
                        peer.check(exp)
                        row["byte_exact"] = True
                    except AssertionError as e:
                        row["byte_exact"] = False
                        row["mismatch"] = str(e)[:300]
                    n_rep = repeat if nbytes >= MB else repeat * 3
                    for _ in range(2):
                        eng.batch_write(peer.session, srcs, dsts, lens)
                    t_before = eng.stats()["time_s"]
                    rx_before = peer.call("stats").get("receiver") or {}
                    times = []
                    prof = None
                    if args.profile:
                        import cProfile
                        prof = cProfile.Profile()
                        prof.enable()
                    for _ in range(n_rep):
                        t0 = time.perf_counter()
                        eng.batch_write(peer.session, srcs, dsts, lens)
                        times.append(time.perf_counter() - t0)
                    if prof is not None:
                        prof.disable()
                        _write_profile(prof, os.path.join(args.profile, f"profile-{fabric}-{topology}-{name}.txt"))
                    t_after = eng.stats()["time_s"]
                    rx_after = peer.call("stats").get("receiver") or {}
                    ms = float(np.median(times)) * 1e3
                    row.update(ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 3),
                               ms_min=round(min(times) * 1e3, 4), repeat=n_rep,
                               time_ms_per_call=_time_breakdown(t_before, t_after, n_rep),
                               receiver_per_call=_receiver_breakdown(rx_before, rx_after, n_rep))
                    if args.inflight > 1:
                        row.update(streamed(eng, peer.session, srcs, dsts, lens, args.inflight, n_rep))
                    if fabric == "ipc" and not args.no_copy_floor:
                        try:
                            row.update(copy_alone(args.data_gpu, srcs, d_off, lens, n_rep))
                        except Exception as e:  # noqa: BLE001 — the floor is a yardstick: the row stands without it
                            row["copy_alone_error"] = f"{type(e).__name__}: {e}"[:300]
                except Exception as e:  # noqa: BLE001 — a failing row is reported, the run goes on
                    row.update(error=f"{type(e).__name__}: {e}"[:500], byte_exact=False)
                    traceback.print_exc()
                rows.append(row)
                print(f"  {fabric:4s} {topology:9s} {name:14s} {row.get('ms', float('nan')):9.3f} ms "
                      f"{row.get('gbps', float('nan')):9.2f} GB/s exact={row.get('byte_exact')} streamed "
                      f"{row.get('ms_streamed', float('nan')):9.3f} ms {row.get('gbps_streamed', float('nan')):9.2f} "
                      f"GB/s", file=sys.stderr, flush=True)
            stats = eng.stats()
            rx = peer.call("stats")
        rows[-1]["sender_stats"] = {k: stats[k] for k in ("paths", "time_s", "rings") if k in stats}
        rows[-1]["receiver_stats"] = rx.get("receiver")
    finally:
        peer.close()
    return rows


def streamed(eng, session: str, srcs, dsts, lens, inflight: int, repeat: int) -> dict:
    """Throughput with ``inflight`` batches of the shape submitted back to back (``batch_write_async``) before
    waiting for them: what a server moving many requests' KV at once sees, where one batch's host work overlaps
    the previous batches' copies. The batches write the same bytes to the same place (the sequential run above
    checked them). Median of ``repeat`` rounds; ms per batch."""
    nbytes = int(lens.sum())
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        handles = [eng.batch_write_async(session, srcs, dsts, lens) for _ in range(inflight)]
        for h in handles:
            h.wait()
        times.append((time.perf_counter() - t0) / inflight)
    ms = float(np.median(times[1:])) * 1e3
    return {"inflight": inflight, "ms_streamed": round(ms, 4), "gbps_streamed": round(nbytes / ms / 1e6, 3)}


def copy_alone(dev: int, srcs, d_off, lens, repeat: int) -> dict:
    """The floor of a row on the ipc fabric: the same pieces copied by what the fabric's inline GPU write runs
    (``BoundCopies``: descriptors staged, one bound launch, the stream synchronised), alone, in this process, into
    a scratch buffer on the sources' GPU; no checks, no plan, no engine. ``copy_alone_ms`` (median of ``repeat``)
    against the row's ``ms`` is what the engine adds on top of its one launch and one wait."""
    import torch
    from transport.fabric.gpu_copy import BoundCopies
    scratch = torch.empty(BUFFER, dtype=torch.uint8, device=f"cuda:{dev}")
    dsts = (scratch.data_ptr() + d_off).astype(np.int64)
    stats = (int(lens.sum()), int(lens.min()), int(lens.max()))
    copies = BoundCopies()
    times = []
    for i in range(repeat + 3):
        t0 = time.perf_counter()
        copies.finish([copies.copy(dev, srcs, dsts, lens, stats)], wait=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del scratch
    return {"copy_alone_ms": round(float(np.median(times)) * 1e3, 4)}


def nvlink_rows(all_shapes: dict, repeat: int) -> list:
    import torch
    rows = []
    src = torch.randint(0, 256, (BUFFER,), dtype=torch.uint8, device="cuda:1")
    dst = torch.empty(BUFFER, dtype=torch.uint8, device="cuda:0")
    for name, lengths in all_shapes.items():
        n = int(sum(lengths))
        s, d = src[:n], dst[:n]
        for _ in range(3):
            d.copy_(s)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)
        times = []
        for _ in range(repeat * 3):
            t0 = time.perf_counter()
            d.copy_(s)
            torch.cuda.synchronize(0)
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        ok = bool(torch.equal(d, s.to("cuda:0")))
        rows.append({"fabric": "-", "topology": "nvlink_copy", "shape": name, "pieces": 1, "bytes": n,
                     "ms": round(ms, 4), "gbps": round(n / ms / 1e6, 3), "byte_exact": ok})
    return rows


def _public_args(argv) -> list:
    """The command line as recorded in the results: folder arguments (machine paths) replaced by their role."""
    out, hide = [], False
    for a in argv:
        out.append("DIR" if hide else a)
        hide = a in ("--out", "--trace", "--profile")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for the two JSON files (default: a new temporary folder)")
    ap.add_argument("--fabrics", default="ipc,tcp")
    ap.add_argument("--topologies", default="direct,pxn_send,pxn_recv,pxn_both,relay_x1,loadstore",
                    help="relay_x1 runs on a machine with one GPU only (two GPUs: pxn_send is the relay)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of the shape names")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per row (x3 below 1 MB)")
    ap.add_argument("--label", default="", help="stored in every row (e.g. which tree was measured)")
    ap.add_argument("--inflight", type=int, default=4,
                    help="batches in flight for the streamed columns (ms_streamed, gbps_streamed); 1: none")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--trace", default=None, help="folder for both engines' Chrome traces (one pair per fabric and "
                                                  "topology; keep the run small)")
    ap.add_argument("--profile", default=None,
                    help="folder for a cProfile of the calling thread per row (the timed calls; direct writes run "
                         "there, relayed and coalesced ones in the rings' threads)")
    ap.add_argument("--forward-large", action="store_true",
                    help="receivers forward large pieces too (TransferEngine(forward_large=True))")
    ap.add_argument("--no-copy-floor", action="store_true",
                    help="ipc rows: skip copy_alone_ms (the same pieces through the fabric's bound GPU copy alone)")
    ap.add_argument("--no-topology", action="store_true",
                    help="engines without a topology (trivial rails): for trees without receive-side PXN")
    ap.add_argument("--enable-peers", action="store_true",
                    help="enable peer access by hand (through torch copies) before the engines start: for trees "
                         "whose library does not do it itself")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.inflight < 1:
        ap.error(f"--inflight must be >= 1, got {args.inflight}")
    logging.basicConfig(level=logging.WARNING)
    import torch
    gpus = min(2, torch.cuda.device_count())
    if gpus < 1:
        print("message_path: needs a CUDA GPU, none visible", file=sys.stderr)
        return 2
    args.data_gpu = gpus - 1
    if gpus == 2:
        args.topologies = ",".join(t for t in args.topologies.split(",") if t != "relay_x1")
    if gpus == 1:
        dropped = [t for t in args.topologies.split(",") if t not in ONE_GPU_TOPOLOGIES and t != "loadstore"]
        if dropped:
            print(f"message_path: one GPU visible: only the direct, relay_x1 and loadstore rows (not {dropped})",
                  file=sys.stderr)
        args.topologies = ",".join(t for t in args.topologies.split(",") if t not in dropped)
    if args.enable_peers and gpus == 2:
        a = torch.ones(16, device="cuda:0")
        b = torch.ones(16, device="cuda:1")
        a.copy_(b)
        b.copy_(a)
        torch.cuda.synchronize()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    all_shapes = shapes(rng)
    if args.shapes:
        want = args.shapes.split(",")
        unknown = [w for w in want if w not in all_shapes]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; choose from {list(all_shapes)}")
        all_shapes = {k: all_shapes[k] for k in want}
    info = machine()
    print(f"message_path: {info} seed {seed}", file=sys.stderr)
    rows = []
    t0 = time.time()
    for fabric in args.fabrics.split(","):
        for topo in args.topologies.split(","):
            if topo == "loadstore" and fabric != "ipc":
                continue
            print(f"[{time.time() - t0:6.1f} s] {fabric} / {topo}", file=sys.stderr, flush=True)
            rows += run_pair(fabric, topo, all_shapes, args.repeat, rng, args)
    if gpus == 2:
        rows += nvlink_rows(all_shapes, args.repeat)
    for r in rows:
        r["label"] = args.label
    out = args.out or tempfile.mkdtemp(prefix="pxn-message-path-")
    os.makedirs(out, exist_ok=True)
    meta = {"machine": info, "seed": seed, "repeat": args.repeat, "label": args.label,
            "command": "python3 benchmarks/message_path.py " + " ".join(_public_args(argv or sys.argv[1:]))}
    pxn_rows = [r for r in rows if r["topology"] in TOPOLOGIES or r["topology"] in ONE_GPU_TOPOLOGIES]
    mp_rows = [r for r in rows if r["fabric"] in ("ipc", "-")]
    names = (f"pxn-x{gpus}.json", f"message-path-x{gpus}.json")
    for name, subset in zip(names, (pxn_rows, mp_rows)):
        with open(os.path.join(out, name), "w") as f:
            json.dump({**meta, "rows": subset}, f, indent=1)
    print(f"wrote {out}/{names[0]} and {out}/{names[1]}", file=sys.stderr)
    print(f"{'fabric':6s} {'topology':11s} {'shape':14s} {'ms':>9s} {'GB/s':>9s} exact {'streamed ms':>11s} "
          f"{'GB/s':>9s} {'copy alone ms':>13s}")
    for r in rows:
        print(f"{r['fabric']:6s} {r['topology']:11s} {r['shape']:14s} {r.get('ms', float('nan')):9.3f} "
              f"{r.get('gbps', float('nan')):9.2f} {str(r.get('byte_exact')):5s} "
              f"{r.get('ms_streamed', float('nan')):11.3f} {r.get('gbps_streamed', float('nan')):9.2f} "
              f"{r.get('copy_alone_ms', float('nan')):13.4f}")
    return 0 if all(r.get("byte_exact") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
